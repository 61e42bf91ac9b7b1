"""This process's view of what is stored: the prefix tree, the free disk slots, catching up with
the catalog, and recovery at open.
"""
