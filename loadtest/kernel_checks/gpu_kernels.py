"""GPU check of the Triton kernels (tensors only): correctness and bandwidth.

    python -m pagedserve.loadtest.kernel_checks.gpu_kernels [--json out.json] [--cpu-smoke] [--budget-s S]

The one prepared GPU script, with the engine's end-to-end sections on top of these, is
``python -m pagedserve.loadtest.gpu_check`` (this module imports kernels/ only); its
docstring holds the one-call command for a lent GPU machine.

1. correctness of paged attention (mixed batch, split-KV decode, a pool of 2^31+
   elements with block ids at its end, Gemma's sliding windows and soft-cap) and of the
   cache write, vs the torch reference, fp16 and bf16;
2. decode-attention time and achieved GB/s (K/V bytes read / time) at batch 64 x 2048
   and batch 8 x 16k (32 q heads, 8 KV heads, head_dim 128, bf16, block 16), default
   config, against a measured device-to-device copy ((read + write bytes) / time); goal
   >= 75%;
3. the quantised KV cache (gpu_kv_quant.py): fp8 e4m3 / e5m2 and int8 attention and
   cache-write correctness, and decode GB/s of the quantised bytes against copy and bf16;
4. a sweep of tile size / warps / splits at the two decode shapes, the best config next to
   the default (the least valuable section: the first to be skipped when time is short).

Every section has an estimate of its time on an H100; ``main`` runs them in order and
skips, with a row saying so, each one that would end past ``--budget-s``; a hard stop a
little later (``--hard-stop-s``) ends the section running then, so the table and the JSON
(rewritten after every section) always come out. The table is printed last.
``--cpu-smoke`` runs every section with tiny shapes on the CPU (Triton interpreter, fp16
only) to check the script itself.
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # must precede the first @triton.jit (kernel import)
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

from pagedserve.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref  # noqa: E402
from pagedserve.loadtest.kernel_checks.paged_batch import make_paged_batch  # noqa: E402
from pagedserve.kernels.triton_cache_write import write_kv_cache_triton  # noqa: E402
from pagedserve.kernels.triton_paged_attention import choose_num_splits, paged_attention_triton  # noqa: E402

T0 = time.time()
ROWS: list[tuple[str, str, str]] = []  # (section, item, value) for the final table
RESULTS: dict = {"correctness": {}, "bandwidth": {}}
# The two decode shapes of the bandwidth section and the sweep: (batch, context).
DECODE_SHAPES = [(64, 2048), (8, 16384)]
SMOKE_DECODE_SHAPES = [(2, 64), (1, 200)]


def row(section: str, item: str, value: str) -> None:
    ROWS.append((section, item, value))
    print(f"[{time.time() - T0:6.1f}s] {section:<15} {item:<44} {value}", flush=True)


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
        # Gemma: local layers' windows (freed blocks before them are NaN), Gemma 2's soft-cap
        "Gemma 2 window 64 + softcap 50, head_dim 256": ([1, 1, 40, 129], [700, 33, 90, 463],
                                                        dict(block_size=16, head_dim=256, sliding_window=64,
                                                             softcap=50.0)),
        "split-KV decode x8, window 1024": ([1] * 8, [4096, 17, 1000, 3000, 2048, 64, 5000, 1],
                                           dict(block_size=16, sliding_window=1024)),
    }
    if smoke:
        cases = {k + " (ctx<=200)": (q, [min(s, 200) for s in sl], kw) for k, (q, sl, kw) in cases.items()}
    for dtype in dtypes:
        for seed, (name, (qls, sls, kw)) in enumerate(cases.items()):
            kw = dict(kw)
            cfg = dict(num_heads=h, num_kv_heads=kw.pop("num_kv_heads", kvh), head_dim=kw.pop("head_dim", d))
            window = dict(sliding_window=kw.get("sliding_window"), softcap=kw.pop("softcap", None))
            b = make_paged_batch(qls, sls, cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], dtype=dtype,
                                 device=dev, seed=1000 + seed, **kw)
            md = b.attn_metadata
            ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, md.block_table, md.seq_lens, md.cu_seqlens_q, b.scale,
                                      **window)
            out = torch.full_like(b.q, float("nan"))
            splits = 4 if name.startswith("split") and smoke else None
            got = paged_attention_triton(b.q, b.k_cache, b.v_cache, md, b.scale, out=out, num_splits=splits, **window)
            err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
            ok = err < tol[dtype] and not bool(torch.isnan(got).any())
            key = f"attention {str(dtype)[6:]} {name}"
            RESULTS["correctness"][key] = {"rel_err": err, "ok": ok}
            row("correctness", key, f"rel err {err:.1e} {'PASS' if ok else 'FAIL'}")
            del b, ref, out, got
    rows = 40 if smoke else 300  # the interpreter runs a program per row
    for dtype in dtypes:
        gen = torch.Generator().manual_seed(5)
        key = torch.randn(rows, kvh, d, generator=gen).to(dtype).to(dev)
        value = torch.randn(rows, kvh, d, generator=gen).to(dtype).to(dev)
        slots = torch.randperm(64 * 16, generator=gen)[:rows].to(dev)
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


def measure_copy_gbs(dev, smoke: bool) -> float:
    """Device-to-device copy bandwidth, (bytes read + bytes written) / time: the bound every
    bandwidth figure of this script is a fraction of."""
    nbytes = (1 << 20) if smoke else (2 << 30)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=dev)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), dev)
    del src, dst
    copy_gbs = 2 * nbytes / t / 1e9
    RESULTS["bandwidth"]["copy_GBps"] = copy_gbs
    row("bandwidth", f"device copy {nbytes >> 20} MiB (read+write)", f"{copy_gbs:8.1f} GB/s")
    return copy_gbs


def copy_gbs(dev, smoke: bool) -> float:
    """The copy bandwidth of the bandwidth section, measured here if that section did not run."""
    return RESULTS["bandwidth"].get("copy_GBps") or measure_copy_gbs(dev, smoke)


def _decode_case(batch: int, ctx: int, dev, smoke: bool):
    """(paged decode batch, K/V bytes one call reads, output buffer, (heads, kv heads, head_dim, dtype))."""
    h, kvh, d, dtype = (4, 2, 64, torch.float16) if smoke else (32, 8, 128, torch.bfloat16)
    b = make_paged_batch([1] * batch, [ctx] * batch, h, kvh, d, 16, dtype=dtype, device=dev, seed=7, poison=False)
    kv_bytes = 2 * batch * ctx * kvh * d * b.k_cache.element_size()
    return b, kv_bytes, torch.empty_like(b.q), (h, kvh, d, dtype)


def _decode_name(batch: int, ctx: int, shape: tuple) -> str:
    h, kvh, d, dtype = shape
    return f"decode {batch} x {ctx} ({h}q/{kvh}kv, d{d}, {str(dtype)[6:]})"


def check_bandwidth(dev, smoke: bool) -> None:
    """Decode attention at the default config (what the engine runs) at both shapes, as a
    fraction of the copy bandwidth: ``decode_attention_bw_fraction`` of the JSON."""
    copy = measure_copy_gbs(dev, smoke)
    fractions = RESULTS.setdefault("decode_attention_bw_fraction", {})
    for batch, ctx in (SMOKE_DECODE_SHAPES if smoke else DECODE_SHAPES):
        b, kv_bytes, out, shape = _decode_case(batch, ctx, dev, smoke)
        md = b.attn_metadata
        auto = choose_num_splits(batch, shape[1], ctx, 64, dev)
        t = bench(lambda: paged_attention_triton(b.q, b.k_cache, b.v_cache, md, b.scale, out=out), dev)
        gbs = kv_bytes / t / 1e9
        name = _decode_name(batch, ctx, shape)
        RESULTS["bandwidth"][name] = {"us": t * 1e6, "GBps": gbs, "of_copy": gbs / copy, "splits_auto": auto}
        fractions[f"{batch}x{ctx}"] = gbs / copy
        row("bandwidth", name, f"{t * 1e6:8.1f} us {gbs:7.1f} GB/s = {100 * gbs / copy:5.1f}% of copy "
            f"(splits {auto})")
        del b, out


def check_attention_sweep(dev, smoke: bool) -> None:
    """Tile size x warps x splits at both decode shapes: the best config next to the default,
    as a fraction of the copy bandwidth (what a retuned default would gain)."""
    copy = copy_gbs(dev, smoke)
    for batch, ctx in (SMOKE_DECODE_SHAPES[:1] if smoke else DECODE_SHAPES):
        b, kv_bytes, out, shape = _decode_case(batch, ctx, dev, smoke)
        md = b.attn_metadata
        auto = choose_num_splits(batch, shape[1], ctx, 64, dev)
        if smoke:  # the code path once: the default and one other config
            configs = [dict(), dict(tile_n=32, num_warps=4, num_splits=2)]
        else:
            configs = [dict()] + [dict(tile_n=tile_n, num_warps=warps, num_splits=splits)
                                  for tile_n in (32, 64, 128) for warps in (4, 8)
                                  for splits in sorted({1, auto, min(64, 2 * auto)})]
        best = default = None
        for cfg in configs:
            try:
                t = bench(lambda: paged_attention_triton(b.q, b.k_cache, b.v_cache, md, b.scale, out=out, **cfg), dev)
            except Exception as e:  # a config that does not compile is skipped, not fatal
                print(f"  config {cfg} failed: {type(e).__name__}: {e}", flush=True)
                continue
            if default is None and not cfg:
                default = t
            if best is None or t < best[0]:
                best = (t, cfg)
        name = _decode_name(batch, ctx, shape)
        t, cfg = best
        gbs = kv_bytes / t / 1e9
        RESULTS["attention_sweep"][name] = {"best_us": t * 1e6, "best_GBps": gbs, "best_of_copy": gbs / copy,
                                            "best_cfg": cfg, "default_us": default * 1e6 if default else None,
                                            "configs": len(configs)}
        row("sweep", f"{name} best of {len(configs)}", f"{t * 1e6:8.1f} us {gbs:7.1f} GB/s = "
            f"{100 * gbs / copy:5.1f}% of copy {json.dumps(cfg)}")
        del b, out


@dataclass(frozen=True)
class Section:
    """One guarded part of the check. ``est_s``: the time it is expected to take on an H100
    (an estimate for the budget guard, not a measurement); ``fn(dev, args)`` runs it."""

    name: str
    est_s: float
    fn: Callable


def kernel_sections() -> tuple[list[Section], Section]:
    """The kernel sections in order, and the sweep (last of all: its value is lowest)."""
    from pagedserve.loadtest.kernel_checks import gpu_kv_quant as kvq

    core = [Section("correctness", 20, lambda dev, a: check_attention(dev, a.cpu_smoke)),
            Section("bandwidth", 10, lambda dev, a: check_bandwidth(dev, a.cpu_smoke)),
            Section("kv quant correctness", 25, lambda dev, a: kvq.check_correctness(dev, a.cpu_smoke, row, RESULTS)),
            Section("kv quant bandwidth", 10,
                    lambda dev, a: kvq.check_bandwidth(dev, a.cpu_smoke, row, RESULTS, bench))]
    return core, Section("attention_sweep", 45, lambda dev, a: check_attention_sweep(dev, a.cpu_smoke))


class HardStop(BaseException):
    """Raised by the alarm at ``--hard-stop-s``: ends the running section (a BaseException, so
    a section's own ``except Exception`` cannot swallow it); the engine's ``finally`` runs."""


def _on_alarm(signum, frame):
    raise HardStop()


def write_json(path: str | None) -> None:
    if path:
        RESULTS["wall_s"] = time.time() - T0
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(RESULTS, f, indent=2, default=str)
        os.replace(tmp, path)


def main(sections: Callable | None = None, add_args=None, description: str | None = None) -> int:
    """Run ``sections(args)`` (a list of Section; default: the kernel sections, then the sweep)
    in order, each guarded so that a failure still prints the table of what ran, each skipped
    with a row when the budget would not cover its estimate. ``add_args(parser)`` adds flags
    (the loadtest script uses both)."""
    ap = argparse.ArgumentParser(description=description or __doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results as JSON to this path (rewritten after every section)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU via the Triton interpreter")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip a section whose H100 estimate would end it past this many seconds from the start "
                         "(default 420; none with --cpu-smoke)")
    ap.add_argument("--hard-stop-s", type=float, default=None,
                    help="end the running section at this many seconds (default: the budget + 30)")
    ap.add_argument("--only", nargs="+", default=None, metavar="SECTION", help="run only these sections")
    ap.add_argument("--skip", nargs="+", default=(), metavar="SECTION", help="skip these sections")
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args()
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke to check the script on a CPU", file=sys.stderr)
        return 2
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    RESULTS["gpu"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)"
    RESULTS["device"] = RESULTS["gpu"]
    RESULTS["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    RESULTS["versions"] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "triton": triton_version, "cuda": torch.version.cuda}
    if sections is None:
        core, sweep = kernel_sections()
        todo = core + [sweep]
    else:
        todo = sections(args)
    if args.budget_s is None:
        args.budget_s = float("inf") if args.cpu_smoke else 420.0
    hard_stop = args.hard_stop_s if args.hard_stop_s is not None else args.budget_s + 30
    signal.signal(signal.SIGALRM, _on_alarm)
    if hard_stop != float("inf"):
        signal.setitimer(signal.ITIMER_REAL, max(1.0, hard_stop - (time.time() - T0)))
    failed, stopped = False, False
    status = RESULTS.setdefault("sections", {})  # name -> {"status", "section_s", "estimate_s", "reason"}
    try:
        for s in todo:
            RESULTS.setdefault(s.name, {})
            elapsed = time.time() - T0
            reason = None
            if stopped:
                reason = f"the hard stop at {hard_stop:.0f} s came"
            elif args.only is not None and s.name not in args.only:
                reason = "not in --only"
            elif s.name in args.skip:
                reason = "--skip"
            elif elapsed + s.est_s > args.budget_s:
                reason = (f"budget: {elapsed:.0f} s spent + ~{s.est_s:.0f} s estimated (H100) > "
                          f"{args.budget_s:.0f} s")
            if reason is not None:
                row(s.name, "skipped", reason)
                status[s.name] = {"status": "skipped", "reason": reason, "estimate_s": s.est_s}
                continue
            t = time.time()
            state = {"status": "ok"}
            try:
                s.fn(dev, args)
            except HardStop:
                stopped = True
                row(s.name, "stopped", f"the hard stop at {hard_stop:.0f} s ended it")
                state = {"status": "stopped", "reason": "hard stop"}
            except Exception as e:  # keep going: the table of what did run still prints
                traceback.print_exc()
                row(s.name, "section failed", f"{type(e).__name__}: {str(e)[:80]}")
                state = {"status": "failed", "reason": repr(e)}
            status[s.name] = {**state, "section_s": time.time() - t, "estimate_s": s.est_s}
            gc.collect()  # a failed section's objects (an engine half built) hold device memory
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            write_json(args.json)
    except HardStop:  # between sections: the rest are not run
        row("main", "stopped", f"the hard stop at {hard_stop:.0f} s came between sections")
        stopped = True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    failed = stopped or any(v["status"] in ("failed", "stopped") for v in status.values())
    failed = failed or not all(v.get("ok", True) for v in RESULTS["correctness"].values())
    failed = failed or any(isinstance(v, dict) and v.get("ok") is False for v in RESULTS.values())
    write_json(args.json)
    print(f"\n=== pagedserve gpu_check: {RESULTS['gpu']}, {RESULTS['date']}, {time.time() - T0:.0f} s ===")
    for section, item, value in ROWS:
        print(f"{section:<15} {item:<48} {value}")
    summary = {k: RESULTS.get(k) for k in ("gpu", "b1_roofline_fraction", "decode_attention_bw_fraction")}
    print("summary " + json.dumps(summary, default=str))
    print("sections " + json.dumps({k: v["status"] for k, v in status.items()}))
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
