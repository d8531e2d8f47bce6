"""GPU check of the Triton kernels (tensors only): correctness and bandwidth.

    python -m pagedserve.kernels.gpu_check [--json out.json] [--cpu-smoke]

The one prepared GPU script, with the engine's end-to-end section on top of these, is
``python -m pagedserve.loadtest.gpu_check`` (kernels/ never imports the engine).

1. correctness of paged attention (mixed batch, split-KV decode, a pool of 2^31+
   elements with block ids at its end) and of the cache write, vs the torch reference,
   fp16 and bf16;
2. decode-attention time and achieved GB/s (K/V bytes read / time) at batch 64 x 2048
   and batch 8 x 16k (32 q heads, 8 KV heads, head_dim 128, bf16, block 16), against a
   measured device-to-device copy ((read + write bytes) / time); goal >= 75%. A small
   sweep of tile size / warps / splits reports the best config next to the default;
3. the quantised KV cache (gpu_check_kv_quant.py): fp8 e4m3 / e5m2 and int8 attention and
   cache-write correctness, and decode GB/s of the quantised bytes against copy and bf16;

The table is printed last. ``--cpu-smoke`` runs every section with tiny shapes on the
CPU (Triton interpreter, fp16 only) to check the script itself.
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # must precede the first @triton.jit (kernel import)
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

from pagedserve.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref  # noqa: E402
from pagedserve.kernels.testing import make_paged_batch  # noqa: E402
from pagedserve.kernels.triton_cache_write import write_kv_cache_triton  # noqa: E402
from pagedserve.kernels.triton_paged_attention import choose_num_splits, paged_attention_triton  # noqa: E402

T0 = time.time()
ROWS: list[tuple[str, str, str]] = []  # (section, item, value) for the final table
RESULTS: dict = {"correctness": {}, "bandwidth": {}}


def row(section: str, item: str, value: str) -> None:
    ROWS.append((section, item, value))
    print(f"[{time.time() - T0:6.1f}s] {section:<12} {item:<44} {value}", flush=True)


def bench(fn, dev: torch.device, reps: int = 20) -> float:
    """Median seconds per call."""
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        times = []
        for _ in range(max(1, reps // 10)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def check_attention(dev, smoke: bool) -> None:
    dtypes = [torch.float16] if smoke else [torch.float16, torch.bfloat16]
    tol = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
    h, kvh, d = (4, 2, 64) if smoke else (32, 8, 128)
    cases = {
        "mixed (1,1328) (5,18) (129,463) +6 decode": ([1] * 6 + [1, 5, 129], [17, 64, 300, 1, 999, 2048, 1328, 18, 463],
                                                      dict(block_size=16)),
        "mixed, block 32, head_dim 64": ([1, 1, 40, 7], [700, 33, 40, 90], dict(block_size=32, head_dim=64)),
        "split-KV decode x8": ([1] * 8, [4096, 17, 1000, 3000, 2048, 64, 5000, 1], dict(block_size=16)),
        "pool 2^31+ elems, ids at end": ([1, 9, 1], [70, 40, 300], dict(block_size=16, num_kv_heads=1, head_dim=64,
                                         num_blocks=2**21 + 64, high_block_ids=True, poison=False)),
    }
    if smoke:
        cases = {k + " (ctx<=200)": (q, [min(s, 200) for s in sl], kw) for k, (q, sl, kw) in cases.items()}
    for dtype in dtypes:
        for seed, (name, (qls, sls, kw)) in enumerate(cases.items()):
            kw = dict(kw)
            cfg = dict(num_heads=h, num_kv_heads=kw.pop("num_kv_heads", kvh), head_dim=kw.pop("head_dim", d))
            b = make_paged_batch(qls, sls, cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], dtype=dtype,
                                 device=dev, seed=1000 + seed, **kw)
            md = b.attn_metadata
            ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, md.block_table, md.seq_lens, md.cu_seqlens_q, b.scale)
            out = torch.full_like(b.q, float("nan"))
            splits = 4 if name.startswith("split") and smoke else None
            got = paged_attention_triton(b.q, b.k_cache, b.v_cache, md, b.scale, out=out, num_splits=splits)
            err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
            ok = err < tol[dtype] and not bool(torch.isnan(got).any())
            key = f"attention {str(dtype)[6:]} {name}"
            RESULTS["correctness"][key] = {"rel_err": err, "ok": ok}
            row("correctness", key, f"rel err {err:.1e} {'PASS' if ok else 'FAIL'}")
            del b, ref, out, got
    for dtype in dtypes:
        gen = torch.Generator().manual_seed(5)
        key = torch.randn(300, kvh, d, generator=gen).to(dtype).to(dev)
        value = torch.randn(300, kvh, d, generator=gen).to(dtype).to(dev)
        slots = torch.randperm(64 * 16, generator=gen)[:300].to(dev)
        slots[::5] = -1
        caches = [torch.full((64, 16, kvh, d), float("nan"), dtype=dtype, device=dev) for _ in range(4)]
        write_kv_cache_ref(key, value, caches[0], caches[1], slots)
        write_kv_cache_triton(key, value, caches[2], caches[3], slots)
        ok = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in ((caches[0], caches[2]),
                                                                                   (caches[1], caches[3])))
        # Last slot of a 2^31+ element pool (lazily allocated: only written pages count).
        big = torch.empty(2**21 + 64, 16, 1, 64, dtype=dtype, device=dev)
        kk = torch.randn(1, 1, 64, dtype=dtype, device=dev)
        write_kv_cache_triton(kk, kk, big, big, torch.tensor([big.shape[0] * 16 - 1], device=dev))
        ok = ok and torch.equal(big[-1, 15], kk[0])
        del big
        RESULTS["correctness"][f"cache write {str(dtype)[6:]}"] = {"ok": ok}
        row("correctness", f"cache write {str(dtype)[6:]} (skips, 2^31+ pool)", "exact PASS" if ok else "FAIL")


def check_bandwidth(dev, smoke: bool) -> None:
    nbytes = (1 << 20) if smoke else (2 << 30)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=dev)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), dev)
    copy_gbs = 2 * nbytes / t / 1e9
    del src, dst
    RESULTS["bandwidth"]["copy_GBps"] = copy_gbs
    row("bandwidth", f"device copy {nbytes >> 20} MiB (read+write)", f"{copy_gbs:8.1f} GB/s")
    h, kvh, d, dtype = (4, 2, 64, torch.float16) if smoke else (32, 8, 128, torch.bfloat16)
    shapes = [(2, 64), (1, 200)] if smoke else [(64, 2048), (8, 16384)]
    for batch, ctx in shapes:
        b = make_paged_batch([1] * batch, [ctx] * batch, h, kvh, d, 16, dtype=dtype, device=dev, seed=7, poison=False)
        md = b.attn_metadata
        kv_bytes = 2 * batch * ctx * kvh * d * b.k_cache.element_size()
        out = torch.empty_like(b.q)
        auto = choose_num_splits(batch, kvh, ctx, 64, dev)
        configs = [dict()]
        if smoke:  # exercise the sweep's code path once
            configs.append(dict(tile_n=32, num_warps=4, num_splits=2))
        elif time.time() - T0 < 180:  # the sweep is the first thing to drop when slow
            for tile_n in (32, 64, 128):
                for warps in (4, 8):
                    for splits in sorted({1, auto, min(64, 2 * auto)}):
                        configs.append(dict(tile_n=tile_n, num_warps=warps, num_splits=splits))
        best = None
        for i, cfg in enumerate(configs):
            try:
                t = bench(lambda: paged_attention_triton(b.q, b.k_cache, b.v_cache, md, b.scale, out=out, **cfg), dev)
            except Exception as e:  # a config that does not compile is skipped, not fatal
                print(f"  config {cfg} failed: {type(e).__name__}: {e}", flush=True)
                continue
            gbs = kv_bytes / t / 1e9
            if i == 0:
                default = (t, gbs)
            if best is None or t < best[0]:
                best = (t, gbs, cfg)
        name = f"decode {batch} x {ctx} ({h}q/{kvh}kv, d{d}, {str(dtype)[6:]})"
        t, gbs = default
        RESULTS["bandwidth"][name] = {"us": t * 1e6, "GBps": gbs, "of_copy": gbs / copy_gbs, "splits_auto": auto,
                                      "best_us": best[0] * 1e6, "best_GBps": best[1], "best_cfg": best[2]}
        row("bandwidth", name, f"{t * 1e6:8.1f} us {gbs:7.1f} GB/s = {100 * gbs / copy_gbs:5.1f}% of copy "
            f"(splits {auto})")
        if len(configs) > 1:
            row("bandwidth", "  best of sweep " + json.dumps(best[2]),
                f"{best[0] * 1e6:8.1f} us {best[1]:7.1f} GB/s = {100 * best[1] / copy_gbs:5.1f}% of copy")
        del b, out


def main(extra_sections=(), add_args=None, description: str | None = None) -> int:
    """Run the kernel sections, then ``extra_sections`` [(name, fn(dev, args))], each guarded
    so that a failure still prints the table of what ran. ``add_args(parser)`` adds the
    extra sections' flags (the e2e section of ``pagedserve.loadtest.gpu_check`` uses both)."""
    ap = argparse.ArgumentParser(description=description or __doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results as JSON to this path")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU via the Triton interpreter")
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args()
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke to check the script on a CPU", file=sys.stderr)
        return 2
    RESULTS["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)"
    RESULTS["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    failed = False
    from pagedserve.kernels import gpu_check_kv_quant as kvq

    sections = [("correctness", lambda: check_attention(dev, args.cpu_smoke)),
                ("bandwidth", lambda: check_bandwidth(dev, args.cpu_smoke)),
                ("kv quant correctness", lambda: kvq.check_correctness(dev, args.cpu_smoke, row, RESULTS)),
                ("kv quant bandwidth", lambda: kvq.check_bandwidth(dev, args.cpu_smoke, row, RESULTS, bench))]
    sections += [(name, (lambda f=fn: f(dev, args))) for name, fn in extra_sections]
    for name, fn in sections:
        RESULTS.setdefault(name, {})
        try:
            fn()
        except Exception as e:  # keep going: the table of what did run still prints
            traceback.print_exc()
            row(name, "section failed", f"{type(e).__name__}: {str(e)[:80]}")
            RESULTS[name]["error"] = repr(e)
            failed = True
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    RESULTS["wall_s"] = time.time() - T0
    failed = failed or not all(v.get("ok", True) for v in RESULTS["correctness"].values())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=2, default=str)
    print(f"\n=== pagedserve gpu_check: {RESULTS['device']}, {RESULTS['date']}, {RESULTS['wall_s']:.0f} s ===")
    for section, item, value in ROWS:
        print(f"{section:<12} {item:<48} {value}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
