"""Where chunk bytes live besides the disk's segments: the DRAM slab, execution buffers, the output
pool, the shared tiers (what both are made of: ``shared/``; Redis: ``remote/``; an object store:
``objects/``), and which codec each tier stores with.
"""
