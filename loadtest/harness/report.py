"""Output of a run: the terminal table (``vllm bench serve``'s layout), JSON, PNG plots.

Plots (matplotlib, Agg backend, imported lazily so the rest works without it):
    latency_cdf.png   CDFs of TTFT, TPOT, ITL, E2EL, one line per run
    rate_sweep.png    output throughput and p99 TPOT against the offered request rate
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def format_table(label: str, m: dict, server: dict | None = None) -> str:
    w = 50
    title = f" {label} " if label else " Serving Benchmark Result "
    rows: list[str] = [title.center(w, "=")]

    def row(name: str, value, fmt: str = "{:.2f}") -> None:
        text = fmt.format(value) if isinstance(value, (int, float)) else str(value)
        rows.append(f"{name:<40}{text:>10}")

    row("Successful requests:", m["completed"], "{:d}")
    row("Cancelled requests:", m["cancelled"], "{:d}")
    row("Failed requests:", m["failed"], "{:d}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:d}")
    row("Total generated tokens:", m["total_output_tokens"], "{:d}")
    row("Request throughput (req/s):", m["request_throughput"])
    if "request_goodput" in m:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    row("Peak concurrent requests:", m["max_concurrent_requests"], "{:d}")
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append(title.center(w, "-"))
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {key.upper()} (ms):",
                m[f"{stat}_{key}_ms"])
    if server:
        rows.append(" Server /metrics ".center(w, "-"))
        for key in ("peak_kv_cache_usage_perc", "peak_num_requests_running", "peak_num_requests_waiting",
                    "num_preemptions", "prefix_cache_hit_rate", "end_kv_cache_usage_perc", "leaked_blocks"):
            if key in server:
                row(key + ":", server[key])
        if server.get("peak_waiting_by_reason"):
            row("peak waiting by reason:", json.dumps(server["peak_waiting_by_reason"]), "{}")
    rows.append("=" * w)
    return "\n".join(rows)


def write_json(path: str | Path, data) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_jsonable))
    return path


def _jsonable(x):
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if hasattr(x, "__dataclass_fields__"):
        return {k: getattr(x, k) for k in x.__dataclass_fields__}
    return str(x)


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_latency_cdfs(runs: dict[str, dict], path: str | Path) -> Path:
    """``runs``: label -> {'ttft': [s...], 'tpot': [...], 'itl': [...], 'e2el': [...]}."""
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, key in zip(axes, ("ttft", "tpot", "itl", "e2el")):
        for label, series in runs.items():
            xs = sorted(v * 1000.0 for v in series.get(key, []))
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylabel("CDF")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_rate_sweep(points: dict[str, list[tuple[float, dict]]], path: str | Path) -> Path:
    """``points``: label -> [(offered rate, metrics dict)], inf drawn past the last finite rate."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, pts in points.items():
        finite = [r for r, _ in pts if not math.isinf(r)] or [1.0]
        xs = [r if not math.isinf(r) else max(finite) * 2 for r, _ in pts]
        a1.plot(xs, [m["output_throughput"] for _, m in pts], "o-", label=label)
        a2.plot(xs, [m["p99_tpot_ms"] for _, m in pts], "o-", label=label)
    a1.set_ylabel("output throughput (tok/s)")
    a2.set_ylabel("p99 TPOT (ms)")
    for ax in (a1, a2):
        ax.set_xlabel("offered request rate (req/s; rightmost = inf)")
        ax.grid(True, alpha=0.3)
    a1.legend(fontsize=8)
    return _save(plt, fig, path)


def latency_series(results) -> dict[str, list[float]]:
    done = [r for r in results if r.success]
    return {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if r.output_len > r.n],
            "itl": [x for r in done for x in r.itl], "e2el": [r.latency for r in done]}


def find_knee(points: list[tuple[float, dict]], tolerance: float = 0.8,
              latency_factor: float = 3.0) -> float | None:
    """The highest offered finite rate the server still keeps up with, scanning upward
    until it first falls behind. Keeping up: achieved request throughput >= ``tolerance``
    x the rate the drawn arrivals actually offered (``offered_request_rate`` when present;
    the run's tail still makes a short run read a little low) and mean TTFT
    <= ``latency_factor`` x the lowest rate's (no queue building up). Past the knee,
    extra load only adds queueing latency. None if even the lowest rate falls behind."""
    pts = sorted((p for p in points if not math.isinf(p[0])), key=lambda p: p[0])
    if not pts:
        return None
    base_ttft = max(pts[0][1]["mean_ttft_ms"], 1e-6)
    knee = None
    for rate, m in pts:
        offered = m.get("offered_request_rate", rate)
        if m["request_throughput"] >= tolerance * offered and m["mean_ttft_ms"] <= latency_factor * base_ttft:
            knee = rate
        else:
            break
    return knee
