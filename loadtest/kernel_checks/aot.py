"""Compile every Triton kernel for a CUDA target without a GPU: frontend, MLIR passes,
LLVM and ptxas all run, so type errors that the interpreter never sees (a loop-carried
variable changing type, a bad dot shape, too much shared memory) fail on a CPU box.

    python -m pagedserve.loadtest.kernel_checks.aot [--arch 90]     # prints one line per variant, exit 1 on failure
    python -m pagedserve.loadtest.kernel_checks.aot --kv-quant     # the quantised-cache variants: fp8 e4m3 / e5m2 /
                                                          # int8 at sm_90, and e5m2 / int8 at sm_80
    python -m pagedserve.loadtest.kernel_checks.aot --lora         # the multi-LoRA shrink and expand
    python -m pagedserve.loadtest.kernel_checks.aot --moe          # the fused-MoE gate/up and down GEMMs
    python -m pagedserve.loadtest.kernel_checks.aot --int4         # the int4 weight GEMM: GPTQ zeros, GGUF mins
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedserve.kernels import (triton_cache_write, triton_lora_expand, triton_lora_shrink, triton_paged_attention,
                                triton_split_kv_reduce)
from pagedserve.kernels.moe import triton_fused_moe
from pagedserve.kernels.quant import triton_int4_gemm


def _compile(fn, types: dict[str, str], consts: dict, arch: int, num_warps: int = 4) -> dict:
    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else types[n]) for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=2))
    return {"shared_bytes": k.metadata.shared}


def _attention_types(dt: str, kv_dt: str | None = None) -> dict[str, str]:
    types = {}
    for n in triton_paged_attention._paged_attention_kernel.arg_names:
        if n in ("out_ptr", "q_ptr"):
            types[n] = "*" + dt
        elif n in ("k_cache_ptr", "v_cache_ptr"):
            types[n] = "*" + (kv_dt or dt)
        elif n in ("k_scale_ptr", "v_scale_ptr"):
            types[n] = "*u8" if kv_dt else "*" + dt
        elif n in ("block_table_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr"):
            types[n] = "*i32"
        elif n in ("part_out_ptr", "part_lse_ptr"):
            types[n] = "*fp32"
        else:
            types[n] = "fp32" if n in ("scale_log2", "softcap_log2") else "i32"
    return types


def variants(quick: bool = False):
    """(name, fn, types, constexprs) for the launch configurations the wrappers use."""
    shapes = [  # (group, group_pad, head_dim, block_m, split)
        (4, 4, 128, 16, False), (4, 4, 128, 64, False), (4, 4, 128, 16, True), (3, 4, 64, 64, False),
        (1, 1, 64, 16, True),
    ]
    dtypes = ("fp16", "bf16") if quick else ("fp16", "bf16", "fp32")
    for dt in dtypes:
        for group, gpad, hd, bm, split in (shapes[:3] if quick else shapes):
            consts = dict(NUM_QUERIES_PER_KV=group, GROUP_PAD=gpad, HEAD_DIM=hd, HEAD_DIM_PAD=hd, BLOCK_SIZE=16,
                          TILE_N=64, BLOCK_Q=bm // gpad, BLOCK_M=bm, SPLIT_KV=split, FP32_DOT=dt == "fp32",
                          KV_QUANT=False, NUM_KV_HEADS=8, INV_QMAX=0.0, USE_WINDOW=False, USE_SOFTCAP=False)
            yield (f"attention {dt} group {group} d{hd} BLOCK_M {bm} split {split}",
                   triton_paged_attention._paged_attention_kernel, _attention_types(dt), consts)
        # Gemma: a sliding window with Gemma 2's soft-cap, and Gemma 3's window alone (head_dim 256)
        for group, hd, bm, split, softcap in ((2, 256, 16, True, True), (2, 256, 64, False, False)) * (
                not quick or dt == "bf16"):
            consts = dict(NUM_QUERIES_PER_KV=group, GROUP_PAD=group, HEAD_DIM=hd, HEAD_DIM_PAD=hd, BLOCK_SIZE=16,
                          TILE_N=64, BLOCK_Q=bm // group, BLOCK_M=bm, SPLIT_KV=split, FP32_DOT=dt == "fp32",
                          KV_QUANT=False, NUM_KV_HEADS=8, INV_QMAX=0.0, USE_WINDOW=True, USE_SOFTCAP=softcap)
            yield (f"attention {dt} window{' softcap' if softcap else ''} group {group} d{hd} BLOCK_M {bm} split {split}",
                   triton_paged_attention._paged_attention_kernel, _attention_types(dt), consts)
    yield ("split-KV reduce", triton_split_kv_reduce._split_kv_reduce_kernel,
           {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "stride_o_tok": "i32",
            "stride_o_head": "i32", "num_heads": "i32"},
           dict(NUM_SPLITS=5, SPLITS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128))
    yield ("cache write", triton_cache_write._write_kv_cache_kernel,
           {n: ("*i64" if n == "slot_mapping_ptr" else "*bf16" if n.endswith("_ptr") else "i32")
            for n in triton_cache_write._write_kv_cache_kernel.arg_names},
           dict(NUM_KV_HEADS=3, HEADS_PAD=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, QUANT=0, QMAX=0.0,
                INV_QMAX=0.0))


# kv format -> (triton pointer type, cache-write QUANT code, QMAX, lowest arch that must compile)
_KV_FORMATS = {"fp8e4nv": ("fp8e4nv", 1, 448.0, 89), "fp8e5": ("fp8e5", 2, 57344.0, 80), "i8": ("i8", 3, 127.0, 80)}


def kv_quant_variants():
    """(name, fn, types, constexprs, arch): every quantised format with bf16 and fp16 queries,
    decode and prefill tiles, split-KV; sm_90, and sm_80 for the formats that must work there."""
    for kv_dt, (ptr, code, qmax, low_arch) in _KV_FORMATS.items():
        for arch in sorted({90, low_arch} - {89}):
            for dt in ("bf16", "fp16"):
                for group, gpad, hd, bm, split in ((4, 4, 128, 16, False), (4, 4, 128, 64, False),
                                                   (1, 1, 64, 16, True)):
                    consts = dict(NUM_QUERIES_PER_KV=group, GROUP_PAD=gpad, HEAD_DIM=hd, HEAD_DIM_PAD=hd,
                                  BLOCK_SIZE=16, TILE_N=64, BLOCK_Q=bm // gpad, BLOCK_M=bm, SPLIT_KV=split,
                                  FP32_DOT=False, KV_QUANT=True, NUM_KV_HEADS=8, INV_QMAX=1.0 / qmax,
                                  USE_WINDOW=False, USE_SOFTCAP=False)
                    yield (f"sm_{arch} attention q {dt} kv {kv_dt} group {group} BLOCK_M {bm} split {split}",
                           triton_paged_attention._paged_attention_kernel, _attention_types(dt, ptr), consts, arch)
            types = {n: ("*i64" if n == "slot_mapping_ptr" else "*u8" if "scale" in n else
                         f"*{ptr}" if "cache" in n else "*bf16" if n.endswith("_ptr") else "i32")
                     for n in triton_cache_write._write_kv_cache_kernel.arg_names}
            yield (f"sm_{arch} cache write bf16 -> {kv_dt}", triton_cache_write._write_kv_cache_kernel, types,
                   dict(NUM_KV_HEADS=3, HEADS_PAD=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, QUANT=code,
                        QMAX=qmax, INV_QMAX=1.0 / qmax), arch)


def _lora_types(fn, dt: str) -> dict[str, str]:
    """xa is fp32, the segment tables int32, x / A / B / out the model's dtype."""
    return {n: ("*fp32" if n == "xa_ptr" else "*i32" if n in ("seg_ptr", "widths_ptr", "cols_ptr", "ranks_ptr")
                else f"*{dt}" if n.endswith("_ptr") else "i32") for n in fn.arg_names}


def lora_variants():
    """(name, fn, types, constexprs): the shrink and the expand in each dtype, at the tile
    sizes their wrappers pick for decode (BLOCK_M 16, split K) and prefill (BLOCK_M 64)."""
    shrink, expand = triton_lora_shrink._lora_shrink_kernel, triton_lora_expand._lora_expand_kernel
    for dt in ("bf16", "fp16", "fp32"):
        for bm, split_k in ((16, 8), (64, 1)):
            yield (f"lora shrink {dt} BLOCK_M {bm} split K {split_k}", shrink, _lora_types(shrink, dt),
                   dict(BLOCK_M=bm, BLOCK_N=32, BLOCK_K=64, SPLIT_K=split_k, FP32_DOT=dt == "fp32"))
        for bm, br in ((16, 16), (64, 32)):
            yield (f"lora expand {dt} BLOCK_M {bm} BLOCK_R {br}", expand, _lora_types(expand, dt),
                   dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_R=br, FP32_DOT=dt == "fp32"))


def _moe_types(fn, dt: str) -> dict[str, str]:
    """The block tables int32, the routing weights fp32, activations and weights the model's dtype."""
    return {n: ("*i32" if n in ("sorted_ids_ptr", "block_expert_ptr") else "*fp32" if n == "topk_weights_ptr"
                else f"*{dt}" if n.endswith("_ptr") else "i32") for n in fn.arg_names}


def moe_variants():
    """(name, fn, types, constexprs): both launches in each dtype, at the BLOCK_M the wrapper
    picks for decode (16) and prefill (64), its BLOCK_N and BLOCK_K."""
    for dt in ("bf16", "fp16", "fp32"):
        for fn, what in ((triton_fused_moe._moe_gate_up_kernel, "gate/up"), (triton_fused_moe._moe_down_kernel, "down")):
            for bm in (16, 64):
                yield (f"moe {what} {dt} BLOCK_M {bm}", fn, _moe_types(fn, dt),
                       dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=32 if dt == "fp32" else 64, FP32_DOT=dt == "fp32"))


def int4_variants():
    """(name, fn, types, constexprs): the int4 GEMM with zeros (GPTQ / AWQ, GGUF's Q4_0) and
    with fp16 mins (GGUF's Q4_1), in each activation dtype, at decode's BLOCK_M and prefill's."""
    fn = triton_int4_gemm._int4_gemm_kernel
    for dt in ("bf16", "fp16", "fp32"):
        for has_min in (False, True):
            for bm in (16, 64):
                types = {n: ("*i32" if n in ("qweight_ptr", "g_idx_ptr") else "*fp16" if n == "scales_ptr"
                             else ("*fp16" if has_min else "*u8") if n == "zeros_ptr"
                             else f"*{dt}" if n.endswith("_ptr") else "i32") for n in fn.arg_names}
                yield (f"int4 {'mins' if has_min else 'zeros'} {dt} BLOCK_M {bm}", fn, types,
                       dict(HAS_G_IDX=False, HAS_MIN=has_min, HAS_BIAS=True, IEEE_FP32=dt == "fp32", BLOCK_M=bm,
                            BLOCK_N=64, BLOCK_K=32))


def _todo(args) -> list:
    if args.int4:
        return [(*v, args.arch) for v in int4_variants()]
    if args.lora:
        return [(*v, args.arch) for v in lora_variants()]
    if args.moe:
        return [(*v, args.arch) for v in moe_variants()]
    return list(kv_quant_variants() if args.kv_quant else ((*v, args.arch) for v in variants(args.quick)))


def _compile_one(args, i: int) -> str:
    """One variant's line; runs in a pool process (the variant is rebuilt there: kernels
    do not pickle)."""
    name, fn, types, consts, arch = _todo(args)[i]
    try:
        meta = _compile(fn, types, consts, arch)
        return f"OK   {name}: shared {meta['shared_bytes']} B"
    except Exception as e:  # report every variant, then fail
        return f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kv-quant", action="store_true", help="the quantised-cache variants only")
    ap.add_argument("--lora", action="store_true", help="the multi-LoRA kernels only")
    ap.add_argument("--moe", action="store_true", help="the fused-MoE kernels only")
    ap.add_argument("--int4", action="store_true", help="the int4 weight GEMM only")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="compile this many variants at once (each compile is one CPU-bound process)")
    args = ap.parse_args()
    n = len(_todo(args))
    failed = 0
    # Fork: the children inherit the imported triton and kernels (no GPU is touched here).
    with ProcessPoolExecutor(max_workers=max(1, min(args.jobs, n)),
                             mp_context=multiprocessing.get_context("fork")) as pool:
        for line in pool.map(_compile_one, [args] * n, range(n)):
            failed += line.startswith("FAIL")
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
