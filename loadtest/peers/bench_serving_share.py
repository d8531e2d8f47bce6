"""The serving path's share at one user, pagedserve's beside vLLM's, on the same weights.

Issue 57's "serving share" is the output rate over HTTP at c=1 over the offline batch-1 rate, each engine on
the same cores:

    offline b1   one request at a time through the engine's own ``LLM.generate`` (one fresh
                 process, start-up and a warm-up request excluded): the chat template's
                 tokens of each question in, ``--max-tokens`` out (ignore_eos), tok/s over the
                 generate() wall time, prefill included as an HTTP request's TTFT is
    http c=1     the engine's OpenAI server with its default flags (vLLM's compiled, as its
                 offline run), the same questions one at a time, streamed, tok/s over the
                 wall time (bench_vs_llama_cpp's client)

Both engines load the default model as the same plain fp32 Hugging Face directory
(``plain_hf_dir``: the prepared GGUF's config, tokenizer and dequantized safetensors, what
``--quantization none`` serves) and run one after the other, never at once; ``--rounds``
repeats the pair with every process started afresh.

    python -m pagedserve.loadtest.peers.bench_serving_share [--rounds 2] [--max-tokens 128]
        [--requests 6] [--offline-requests 4] [--no-vllm] [--gguf]

``--gguf`` adds pagedserve on the GGUF itself (native, the default model as served). The
last line is one JSON object: per engine and round ``offline_tok_s``, ``http_tok_s`` and
``share``, and each engine's median ``share``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from pagedserve.loadtest.harness.servers import pagedserve_server
from pagedserve.loadtest.peers.bench_vs_llama_cpp import QUESTIONS, default_gguf, http_run
from pagedserve.loadtest.peers.bench_vs_vllm import cpu_name

MAX_MODEL_LEN = 2048


def plain_hf_dir(gguf: str) -> str:
    """A directory any Hugging Face loader reads as the GGUF's model in fp32: the prepared
    directory's files, its config without ``gguf_file`` and the dequantized weights linked
    in (written by a dequantizing load first, once)."""
    import atexit
    import os
    import shutil
    import tempfile

    from pagedserve.worker.loading.model_source import prepare_gguf

    src = prepare_gguf(gguf)
    weights = os.path.join(src, "dequantized", "model.safetensors")
    if not os.path.exists(weights):
        from pagedserve import LLM

        LLM(model=gguf, quantization="none", max_model_len=256, kv_cache_memory_bytes=1 << 26).shutdown()
    out = tempfile.mkdtemp(prefix="pagedserve-share-model-")
    atexit.register(shutil.rmtree, out, True)
    for name in os.listdir(src):
        if name.endswith((".json", ".jinja")) and name != "config.json":
            os.symlink(os.path.join(src, name), os.path.join(out, name))
    with open(os.path.join(src, "config.json")) as f:
        cfg = {k: v for k, v in json.load(f).items() if not k.startswith("gguf_")}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    os.symlink(weights, os.path.join(out, "model.safetensors"))
    return out


def chat_prompts(model_dir: str, n: int) -> list[list[int]]:
    """The token ids a chat request of each question becomes (the model's own template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(n)]


# Runs in the engine's own venv: batch-1 requests one after the other in one process.
_B1_SCRIPT = r"""
import json, sys, time

def main():  # under a __main__ guard: vLLM's engine core is a spawned process
    spec = json.load(open(sys.argv[1]))
    if spec["engine"] == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"], seed=0)
        wrap = lambda p: {"prompt_token_ids": p}
    else:
        from pagedserve import LLM, SamplingParams
        llm = LLM(model=spec["model"], max_model_len=spec["max_model_len"], seed=0)
        wrap = lambda p: p
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    llm.generate([wrap(spec["prompts"][0])], params, use_tqdm=False)  # warm-up
    times, tokens = [], []
    for p in spec["prompts"]:
        t0 = time.perf_counter()
        out = llm.generate([wrap(p)], params, use_tqdm=False)[0]
        times.append(time.perf_counter() - t0)
        tokens.append(len(out.outputs[0].token_ids))
    print("RESULT " + json.dumps({"elapsed": sum(times), "num_output_tokens": sum(tokens),
                                  "rates": [n / t for n, t in zip(tokens, times)]}), flush=True)

if __name__ == "__main__":
    main()
"""


def offline_b1(engine: str, model: str, prompts: list[list[int]], max_tokens: int) -> float:
    """The mean output rate of ``prompts`` sent one at a time, each a batch of one, in one fresh
    process of the engine's (vLLM: its defaults, compiled; fp32 as the server)."""
    import os
    import sys

    from pagedserve.loadtest.harness.servers import ROOT
    from pagedserve.loadtest.peers.vllm_cpu import PY, run_offline_script, vllm_env

    spec = {"engine": engine, "model": model, "prompts": prompts, "max_tokens": max_tokens,
            "max_model_len": MAX_MODEL_LEN}
    if engine == "vllm":
        r = run_offline_script(str(PY), _B1_SCRIPT, spec, env={**os.environ, **vllm_env()}, what="vLLM",
                               timeout=900)
    else:
        r = run_offline_script(sys.executable, _B1_SCRIPT, spec, env=dict(os.environ), what="pagedserve",
                               timeout=900, cwd=str(ROOT))
    return statistics.fmean(r["rates"])


def http_c1(engine: str, model: str, requests: int, max_tokens: int, log_dir) -> float:
    from pagedserve.loadtest.peers.vllm_cpu import vllm_server

    name = "share-model"
    if engine == "vllm":
        server = vllm_server(model, served_model_name=name, max_model_len=MAX_MODEL_LEN, log_dir=log_dir,
                             enforce_eager=False)
    else:
        server = pagedserve_server(model, served_model_name=name, max_model_len=MAX_MODEL_LEN, log_dir=log_dir)
    with server:
        return asyncio.run(http_run(server.base_url, name, 1, requests, max_tokens))["output_tok_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=6, help="HTTP requests at c=1 a round")
    p.add_argument("--offline-requests", type=int, default=4, help="offline batch-1 requests a round")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--gguf", action="store_true", help="also pagedserve on the GGUF itself (native)")
    p.add_argument("--log-dir", default=None)
    a = p.parse_args(argv)
    gguf = default_gguf()
    hf_dir = plain_hf_dir(gguf)
    engines = [("pagedserve", hf_dir)] + ([] if a.no_vllm else [("vllm", hf_dir)]) \
        + ([("pagedserve-gguf", gguf)] if a.gguf else [])
    if not a.no_vllm:
        from pagedserve.loadtest.peers.vllm_cpu import setup_vllm

        setup_vllm()
    prompts = chat_prompts(hf_dir, a.offline_requests)
    print(f"bench_serving_share: {hf_dir}; {cpu_name()}", flush=True)
    report: dict = {"cpu": cpu_name(), "model": hf_dir, "rounds": []}
    for i in range(a.rounds):
        row = {}
        for name, model in engines:
            engine = "vllm" if name == "vllm" else "pagedserve"
            off = offline_b1(engine, model, prompts, a.max_tokens)
            http = http_c1(engine, model, a.requests, a.max_tokens, a.log_dir)
            row[name] = {"offline_tok_s": off, "http_tok_s": http, "share": http / off}
            print(f"  round {i + 1}: {name:16s} offline b1 {off:6.1f} tok/s  HTTP c=1 {http:6.1f} tok/s  "
                  f"share {http / off:.2f}", flush=True)
        report["rounds"].append(row)
    report["median_share"] = {name: statistics.median(r[name]["share"] for r in report["rounds"])
                              for name, _ in engines}
    print("  median share: " + ", ".join(f"{k} {v:.2f}" for k, v in report["median_share"].items()), flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
