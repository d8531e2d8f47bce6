"""The graph-ready runner: static step buffers, padded decode batches, capture sizes, enforce_eager.

Story: one scheduler drives two runners over the same plans, step for step, while
requests join and leave: one pads every decode-only batch to its graph size exactly as
the CUDA graph path does (``pad_eager``: same buffers, same padding, same slicing, just
no graph on a CPU), the other runs the plain eager path. Tokens must be equal and logits
allclose (fp32) every step; the buffers must keep their addresses (a graph replays fixed
ones); padded rows must write nowhere in the KV cache. The CUDA test at the end captures
real graphs and compares them with enforce_eager; it runs on a GPU machine only.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _sched_helpers import add, make_scheduler

from pagedserve.cluster.cli.args import add_engine_args, engine_config_from_args
from pagedserve.worker.cuda_graphs import capture_sizes, graphs_disabled_reason
from pagedserve.worker.loading.loader import load_model
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.loading.random_models import make_test_model

BLOCK_SIZE = 8
NUM_BLOCKS = 64
MAX_SEQS = 8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_test_model("llama-gqa2-hd64", tmp_path_factory.getbasetemp() / "ps-test-models")


def make_runner(path, device="cpu", **kw) -> ModelRunner:
    cfg = ModelConfig.from_pretrained(path, max_model_len=256)
    backend = "triton" if torch.device(device).type == "cuda" else "torch"
    model = load_model(cfg, device, attention_backend=backend)
    runner = ModelRunner(model, cfg, block_size=BLOCK_SIZE, device=torch.device(device), max_num_seqs=MAX_SEQS,
                         max_num_batched_tokens=64, **kw)
    runner.initialize_cache(NUM_BLOCKS, cfg.num_key_value_heads, torch.float32)
    return runner


def record(runner: ModelRunner):
    """Spies that call through: the logits each step computed, and the shape each step ran as."""
    logits, shapes = [], []
    compute, forward = runner.model.compute_logits, runner.graph_runner.forward

    def compute_logits(h):
        out = compute(h)
        logits.append(out.clone())
        return out

    def graph_forward(inputs, kv_caches):
        # Every real row writes its token's K/V; only padding has slot -1.
        real = int((inputs.attn_metadata.slot_mapping >= 0).sum()) if inputs.padded else inputs.num_rows
        shapes.append((inputs.num_rows, inputs.padded, real))
        return forward(inputs, kv_caches)

    runner.model.compute_logits = compute_logits
    runner.graph_runner.forward = graph_forward
    return logits, shapes


# (step it arrives at, prompt length, max_tokens): 3 decode alone, 5 after the next two
# join, 8 at the peak, then they leave one by one (different max_tokens).
ARRIVALS = [(0, 9, 14), (0, 12, 20), (0, 5, 12), (4, 17, 12), (4, 3, 25), (9, 8, 10), (9, 11, 16), (9, 6, 22)]


def drive(runners, num_steps=40, check=None, **cache_kw):
    """One scheduler, the same plan to every runner; the first runner's tokens go back.
    Returns the real batch size of each decode-only step."""
    sched = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, budget=64, max_seqs=MAX_SEQS,
                           max_model_len=256, **cache_kw)
    g = torch.Generator().manual_seed(3)
    decode_sizes = []
    for step in range(num_steps):
        for i, (at, n, max_tokens) in enumerate(ARRIVALS):
            if at == step:
                prompt = torch.randint(3, 500, (n,), generator=g).tolist()
                add(sched, f"r{i}", prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        plan = sched.schedule()
        if not plan.total_num_scheduled_tokens:
            break
        if all(n == 1 for n in plan.num_scheduled_tokens.values()):
            decode_sizes.append(len(plan.num_scheduled_tokens))
        outs = [r.execute_model(plan) for r in runners]
        for out in outs[1:]:
            assert out.req_ids == outs[0].req_ids
            assert out.sampled_token_ids == outs[0].sampled_token_ids, f"step {step}"
        if check is not None:
            check(step, plan)
        sched.update_from_output(plan, outs[0])
    return decode_sizes


def test_padded_decode_equals_eager_while_requests_join_and_leave(model_path):
    padded, eager = make_runner(model_path, pad_eager=True), make_runner(model_path)
    lp, shapes = record(padded)
    le, eager_shapes = record(eager)
    decode_sizes = drive([padded, eager])
    assert {3, 5, 8} <= set(decode_sizes) and len(set(decode_sizes)) >= 6  # joined, then left one by one
    assert len(lp) == len(le) > 30
    for a, b in zip(lp, le):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Every decode-only step ran padded to its graph size; mixed steps never pad.
    ran = {(rows, real) for rows, was_padded, real in shapes if was_padded}
    assert {(4, 3), (8, 5), (8, 8), (2, 2), (1, 1)} <= ran
    assert all(rows in capture_sizes(MAX_SEQS) for rows, _ in ran)
    assert sum(p for _, p, _ in shapes) == len(decode_sizes)
    assert not any(p for _, p, _ in eager_shapes)  # the default CPU path never pads
    assert all(rows == real for rows, _, real in eager_shapes)


def test_static_buffers_keep_their_addresses_and_padding_writes_nothing(model_path):
    runner = make_runner(model_path, pad_eager=True)
    ptrs = {name: t.data_ptr() for name, t in runner.buffers.dev.items()}
    seen_blocks: set[int] = set()
    captured = []
    fill = runner.buffers.fill

    def spy_fill(*args, **kw):
        inputs = fill(*args, **kw)
        captured.append(inputs)
        return inputs

    runner.buffers.fill = spy_fill

    def check(step, plan):
        inputs = captured[-1]
        md = inputs.attn_metadata
        assert {name: t.data_ptr() for name, t in runner.buffers.dev.items()} == ptrs
        for t in (inputs.input_ids, inputs.positions, md.slot_mapping, md.seq_lens, md.cu_seqlens_q,
                  md.block_table):
            assert t.untyped_storage().data_ptr() in ptrs.values() and t.storage_offset() == 0
        real = len(plan.num_scheduled_tokens)
        if inputs.padded:
            assert md.block_table.shape == (inputs.num_rows, runner.buffers.max_blocks_per_seq)
            assert (md.slot_mapping[real:] < 0).all() and (md.slot_mapping[:real] >= 0).all()
            assert md.seq_lens[real:].tolist() == [1] * (inputs.num_rows - real)
        for st in runner.requests.values():
            seen_blocks.update(st.block_ids)
        never_owned = [b for b in range(NUM_BLOCKS) if b not in seen_blocks]
        assert len(never_owned) > 16
        for layer in runner.kv_caches:
            for cache in layer:
                assert not cache[never_owned].any(), f"step {step}: a block no request owns was written"

    drive([runner], check=check)
    padded = [i for i in captured if i.padded]
    assert len(padded) > 20 and any((i.attn_metadata.slot_mapping < 0).any() for i in padded)


def test_step_buffers_fill_exact_values():
    """Block size 4. Row 0 decodes position 5 (block 2, offset 1: slot 9); row 1 runs
    positions 2..5 of a chunk over blocks [3, 9]: slots 14, 15, 36, 37."""
    from pagedserve.worker.step_buffers import StepBuffers

    buf = StepBuffers(max_num_tokens=16, max_num_seqs=4, max_model_len=32, block_size=4, device=torch.device("cpu"))
    x = buf.fill([11, 21, 22, 23, 24], [1, 4], [5, 2], [[7, 2], [3, 9]], num_decode=1)
    md = x.attn_metadata
    assert (x.num_rows, x.padded) == (2, False)
    assert x.input_ids.tolist() == [11, 21, 22, 23, 24] and x.positions.tolist() == [5, 2, 3, 4, 5]
    assert md.slot_mapping.tolist() == [9, 14, 15, 36, 37]
    assert md.seq_lens.tolist() == [6, 6] and md.cu_seqlens_q.tolist() == [0, 1, 5]
    assert md.block_table.tolist() == [[7, 2], [3, 9]] and md.block_table.is_contiguous()
    assert (md.max_seqlen_q, md.max_seq_len, md.num_decode_tokens) == (4, 6, 1)
    assert md.query_lens_cpu == [1, 4] and md.seq_lens_cpu == [6, 6]
    # Three decode rows padded to 4 at the graph width (32 / 4 = 8 blocks per row).
    x = buf.fill([5, 6, 7], [1, 1, 1], [0, 4, 9], [[1], [4, 2], [6, 8, 3]], num_decode=3, pad_to=4)
    md = x.attn_metadata
    assert (x.num_rows, x.padded) == (4, True)
    assert x.input_ids.tolist() == [5, 6, 7, 0] and x.positions.tolist() == [0, 4, 9, 0]
    assert md.slot_mapping.tolist() == [4, 8, 13, -1]  # position 9: block 3, offset 1
    assert md.seq_lens.tolist() == [1, 5, 10, 1] and md.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert md.block_table.shape == (4, 8) and md.block_table[:, :3].tolist() == [[1, 0, 0], [4, 2, 0], [6, 8, 3],
                                                                                [0, 0, 0]]
    assert (md.max_seqlen_q, md.max_seq_len, md.num_decode_tokens) == (1, 32, 4)
    with pytest.raises(ValueError, match="only a decode-only step pads"):
        buf.fill([1, 2], [2], [0], [[1]], num_decode=0, pad_to=2)
    with pytest.raises(ValueError, match="exceeds the buffers"):
        buf.fill([1] * 5, [1] * 5, [0] * 5, [[1]] * 5, num_decode=5)


def test_step_buffers_split_a_hybrid_caches_ids_by_group():
    """A hybrid KV cache's plan interleaves each request's ids by group ([g0 b0, g1 b0, g0 b1,
    ...]); each group gets its own table and slots, padded rows block 0 and slot -1 in each."""
    from pagedserve.worker.step_buffers import StepBuffers

    buf = StepBuffers(max_num_tokens=16, max_num_seqs=4, max_model_len=32, block_size=4, device=torch.device("cpu"),
                      num_groups=2)
    x = buf.fill([11, 21, 22, 23, 24], [1, 4], [5, 2], [[7, 17, 2, 12], [3, 0, 9, 19]], num_decode=1)
    md = x.attn_metadata
    g0, g1 = md.groups
    assert g0 is md and g1.seq_lens is md.seq_lens and g1.groups is None
    assert md.block_table.tolist() == [[7, 2], [3, 9]] and g1.block_table.tolist() == [[17, 12], [0, 19]]
    assert md.slot_mapping.tolist() == [9, 14, 15, 36, 37] and g1.slot_mapping.tolist() == [49, 2, 3, 76, 77]
    x = buf.fill([5, 6], [1, 1], [0, 4], [[1, 11], [4, 14, 2, 12]], num_decode=2, pad_to=4)
    g0, g1 = x.attn_metadata.groups
    assert g1.block_table.shape == (4, 8) and g1.block_table[:, :2].tolist() == [[11, 0], [14, 12], [0, 0], [0, 0]]
    assert g0.slot_mapping.tolist() == [4, 8, -1, -1] and g1.slot_mapping.tolist() == [44, 48, -1, -1]
    graph = buf.graph_metadata(4)
    assert len(graph.groups) == 2 and graph.groups[1].block_table.data_ptr() == g1.block_table.data_ptr()


def test_hybrid_kv_cache_padded_decode_equals_eager(tmp_path_factory):
    """Gemma 3's hybrid KV cache (window 8: local, local, global, local, four groups of one
    layer) through the graph-shaped padded path and the eager one: the same tokens and
    logits while requests join and leave and the local groups free their blocks."""
    from pagedserve.worker.loading.model_cache import build_once
    from pagedserve.worker.loading.random_models import make_random_llama

    path = build_once(str(tmp_path_factory.getbasetemp() / "gemma3-hybrid"), lambda tmp: make_random_llama(
        tmp, "gemma3", num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]))
    groups = ModelConfig.from_pretrained(path, max_model_len=256).kv_cache_groups()
    assert groups.num_groups == 4
    padded, eager = (make_runner(path, pad_eager=pad, kv_groups=groups) for pad in (True, False))
    lp, shapes = record(padded)
    le, _ = record(eager)
    drive([padded, eager], kv_groups=groups)
    assert len(lp) == len(le) > 30 and any(p for _, p, _ in shapes)
    for a, b in zip(lp, le):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_capture_sizes_and_the_padded_size_of_a_batch(model_path):
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]  # max_num_seqs itself, so every batch has a graph
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1024)[-1] == 512 and capture_sizes(64, max_capture_size=20)[-1] == 20
    runner = make_runner(model_path, pad_eager=True)
    gr = runner.graph_runner
    assert gr.sizes == [1, 2, 4, 8]
    assert [gr.padded_size(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert make_runner(model_path).graph_runner.padded_size(3) is None  # CPU default: no padding


def test_batches_above_the_largest_size_run_eager(model_path):
    capped, eager = make_runner(model_path, pad_eager=True, max_capture_size=4), make_runner(model_path)
    assert capped.graph_runner.sizes == [1, 2, 4]
    _, shapes = record(capped)
    decode_sizes = drive([capped, eager])
    assert max(decode_sizes) == 8
    padded = [(rows, real) for rows, was_padded, real in shapes if was_padded]
    assert (4, 3) in padded and all(rows <= 4 for rows, _ in padded)
    assert (5, False, 5) in shapes and (8, False, 8) in shapes  # above 4: eager, unpadded


def test_enforce_eager_reaches_the_runner_and_cpu_never_captures(model_path, caplog):
    from pagedserve import LLM, SamplingParams

    ap = add_engine_args(__import__("argparse").ArgumentParser())
    assert engine_config_from_args(ap.parse_args(["--enforce-eager"])).enforce_eager is True
    assert engine_config_from_args(ap.parse_args([])).enforce_eager is False
    assert graphs_disabled_reason(torch.device("cuda"), "triton", False) is None
    assert "enforce_eager" in graphs_disabled_reason(torch.device("cuda"), "triton", True)
    assert "torch" in graphs_disabled_reason(torch.device("cuda"), "torch", False)
    for enforce, reason in ((True, "enforce_eager is set"), (False, "the device is cpu")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagedserve.worker.model_runner"):
            llm = LLM(model=model_path, enforce_eager=enforce, device="cpu", max_model_len=128,
                      num_gpu_blocks_override=32, max_num_seqs=4)
        try:
            runner = llm.engine.executor.worker.runner
            assert llm.engine.config.enforce_eager is enforce
            assert not runner.graph_runner.use_graphs and runner.graph_runner.graphs == {}
            assert f"CUDA graphs off (decode runs eagerly): {reason}" in caplog.text
            out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                               use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4
        finally:
            llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_tokens_equal_eager(model_path):
    pytest.importorskip("triton")
    graphs, eager = make_runner(model_path, "cuda"), make_runner(model_path, "cuda", enforce_eager=True)
    assert sorted(graphs.graph_runner.graphs) == capture_sizes(MAX_SEQS) and not eager.graph_runner.graphs
    lg, shapes = record(graphs)
    le, _ = record(eager)
    drive([graphs, eager])
    replayed = [(rows, real) for rows, was_padded, real in shapes if was_padded]
    assert (4, 3) in replayed and (8, 5) in replayed
    for a, b in zip(lg, le):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
