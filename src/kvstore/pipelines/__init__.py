"""The store's data paths: put, get, layer-wise loads, row reads, asynchronous saving, and the
threads that run them.
"""
