"""GPU check, quantised KV cache section (``--kv-cache-dtype fp8 | fp8_e5m2 | int8``).

Run as part of ``python -m pagedserve.loadtest.kernel_checks.gpu_kernels`` (and the loadtest one):

1. correctness: paged attention on quantised caches (mixed batch, split-KV decode) against the
   torch reference on the same bytes, fp16 and bf16 queries, every format; the cache write
   against the torch quantiser (scales, and values within one code);
2. decode GB/s of the quantised bytes (codes + scales) at batch 64 x 2048 and 8 x 16k against
   the measured copy bandwidth, and the time against the bf16 cache of the same shape.

fp8 e4m3 needs sm_89+: on an older GPU its rows say "refused" (the wrapper's clear error)
and do not fail the check. ``--cpu-smoke``: tiny shapes, fp16, the Triton interpreter.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref
from pagedserve.kernels.kv_quant import QUANT_DTYPES, SCALE_DTYPE, dequantize_rows
from pagedserve.loadtest.kernel_checks.paged_batch import make_paged_batch
from pagedserve.kernels.triton_cache_write import write_kv_cache_triton
from pagedserve.kernels.triton_paged_attention import choose_num_splits, paged_attention_triton

_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.int8: "int8"}
# One code step relative to the row's absmax, the most a cache-write value may differ by
# (a GPU's fp32 division may round the last bit differently from torch's).
_STEP = {torch.float8_e4m3fn: 2.0 ** -3, torch.float8_e5m2: 2.0 ** -2, torch.int8: 1 / 127}


def _formats(smoke: bool) -> tuple[torch.dtype, ...]:
    """Every quantised format; the CPU smoke run, which checks the script, not the kernels
    (tests/test_kernels_triton_kv_quant.py runs them all in the interpreter), takes one."""
    return QUANT_DTYPES[:1] if smoke else QUANT_DTYPES


def _refused(fmt: torch.dtype, dev: torch.device) -> bool:
    return fmt == torch.float8_e4m3fn and dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9)


def check_correctness(dev, smoke: bool, row, results: dict) -> None:
    dtypes = [torch.float16] if smoke else [torch.float16, torch.bfloat16]
    tol = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
    h, kvh, d = (4, 2, 64) if smoke else (32, 8, 128)
    cases = {
        "mixed (1,1328) (5,18) (129,463) +6 decode": ([1] * 6 + [1, 5, 129], [17, 64, 300, 1, 999, 2048, 1328, 18, 463]),
        "split-KV decode x8": ([1] * 8, [4096, 17, 1000, 3000, 2048, 64, 5000, 1]),
    }
    for fmt in _formats(smoke):
        for dtype in dtypes:
            for seed, (name, (qls, sls)) in enumerate(cases.items()):
                if smoke:
                    sls = [min(s, 200) for s in sls]
                key = f"attention {str(dtype)[6:]} kv {_NAMES[fmt]} {name}"
                if _refused(fmt, dev):
                    row("kv quant", key, "refused (sm < 89), as designed")
                    continue
                b = make_paged_batch(qls, sls, h, kvh, d, 16, dtype=dtype, device=dev, seed=2000 + seed, kv_dtype=fmt)
                md = b.attn_metadata
                ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, md.block_table, md.seq_lens, md.cu_seqlens_q,
                                          b.scale, k_scale=b.k_scale, v_scale=b.v_scale)
                out = torch.full_like(b.q, float("nan"))
                splits = 4 if name.startswith("split") and smoke else None
                got = paged_attention_triton(b.q, b.k_cache, b.v_cache, md, b.scale, out=out, num_splits=splits,
                                             k_scale=b.k_scale, v_scale=b.v_scale)
                err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                ok = err < tol[dtype] and not bool(torch.isnan(got).any())
                results["correctness"][key] = {"rel_err": err, "ok": ok}
                row("kv quant", key, f"rel err {err:.1e} {'PASS' if ok else 'FAIL'}")
                del b, ref, out, got
        if _refused(fmt, dev):
            continue
        gen = torch.Generator().manual_seed(6)
        x_dtype = dtypes[-1]
        rows = 40 if smoke else 300  # the interpreter runs a program per row
        k_in = torch.randn(rows, kvh, d, generator=gen) * torch.logspace(-2, 2, rows)[:, None, None]
        k_in = k_in.to(x_dtype).to(dev)
        v_in = torch.randn(rows, kvh, d, generator=gen).to(x_dtype).to(dev)
        slots = torch.randperm(64 * 16, generator=gen)[:rows].to(dev)
        slots[::5] = -1
        caches = [torch.zeros(64, 16, kvh, d, dtype=fmt, device=dev) for _ in range(4)]
        scales = [torch.zeros(64, 16, kvh, dtype=SCALE_DTYPE, device=dev) for _ in range(4)]
        write_kv_cache_ref(k_in, v_in, caches[0], caches[1], slots, scales[0], scales[1])
        write_kv_cache_triton(k_in, v_in, caches[2], caches[3], slots, scales[2], scales[3])
        worst, same = 0.0, 0
        for r, t in ((0, 2), (1, 3)):
            a, b2 = dequantize_rows(caches[r], scales[r]), dequantize_rows(caches[t], scales[t])
            amax = a.abs().amax(-1, keepdim=True).clamp_min(1e-30)
            worst = max(worst, float(((a - b2).abs() / amax).max()))
            same += int((caches[r].view(torch.uint8) == caches[t].view(torch.uint8)).sum())
        frac = same / (2 * caches[0].numel())
        ok = worst <= _STEP[fmt] * (1 + 1e-3)
        name = f"cache write {str(x_dtype)[6:]} -> {_NAMES[fmt]} (skips)"
        results["correctness"][name] = {"ok": ok, "max_diff_of_absmax": worst, "bytes_equal": frac}
        row("kv quant", name, f"{100 * frac:.3f}% bytes equal, max diff {worst:.1e} of absmax "
            f"{'PASS' if ok else 'FAIL'}")


def check_bandwidth(dev, smoke: bool, row, results: dict, bench) -> None:
    copy = results["bandwidth"].get("copy_GBps")
    h, kvh, d, dtype = (4, 2, 64, torch.float16) if smoke else (32, 8, 128, torch.bfloat16)
    shapes = [(2, 64)] if smoke else [(64, 2048), (8, 16384)]
    for batch, ctx in shapes:
        base = make_paged_batch([1] * batch, [ctx] * batch, h, kvh, d, 16, dtype=dtype, device=dev, seed=7,
                                poison=False)
        out = torch.empty_like(base.q)
        md = base.attn_metadata
        t_base = bench(lambda: paged_attention_triton(base.q, base.k_cache, base.v_cache, md, base.scale, out=out), dev)
        for fmt in _formats(smoke):
            name = f"decode {batch} x {ctx} kv {_NAMES[fmt]} ({h}q/{kvh}kv, d{d}, q {str(dtype)[6:]})"
            if _refused(fmt, dev):
                row("kv quant", name, "refused (sm < 89), as designed")
                continue
            b = make_paged_batch([1] * batch, [ctx] * batch, h, kvh, d, 16, dtype=dtype, device=dev, seed=7,
                                 poison=False, kv_dtype=fmt)
            kv_bytes = 2 * batch * ctx * kvh * (d * b.k_cache.element_size() + b.k_scale.element_size())
            t = bench(lambda: paged_attention_triton(b.q, b.k_cache, b.v_cache, b.attn_metadata, b.scale, out=out,
                                                     k_scale=b.k_scale, v_scale=b.v_scale), dev)
            gbs = kv_bytes / t / 1e9
            results["bandwidth"][name] = {"us": t * 1e6, "GBps": gbs, "of_copy": gbs / copy if copy else None,
                                          "speedup_vs_" + str(dtype)[6:]: t_base / t,
                                          "splits_auto": choose_num_splits(batch, kvh, ctx, 64, dev)}
            of_copy = f" = {100 * gbs / copy:5.1f}% of copy" if copy else ""
            row("kv quant", name, f"{t * 1e6:8.1f} us {gbs:7.1f} GB/s{of_copy}, {t_base / t:.2f}x the "
                f"{str(dtype)[6:]} cache")
            del b
        del base, out
