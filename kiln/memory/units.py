"""Byte units of the memory arithmetic: GiB is 2^30 (the hierarchical cache's GB is 1e9)."""

GIB = 1 << 30
MIB = 1 << 20
