"""What leaves a tier and when: priority functions, the one victim chooser, what the reuse policy
learns, the scheduler's look-ahead.
"""
