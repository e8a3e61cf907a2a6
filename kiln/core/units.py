"""Byte units of the memory arithmetic: GiB is 2^30 (the hierarchical cache's GB is 1e9)."""

GIB = 1 << 30
MIB = 1 << 20


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def human(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number readable."""
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n:,} B"
