"""Routing across engine replicas: the KV router against Ray Serve LLM's and Serve's own (issue 30).

Each router gets a server of its own (``pagedserve serve --min-replicas 2 --request-router
R``) and the same workloads, in one run:

    shared_prefix  requests that each start with one of P prefixes of L tokens (more than
                   one replica's cache holds), then S fresh tokens; O tokens out
    multi_turn     N chat sessions of T turns; each turn sends the whole history; C clients
                   take turns from random sessions (vLLM's multi-turn benchmark)
    random         prompts that share nothing: the fallback must not lose

    routers   kv      the replica holding most of the prompt's blocks (cluster/front/router/routing.py)
              prefix  Ray Serve LLM's PrefixCacheAffinityRouter (a prefix tree of prompt text)
              pow2    Serve's power of two choices

Reported per router and workload: TTFT mean / p50 / p99 (client side, streamed), output
tok/s, the prefix hit rate (the replicas' own counters: cached prompt tokens over prompt
tokens looked up, during the workload), each replica's share of the requests; and the kv
router's ratios against both peers. ``single_replica_hit_rate``: one replica alone on the
shared workloads, the hit rate a router should keep. The prompts are text (every router
reads text; the KV router's front tokenizes it once), made of words that are one token
each in the model's vocabulary, so lengths are close to the token counts asked for.

Shapes (``--shape``, issue 56): the workloads above with other sizes, each a name in SHAPES:
prefix and sessions (the defaults), mid_prefix, long_prefix (long shared prefixes, long
outputs), zipf (hot prefixes and a long tail), few_sessions, many_sessions, random. Every
shape runs on each router's one server, in order; the report adds ``goals``: issue 56's
acceptance per shape (shape_goals).

    python -m pagedserve.loadtest.serving.bench_routing [--model M] [--workloads shared_prefix multi_turn random]
        [--shape all | prefix mid_prefix ...]
        [--routers kv prefix pow2] [--num-prefixes 8 --prefix-len 512 --suffix-len 32 --output-len 16]
        [--sessions 16 --turns 4] [--concurrency 8] [--num-gpu-blocks N] [--repeats R]

The last line printed is one JSON object: ``{"shared_prefix": {"kv": {...}, "prefix":
{...}, "pow2": {...}}, "multi_turn": {...}, "random": {...}, "single_replica_hit_rate":
{"shared_prefix": h, "multi_turn": h}}``; each router's object has ``ttft_mean_s``,
``ttft_p50_s``, ``ttft_p99_s``, ``output_tok_s``, ``hit_rate``, ``max_replica_share``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass

import httpx

from pagedserve.loadtest.harness.client import RequestSpec, read_chat_stream, send_completion
from pagedserve.loadtest.harness.metrics import percentile
from pagedserve.loadtest.harness.servers import pagedserve_server
from pagedserve.loadtest.workloads import WordText, word_prompts, word_shared_prefix_prompts

WORKLOADS = ("shared_prefix", "multi_turn", "random")
ROUTERS = ("kv", "prefix", "pow2")


# ---------------------------------------------------------------- shapes (issue 56)
@dataclass(frozen=True)
class Shape:
    """One workload shape: a workload above with some of its arguments set.
    ``prefix_heavy``: the shapes where routing by cache is the point (the goals of 1.5x
    lower mean TTFT than pow2 and 1.1x lower than Ray's prefix router hold there)."""

    workload: str
    args: dict
    prefix_heavy: bool = False
    about: str = ""


SHAPES = {
    "prefix": Shape("shared_prefix", {}, True, "the default shared_prefix: 8 prefixes x 512 + 32, 16 out"),
    "mid_prefix": Shape("shared_prefix", dict(num_prefixes=10, prefix_len=384, suffix_len=96, output_len=32),
                        True, "issue 56's: 10 prefixes x 384 + 96, 32 out"),
    "long_prefix": Shape("shared_prefix", dict(num_prefixes=4, prefix_len=1024, suffix_len=32, output_len=128,
                                               num_requests=24),
                         True, "long shared prefixes, long outputs: 4 x 1,024 + 32, 128 out, 24 requests"),
    "zipf": Shape("shared_prefix", dict(num_prefixes=32, prefix_len=256, suffix_len=32, num_requests=96, zipf_s=1.0),
                  True, "32 prefixes x 256 + 32 drawn Zipf (s = 1), 16 out, 96 requests"),
    "sessions": Shape("multi_turn", {}, False, "the default multi_turn: 16 sessions x 4 turns"),
    "few_sessions": Shape("multi_turn", dict(sessions=6, turns=4, system_len=384, user_len=96, turn_output_len=32),
                          False, "issue 56's: 6 long sessions x 4 turns (384-token system, 96 a turn, 32 out)"),
    "many_sessions": Shape("multi_turn", dict(sessions=48, turns=2, system_len=256, user_len=32),
                           False, "48 short sessions x 2 turns (256-token system, 32 a turn, 16 out)"),
    "random": Shape("random", {}, False, "32 x 256 words that share nothing"),
}


# ---------------------------------------------------------------- prompts
def one_token_words(model: str, limit: int = 3000) -> list[str]:
    """Lower-case words that the model's tokenizer spells as one token after a space."""
    from transformers import AutoTokenizer

    from pagedserve.worker.loading.model_source import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(model).path, local_files_only=True)
    words = sorted({t[1:] for t in tok.get_vocab() if t.startswith("\u0120") and t[1:].isalpha()
                    and t[1:].islower() and len(t) >= 4})
    words = [w for w in words[:limit * 2] if len(tok.encode(" " + w, add_special_tokens=False)) == 1][:limit]
    if len(words) < 100:
        raise SystemExit(f"{model}: too few one-token words in its vocabulary for text prompts")
    return words


# ---------------------------------------------------------------- one request
class Result:
    def __init__(self, ttft: float, tokens: int, replica: str, ok: bool, text: str = "", error: str = "") -> None:
        self.ttft, self.tokens, self.replica, self.ok, self.text, self.error = ttft, tokens, replica, ok, text, error
        self.index, self.group = 0, None  # the request's place in its workload; its prefix or session


# A 429 (a replica's KV admission: its waiting prompts would not fit) is retried after the
# server's Retry-After, as the OpenAI SDK does; TTFT counts from the first attempt.
MAX_RETRIES = 8


async def chat(client: httpx.AsyncClient, base: str, model: str, messages: list[dict], max_tokens: int) -> Result:
    t0 = time.perf_counter()
    for attempt in range(MAX_RETRIES + 1):
        r, retry_after = await _chat_once(client, base, model, messages, max_tokens, t0)
        if retry_after is None or attempt == MAX_RETRIES:
            return r
        await asyncio.sleep(retry_after)
    return r


async def _chat_once(client, base, model, messages, max_tokens, t0) -> tuple[Result, float | None]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
        replica = resp.headers.get("x-pagedserve-replica", "")
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            retry = float(resp.headers.get("retry-after") or 0.5) if resp.status_code == 429 else None
            return Result(0.0, 0, replica, False, error=f"HTTP {resp.status_code}: {text[:200]}"), retry
        ttft, tokens, text = await read_chat_stream(resp, t0)
    return Result(ttft, tokens, replica, tokens > 0, text), None


async def complete(client: httpx.AsyncClient, base: str, model: str, rid: str, prompt: str, out: int) -> Result:
    spec = RequestSpec(rid, prompt, len(prompt.split()), out)
    r = await send_completion(client, base, spec, model, max_retries=MAX_RETRIES)
    return Result(r.ttft, r.output_len, r.replica, r.success, error=r.error)


# ---------------------------------------------------------------- workloads
async def run_shared_prefix(base, model, words, a, seed) -> list[Result]:
    prompts, picks = word_shared_prefix_prompts(words, seed, a.num_requests, a.num_prefixes, a.prefix_len,
                                                a.suffix_len, getattr(a, "zipf_s", 0.0))
    results = await _closed_loop(base, model, prompts, a.output_len, a.concurrency)
    for r in results:
        r.group = picks[r.index]
    return results


async def run_random(base, model, words, a, seed) -> list[Result]:
    prompts = word_prompts(words, seed, a.random_requests, a.random_len)
    return await _closed_loop(base, model, prompts, a.output_len, a.concurrency)


async def _closed_loop(base, model, prompts, out, concurrency) -> list[Result]:
    queue = list(enumerate(prompts))
    results: list[Result] = []
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker():
            while queue:
                i, p = queue.pop(0)
                r = await complete(client, base, model, f"r{i}", p, out)
                r.index = i
                results.append(r)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def run_multi_turn(base, model, words, a, seed) -> list[Result]:
    """``--concurrency`` clients over ``--sessions`` conversations, as vLLM's multi-turn
    benchmark drives them: a free client takes a random conversation that is not waiting
    for an answer and sends its next turn, the whole history. So a conversation's next turn
    does not follow its answer at once (its user reads while other conversations go on).
    In a closed loop where it did, the replica that had just answered was the least loaded
    one at that instant, and power of two choices kept every conversation in place by
    accident."""
    text = WordText(words, seed)
    rng = random.Random(seed + 2)
    history = {s: [{"role": "system", "content": text(a.system_len)}] for s in range(a.sessions)}
    turns_left = dict.fromkeys(history, a.turns)
    busy: set[int] = set()
    results: list[Result] = []
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker():
            while any(turns_left.values()):
                ready = [s for s, n in turns_left.items() if n and s not in busy]
                if not ready:  # every conversation left is waiting for its answer
                    await asyncio.sleep(0.01)
                    continue
                s = rng.choice(ready)
                busy.add(s)
                turns_left[s] -= 1
                history[s].append({"role": "user", "content": text(a.user_len)})
                r = await chat(client, base, model, history[s], a.turn_output_len)
                r.group = s
                results.append(r)
                history[s].append({"role": "assistant", "content": r.text})
                busy.discard(s)

        await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    return results


RUNNERS = {"shared_prefix": run_shared_prefix, "multi_turn": run_multi_turn, "random": run_random}


# ---------------------------------------------------------------- server side
def scrape(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        for s in fam.samples:
            label = s.labels.get("decision") or s.labels.get("replica")
            out[s.name + (f"|{label}" if label else "")] = s.value
    return out


def wait_ready(base: str, model: str, replicas: int, router: str, words: list[str], timeout: float = 180.0) -> None:
    """Every replica up and reporting (a replica reports once it has served a request: the
    warm-up prompts share nothing, so every router spreads them); for the KV router, its
    view in use (the front's tokenizer loaded, the replicas' event addresses known)."""
    deadline = time.monotonic() + timeout
    text = WordText(words, seed=-1)
    while time.monotonic() < deadline:
        m = scrape(base)
        decided = m.get("pagedserve:router_requests_total|prefix", 0) + m.get("pagedserve:router_requests_total|load", 0)
        if m.get("pagedserve:num_replicas", 0) >= replicas and (router != "kv" or decided > 0):
            return
        httpx.post(f"{base}/v1/completions", timeout=120, json={"model": model, "prompt": text(8), "max_tokens": 1})
        time.sleep(0.5)
    raise TimeoutError(f"{router}: {replicas} replicas not ready in {timeout:.0f} s")


def summarize(results: list[Result], wall: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    shares = Counter(r.replica for r in ok)
    queries = after.get("pagedserve:prefix_cache_queries_total", 0) - before.get("pagedserve:prefix_cache_queries_total", 0)
    hits = after.get("pagedserve:prefix_cache_hits_total", 0) - before.get("pagedserve:prefix_cache_hits_total", 0)
    routed = {d: after.get(f"pagedserve:router_requests_total|{d}", 0) - before.get(f"pagedserve:router_requests_total|{d}", 0)
              for d in ("prefix", "load")}
    return dict(requests=len(results), failed=len(results) - len(ok),
                ttft_mean_s=statistics.fmean(ttfts) if ttfts else None,
                ttft_p50_s=percentile(ttfts, 50) if ttfts else None,
                ttft_p99_s=percentile(ttfts, 99) if ttfts else None,
                output_tok_s=sum(r.tokens for r in ok) / wall, wall_s=wall,
                hit_rate=hits / queries if queries else 0.0,
                max_replica_share=max(shares.values()) / len(ok) if ok else 1.0,
                replica_shares=sorted(shares.values(), reverse=True),
                # how many replicas each prefix (session) was served by: 1.0 is perfect affinity
                replicas_per_group=(statistics.fmean(len({r.replica for r in ok if r.group == g})
                                                     for g in {r.group for r in ok}) if ok and ok[0].group is not None
                                    else None),
                errors=sorted(Counter(r.error[:80] for r in results if not r.ok).items()),
                routed_by=routed)  # the KV router's decisions (0 for the others)


def run_server(a, router: str | None, replicas: int, jobs: list[tuple[str, str, argparse.Namespace]],
               words: list[str]) -> dict:
    """One server with ``router``; each job (label, workload, its arguments) run
    ``a.repeats`` times on it, in order. Returns {label: the median summary}."""
    server = pagedserve_server(a.model, min_replicas=replicas, request_router=router, max_model_len=a.max_model_len,
                               max_num_seqs=a.max_num_seqs, num_gpu_blocks_override=a.num_gpu_blocks,
                               enable_prefix_caching=True, log_dir=a.log_dir)
    out = {}
    with server:
        base = server.base_url
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        wait_ready(base, model, replicas, router or "pow2", words)
        for i, (label, w, args) in enumerate(jobs):
            runs = []
            for rep in range(a.repeats):  # each with prompts of its own (another seed)
                before = scrape(base)
                t0 = time.perf_counter()
                results = asyncio.run(RUNNERS[w](base, model, words, args, a.seed + 1000 * i + 100 * rep))
                wall = time.perf_counter() - t0
                time.sleep(1.5)  # the replicas' last stats push
                s = summarize(results, wall, before, scrape(base))
                runs.append(s)
                print(f"  {router or 'single':6s} {label:14s} ttft mean {s['ttft_mean_s'] or 0:.3f} s "
                      f"p99 {s['ttft_p99_s'] or 0:.3f} s  out {s['output_tok_s']:.1f} tok/s  hit {s['hit_rate']:.2f}  "
                      f"shares {s['replica_shares']}  replicas/group {s['replicas_per_group']}  "
                      f"routed by {s['routed_by']}  failed {s['failed']} "
                      f"{s['errors'] or ''}", flush=True)
            out[label] = median_of(runs)
    return out


def median_of(runs: list[dict]) -> dict:
    """One run's summary as is; several: the median of each number over them (the rest from
    the first), and each run's TTFT mean, tok/s and hit rate under ``runs``."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for k, v in runs[0].items():
        values = [r[k] for r in runs]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values):
            out[k] = statistics.median(values)
    out["runs"] = [{k: r[k] for k in ("ttft_mean_s", "output_tok_s", "hit_rate")} for r in runs]
    return out


def shape_goals(row: dict, prefix_heavy: bool) -> dict[str, bool]:
    """Issue 56's goals for one shape, from its three routers' summaries: kv's mean and p99
    TTFT within 5% of the better of pow2 and prefix (or lower); on the prefix-heavy shapes
    at least 1.5x lower mean TTFT than pow2 and 1.1x lower than prefix; output tok/s at
    least 0.95x pow2's. A router with a failed request fails the row."""
    kv, peers = row["kv"], [row["pow2"], row["prefix"]]
    if kv["failed"] or any(x["ttft_mean_s"] is None for x in (kv, *peers)):
        return {"no failures": False}
    out = {"mean within 5%": kv["ttft_mean_s"] <= 1.05 * min(x["ttft_mean_s"] for x in peers),
           "p99 within 5%": kv["ttft_p99_s"] <= 1.05 * min(x["ttft_p99_s"] for x in peers)}
    if prefix_heavy:
        out["1.5x pow2"] = row["pow2"]["ttft_mean_s"] >= 1.5 * kv["ttft_mean_s"]
        out["1.1x prefix"] = row["prefix"]["ttft_mean_s"] >= 1.1 * kv["ttft_mean_s"]
    out["tok/s 0.95x pow2"] = kv["output_tok_s"] >= 0.95 * row["pow2"]["output_tok_s"]
    return out


def default_blocks(a) -> int:
    """Room for about 60% of the shared prefixes plus the running requests' own blocks: more
    prefixes than one replica holds, all of them in two."""
    prefix_blocks = math.ceil(a.prefix_len / 16)
    return math.ceil(0.6 * a.num_prefixes * prefix_blocks) + a.concurrency * math.ceil(
        (a.suffix_len + a.output_len) / 16) + 16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the built-in default model (SmolLM2-135M-Instruct)")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--shape", nargs="+", choices=[*SHAPES, "all"], default=None,
                   help="run these shapes (SHAPES; 'all': every one) instead of --workloads, and check "
                        "issue 56's goals on each")
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64, help="shared_prefix requests")
    p.add_argument("--sessions", type=int, default=16,
                   help="their histories at the last turn exceed one replica's cache, as the prefixes do, "
                        "and fit in two")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=128, help="multi_turn: each session's own system prompt")
    p.add_argument("--user-len", type=int, default=16)
    p.add_argument("--turn-output-len", type=int, default=16)
    p.add_argument("--random-requests", type=int, default=32)
    p.add_argument("--random-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV blocks per replica (default: about 60%% of the shared prefixes + the running requests)")
    p.add_argument("--no-single", action="store_true", help="skip the one-replica hit-rate baseline")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each workload per server, each on prompts of its own; the report takes medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None)
    a = p.parse_args(argv)
    if a.model is None:
        from pagedserve.worker.loading.model_source import DEFAULT_MODEL_NAME

        a.model = DEFAULT_MODEL_NAME
    a.num_gpu_blocks = a.num_gpu_blocks or default_blocks(a)
    words = one_token_words(a.model)
    shapes = None if a.shape is None else list(SHAPES) if "all" in a.shape else a.shape
    jobs = ([(w, w, a) for w in a.workloads] if shapes is None else
            [(n, SHAPES[n].workload, argparse.Namespace(**{**vars(a), **SHAPES[n].args})) for n in shapes])
    labels = [label for label, _, _ in jobs]
    print(f"bench_routing: {a.replicas} replicas x {a.num_gpu_blocks} KV blocks; {'shapes' if shapes else 'workloads'} "
          f"{labels}; routers {a.routers}", flush=True)
    per_router = {r: run_server(a, r, a.replicas, jobs, words) for r in a.routers}
    report: dict = {label: {r: per_router[r][label] for r in a.routers} for label in labels}
    shared = [job for job in jobs if job[1] != "random"]
    if not a.no_single and shared:
        single = run_server(a, None, 1, shared, words)
        report["single_replica_hit_rate"] = {label: single[label]["hit_rate"] for label, _, _ in shared}
    if "kv" in a.routers:
        for w in labels:
            kv = report[w]["kv"]
            for peer in (r for r in a.routers if r != "kv"):
                o = report[w][peer]
                if not (kv["ttft_mean_s"] and o["ttft_mean_s"] and o["output_tok_s"]):
                    continue  # a run with no successful request: its rows say failed
                kv[f"ttft_mean_vs_{peer}"] = o["ttft_mean_s"] / kv["ttft_mean_s"]
                kv[f"tok_s_vs_{peer}"] = kv["output_tok_s"] / o["output_tok_s"]
                print(f"  {w:14s} kv vs {peer:6s}: TTFT mean {kv[f'ttft_mean_vs_{peer}']:.2f}x lower, "
                      f"output tok/s {kv[f'tok_s_vs_{peer}']:.2f}x", flush=True)
            if w in report.get("single_replica_hit_rate", {}):
                h1 = report["single_replica_hit_rate"][w]
                print(f"  {w:14s} kv hit rate {kv['hit_rate']:.2f} vs one replica alone {h1:.2f}", flush=True)
    if shapes and {"kv", "prefix", "pow2"} <= set(a.routers):
        report["goals"] = {n: shape_goals(report[n], SHAPES[n].prefix_heavy) for n in shapes}
        for n, g in report["goals"].items():
            print(f"  goals {n:14s} " + "  ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in g.items()), flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
