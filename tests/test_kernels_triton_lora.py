"""The multi-LoRA Triton kernels agree with their torch reference, run by the Triton interpreter.

Same harness as test_kernels_triton.py: the cases run in child processes started with
TRITON_INTERPRET=1 (this file run as a script prints one JSON line per case). Inputs are fp32
and fp16; the interpreter computes bf16 arithmetic wrongly, so bf16 is only compiled here (a
real sm_90 compile of every variant, loadtest/kernel_checks/aot.py --lora) and waits for a GPU
to be run.

The story of one projection of two modules (a fused gate_up, say) over three slots, in a
pool of rank 16 holding adapters of rank 4 and 8 (rank padding):

    rows:    0 1 | 2 | 3 | 4 .. 23 | 24 25 26 | 27 .. 35 | 36 .. 47
    slot:    s1    --  s0  s1        s2         s0         --          (--: base model)
    slot 0   r 4, both modules      slot 1  r 8, both      slot 2  r 8, the second only

The slots' unused A rows and B columns hold large junk (a previous, larger adapter), xa and
``out`` start as NaN / random: the kernels must read only up to each slot's width and rank,
write xa only in segment rows, and leave the base model's rows of ``out`` bit-identical.
Then the worker's wiring: LoRAManager on the Triton path against its torch path, on every
projection of a tiny model with two PEFT adapters on disk.
"""

from __future__ import annotations

import json

import pytest

from _triton_interp import aot_compiled, emit, interpreter_results

SEGMENTS = [(0, 2, 1), (3, 1, 0), (4, 20, 1), (24, 3, 2), (27, 9, 0)]  # (start, num_rows, slot)
NUM_TOKENS, FAN_IN, MAX_RANK, OUTS = 48, 96, 16, (40, 24)  # FAN_IN 96: a partial K tile
RANKS = (4, 8, 8)
COLS = ((0, 4), (0, 8), (-1, 0))  # per slot: each module's first column in xa, -1 not targeted
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def _rel_err(got, ref) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


def _kernel_case(dtype_name: str, split_k: int) -> dict:
    import torch

    from pagedserve.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
    from pagedserve.kernels.triton_lora_expand import lora_expand_triton
    from pagedserve.kernels.triton_lora_shrink import lora_shrink_triton

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(split_k)
    num_slots, n = len(RANKS), len(OUTS) * MAX_RANK
    x = torch.randn(NUM_TOKENS, FAN_IN, generator=g).to(dtype)
    a = torch.full((num_slots, n, FAN_IN), 1e3).to(dtype)  # junk beyond each slot's width
    bs = [torch.full((num_slots, out, MAX_RANK), 1e3).to(dtype) for out in OUTS]  # junk beyond r
    widths = []
    for slot, (r, cols) in enumerate(zip(RANKS, COLS)):
        k = sum(c >= 0 for c in cols)
        a[slot, :k * r] = (torch.randn(k * r, FAN_IN, generator=g) / FAN_IN ** 0.5).to(dtype)
        for b, c in zip(bs, cols):
            if c >= 0:
                b[slot, :, :r] = torch.randn(b.shape[1], r, generator=g).to(dtype)
        widths.append(k * r)
    segments = torch.tensor(SEGMENTS, dtype=torch.int32)
    widths = torch.tensor(widths, dtype=torch.int32)
    ranks = torch.tensor(RANKS, dtype=torch.int32)
    max_rows = max(s[1] for s in SEGMENTS)
    xa_ref = lora_shrink_ref(x, a, segments, widths, torch.full((NUM_TOKENS, n), float("nan")))
    xa = lora_shrink_triton(x, a, segments, widths, max_rows, torch.full((NUM_TOKENS, n), float("nan")),
                            split_k=split_k)
    written = ~torch.isnan(xa_ref)
    res = {"shrink_err": _rel_err(xa[written], xa_ref[written]),
           "shrink_nan_where_ref": bool(torch.isnan(xa[written]).any())}
    if split_k == 1:  # split K zeroes xa first; a plain launch touches nothing outside the segments
        res["shrink_untouched"] = bool(torch.isnan(xa[~written]).all())
    # The module's output columns are a slice of a wider fused output (q of qkv), as the model passes them.
    fused = torch.randn(NUM_TOKENS, sum(OUTS) + 8, generator=g).to(dtype)
    got, ref = fused.clone(), fused.clone()
    o0 = 8
    for j, (b, out) in enumerate(zip(bs, OUTS)):
        cols = torch.tensor([c[j] for c in COLS], dtype=torch.int32)
        lora_expand_ref(xa_ref, b, ref[:, o0:o0 + out], segments, cols, ranks)
        lora_expand_triton(xa, b, got[:, o0:o0 + out], segments, cols, ranks, max_rows)
        o0 += out
    base_rows = [2] + list(range(36, NUM_TOKENS))
    res["expand_err"] = _rel_err(got, ref)
    res["changed"] = bool((ref[:, 8:] != fused[:, 8:]).any())
    res["base_rows_untouched"] = bool(torch.equal(got[base_rows], fused[base_rows]))
    res["other_columns_untouched"] = bool(torch.equal(got[:, :8], fused[:, :8]))
    # slot 2 targets only the second module: its rows of the first are untouched
    res["untargeted_untouched"] = bool(torch.equal(got[24:27, 8:8 + OUTS[0]], fused[24:27, 8:8 + OUTS[0]]))
    return res


def _manager_case() -> dict:
    """LoRAManager, Triton path against torch path: every projection of every layer."""
    import tempfile

    import torch

    from pagedserve.loadtest.offline.bench_lora import make_adapter
    from pagedserve.scheduler.lora import LoRARequest
    from pagedserve.worker.lora.lora_ops import LayerLoRA
    from pagedserve.worker.lora.manager import LoRAManager
    from pagedserve.worker.model_config import ModelConfig

    hf = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, intermediate_size=96, vocab_size=128)
    cfg = ModelConfig.from_dict(hf, dtype="float32")
    root = tempfile.mkdtemp()
    everything = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    a = LoRARequest("all", 1, make_adapter(hf, f"{root}/all", rank=4, targets=everything, seed=1))
    b = LoRARequest("some", 2, make_adapter(hf, f"{root}/some", rank=8, targets=("k_proj", "up_proj", "down_proj"),
                                            seed=2))
    rows = [(b, 2), (None, 1), (a, 1), (b, 1), (a, 13), (None, 2), (b, 4)]  # rows 2, 18, 19: the base model
    num_tokens = sum(n for _, n in rows)
    mgrs = [LoRAManager(cfg, max_loras=2, max_lora_rank=16, device=torch.device("cpu"), backend=backend)
            for backend in ("torch", "triton")]
    for mgr in mgrs:
        mgr.begin_step(rows)
    g = torch.Generator().manual_seed(0)
    errs, base_untouched = {}, True
    for layer in range(cfg.num_hidden_layers):
        hooks = [LayerLoRA(mgr.ctx, layer) for mgr in mgrs]
        for proj, (fan_in, parts) in mgrs[0].pool.layout.items():
            x = torch.randn(num_tokens, fan_in, generator=g)
            out = torch.randn(num_tokens, parts[-1][2], generator=g)
            got = [out.clone(), out.clone()]
            for hook, o in zip(hooks, got):
                hook.apply(proj, x, o)
            errs[f"{layer}.{proj}"] = _rel_err(got[1] - out, got[0] - out)
            base_untouched &= torch.equal(got[1][[2, 18, 19]], out[[2, 18, 19]])
    return {"max_err": max(errs.values()), "base_untouched": bool(base_untouched),
            "segments": mgrs[1].ctx.segments.tolist(), "max_rows": mgrs[1].ctx.max_rows}


def _wrapper_errors() -> dict:
    import torch

    from pagedserve.kernels.triton_lora_expand import lora_expand_triton
    from pagedserve.kernels.triton_lora_shrink import lora_shrink_triton

    x, a = torch.randn(4, 32), torch.randn(2, 8, 32)
    seg, w = torch.tensor([[0, 4, 1]], dtype=torch.int32), torch.tensor([8, 8], dtype=torch.int32)
    xa, b, out = torch.zeros(4, 8), torch.randn(2, 16, 8), torch.zeros(4, 16)
    bad = {
        "dtype": lambda: lora_shrink_triton(x.half(), a, seg, w, 4),
        "segments": lambda: lora_shrink_triton(x, a, seg.long(), w, 4),
        "fan_in": lambda: lora_shrink_triton(x[:, :16], a, seg, w, 4),
        "xa": lambda: lora_expand_triton(xa.half(), b, out, seg, w, w, 4),
        "cols": lambda: lora_expand_triton(xa, b, out, seg, w[:1], w, 4),
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

    from pagedserve.kernels import triton_lora_expand, triton_lora_shrink

    interpreted = all(isinstance(k, InterpretedFunction) for k in (
        triton_lora_shrink._lora_shrink_kernel, triton_lora_expand._lora_expand_kernel))
    print(json.dumps({"case": "interpreted", "result": interpreted}), flush=True)
    emit("fp32", lambda: _kernel_case("float32", 1))
    emit("fp16", lambda: _kernel_case("float16", 1))
    emit("fp32_split_k", lambda: _kernel_case("float32", 3))
    emit("manager", _manager_case)
    emit("wrapper_errors", _wrapper_errors)


@pytest.fixture(scope="module")
def results() -> dict:
    return interpreter_results(__file__)


def test_kernels_run_in_the_interpreter(results):
    assert results["interpreted"] is True


@pytest.mark.parametrize("case", ["fp32", "fp16", "fp32_split_k"])
def test_shrink_and_expand_match_reference(results, case):
    r = results[case]
    tol = TOLERANCE["float16" if case == "fp16" else "float32"]
    assert r["shrink_err"] < tol and not r["shrink_nan_where_ref"], r
    assert r.get("shrink_untouched", True), r
    assert r["expand_err"] < tol and r["changed"], r
    assert r["base_rows_untouched"] and r["other_columns_untouched"] and r["untargeted_untouched"], r


def test_manager_triton_path_matches_torch_path(results):
    r = results["manager"]
    # the runs of each adapter as segments: (start, num_rows, slot); adapter b got slot 0
    assert r["segments"] == [[0, 2, 0], [4, 1, 0], [20, 4, 0], [3, 1, 1], [5, 13, 1]] and r["max_rows"] == 13
    assert r["max_err"] < 1e-5 and r["base_untouched"], r


def test_wrappers_reject_bad_inputs_clearly(results):
    e = results["wrapper_errors"]
    assert "dtypes must match" in e["dtype"]
    assert "int32" in e["segments"]
    assert "input features" in e["fan_in"]
    assert "xa must be fp32" in e["xa"]
    assert "cols must be" in e["cols"]


@pytest.mark.slow  # twelve ptxas compiles
@pytest.mark.scenarios  # so under -m scenarios (pyproject.toml), not the default run
def test_kernels_compile_for_sm90_without_a_gpu():
    """Frontend + ptxas for the real target, bf16 included: errors the interpreter cannot see."""
    assert aot_compiled("--lora") == 12


if __name__ == "__main__":
    _child_main()
