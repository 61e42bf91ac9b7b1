"""The open store: the public facade, opening a directory, argument checks and its statistics.
"""
