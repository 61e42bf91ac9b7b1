"""This process's view of what is stored: the prefix tree, the free disk slots, boundary states,
and recovery at open.
"""
