"""The GPU image's packages, and nothing else: ``--image-packages-only`` makes every installed
package outside loadtest/gpu_image_packages.txt and the carried wheels (.whl/) unimportable,
so that a top-level import the GPU machine would fail on fails here too.

Standard library only, and called by the entry (loadtest/gpu_check.py) before anything
imports torch or the rest of pagedserve: a package already loaded cannot be blocked, and
``block`` reports it as a violation. Keep it that way (and loadtest/gpu/__init__.py free of imports).
"""

from __future__ import annotations

import os
import sys

_LOADTEST = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package list lives there
_ROOT = os.path.dirname(_LOADTEST)  # the checkout: .whl/ holds the carried wheels

# (blocked top-level names, those already imported before the block) once ``block`` ran;
# None when the run does not ask for --image-packages-only (the imports section reads it).
BLOCKED: tuple[list[str], list[str]] | None = None


def block_packages_outside_image() -> tuple[list[str], list[str]]:
    """Make every top-level module unimportable whose distribution the GPU image lacks and no
    carried wheel brings (``sys.modules[name] = None``: ``import`` raises ImportError and
    ``importlib.util.find_spec`` says absent). Allowed: the image's list, what those
    distributions require as installed here (another version's needs may differ), the wheels
    in .whl/ or named by gpu_check_setup.sh's CARRY, and pagedserve itself; pagedserve's own
    requirements the image lacks are blocked even where some allowed distribution here
    requires them. Returns (blocked, already imported before the block: a violation)."""
    import glob
    import importlib.metadata as md
    import re

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    def req_name(req: str) -> str | None:
        if "extra ==" in req.replace("extra==", "extra =="):
            return None
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9_.-]*", req)
        return norm(m.group(0)) if m else None

    with open(os.path.join(_LOADTEST, "gpu_image_packages.txt")) as f:
        image = {norm(s.strip()) for s in f if s.strip() and not s.startswith("#")}
    carried = {norm(os.path.basename(p).split("-")[0])
               for p in glob.glob(os.path.join(_ROOT, ".whl", "*.whl"))}
    # and the wheels gpu_check_setup.sh's CARRY names (what `prepare` puts in .whl/ for the GPU)
    with open(os.path.join(_LOADTEST, "gpu_check_setup.sh")) as f:
        line = next((ln for ln in f if ln.startswith("CARRY=")), 'CARRY=""')
    carried |= {norm(w.split("==")[0]) for w in line.split("=", 1)[1].strip().strip('"').split()}
    dists = {}
    for d in md.distributions():
        if d.metadata["Name"]:
            dists.setdefault(norm(d.metadata["Name"]), d)
    own = {n for r in (dists["pagedserve"].requires or []) if (n := req_name(r))} if "pagedserve" in dists else set()
    absent = own - image - carried
    allowed, todo = set(), [n for n in image | carried if n in dists]
    while todo:
        name = todo.pop()
        if name in allowed or name in absent:
            continue
        allowed.add(name)
        todo += [n for r in (dists[name].requires or []) if (n := req_name(r)) and n in dists]
    allowed |= image | carried | {"pagedserve"}
    blocked = sorted(top for top, names in md.packages_distributions().items()
                     if not top.startswith("_") and top not in sys.stdlib_module_names
                     and (not any(norm(n) in allowed for n in names) or any(norm(n) in absent for n in names)))
    loaded = [top for top in blocked if sys.modules.get(top) is not None]
    for top in blocked:
        sys.modules.setdefault(top, None)
    return blocked, loaded



def block() -> tuple[list[str], list[str]]:
    """``block_packages_outside_image``, its result kept in ``BLOCKED``."""
    global BLOCKED
    BLOCKED = block_packages_outside_image()
    return BLOCKED
