"""The Triton kernels on a quantised KV cache (fp8 e4m3 / e5m2, int8), run by the interpreter.

Same harness as test_kernels_triton.py: the cases run in a child process started with
TRITON_INTERPRET=1 (this file run as a script prints one JSON line per case). q is fp32 or
fp16 (the interpreter computes bf16 wrongly; a GPU checks bf16 in loadtest/kernel_checks/gpu_kernels.py).
The oracle runs on the same quantised bytes, so attention must match it as closely as an
unquantised run does, and the cache write must produce the torch reference's bytes exactly.
A real sm_90 / sm_80 compile of every quantised variant runs without a GPU (loadtest/kernel_checks/aot.py),
started with the module so that it compiles while the interpreter children run: both are
CPU-bound, one core each, and side by side the module ends sooner than one after the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _triton_interp import emit, interpreter_results

ROOT = Path(__file__).resolve().parent.parent
# Every quantised format through the interpreter, and the sm_90/sm_80 compile: under
# -m scenarios (pyproject.toml), not the default run (tests/test_kernels_triton.py stays in it).
pytestmark = pytest.mark.scenarios

FORMATS = ("float8_e4m3fn", "float8_e5m2", "int8")
# name: (query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, num_splits)
CASES = {
    "mixed_gqa2_d64_b16": ([1, 5, 129], [700, 18, 263], 4, 2, 64, 16, None),
    "mixed_gqa3_d64_b32": ([1, 1, 7, 20], [77, 1, 7, 50], 6, 2, 64, 32, None),
    "split_kv_x4": ([1, 1, 1], [900, 40, 300], 4, 2, 64, 16, 4),
}
TOLERANCE = {"float32": 1e-4, "float16": 5e-3}


def _attention(name: str, fmt: str, qdtype: str) -> dict:
    import torch

    from pagedserve.kernels.attention_ref import paged_attention_ref
    from pagedserve.loadtest.kernel_checks.paged_batch import make_paged_batch
    from pagedserve.kernels.triton_paged_attention import paged_attention_triton

    qls, sls, nh, nkv, hd, bs, splits = CASES[name]
    seed = int.from_bytes(os.urandom(4), "little")
    b = make_paged_batch(qls, sls, nh, nkv, hd, bs, dtype=getattr(torch, qdtype), seed=seed,
                         kv_dtype=getattr(torch, fmt))
    md = b.attn_metadata
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, md.block_table, md.seq_lens, md.cu_seqlens_q, b.scale,
                              k_scale=b.k_scale, v_scale=b.v_scale)
    out = torch.full(b.q.shape, float("nan"), dtype=b.q.dtype)
    got = paged_attention_triton(b.q, b.k_cache, b.v_cache, md, b.scale, out=out, num_splits=splits,
                                 k_scale=b.k_scale, v_scale=b.v_scale)
    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    return {"nan": bool(torch.isnan(got).any()), "rel_err": err, "seed": seed}


def _cache_write() -> dict:
    import torch

    from pagedserve.kernels.attention_ref import write_kv_cache_ref
    from pagedserve.kernels.triton_cache_write import write_kv_cache_triton

    res = {}
    for fmt in FORMATS:
        for xdt in ("float32", "float16"):
            gen = torch.Generator().manual_seed(FORMATS.index(fmt) * 2 + (xdt == "float16"))
            # Rows of very different ranges, an outlier and a zero row (its scale is the floor).
            key = (torch.randn(120, 3, 64, generator=gen) * torch.logspace(-3, 3, 120)[:, None, None]).to(getattr(torch, xdt))
            key[4, 2, 9] = 60000.0
            key[8] = 0.0
            key[9, 1, :5] = -0.0  # the sign of zero is kept (torch's cast: byte 0x80 in fp8)
            value = torch.randn(120, 3, 64, generator=gen).to(getattr(torch, xdt))
            slots = torch.randperm(40 * 16, generator=gen)[:120]
            slots[::7] = -1
            dt = getattr(torch, fmt)
            c = [torch.zeros(40, 16, 3, 64, dtype=dt) for _ in range(4)]
            s = [torch.full((40, 16, 3), 255, dtype=torch.uint8) for _ in range(4)]  # 255 (NaN): unwritten
            write_kv_cache_ref(key, value, c[0], c[1], slots, s[0], s[1])
            write_kv_cache_triton(key, value, c[2], c[3], slots, s[2], s[3])
            same = all(torch.equal(c[i].view(torch.uint8), c[i + 2].view(torch.uint8)) and torch.equal(s[i], s[i + 2])
                       for i in (0, 1))
            res[f"{fmt}_{xdt}"] = {"equal": same, "written": int((s[2] != 255).sum()) // 3,
                                   "codes": sorted({int(c) for c in s[2][s[2] != 255]})[:1]}
    return res


def _wrapper_errors() -> dict:
    import torch

    from pagedserve.loadtest.kernel_checks.paged_batch import make_paged_batch
    from pagedserve.kernels.triton_paged_attention import paged_attention_triton

    b = make_paged_batch([1, 4], [9, 4], 4, 2, 64, kv_dtype=torch.int8)
    errors = {}
    for key, kw in (("no_scales", {}), ("fp32_scales", dict(k_scale=b.k_scale.float(), v_scale=b.v_scale.float()))):
        try:
            paged_attention_triton(b.q, b.k_cache, b.v_cache, b.attn_metadata, b.scale, **kw)
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)
    return errors


def _child_main() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from pagedserve.kernels import triton_cache_write, triton_paged_attention

    print(json.dumps({"case": "interpreted", "result": all(isinstance(k, InterpretedFunction) for k in (
        triton_paged_attention._paged_attention_kernel, triton_cache_write._write_kv_cache_kernel))}), flush=True)
    for name in CASES:
        for fmt in FORMATS:
            for qdt in ("float32", "float16"):
                emit(f"{name}/{fmt}/{qdt}", lambda name=name, fmt=fmt, qdt=qdt: _attention(name, fmt, qdt))
    emit("cache_write", _cache_write)
    emit("wrapper_errors", _wrapper_errors)


AOT_TEST = "test_quantised_variants_compile_for_sm90_and_sm80_without_a_gpu"


@pytest.fixture(scope="module", autouse=True)
def aot(request):
    """The sm_90 / sm_80 compile, started at the module's first test if its test was selected."""
    if not any(i.name == AOT_TEST and i.module is request.module for i in request.session.items):
        yield None
        return
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.loadtest.kernel_checks.aot", "--kv-quant"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:  # its test failed early or was not reached
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter_results(__file__)


def test_kernels_run_in_the_interpreter(results):
    assert results["interpreted"] is True


@pytest.mark.parametrize("qdtype", ["float32", "float16"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(CASES))
def test_attention_on_quantised_cache_matches_reference(results, name, fmt, qdtype):
    r = results[f"{name}/{fmt}/{qdtype}"]
    assert not r["nan"], r  # NaN scales of unowned slots were never read
    assert r["rel_err"] < TOLERANCE[qdtype], r


@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_write_bytes_and_scales_equal_the_torch_reference(results, fmt):
    for xdt in ("float32", "float16"):
        r = results["cache_write"][f"{fmt}_{xdt}"]
        assert r["equal"], (fmt, xdt)
        assert r["written"] == 120 - 18  # every 7th of 120 rows skipped
        assert r["codes"] == [0]  # the zero row's absmax floors at code 0 (2^-15)


def test_wrappers_reject_missing_or_wrong_scales(results):
    e = results["wrapper_errors"]
    assert "needs k_scale and v_scale" in e["no_scales"]
    assert "must be a contiguous torch.uint8 tensor (UE5M3 absmax codes)" in e["fp32_scales"]


def test_fp8_e4m3_refused_clearly_before_sm89(monkeypatch):
    import torch

    from pagedserve.kernels.kv_quant import check_fp8_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match=r"compute capability 8.9\+.*Use fp8_e5m2 or int8"):
        check_fp8_device(torch.float8_e4m3fn, torch.device("cuda"))
    for ok in (torch.float8_e5m2, torch.int8):
        check_fp8_device(ok, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.float8_e4m3fn, torch.device("cuda"))


def test_quantised_variants_compile_for_sm90_and_sm80_without_a_gpu(aot):
    stdout, stderr = aot.communicate(timeout=900)
    assert aot.returncode == 0, stdout[-3000:] + stderr[-3000:]
    # 3 formats x (sm_90, plus sm_80 for e5m2 / int8) x (6 attention variants + 1 cache write)
    assert stdout.count("OK ") == 5 * 7
    assert "sm_80 attention q bf16 kv fp8e5" in stdout and "sm_80 cache write bf16 -> i8" in stdout


if __name__ == "__main__":
    _child_main()
