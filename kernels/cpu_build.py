"""Build and load the CPU C++ extensions (cpu_decode_attention.py, cpu_fused.py) safely
across processes.

torch's ``load_inline`` guards a build directory with a lock *file* (``FileBaton``): the
process that creates ``<build>/lock`` builds, every other one polls until the file is gone.
A process killed while it holds the file (a worker SIGKILLed, a Serve replica force-killed
after its grace period, a test timeout) leaves it behind, and from then on every process
that loads the extension, on that machine, polls forever: a model worker that hangs in its
first forward, with nothing in any log. This module takes an ``flock`` on a file of its own
first (the kernel drops it when its holder dies, however it dies); whoever holds it is the
only one of our loaders in the directory, so a ``lock`` file found then is stale and is
removed before torch looks. Loaders wait for each other's build, as with torch's lock.

:func:`load_cpu_extension` raises what the build raises (no compiler, no ninja); the
callers catch it, cache the module (or the failure) per process and fall back to torch
formulas.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time

logger = logging.getLogger(__name__)

FLOCK_NAME = "pagedserve.flock"


def build_directory(name: str) -> str:
    """torch's build directory for extension ``name`` ($TORCH_EXTENSIONS_DIR/<name>), created."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def load_cpu_extension(name: str, source: str, extra_cflags: list[str], extra_ldflags: list[str]):
    """``load_inline(name, source)`` with its own PYBIND11_MODULE, under an flock that
    survives its holder's death (see the module docstring). Raises what the build raises."""
    from torch.utils.cpp_extension import load_inline

    build_dir = build_directory(name)
    t0 = time.monotonic()
    with open(os.path.join(build_dir, FLOCK_NAME), "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                logger.warning("Removing %s: a stale torch build lock (its holder died mid-load).", stale)
                os.unlink(stale)
            mod = load_inline(name=name, cpp_sources=source, functions=None, extra_cflags=extra_cflags,
                              extra_ldflags=extra_ldflags, build_directory=build_dir, verbose=False)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    took = time.monotonic() - t0
    if took > 5.0:
        logger.info("Built the CPU extension %s in %.0f s (%s).", name, took, build_dir)
    return mod
