"""The GPUs `kiln plan --device-name` can describe without running on one: what CUDA reports for each (memory as
torch.cuda.mem_get_info gives the total, compute capability) and its memory bandwidth from the vendor's sheet.
Memory is what the driver reports, a little under the marketed size (an H200 sold as 141 GB reports ~139.8 GiB)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceSpec:
    name: str  # as given to --device-name, and a substring of what torch.cuda.get_device_name() says
    memory_bytes: int
    capability: tuple[int, int]
    bandwidth_tb_s: float  # HBM/GDDR bandwidth, TB/s


DEVICES = (
    DeviceSpec("B200", int(178.4 * GIB), (10, 0), 8.0),
    DeviceSpec("H200", int(139.8 * GIB), (9, 0), 4.8),
    DeviceSpec("H100", int(79.1 * GIB), (9, 0), 3.35),
    DeviceSpec("H20", int(95.0 * GIB), (9, 0), 4.0),
    DeviceSpec("A100-40GB", int(39.4 * GIB), (8, 0), 1.555),
    DeviceSpec("A100", int(79.1 * GIB), (8, 0), 2.039),
    DeviceSpec("L40S", int(44.4 * GIB), (8, 9), 0.864),
    DeviceSpec("L4", int(22.0 * GIB), (8, 9), 0.3),
    DeviceSpec("RTX 4090", int(23.5 * GIB), (8, 9), 1.008),
    DeviceSpec("A10", int(22.0 * GIB), (8, 6), 0.6),
    DeviceSpec("RTX 3090", int(23.6 * GIB), (8, 6), 0.936),
)


def _key(name: str) -> str:
    return name.upper().replace("-", " ").replace("_", " ")


def device_spec(name: str) -> DeviceSpec:
    """The table's entry for --device-name `name` (case and `-`/`_`/space insensitive). Raises ValueError naming
    the known ones."""
    for spec in DEVICES:
        if _key(spec.name) == _key(name):
            return spec
    known = ", ".join(spec.name for spec in DEVICES)
    raise ValueError(
        f"--device-name {name}: not a GPU Kiln knows ({known}); describe it with --device cuda --device-memory "
        "SIZE --compute-capability X.Y instead"
    )


def same_device(name: str, reported: str) -> bool:
    """Whether --device-name `name` describes the GPU torch reports as `reported` (e.g. "NVIDIA H100 80GB HBM3"):
    every word of the entry's name is a word of the reported one (H20 is not H200)."""
    return set(_key(device_spec(name).name).split()) <= set(_key(reported).split())
