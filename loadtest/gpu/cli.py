"""The GPU check's command line: every section in order with its estimate (sections()), the
engine sections' flags (add_args), and main, which hands both to the kernel check's runner
(kernel_checks/gpu_kernels.py: the budget, the hard stop, the table and the JSON)."""

from __future__ import annotations

import atexit
import shutil

import torch

from pagedserve.loadtest.gpu.checks_correctness import check_exact, check_imports, check_long_context, check_tp2
from pagedserve.loadtest.gpu.checks_gguf import check_gguf
from pagedserve.loadtest.gpu.checks_memory import check_memory_profile
from pagedserve.loadtest.gpu.checks_roofline import check_b1, check_b1_8b
from pagedserve.loadtest.gpu.checks_speed import (check_fp8_kv, check_hf_generate, check_spec, check_throughput,
                                                  check_top_p, check_ttft)
from pagedserve.loadtest.gpu.harness import Ctx
from pagedserve.loadtest.kernel_checks import gpu_kernels as kernel_check
from pagedserve.loadtest.kernel_checks.gpu_kernels import RESULTS, Section

VLLM_NOTE = ("vLLM does not run in this workplace: its wheel is far over the 64 MiB a device call carries "
             "and the GPU machine has no network; measure it where pip reaches PyPI.")


def sections(args) -> list[Section]:
    """Every section in the order of its value, with its H100 estimate (seconds; a guess for
    the budget guard until a run's section_s replaces it). The first engine section also
    writes the ~0.85B checkpoint (HF's init on the CPU, ~3.4 GB in fp32)."""
    core, sweep = kernel_check.kernel_sections()
    ctx_box: list[Ctx] = []

    def with_ctx(fn):
        def call(dev, a):
            if not ctx_box:
                ctx_box.append(Ctx(dev, a))
                atexit.register(shutil.rmtree, ctx_box[0].work, True)  # the checkpoints, GBs
            fn(ctx_box[0])
        return call

    RESULTS.update(vllm_b1_tok_s=None, vllm_throughput_tok_s=None, vllm_note=VLLM_NOTE)
    e2e = [Section("exact", 40, with_ctx(check_exact)),
           Section("b1", 12, with_ctx(check_b1)),
           Section("b1_8b", 75, with_ctx(check_b1_8b)),
           Section("throughput", 50, with_ctx(check_throughput)),
           Section("memory_profile", 15, with_ctx(check_memory_profile)),
           Section("fp8_kv", 15, with_ctx(check_fp8_kv)),
           Section("long_context", 25, with_ctx(check_long_context)),
           Section("top_p", 12, with_ctx(check_top_p)),
           Section("ttft", 12, with_ctx(check_ttft)),
           Section("imports", 0, with_ctx(check_imports)),
           Section("gguf", 40, with_ctx(check_gguf)),  # after imports: it loads the gguf package
           # Only with two GPUs does it start engines; else it is a row saying why.
           Section("tp2", 60 if not args.cpu_smoke and torch.cuda.device_count() >= 2 else 0, with_ctx(check_tp2)),
           Section("hf_generate", 20, with_ctx(check_hf_generate)),
           Section("spec_decode", 20, with_ctx(check_spec))]
    if args.skip_e2e:
        args.skip = list(args.skip) + [s.name for s in e2e]
    return core + e2e + [sweep]


def add_args(ap) -> None:
    ap.add_argument("--skip-e2e", action="store_true", help="the kernel sections only")
    ap.add_argument("--max-tokens", type=int, default=None, help="generated tokens per sequence (default 128)")
    ap.add_argument("--work-dir", default=None, help="where the random checkpoints are written (default: $TMPDIR)")
    ap.add_argument("--image-packages-only", action="store_true",
                    help="packages outside the GPU image unimportable (loadtest/gpu_image_packages.txt)")



def main(description: str) -> int:
    return kernel_check.main(sections=sections, add_args=add_args, description=description)
