"""Build and load the CPU C++ extensions (cpu_decode_attention.py, cpu_fused.py,
cpu_gemm.py) safely across processes, once per process and per CPU kind.

Their C++ is in this folder beside them (one .cpp an extension, and the headers the .cpp files
include in quotes); :func:`read_source` makes a .cpp one text, its quoted includes inlined, since
``load_inline`` compiles the text from a build directory of its own. The text is what torch
hashes to decide on a rebuild (with the flags), so a changed header rebuilds too.

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
formulas; :class:`LazyExtension` does that for them.

The extensions are built with ``-march=native``, and torch reuses a build whose source and
flags are unchanged. The machine kind under one home directory can change (this project's
CI and dev machines move between Intel and AMD parts), and a module built for AVX-512 dies
of SIGILL on a CPU without it. So the build name carries a hash of the CPU's model and
feature flags: a new CPU kind gets a build of its own.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import re
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

FLOCK_NAME = "pagedserve.flock"

SOURCE_DIR = Path(__file__).resolve().parent  # the .cpp and .h files
_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[^\n]*$', re.M)


def read_source(name: str) -> str:
    """kernels/<name> as one translation unit: each ``#include "x.h"`` line replaced by x.h's
    text (the same way in x.h, and each header once). ``#line`` directives keep the compiler's
    messages (warnings, errors, TORCH_CHECK's) pointing at the files' own lines."""
    seen: set[str] = set()

    def text(rel: str) -> str:
        seen.add(rel)
        out, at = [f'#line 1 "kernels/{rel}"\n'], 0
        src = (SOURCE_DIR / rel).read_text()
        for m in _QUOTED_INCLUDE.finditer(src):
            out.append(src[at:m.start()])
            at = m.end() + 1  # past the line's newline
            if m.group(1) not in seen:
                out.append(text(m.group(1)))
            next_line = src.count("\n", 0, at) + 1
            out.append(f'#line {next_line} "kernels/{rel}"\n')
        out.append(src[at:])
        return "".join(out)

    return text(name)


@functools.lru_cache(maxsize=1)
def cpu_kind_tag() -> str:
    """8 hex digits of the CPU's vendor, model and feature flags (/proc/cpuinfo), so that
    ``-march=native`` builds for different CPU kinds never share a directory."""
    keys = ("vendor_id", "cpu family", "model", "flags")
    seen: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in keys and key not in seen:
                    seen[key] = value.strip()
                if len(seen) == len(keys):
                    break
    except OSError:
        import platform

        seen["platform"] = platform.processor() or platform.machine()
    return hashlib.sha1(repr(sorted(seen.items())).encode()).hexdigest()[:8]


def build_directory(name: str) -> str:
    """torch's build directory for extension ``name`` ($TORCH_EXTENSIONS_DIR/<name>), created."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def load_cpu_extension(name: str, source: str, extra_cflags: list[str], extra_ldflags: list[str]):
    """``load_inline(name, source)`` (a :func:`read_source` text, with its own PYBIND11_MODULE),
    under an flock that survives its holder's death (see the module docstring). Raises what
    the build raises."""
    from torch.utils.cpp_extension import load_inline

    name = f"{name}_{cpu_kind_tag()}"
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
                              extra_ldflags=extra_ldflags, build_directory=build_dir, verbose=False,
                              no_implicit_headers=True)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    took = time.monotonic() - t0
    if took > 5.0:
        logger.info("Built the CPU extension %s in %.0f s (%s).", name, took, build_dir)
    return mod


class LazyExtension:
    """One C++ extension, built or loaded on the first :meth:`get` in a process and cached
    (the failure too: no compiler, no ninja, ``PAGEDSERVE_CPU_EXT=0``); callers fall back
    to torch when :meth:`get` returns None. ``what`` and ``fallback`` word the warning."""

    def __init__(self, name: str, source: str, extra_cflags: list[str], what: str, fallback: str) -> None:
        self.name, self.source, self.cflags = name, source + "\n", list(extra_cflags)
        self.what, self.fallback = what, fallback
        self._lock = threading.Lock()
        self._module = None
        self._failed = False

    def get(self):
        if self._module is not None or self._failed:
            return self._module
        with self._lock:
            if self._module is None and not self._failed:
                if os.environ.get("PAGEDSERVE_CPU_EXT", "1") == "0":
                    self._failed = True
                    return None
                try:
                    # -fopenmp: at::parallel_for is inline OpenMP in torch's headers; built
                    # without it the loop runs on one thread whatever torch's thread count.
                    # The module links libgomp.so.1, the soname torch's own
                    # copy has, so the loader reuses the runtime torch loaded. Each source has
                    # its own PYBIND11_MODULE, whose calls release the GIL. -Wall: the sources
                    # build without a warning (torch's headers come in as -isystem).
                    self._module = load_cpu_extension(self.name, self.source,
                                                      self.cflags + ["-fopenmp", "-Wall"], ["-fopenmp"])
                except Exception as e:
                    self._failed = True
                    logger.warning("%s extension unavailable (%s); %s.", self.what, e, self.fallback)
        return self._module

    def available(self) -> bool:
        return self.get() is not None
