"""The fused elementwise ops of a Llama layer on CPU (kernels/cpu_fused.py) against the
torch formulas they replace (transformers' numerics), and the fallbacks they keep."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.kernels import cpu_fused as F


def test_the_extension_builds_here():
    assert F.available()  # g++ is on every machine of this project's kind


def test_a_stale_torch_build_lock_does_not_hang_the_next_load():
    """A process killed while torch's build lock file exists (a SIGKILLed worker, a replica
    force-killed by Serve) left the file, and every later load on the machine polled for
    it forever: a model worker hung in its first forward (CI timed out on it). A fresh
    process now loads, with the stale file in place, and removes it."""
    import subprocess
    import sys
    from pathlib import Path

    from pagedserve.kernels.cpu_build import build_directory, cpu_kind_tag

    # In the real build directory, where the module is built already (a copy elsewhere
    # would make torch rebuild it: its ninja file names the directory).
    assert F.available()
    lock = Path(build_directory(f"{F._EXT.name}_{cpu_kind_tag()}")) / "lock"
    lock.touch()
    try:
        code = ("from pagedserve.kernels import cpu_fused; import sys; "
                "sys.exit(0 if cpu_fused.available() else 3)")
        r = subprocess.run([sys.executable, "-c", code], timeout=240, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "stale torch build lock" in r.stderr
        assert not lock.exists()
    finally:
        lock.unlink(missing_ok=True)


@pytest.mark.parametrize("n,d", [(1, 64), (7, 576), (300, 768)])  # 300 rows: several threads' chunks
def test_rms_norm_and_the_residual_add(n, d):
    g = torch.Generator().manual_seed(n)
    x, r, w = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), torch.randn(d, generator=g)
    torch.testing.assert_close(F.rms_norm(x, w, 1e-5), F.rms_norm_ref(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    strided = torch.randn(n, 2 * d, generator=g)[:, :d]  # rows apart: a view, not a copy
    torch.testing.assert_close(F.rms_norm(strided, w, 1e-6), F.rms_norm_ref(strided, w, 1e-6),
                               rtol=2e-6, atol=2e-6)
    x2 = x.clone()
    out, s = F.add_rms_norm(x2, r, w, 1e-5)
    assert s is x2 and torch.equal(s, x + r)  # the sum lands in x, in place (the model relies on it)
    torch.testing.assert_close(out, F.rms_norm_ref(x + r, w, 1e-5), rtol=2e-6, atol=2e-6)


def test_silu_and_mul():
    g = torch.Generator().manual_seed(1)
    for n, d in [(1, 16), (5, 2048), (129, 1536)]:
        x = torch.randn(n, 2 * d, generator=g) * 4
        torch.testing.assert_close(F.silu_and_mul(x), F.silu_and_mul_ref(x), rtol=2e-6, atol=1e-6)


def test_rotary_is_bit_identical_on_a_view_of_fused_qkv():
    g = torch.Generator().manual_seed(2)
    n, heads, kv_heads, d = 37, 12, 4, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g)
    x = qkv[:, : (heads + kv_heads) * d].view(n, -1, d)  # q and k side by side, token rows apart
    pos = torch.randint(0, 4096, (n,), generator=g).float()
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    got = F.rotary(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, F.rotary_ref(x, cos, sin))


def test_other_dtypes_take_the_torch_formulas():
    x, w = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    assert torch.equal(F.rms_norm(x, w, 1e-6), F.rms_norm_ref(x, w, 1e-6))
    y = torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(F.silu_and_mul(y), F.silu_and_mul_ref(y))


def test_extension_builds_are_per_cpu_kind():
    """Built with -march=native, a module from another CPU kind under the same home directory
    (CI and dev machines move between Intel and AMD parts) would die of SIGILL: the build
    name carries a tag of the CPU's model and flags, stable within a machine."""
    from pagedserve.kernels import cpu_build

    tag = cpu_build.cpu_kind_tag()
    assert len(tag) == 8 and int(tag, 16) >= 0
    cpu_build.cpu_kind_tag.cache_clear()
    assert cpu_build.cpu_kind_tag() == tag
    assert F.available()
    assert os.path.isdir(cpu_build.build_directory(f"{F._EXT.name}_{tag}"))


def test_an_extension_source_is_its_cpp_file_with_its_headers_inlined():
    """The C++ lives in .cpp and .h files in kernels/; load_inline gets one text an extension
    (it compiles it from a directory of its own), each quoted #include replaced by the
    header's text, once, and #line directives that put every line at the file and line it
    came from, so that the compiler's warnings and errors name the real file."""
    from pathlib import Path

    from pagedserve.kernels.cpu_build import _QUOTED_INCLUDE, SOURCE_DIR, read_source

    text = read_source("cpu_decode_attention.cpp")
    assert not _QUOTED_INCLUDE.search(text)
    assert text.count("namespace torch { using at::Tensor; }") == 1  # cpu_prelude.h
    assert text.count("static inline float row_scale(") == 1  # cpu_kv_dequant.h
    lines = {f: (SOURCE_DIR / f).read_text().splitlines()
             for f in ("cpu_decode_attention.cpp", "cpu_prelude.h", "cpu_kv_dequant.h")}
    where, seen = None, set()
    for line in text.splitlines():
        if line.startswith("#line "):
            _, n, name = line.split(" ", 2)
            where = [Path(name.strip('"')).name, int(n)]
            assert name.strip('"') == f"kernels/{where[0]}"
            continue
        assert where is not None, "the text starts with a #line"
        assert lines[where[0]][where[1] - 1] == line, where
        seen.add(where[0])
        where[1] += 1
    assert seen == set(lines)
