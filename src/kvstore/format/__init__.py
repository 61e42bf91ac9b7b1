"""Everything on disk: catalog records, chunk extents, segment files and their IO throttle, hashing,
the directory's confinement, locks and the writers' registry.
"""
