"""Loading Kiln's C++ CPU kernels: torch's extension loader behind a lock of Kiln's own.

A module of its own below every kernel module (kiln/layers/cpu_gemm.py, kiln/layers/int_gemm.py), so that one
kernel module can use another's kernels without an import cycle.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os

logger = logging.getLogger("kiln")

# the float32 kernels' flags: built for AVX2 and FMA throughout (their callers check the CPU first)
DEFAULT_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")


def extension_directory(name: str, sources: list[str] | tuple[str, ...]) -> str:
    """The extension's build directory: one per torch installation and source location, under torch's own
    directory for `name` (TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions). torch's loader keys a build by the
    name alone, and its build file holds the sources' and torch's absolute paths: two checkouts or two virtual
    environments of one user would then rebuild each other's kernels at every switch (a minute of compiling
    inside whichever start came next). A few megabytes per checkout is the price."""
    import torch
    from torch.utils import cpp_extension

    where = "\n".join([os.path.dirname(torch.__file__), *map(os.path.abspath, sources)])
    key = hashlib.sha256(where.encode()).hexdigest()[:12]
    directory = os.path.join(cpp_extension._get_build_directory(name, verbose=False), key)
    os.makedirs(directory, exist_ok=True)
    return directory


def load_extension(
    name: str, sources: list[str], build_directory: str | None = None, flags: list[str] | None = None
):
    """torch's C++ extension loader (build on first use, then load from the extension cache) with Kiln's flags, one
    Kiln process at a time per build directory. torch marks a build in progress with a `lock` file that a process
    killed mid-build leaves behind, and every later load then waits on it forever. Kiln holds an OS lock on a file
    of its own around the load (released by the kernel when its holder dies), so a `lock` found while holding it
    can only be such a leftover, and is removed. `flags` replace DEFAULT_FLAGS (an extension that picks its
    instruction sets per function is built without global -m flags)."""
    from torch.utils import cpp_extension

    directory = build_directory or extension_directory(name, sources)
    os.makedirs(directory, exist_ok=True)  # a directory given by the caller
    with open(os.path.join(directory, "kiln.flock"), "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info(f"Waiting for another Kiln process to finish building {name} in {directory}.")
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = os.path.join(directory, "lock")
        if os.path.exists(stale):
            logger.warning(f"Removing {stale}, left by a build of {name} that was killed before it finished.")
            os.remove(stale)
        cflags = list(flags if flags is not None else DEFAULT_FLAGS)
        return cpp_extension.load(name, sources, extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                                  build_directory=directory)  # fmt: skip
