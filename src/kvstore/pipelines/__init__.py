"""The store's data paths: put, get, layer-wise loads, row reads, asynchronous saving, the
scheduler's look-ahead prefetches, and the remote tier's reads and write-through.
"""
