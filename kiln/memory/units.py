"""Byte units of the memory arithmetic: GiB is 2^30 (the hierarchical cache's GB is 1e9)."""

GIB = 1 << 30
MIB = 1 << 20


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"
