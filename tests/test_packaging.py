"""The distribution as a user installs it: pyproject.toml's hand-kept package list against the
folders of the checkout, its package data against the non-Python files of those folders,
and the wheel built from them, installed alone, serving.

An editable install (./dev, CI) finds every folder of the checkout whatever the list says,
so only a built wheel shows what the list leaves out (as it once left out cluster/text/, and
a wheel could not serve)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
# Folders of the checkout that are not part of the package, though they may hold an __init__.py.
NOT_PACKAGED = {"tests"}


def _setuptools_config(root: Path) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_folders(root: Path) -> dict[str, Path]:
    """'pagedserve.<folder.sub>' -> folder, for the root and every folder below it with an
    __init__.py whose parents all have one (any other is not importable as pagedserve.*)."""
    found = {}
    for here, dirs, files in os.walk(root):
        rel = Path(here).relative_to(root)
        if "__init__.py" not in files or (rel.parts and rel.parts[0] in NOT_PACKAGED):
            dirs[:] = []
            continue
        found[".".join(("pagedserve", *rel.parts))] = Path(here)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
    return found


def data_files(root: Path) -> dict[str, list[Path]]:
    """package -> the files other than Python source in its folder, and in folders below it
    that are no package of their own. The root's are the repository's (README, pyproject,
    ./dev), not the package's."""
    packages = package_folders(root)
    folders = {folder: name for name, folder in packages.items()}
    out: dict[str, list[Path]] = {}
    for name, folder in packages.items():
        if folder == root:
            continue
        for here, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__"
                             and Path(here, d) not in folders)
            out.setdefault(name, []).extend(Path(here, f) for f in sorted(files)
                                             if not f.endswith((".py", ".pyc")) and not f.startswith("."))
    return {k: v for k, v in out.items() if v}


def test_every_package_folder_is_listed():
    """Every folder with an __init__.py is in [tool.setuptools] packages, and nothing else."""
    listed = set(_setuptools_config(ROOT)["packages"])
    tree = set(package_folders(ROOT))
    assert not tree - listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(tree - listed)}"
    assert not listed - tree, f"listed in pyproject.toml but no package folder: {sorted(listed - tree)}"


def test_package_data_covers_every_other_file():
    """Every non-Python file in a package folder is matched by [tool.setuptools.package-data]
    (the code reads such files from its own folder: the dashboard page, a package list)."""
    config = _setuptools_config(ROOT)
    patterns = config.get("package-data", {})
    missing = []
    for name, files in data_files(ROOT).items():
        folder = package_folders(ROOT)[name]
        covered = {Path(p) for pattern in patterns.get(name, []) + patterns.get("*", [])
                   for p in glob.glob(str(folder / pattern), recursive=True)}
        missing += [f"{name}: {f.relative_to(folder)}" for f in files if f not in covered]
    assert not missing, f"add to [tool.setuptools.package-data] in pyproject.toml: {missing}"


def _copy_source(dst: Path) -> Path:
    """The checkout as it is now, without what a build or a run leaves in it: others may be
    editing it, and the build writes its own build/ and egg-info beside the sources."""
    shutil.copytree(ROOT, dst, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".hypothesis",
        "results", ".cache"))
    return dst


def _python_without_the_checkout(where: Path) -> Path:
    """A fresh virtual environment that sees this one's site-packages as a plain path entry
    (dependencies only: a path entry's .pth files are not run, so the editable install's
    finder, which maps pagedserve onto the checkout, is not installed there)."""
    venv.create(where, with_pip=False, symlinks=True)
    python = where / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site, "dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    return python


# A server built from a fresh venv: in the second run CI makes (-m cluster), which keeps the
# default run's minutes for the tests that need no process of their own.
@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_wheel_alone_serves(tmp_path):
    """Build the wheel from (a copy of) the checkout; it holds every package folder's Python
    files and data files and nothing of tests/, deploy/ or docs/. Installed with --target
    into an empty folder and run by an interpreter that knows only that folder and the
    dependencies, from a folder outside the checkout, it imports from the target, serves a
    chat completion and its dashboard over HTTP, and on SIGTERM exits 0 leaving nothing."""
    from test_serve_shutdown import ServerProcess, chat

    src = _copy_source(tmp_path / "src")
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-cache-dir", "-q", "-w", str(dist), str(src)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    [wheel] = dist.glob("pagedserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    expected = set()
    for name, folder in package_folders(src).items():
        expected |= {f"pagedserve/{f.relative_to(src).as_posix()}" for f in folder.glob("*.py")}
    for files in data_files(src).values():
        expected |= {f"pagedserve/{f.relative_to(src).as_posix()}" for f in files}
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    stray = sorted(n for n in names if n.split("/")[0] not in ("pagedserve", "pagedserve-0.1.0.dist-info")
                   or n.split("/")[1] in ("tests", "deploy", "docs"))
    assert not stray, f"not the package's: {stray}"
    assert "pagedserve/cluster/text/tokenizer_pool.py" in names
    cpp = {f"pagedserve/kernels/{f.name}" for pattern in ("*.cpp", "*.h") for f in (src / "kernels").glob(pattern)}
    assert "pagedserve/kernels/cpu_gemm.cpp" in cpp and not cpp - names  # the C++ a CPU worker builds at start

    target = tmp_path / "target"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
                              "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    python = _python_without_the_checkout(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(target)
    work = tmp_path / "work"  # the cwd, outside the checkout: not on sys.path either
    work.mkdir()
    where = subprocess.run(
        [python, "-c", "import sys, pagedserve, pagedserve.cluster.text, pagedserve.cluster.front.door; "
                       "print(pagedserve.__file__); print(any('Editable' in repr(f) for f in sys.meta_path))"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr[-3000:]
    module_file, editable = where.stdout.split()
    assert Path(module_file).is_relative_to(target) and editable == "False", where.stdout

    server = ServerProcess(str(python), tmp_path / "serve.log", work, env=env)
    try:
        server.wait_ready()
        chat(server.port)
        page = httpx.get(f"http://127.0.0.1:{server.port}/dashboard", timeout=60)
        assert page.status_code == 200 and "<html" in page.text.lower()  # dashboard.html, package data
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=120) == 0, server.tail()
        left = server.wait_gone()
        assert not left, f"its processes outlived it: {left}"
    finally:
        server.stop_for_good()
