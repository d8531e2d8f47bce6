"""ARCHITECTURE.md's boundaries, checked on the source (every import statement, including
the lazy ones inside functions) and, for what must stay light at import time, in a fresh
interpreter (this test process may already have imported torch or ray for other tests).

    scheduler/  no torch, no ray, nothing of the other packages
    kernels/    torch and triton; never scheduler/, worker/, cluster/
    worker/     torch, kernels/, scheduler/ wire types; never cluster/, never ray
    cluster/    the only place that imports ray; one sub-package per process or layer:
                cli -> {front, replica} -> engine, replica -> executors; the front and
                the replica meet only through wire/, the engine loop and the executors
                never import each other; wire/ imports nothing of cluster/ but itself;
                text/ (tokenization) is shared by the front and the replica, imports none
    loadtest/   anything of pagedserve, but ray only through cluster/
    plugins.py  (the PAGEDSERVE_PLUGINS loader, called by worker/ and cluster/engine) only the stdlib
    nothing imports loadtest/ or tests/ (tests/' helpers by their bare names included), and
    the shipped code never names the tests' fault plugin: tests install it from outside
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("scheduler", "kernels", "worker", "cluster", "loadtest")
CLUSTER_PARTS = ("cli", "front", "replica", "engine", "executors", "text", "wire")
CLUSTER_FILES = ("app.py", "llm.py", "placement.py", "ray_utils.py")  # composition roots and Ray's helpers
# tests/' modules, as its files import each other (``from _sched_helpers import ...``)
TEST_MODULES = frozenset(p.stem for p in (ROOT / "tests").glob("*.py"))


def _unit(path: Path) -> str:
    """'scheduler', 'kernels', ..., or 'cluster.engine' etc. for a file of the checkout."""
    parts = path.relative_to(ROOT).parts
    if parts[0] == "cluster" and len(parts) > 2:
        return f"cluster.{parts[1]}"
    return parts[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = ["pagedserve", *path.relative_to(ROOT).parent.parts]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def _target(mod: str) -> str | None:
    """The unit a module name belongs to, in the same vocabulary as _unit; None if foreign."""
    parts = mod.split(".")
    if parts[0] in ("torch", "ray", "triton"):
        return parts[0]
    if parts[0] in TEST_MODULES:
        return "tests"
    if parts[0] != "pagedserve" or len(parts) < 2:
        return None
    if parts[1] == "cluster" and len(parts) > 2 and parts[2] in CLUSTER_PARTS:
        return f"cluster.{parts[2]}"
    return parts[1] if parts[1] in PACKAGES + ("tests",) else None


# unit -> units (or torch/ray/triton) it must never import, lazily or not
FORBIDDEN = {
    "scheduler": {"torch", "ray", "triton", "kernels", "worker", "cluster", "loadtest", "tests"},
    "kernels": {"ray", "scheduler", "worker", "cluster", "loadtest", "tests"},
    "worker": {"ray", "cluster", "loadtest", "tests"},
    "cluster": {"loadtest", "tests"},
    "cluster.front": {"cluster.replica", "cluster.engine", "cluster.executors", "cluster.cli", "loadtest", "tests"},
    "cluster.replica": {"cluster.front", "cluster.cli", "loadtest", "tests"},
    "cluster.engine": {"ray", "cluster.front", "cluster.replica", "cluster.executors", "cluster.cli",
                       "loadtest", "tests"},
    "cluster.executors": {"cluster.front", "cluster.replica", "cluster.engine", "cluster.cli", "loadtest", "tests"},
    "cluster.wire": {"ray", "cluster.front", "cluster.replica", "cluster.engine", "cluster.executors",
                     "cluster.cli", "loadtest", "tests"},
    "cluster.text": {"ray", "cluster.front", "cluster.replica", "cluster.engine", "cluster.executors",
                     "cluster.cli", "cluster.wire", "loadtest", "tests"},
    "cluster.cli": {"loadtest", "tests"},
    "loadtest": {"ray", "tests"},  # drives cluster/'s own helpers, never ray directly
}


def _source_files():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _shipped_files() -> list[Path]:
    """The package's own code: the top-level modules and every package but loadtest/."""
    return [*sorted(ROOT.glob("*.py")),
            *(p for pkg in PACKAGES if pkg != "loadtest" for p in sorted((ROOT / pkg).rglob("*.py")))]


def test_every_cluster_file_is_in_one_of_its_parts():
    loose = sorted(p.name for p in (ROOT / "cluster").glob("*.py") if p.name != "__init__.py")
    assert loose == sorted(CLUSTER_FILES), f"cluster/ files outside its sub-packages: {loose}"
    parts = sorted(p.name for p in (ROOT / "cluster").iterdir() if (p / "__init__.py").exists())
    assert parts == sorted(CLUSTER_PARTS)
    for part in CLUSTER_PARTS:  # each says what it owns and what it may import
        doc = ast.get_docstring(ast.parse((ROOT / "cluster" / part / "__init__.py").read_text()))
        assert doc and "Imports" in doc, part


MAX_FOLDER_FILES = 16  # Python files in one folder of the package: past that, a folder wants sub-rooms


def test_no_package_folder_is_crowded():
    """Every folder of the package (loadtest/ included; tests/ is the suite, not the package)
    holds at most MAX_FOLDER_FILES Python files, __init__.py counted."""
    folders = {ROOT, *(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*") if p.is_dir())}
    crowded = {
        str(f.relative_to(ROOT)) or ".": n
        for f in folders
        if "__pycache__" not in f.parts and (n := len(list(f.glob("*.py")))) > MAX_FOLDER_FILES
    }
    assert not crowded, f"folders over {MAX_FOLDER_FILES} Python files: {crowded}"


MAX_SWITCHES = 8  # PAGEDSERVE_* environment variables the shipped code reads


def test_environment_switches_are_few_and_each_is_in_the_deploy_table():
    """Flags are the interface: the shipped code (not tests/, not loadtest/) reads at most
    MAX_SWITCHES PAGEDSERVE_* variables, and deploy/README.md's table lists every one."""
    import re

    names = {m for p in _shipped_files() for m in re.findall(r"PAGEDSERVE_[A-Z0-9_]*[A-Z0-9]", p.read_text())}
    assert len(names) <= MAX_SWITCHES, sorted(names)
    table = (ROOT / "deploy" / "README.md").read_text().split("### Environment switches", 1)[1].split("\n### ", 1)[0]
    listed = set(re.findall(r"^\| `(PAGEDSERVE_[A-Z0-9_]+)`", table, re.M))
    assert names <= listed, f"read by the code, not in deploy/README.md's table: {sorted(names - listed)}"


def test_fault_hooks_are_installed_from_outside():
    """The planted failures are a test plugin (tests/fault_plugin.py, loaded through
    PAGEDSERVE_PLUGINS): no shipped file holds a fault hook, names the plugin or its
    fault, or switches planted failures on; the shipped code only calls plugins.py."""
    import re

    names = re.compile(r"fault_plugin|InjectedFault|pagedserve-fault|FAULT_INJECTION|install_(engine|runner)\(self\)")
    bad = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in _shipped_files() if (m := names.search(p.read_text()))]
    bad += [str(p.relative_to(ROOT)) for p in _shipped_files() if "fault" in p.stem]
    assert not bad, bad


def test_the_plugin_loader_imports_only_the_stdlib():
    """plugins.py runs in every engine and worker process and is imported by worker/ and
    cluster/engine: it imports nothing of the package, nor torch or ray."""
    mods = {m.split(".")[0] for _, m in _imports(ROOT / "plugins.py")}
    assert not mods & {"pagedserve", "torch", "ray", "triton", *PACKAGES}, sorted(mods)
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}, sorted(mods)


@pytest.mark.parametrize("unit", sorted(FORBIDDEN))
def test_no_forbidden_imports(unit):
    bad = []
    for path in _source_files():
        own = _unit(path)
        if own != unit and not (unit == "cluster" and own.startswith("cluster")):
            continue
        for line, mod in _imports(path):
            if mod.split(".")[0] in PACKAGES:  # a bare top-level name: shadowed by PyPI packages
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod} (use pagedserve.{mod})")
            target = _target(mod)
            if target in FORBIDDEN[unit] and not (target == own):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The scan above is only as good as _imports: a planted lazy import and a relative
    one must both be found (so the layering tests can fail)."""
    planted = ROOT / "kernels" / "_planted_layering_probe.py"
    planted.write_text("def f():\n    from pagedserve.cluster.engine import llm\n    import ray\n"
                       "from .. import worker\n")
    try:
        mods = [m for _, m in _imports(planted)]
        assert "pagedserve.cluster.engine" in mods and "ray" in mods and "pagedserve.worker" in mods
        with pytest.raises(AssertionError, match="_planted_layering_probe"):
            test_no_forbidden_imports("kernels")
    finally:
        planted.unlink()


def _fresh_import(code: str) -> subprocess.CompletedProcess:
    # From outside the checkout, so only the installed distribution is importable.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd="/", env=env,
                          capture_output=True, text=True, timeout=120)


_LOADED = "import sys; bad = sorted({m.split('.')[0] for m in sys.modules} & {%s}); assert not bad, bad"


@pytest.mark.parametrize("modules, heavy", [
    # scheduler/ and everything it re-exports: pure Python
    (["pagedserve.scheduler", "pagedserve.scheduler.scheduler", "pagedserve.scheduler.kv.kv_cache_manager"],
     ["torch", "ray", "triton"]),
    # the public API's import costs nothing; LLM loads the engine, never ray (TP 1 offline)
    (["pagedserve"], ["torch", "ray", "triton"]),
    (["pagedserve.cluster.llm", "pagedserve.cluster.engine.llm_engine"], ["ray"]),
    (["pagedserve.worker.worker", "pagedserve.kernels"], ["ray"]),
    (["pagedserve.cluster.cli.main"], ["ray", "torch"]),
])
def test_import_time_weight(modules, heavy):
    code = "; ".join(f"import {m}" for m in modules) + "; " + _LOADED % ", ".join(map(repr, heavy))
    proc = _fresh_import(code)
    assert proc.returncode == 0, proc.stderr
