"""Where this node keeps what it prepares once: the demo model, a GGUF's prepared directory,
an object-store copy (``$PAGEDSERVE_CACHE``, default ``~/.cache/pagedserve``), and how an
entry is built there so that no reader ever sees half of one."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable


def cache_root() -> str:
    return os.environ.get("PAGEDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve")


def build_once(final: str | os.PathLike, build: Callable[[str], Any]) -> str:
    """Return ``final``, first running ``build(tmp_dir)`` and renaming it into place if it
    does not exist yet. The rename is atomic, so readers never see a half-written model
    and concurrent builders (tests, several processes) need no lock: the loser discards."""
    final = os.fspath(final)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    parent = os.path.dirname(final) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}-", dir=parent)
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
