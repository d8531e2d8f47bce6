"""The Triton kernels agree with the torch reference, run by the Triton interpreter.

TRITON_INTERPRET=1 must be in the environment when ``@triton.jit`` runs (when the
kernel modules are first imported). pytest imports every test module into one process,
and any of them may import pagedserve.kernels.triton_* first, so the cases run in a child process
started with the variable set (this file, run as a script, prints one JSON line per
case); the child also checks that the kernels really are interpreted. The interpreter
computes bf16 arithmetic wrongly, so cases are fp32 and fp16; bf16 is checked on a GPU
by loadtest/kernel_checks/gpu_kernels.py.

Every attention case: fresh random inputs, NaN in every cache slot no sequence owns,
and NaN in ``out`` before the launch (a row the kernel skips stays NaN and fails).
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

# name: (query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, extra)
MIXED_ROWS = ([1, 5, 129], [1328, 18, 463])  # the rows, one launch
ATTENTION_CASES = {
    # GQA 2, head_dim 64, block 16; prefill tiles of 32 query rows (BLOCK_M 64).
    "mixed_fp32_gqa2_d64_b16": (*MIXED_ROWS, 4, 2, 64, 16, "float32", {}),
    # GQA 4, head_dim 128, block 32, fp16 (fp16 P in the PV dot).
    "mixed_fp16_gqa4_d128_b32": (*MIXED_ROWS, 8, 2, 128, 32, "float16", {}),
    # GQA 3 (not a power of 2: padded head rows), decode rows first like the runner,
    # a whole-prompt prefill and a chunk, head_dim 64, block 32; q a strided view of a
    # fused qkv tensor, as the model passes it.
    "mixed_fp32_gqa3_d64_b32": ([1, 1, 7, 20], [77, 1, 7, 50], 6, 2, 64, 32, "float32", {"q_view": True}),
    # Flash-decoding: decode-only batch, 8 KV splits; the 40-token row leaves splits empty.
    "split_kv_fp32": ([1, 1, 1], [1328, 40, 700], 4, 2, 64, 16, "float32", {"num_splits": 8}),
    "split_kv_fp16_d128": ([1, 1], [900, 3], 8, 1, 128, 16, "float16", {"num_splits": 5}),
    # A 2,097,216-block pool (2^31 + 64Ki elements per cache, allocated lazily) and block
    # ids from its tail: block_id * stride_blk passes 2^31, so int32 offsets would wrap.
    "large_pool_fp16": ([1, 9], [70, 40], 2, 1, 64, 16, "float16",
                        {"num_blocks": 2**21 + 64, "high_block_ids": True, "poison": False}),
    # Sliding windows (Gemma's local layers): a row sees its W newest keys; the blocks no
    # row's window reaches are NaN (a hybrid KV cache freed them) and must not be read.
    # The rows at W 40 (a prefill tile whose rows start in different KV tiles).
    "window_mixed_fp32": (*MIXED_ROWS, 4, 2, 64, 16, "float32", {"sliding_window": 40}),
    # Gemma 2: a window and soft-capped scores, fp16, GQA 3, the chunk rows straddling blocks.
    "window_softcap_fp16_gqa3": ([1, 1, 7, 20], [77, 1, 7, 50], 6, 2, 64, 32, "float16",
                                 {"sliding_window": 17, "softcap": 30.0}),
    # Split-KV over a window: the splits share the window's tiles, the rest stay empty.
    "window_split_kv_fp32": ([1, 1, 1], [1328, 40, 700], 4, 2, 64, 16, "float32",
                             {"num_splits": 8, "sliding_window": 100}),
    "softcap_fp32": (*MIXED_ROWS, 4, 2, 64, 16, "float32", {"softcap": 5.0}),
}
TOLERANCE = {"float32": 1e-3, "float16": 5e-3}


def _rel_err(got, ref) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def _run_attention_case(name: str) -> dict:
    import torch

    from pagedserve.kernels.attention_ref import paged_attention_ref
    from pagedserve.loadtest.kernel_checks.paged_batch import make_paged_batch
    from pagedserve.kernels.triton_paged_attention import paged_attention_triton

    qls, sls, nh, nkv, hd, bs, dtype, extra = ATTENTION_CASES[name]
    extra = dict(extra)
    num_splits = extra.pop("num_splits", None)
    q_view = extra.pop("q_view", False)
    window, softcap = extra.pop("sliding_window", None), extra.pop("softcap", None)
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; reported for a rerun
    b = make_paged_batch(qls, sls, nh, nkv, hd, bs, dtype=getattr(torch, dtype), seed=seed, sliding_window=window,
                         **extra)
    md = b.attn_metadata
    if q_view:
        qkv = torch.randn(b.q.shape[0], (nh + 2 * nkv) * hd, dtype=b.q.dtype)
        qkv[:, :nh * hd] = b.q.reshape(-1, nh * hd)
        b.q = qkv[:, :nh * hd].view(-1, nh, hd)
        assert not b.q.is_contiguous()
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, md.block_table, md.seq_lens, md.cu_seqlens_q, b.scale,
                              sliding_window=window, softcap=softcap)
    out = torch.full(b.q.shape, float("nan"), dtype=b.q.dtype)
    got = paged_attention_triton(b.q, b.k_cache, b.v_cache, md, b.scale, out=out, num_splits=num_splits,
                                 sliding_window=window, softcap=softcap)
    return {"nan": bool(torch.isnan(got).any()), "rel_err": _rel_err(got, ref), "same_out": got is out,
            "max_block_id": int(md.block_table.max()), "seed": seed}


def _run_cache_write_case() -> dict:
    import torch

    from pagedserve.kernels.attention_ref import write_kv_cache_ref
    from pagedserve.kernels.triton_cache_write import write_kv_cache_triton

    res = {}
    for dtype in ("float32", "float16"):
        dt = getattr(torch, dtype)
        seed = int.from_bytes(os.urandom(4), "little")
        res[dtype + "_seed"] = seed
        gen = torch.Generator().manual_seed(seed)
        num_blocks, bs, nkv, hd = 40, 16, 3, 64  # 3 KV heads: padded head rows
        key = torch.randn(50, nkv, hd, generator=gen).to(dt)
        value = torch.randn(50, nkv, hd, generator=gen).to(dt)
        slots = torch.randperm(num_blocks * bs, generator=gen)[:50]
        slots[::7] = -1  # skipped rows
        k1 = torch.full((num_blocks, bs, nkv, hd), float("nan"), dtype=dt)
        v1, k2, v2 = k1.clone(), k1.clone(), k1.clone()
        write_kv_cache_ref(key, value, k1, v1, slots)
        write_kv_cache_triton(key, value, k2, v2, slots)
        res[dtype] = bool(torch.equal(k1.nan_to_num(7.0), k2.nan_to_num(7.0))
                          and torch.equal(v1.nan_to_num(7.0), v2.nan_to_num(7.0)))
        res[dtype + "_written"] = int((~torch.isnan(k2)).sum()) // (nkv * hd)
    # Large pool: the last slot of a 2^21 + 64 block pool (lazily allocated).
    num_blocks = 2**21 + 64
    kc = torch.empty(num_blocks, 16, 1, 64, dtype=torch.float16)
    vc = torch.empty_like(kc)
    key = torch.randn(2, 1, 64).half()
    slots = torch.tensor([num_blocks * 16 - 1, (num_blocks - 3) * 16 + 5])
    write_kv_cache_triton(key, -key, kc, vc, slots)
    res["large_pool"] = bool(torch.equal(kc[-1, 15], key[0]) and torch.equal(vc[-3, 5], -key[1]))
    return res


def _run_wrapper_errors() -> dict:
    import torch

    from pagedserve.loadtest.kernel_checks.paged_batch import make_paged_batch
    from pagedserve.kernels.triton_paged_attention import paged_attention_triton

    b = make_paged_batch([1, 4], [9, 4], 4, 2, 64)
    errors = {}
    bad = {
        "dtype": lambda: paged_attention_triton(b.q.half(), b.k_cache, b.v_cache, b.attn_metadata, b.scale),
        "heads": lambda: paged_attention_triton(b.q[:, :3], b.k_cache, b.v_cache, b.attn_metadata, b.scale),
        "stride": lambda: paged_attention_triton(b.q.transpose(1, 2).contiguous().transpose(1, 2), b.k_cache,
                                                 b.v_cache, b.attn_metadata, b.scale),
        "split_prefill": lambda: paged_attention_triton(b.q, b.k_cache, b.v_cache, b.attn_metadata, b.scale,
                                                        num_splits=2),
    }
    for key, fn in bad.items():
        try:
            fn()
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)
    md = b.attn_metadata
    md.seq_lens = md.seq_lens.long()
    try:
        paged_attention_triton(b.q, b.k_cache, b.v_cache, md, b.scale)
        errors["int64_seq_lens"] = None
    except ValueError as e:
        errors["int64_seq_lens"] = str(e)
    return errors


def _child_main() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from pagedserve.kernels import triton_cache_write, triton_paged_attention, triton_split_kv_reduce

    interpreted = all(isinstance(k, InterpretedFunction) for k in (
        triton_paged_attention._paged_attention_kernel, triton_split_kv_reduce._split_kv_reduce_kernel,
        triton_cache_write._write_kv_cache_kernel))
    print(json.dumps({"case": "interpreted", "result": interpreted}), flush=True)
    for name in ATTENTION_CASES:
        emit(name, lambda name=name: _run_attention_case(name))
    emit("cache_write", _run_cache_write_case)
    emit("wrapper_errors", _run_wrapper_errors)


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter_results(__file__)


def test_kernels_run_in_the_interpreter(results):
    assert results["interpreted"] is True


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_matches_reference(results, name):
    r = results[name]
    assert r["same_out"]
    assert not r["nan"], f"a row stayed NaN (not written) or read an unowned slot: {r}"
    assert r["rel_err"] < TOLERANCE[ATTENTION_CASES[name][6]], r


def test_large_pool_uses_high_block_ids(results):
    r = results["large_pool_fp16"]
    assert r["max_block_id"] * 16 * 64 >= 2**31  # element offset past int32


def test_cache_write_matches_reference(results):
    r = results["cache_write"]
    assert r["float32"] and r["float16"], r
    assert r["float32_written"] == 50 - 8  # rows 0, 7, ..., 49 skipped
    assert r["large_pool"]


def test_wrappers_reject_bad_inputs_clearly(results):
    e = results["wrapper_errors"]
    assert "dtypes must match" in e["dtype"]
    assert "multiple of num_kv_heads" in e["heads"]
    assert "stride 1" in e["stride"]
    assert "decode-only" in e["split_prefill"]
    assert "seq_lens must be a 1-D int32" in e["int64_seq_lens"]


def test_kernels_compile_for_sm90_without_a_gpu():
    """Frontend + ptxas for the real target: errors the interpreter cannot see."""
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "pagedserve.loadtest.kernel_checks.aot", "--quick"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("OK ") == 10  # 6 attention variants, 2 with a window (Gemma), reduce, write


def test_kernels_package_imports_without_triton():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('no triton here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "from pagedserve import kernels\n"
        "from pagedserve.loadtest.kernel_checks.paged_batch import make_paged_batch\n"
        "assert not kernels.triton_available()\n"
        "b = make_paged_batch([1, 3], [20, 3], 4, 2, 64)\n"
        "o = kernels.paged_attention(b.q, b.k_cache, b.v_cache, b.attn_metadata, b.scale, backend='torch')\n"
        "assert not o.isnan().any()\n"
        "try:\n"
        "    kernels.paged_attention(b.q, b.k_cache, b.v_cache, b.attn_metadata, b.scale, backend='triton')\n"
        "except RuntimeError as e:\n"
        "    print('clear:', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "clear: backend='triton' needs the triton package" in proc.stdout


if __name__ == "__main__":
    _child_main()
