"""The open store: the public facade, opening a directory, its typed config, the parts its
pipelines share, and its statistics.
"""
