"""What leaves a tier and when: priority functions and their heap, and the queue of background
jobs (evictions, prefetches) the scheduler's look-ahead feeds.
"""
