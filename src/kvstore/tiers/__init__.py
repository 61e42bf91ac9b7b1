"""Where chunk bytes live besides the disk's segments: the DRAM slab, execution buffers, the output
pool, the remote (Redis) tier, and which codec each tier stores with.
"""
