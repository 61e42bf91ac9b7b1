"""Offline tools over a store directory: the ``kvstore verify``/``inspect`` command line and its
checks.
"""
