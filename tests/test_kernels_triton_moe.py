"""The fused-MoE Triton kernel (kernels/moe/triton_fused_moe.py) against its torch reference
(kernels/moe/grouped_torch.py), run by the Triton interpreter.

Same harness as test_kernels_triton.py: the cases run in child processes started with
TRITON_INTERPRET=1 (this file run as a script prints one JSON line per case). fp32 (exact
"ieee" dots) and fp16; the interpreter computes bf16 arithmetic wrongly, so bf16 is only
compiled (loadtest/kernel_checks/aot.py --moe, a real sm_90 compile of every variant).

    fp32         9 tokens, top-2 of 4 experts, one expert never chosen, 64 x 48 (partial tiles)
    fp16         5 tokens, top-3 of 8, hidden 40, intermediate 24: tiles past both edges
    decode       1 token, top-2 of 8: six experts unread, most blocks unused
    prefill      40 tokens, top-2 of 4: 20 rows an expert, BLOCK_M 32
    block        Qwen3-MoE's SparseMoeBlock (router softmax in fp32, top-k, no renormalising)
                 with its FusedMoE forced onto the Triton path, against the same block on torch

In this process, no interpreter: the sort-and-pad layout itself, and the whole wrapper on
the meta device (no data at all), which fails on any read of a value back to the host, so
the CUDA path has no sync a layer.
"""

from __future__ import annotations

import json

import pytest
import torch

from _triton_interp import aot_compiled, emit, interpreter_results

TOLERANCE = {"float32": 1e-5, "float16": 3e-3}


def _rel_err(got, ref) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def _weights(g, num_experts: int, hidden: int, inter: int, dtype):
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    return w13, w2


def _kernel_case(dtype_name: str, n: int, k: int, num_experts: int, hidden: int, inter: int,
                 unused: tuple[int, ...] = (), seed: int = 0) -> dict:
    from pagedserve.kernels.moe.grouped_torch import grouped_experts, select_experts
    from pagedserve.kernels.moe.triton_fused_moe import fused_experts_triton

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    w13, w2 = _weights(g, num_experts, hidden, inter, dtype)
    logits = torch.randn(n, num_experts, generator=g)
    logits[:, list(unused)] = -1e4  # experts nobody chooses
    topk_weights, topk_ids = select_experts(logits, k, renormalize=True)
    got = fused_experts_triton(x, w13, w2, topk_weights, topk_ids)
    ref = grouped_experts(x, w13, w2, topk_weights, topk_ids)
    return {"err": _rel_err(got, ref), "dtype": str(got.dtype).removeprefix("torch."),
            "shape": list(got.shape), "finite": bool(torch.isfinite(got).all()),
            "experts_used": sorted(set(topk_ids.flatten().tolist()))}


def _block_case() -> dict:
    from pagedserve.worker.layers.fused_moe import SparseMoeBlock
    from pagedserve.worker.model_config import ModelConfig

    cfg = ModelConfig.from_dict(dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
                                     intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128, num_experts=8,
                                     num_experts_per_tok=2, norm_topk_prob=False), dtype="float32")
    g = torch.Generator().manual_seed(3)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    x = torch.randn(12, 64, generator=g)
    with torch.no_grad():
        ref = block(x)
        block.experts.backend = "triton"
        got = block(x)
    return {"err": _rel_err(got, ref)}


def _wrapper_errors() -> dict:
    from pagedserve.kernels.moe.triton_fused_moe import fused_experts_triton

    x, w13, w2 = torch.randn(3, 32), torch.randn(4, 48, 32), torch.randn(4, 32, 24)
    w, ids = torch.full((3, 2), 0.5), torch.zeros(3, 2, dtype=torch.long)
    bad = {
        "shape": lambda: fused_experts_triton(x[:, :16], w13, w2, w, ids),
        "dtype": lambda: fused_experts_triton(x.half(), w13, w2, w, ids),
        "weights": lambda: fused_experts_triton(x, w13, w2, w.half(), ids),
    }
    errors = {}
    for key, fn in bad.items():
        try:
            fn()
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)
    return errors


def _child_main() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from pagedserve.kernels.moe import triton_fused_moe

    interpreted = all(isinstance(k, InterpretedFunction) for k in (
        triton_fused_moe._moe_gate_up_kernel, triton_fused_moe._moe_down_kernel))
    print(json.dumps({"case": "interpreted", "result": interpreted}), flush=True)
    emit("fp32", lambda: _kernel_case("float32", 9, 2, 4, 64, 48, unused=(2,)))
    emit("fp16", lambda: _kernel_case("float16", 5, 3, 8, 40, 24, seed=1))
    emit("decode", lambda: _kernel_case("float32", 1, 2, 8, 32, 32, seed=2))
    emit("prefill", lambda: _kernel_case("float32", 40, 2, 4, 32, 16, seed=4))
    emit("block", _block_case)
    emit("wrapper_errors", _wrapper_errors)


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter_results(__file__)


def test_kernels_run_in_the_interpreter(results):
    assert results["interpreted"] is True


@pytest.mark.parametrize("case,dtype,shape", [("fp32", "float32", [9, 64]), ("fp16", "float16", [5, 40]),
                                              ("decode", "float32", [1, 32]), ("prefill", "float32", [40, 32])])
def test_fused_experts_match_the_torch_reference(results, case, dtype, shape):
    r = results[case]
    assert r["err"] < TOLERANCE[dtype] and r["finite"], r
    assert (r["dtype"], r["shape"]) == (dtype, shape), r
    if case == "fp32":
        assert 2 not in r["experts_used"] and len(r["experts_used"]) == 3, r


def test_sparse_moe_block_on_the_triton_path_matches_torch(results):
    assert results["block"]["err"] < 1e-5, results["block"]


def test_wrapper_rejects_bad_inputs_clearly(results):
    e = results["wrapper_errors"]
    assert "do not agree" in e["shape"]
    assert "dtypes must match" in e["dtype"]
    assert "topk_weights must be fp32" in e["weights"]


# ---- in this process: the layout, and no host read-back -------------------------------------
def test_align_groups_pairs_by_expert_in_whole_blocks():
    from pagedserve.kernels.moe.triton_fused_moe import align_by_expert, padded_capacity

    topk_ids = torch.tensor([[0, 3], [3, 1], [1, 0], [2, 3], [3, 0]])  # pairs 0..9, expert 4 unused
    num_pairs, block_m = 10, 4
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts=5, block_m=block_m)
    assert sorted_ids.dtype == block_expert.dtype == torch.int32
    assert sorted_ids.shape[0] == padded_capacity(num_pairs, 5, block_m) == 28 and block_expert.shape[0] == 7
    flat = topk_ids.flatten()
    blocks = sorted_ids.view(-1, block_m).tolist()
    expected = {0: [0, 5, 9], 1: [3, 4], 2: [6], 3: [1, 2, 7, 8]}  # each run in pair (token) order
    assert block_expert.tolist() == [0, 1, 2, 3, -1, -1, -1]  # 10 + 5 (4 - 1) rows, in 7 blocks
    for b, e in enumerate(block_expert.tolist()):
        real = [p for p in blocks[b] if p < num_pairs]
        if e < 0:
            assert real == []
        else:
            assert real == expected[e] and all(flat[p] == e for p in real)
            assert blocks[b][len(real):] == [num_pairs] * (block_m - len(real))


def test_the_cuda_path_reads_nothing_back_to_the_host(monkeypatch):
    """align_by_expert and the wrapper around the launches on meta tensors (shapes, no data):
    a .item(), .tolist(), bool() or a data-dependent shape there raises on meta."""
    pytest.importorskip("triton")
    from pagedserve.kernels.moe import triton_fused_moe
    from pagedserve.kernels.moe.grouped_torch import select_experts

    launches = []

    class _Stub:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw))

    monkeypatch.setattr(triton_fused_moe, "_moe_gate_up_kernel", _Stub())
    monkeypatch.setattr(triton_fused_moe, "_moe_down_kernel", _Stub())
    meta = torch.device("meta")
    n, k, num_experts, hidden, inter = 7, 2, 8, 64, 32
    x = torch.empty(n, hidden, device=meta)
    topk_weights, topk_ids = select_experts(torch.empty(n, num_experts, device=meta), k, renormalize=True)
    out = triton_fused_moe.fused_experts_triton(x, torch.empty(num_experts, 2 * inter, hidden, device=meta),
                                                torch.empty(num_experts, hidden, inter, device=meta),
                                                topk_weights, topk_ids)
    assert out.device == meta and tuple(out.shape) == (n, hidden)
    assert len(launches) == 2


@pytest.mark.slow  # twelve ptxas compiles
@pytest.mark.scenarios  # so under -m scenarios (pyproject.toml), not the default run
def test_kernels_compile_for_sm90_without_a_gpu():
    """Frontend + ptxas for the real target, bf16 included: errors the interpreter cannot see."""
    assert aot_compiled("--moe") == 12


if __name__ == "__main__":
    _child_main()
