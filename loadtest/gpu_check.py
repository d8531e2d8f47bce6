"""The one prepared GPU check: kernels, then the engine end to end, in a single call.

    python -m pagedserve.loadtest.gpu_check --json latest.json [--budget-s 420] [--only S ..] [--skip S ..]
    python -m pagedserve.loadtest.gpu_check --cpu-smoke --image-packages-only   # the script itself, on a CPU

On this workplace's GPU machine (no network): first, here, ``bash loadtest/gpu_check_setup.sh
prepare`` (the wheels the GPU image lacks into .whl/: today gguf's, for section 15; the script
says why), then the device tool's ``run`` with ``timeout_s`` 480, ``carry: [".whl"]`` and this
command:

    set -o pipefail; . loadtest/gpu_check_setup.sh offline && cd /tmp && PYTHONUNBUFFERED=1 python3 -m pagedserve.loadtest.gpu_check --json $OUT/latest.json --budget-s 420 2>&1 | tee $OUT/gpu_check.log

(``cd /tmp``: run from the checkout, its folders would shadow installed names, HF's
``kernels`` among them), then copy ``latest.json`` from the reply's ``files_at`` to
docs/gpu/latest.json. The sections run in this order, the order of their value; each is
skipped, with a row saying so, when its estimate (an H100 guess, in gpu/cli.py's ``sections()``) would
end it past ``--budget-s``, and the hard stop (``--hard-stop-s``, default budget + 30 s)
ends the one running then, so the table and the JSON (rewritten after every section) come
back inside the call. The estimates add up to ~450 s, the 8B section ~75 s of it:

 1-4. kernels (pagedserve.loadtest.kernel_checks.gpu_kernels): attention and cache-write correctness vs the
      torch reference; decode attention GB/s against a device-to-device copy at 64 x 2048
      and 8 x 16k (``decode_attention_bw_fraction``); the quantised KV formats likewise.
 5. exact: greedy tokens of the engine, with CUDA graphs and with ``enforce_eager``, equal
    transformers ``generate()`` on the same random ~0.85B Llama, both in float32. Why fp32:
    a bf16 run rounds every activation to 8 bits of mantissa, and the engine (Triton paged
    attention, its own fused layers, split-KV merges) and HF (SDPA, other GEMM shapes) round
    in different places; a greedy near-tie then flips a token and the rest of the sequence
    diverges, so bf16 token equality may legitimately fail. In fp32 (IEEE dots in the Triton
    kernel, TF32 off in torch) the two differ by ~1e-6, far below the random model's top-1
    margins (worker/loading/random_models.py), and equality is expected token for token.
 6. b1: batch-1 decode step time from CUDA events (around the worker's execute_model)
    against the HBM roofline: (weight bytes + KV bytes read per step) / the copy bandwidth,
    on the ~0.85B model in bf16.
 7. b1_8b: the same on an 8B-shaped random Llama in bf16 (hidden 4096, 32 layers, 32 heads,
    8 KV heads, intermediate 14336, vocab 128256): ~16 GB of weights drawn on the GPU and
    written with safetensors in shards, loaded by the engine, deleted after. The costliest
    section: the write (~16 GB through the page cache), the engine's load and a short run.
    ``b1_roofline_fraction`` of the JSON is this model's (else the small one's).
 8. throughput: decode tok/s at batch 1, 8, 64, 256 with CUDA graphs on and off
    (``enforce_eager``) x ``async_scheduling`` on and off, and greedy token agreement with
    the graphs + sync run (bf16: graphs and eager may split KV differently, see 10).
 9. memory_profile: an engine started without ``num_gpu_blocks_override``: the KV blocks and
    GiB it reports (its ``kv_sizing``, the worker's memory plan, the start-up log), then a
    batch at ``max_num_seqs`` with top-p and logprobs (the sampler's worst case): no OOM.
10. fp8_kv: ``kv_cache_dtype="fp8"`` end to end: tok/s and token agreement with the bf16 KV
    run of section 8.
11. long_context: a decode batch whose context makes the Triton kernel split the KV
    (``choose_num_splits``) replayed inside CUDA graphs: greedy tokens equal to eager, fp32
    (the graph bounds the context by max_model_len, so it splits differently from eager).
12. top_p: batch 256 with temperature 0.8, top_p 0.9, seeded: tok/s against greedy on the
    same engine, and the same tokens when run again.
13. ttft: prefill time to first token of a 2k- and an 8k-token prompt (default chunked
    prefill budget).
14. imports: that the single-GPU sections loaded no ray, zmq, xgrammar, pydantic, ...
15. gguf: the random Llama (4 layers) written as a Q4_1 GGUF, served natively (the Triton
    int4 GEMM with the file's mins) and dequantized: fp32 greedy tokens equal, bf16 batch-1
    step and device memory each (loadtest/gpu/checks_gguf.py; the gguf wheel is carried).
16. tp2: TensorParallel 2 over NCCL, fp32 tokens equal to HF's (section 5), when two GPUs
    and ray are there; a row says why not otherwise (ray's wheel is over the carry limit).
17. hf_generate: transformers ``generate()`` tok/s at the same batches, as the ratio x HF.
18. spec_decode: prompt-lookup speculation on vs off at batch 1 and 8.
19. attention_sweep: the decode kernel's tile / warps / splits sweep (kernels).

vLLM does not run in this workplace (its wheel is far over the carry limit), so
``vllm_b1_tok_s`` and ``vllm_throughput_tok_s`` are null with a note. Every LLM(...) in gpu/
passes ``device`` explicitly ("cuda", or "cpu" for the smoke). ``--cpu-smoke`` runs every
section with tiny shapes on the CPU (Triton interpreter, the engine's torch path);
``--image-packages-only`` first makes every installed package outside the GPU image
(loadtest/gpu_image_packages.txt) and the carried wheels unimportable. It lives here, not
in kernels/, because it drives the whole engine and kernels/ imports tensors only. This
file is the entry only; the code is in loadtest/gpu/ (its __init__.py lists the files).
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # must precede the first @triton.jit (kernel import)
    os.environ["TRITON_INTERPRET"] = "1"

# Before anything imports torch or the rest of pagedserve (image.py is stdlib only).
from pagedserve.loadtest.gpu import image  # noqa: E402

if "--image-packages-only" in sys.argv:
    image.block()  # its result in image.BLOCKED, for the imports section

from pagedserve.loadtest.gpu import cli  # noqa: E402


def main() -> int:
    return cli.main(description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
