"""The CPU experts (kernels/moe/cpu_experts.py over kernels/cpu_moe.cpp) against the torch
reference (kernels/moe/grouped_torch.py): shapes with partial panels and tile groups, experts
nobody chose, one expert's rows past a tile call's 48, top-1 to top-3; then the worker's
wiring: a SparseMoeBlock whose experts pack_cpu_experts packed gives the torch block's output,
and --cpu-linear aten / onednn leave the experts on torch. The greedy tokens of Mixtral and
Qwen3-MoE engines (which pack their experts) against transformers: test_model_families.py."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.moe import cpu_experts
from pagedserve.kernels.moe.grouped_torch import grouped_experts, select_experts

pytestmark = pytest.mark.skipif(not cpu_experts.available(), reason="the CPU experts need AVX2 + FMA or AVX-512")


def _rel_err(got, ref) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("num_experts,hidden,inter,k", [(8, 40, 24, 2), (5, 100, 50, 3), (4, 64, 160, 1)])
@pytest.mark.parametrize("n", [1, 3, 9, 50, 130])
def test_cpu_experts_match_the_torch_reference(num_experts, hidden, inter, k, n):
    g = torch.Generator().manual_seed(n * 7 + k)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    x = torch.randn(n, hidden, generator=g)
    logits = torch.randn(n, num_experts, generator=g)
    logits[:, 1] = -1e4  # nobody chooses expert 1
    if n == 130:
        logits[:, 0] = 1e4  # every token's first choice: 130 rows for one expert, three tile calls
    topk_weights, topk_ids = select_experts(logits, k, renormalize=k > 1)
    packed = cpu_experts.CPUExperts(w13, w2)
    got = cpu_experts.cpu_grouped_experts(x, packed, topk_weights, topk_ids)
    ref = grouped_experts(x, w13, w2, topk_weights, topk_ids)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert _rel_err(got, ref) < 1e-5


def test_cpu_experts_reject_what_they_do_not_run():
    with pytest.raises(ValueError, match="fp32 w13"):
        cpu_experts.CPUExperts(torch.zeros(2, 8, 4, dtype=torch.bfloat16), torch.zeros(2, 4, 4, dtype=torch.bfloat16))
    packed = cpu_experts.CPUExperts(torch.zeros(2, 8, 4), torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match="hidden size 4"):
        cpu_experts.cpu_grouped_experts(torch.zeros(3, 5), packed, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long))


def _block():
    from pagedserve.worker.layers.fused_moe import SparseMoeBlock
    from pagedserve.worker.model_config import ModelConfig

    cfg = ModelConfig.from_dict(dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=64,
                                     intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, num_local_experts=6,
                                     num_experts_per_tok=2), dtype="float32")
    block = SparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return block


@pytest.mark.parametrize("requested,packs", [("auto", True), ("panel", True), ("aten", False), ("onednn", False)])
def test_the_worker_packs_experts_under_auto_and_panel(requested, packs):
    from torch import nn

    from pagedserve.worker.layers.cpu_backend import pack_cpu_experts

    block = _block()
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = block(x)
        assert pack_cpu_experts(nn.ModuleList([block]), requested) == int(packs)
        got = block(x)
    assert (block.experts._cpu is not None) == packs
    assert block.experts.w13_weight.numel() == (0 if packs else 6 * 96 * 64)  # the plain copy freed
    assert _rel_err(got, ref) < 1e-5


@pytest.mark.benchmarks  # so under -m benchmarks, not the default run
@pytest.mark.timeout(600)
def test_bench_moe_smoke_runs_end_to_end(tmp_path):
    """loadtest/offline/bench_moe.py on its 2-layer model, vLLM left out: every row and the
    last line's JSON (its figures are this machine's, never asserted)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "pagedserve.loadtest.offline.bench_moe", "--smoke", "--skip-vllm"],
                          cwd=root, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PAGEDSERVE_CACHE=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["num_prompts"] == 4 and out["output_tokens"] > 0
    for key in ("pagedserve_tok_s", "torch_moe_tok_s", "hf_tok_s", "ratio_vs_hf", "ratio_vs_torch_moe"):
        assert out[key] > 0, key
    assert 0 < out["pagedserve_moe_share"] < 1 and 0 < out["torch_moe_share"] < 1
