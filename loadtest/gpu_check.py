"""The one prepared GPU check: kernels, then the engine end to end, in a single call.

    python -m pagedserve.loadtest.gpu_check [--json out.json] [--skip-e2e] [--cpu-smoke]

1-2. the kernel sections of ``pagedserve.kernels.gpu_check``: paged-attention and
   cache-write correctness vs the torch reference (fp16, bf16, split-KV, a 2^31+ pool),
   decode-attention GB/s against a measured device-to-device copy, with a config sweep, and
   the same for the quantised KV cache (fp8 e4m3 / e5m2, int8; kernels/gpu_check_kv_quant.py);
3. end-to-end decode tokens/s of the engine on a ~1.1B random Llama (bf16) at batch 1,
   32, 128 next to transformers ``generate()`` with the same batch (guarded: a failure
   there still prints the kernel table).

It lives here, not in kernels/, because section 3 drives the whole engine and kernels/
imports tensors only. ``--cpu-smoke`` runs every section with tiny shapes on the CPU
(Triton interpreter, the engine's torch path) to check the script itself.
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # must precede the first @triton.jit (kernel import)
    os.environ["TRITON_INTERPRET"] = "1"

import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from pagedserve.kernels import gpu_check as kernel_check  # noqa: E402
from pagedserve.kernels.gpu_check import RESULTS, T0, row  # noqa: E402


def check_e2e(dev, smoke: bool, max_tokens: int) -> None:
    from transformers import AutoModelForCausalLM

    from pagedserve import LLM, SamplingParams
    from pagedserve.worker.testing import make_random_llama

    if smoke:
        cfg = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)
        batches, dtype, prompt_len = (1, 4), "float32", 16
    else:
        cfg = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)
        batches, dtype, prompt_len = (1, 32, 128), "bfloat16", 32
    tmp = tempfile.mkdtemp(prefix="gpu_check_llama_")
    path = make_random_llama(os.path.join(tmp, "model"), **cfg)
    row("e2e", "random Llama written", f"{sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 1e9:.2f} GB")
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, cfg["vocab_size"], (max(batches), prompt_len), generator=gen)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(dev).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    RESULTS["e2e"]["params"] = n_params
    hf_tps = {}
    with torch.no_grad():
        hf.generate(prompts[:1].to(dev), max_new_tokens=4, do_sample=False)  # warm-up
        for bsz in batches:
            ids = prompts[:bsz].to(dev)
            sync()
            t = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                        min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            sync()
            hf_tps[bsz] = bsz * max_tokens / (time.perf_counter() - t)
    del hf
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    llm = LLM(model=path, dtype=dtype, max_num_seqs=max(batches), max_model_len=prompt_len + max_tokens + 16,
              gpu_memory_utilization=0.6, device=dev.type)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([prompts[i].tolist() for i in range(4)], SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True), use_tqdm=False)
        for bsz in batches:
            t = time.perf_counter()
            outs = llm.generate([prompts[i].tolist() for i in range(bsz)], params, use_tqdm=False)
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            tps = n / dt
            RESULTS["e2e"][f"batch {bsz}"] = {"engine_tok_s": tps, "hf_generate_tok_s": hf_tps[bsz]}
            row("e2e", f"decode batch {bsz:>3} ({n_params / 1e9:.2f}B, {dtype}, {max_tokens} tok)",
                f"engine {tps:9.1f} tok/s   HF generate {hf_tps[bsz]:9.1f} tok/s   x{tps / hf_tps[bsz]:.2f}")
    finally:
        llm.shutdown()


def e2e_section(dev, args) -> None:
    if args.skip_e2e or time.time() - T0 > args.budget_s:
        row("e2e", "skipped", "--skip-e2e" if args.skip_e2e else f"past the {args.budget_s:.0f} s budget")
        return
    check_e2e(dev, args.cpu_smoke, args.max_tokens or (8 if args.cpu_smoke else 128))


def add_e2e_args(ap) -> None:
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=None, help="generated tokens per sequence in the e2e section")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the e2e section if started later than this")


def main() -> int:
    return kernel_check.main(extra_sections=[("e2e", e2e_section)], add_args=add_e2e_args,
                             description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
