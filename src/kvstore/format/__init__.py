"""Everything on disk: catalog records, chunk extents, segment files, hashing, the directory's
confinement, locks and the writers' registry, index files.
"""
