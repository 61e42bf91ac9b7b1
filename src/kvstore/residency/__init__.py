"""What this process holds resident, and its lock: the core of an open store (prefix tree, slots,
DRAM index, mirror of other processes' commits, counters), the victims a save evicts and
what the reuse policy learns from puts.
"""
