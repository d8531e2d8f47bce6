"""Tensor parallelism on CPU: two spawned processes joined by gloo produce the logits
one process does, for a mixed paged batch (prefill of two prompts, then a decode step).
Covers column/row-parallel linears + all-reduce, the vocab-parallel embedding (odd vocab,
so one shard is padded), tied embeddings, qkv bias and the all-gathered LM head."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.worker.loading.loader import load_model
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from pagedserve.worker.loading.random_models import make_random_llama, make_test_model

BLOCK_SIZE = 4


def _metadata(rows):
    """rows: [(start, end, block_ids)] for sequences in this step, decode rows first."""
    slots, lens, cu = [], [], [0]
    for start, end, blocks in rows:
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
        lens.append(end)
        cu.append(cu[-1] + end - start)
    width = max(len(b) for _, _, b in rows)
    q_lens = [e - s for s, e, _ in rows]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.tensor([b + [0] * (width - len(b)) for _, _, b in rows], dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), max_seqlen_q=max(q_lens), max_seq_len=max(lens),
        num_decode_tokens=sum(q == 1 for q in q_lens), seq_lens_cpu=lens, query_lens_cpu=q_lens)


def run_two_steps(path: str, tp_size: int) -> torch.Tensor:
    """Prefill A (20 tokens) and B (7) in one step, then decode both; logits of both steps."""
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(cfg)
    kv_heads = cfg.get_num_kv_heads(tp_size)
    shape = (16, BLOCK_SIZE, kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(3, cfg.vocab_size, (21,), generator=g), torch.randint(3, cfg.vocab_size, (8,), generator=g)
    blocks_a, blocks_b = [9, 1, 14, 6, 3, 12], [2, 11]
    with torch.no_grad():
        md = _metadata([(0, 20, blocks_a), (0, 7, blocks_b)])
        h = model(torch.cat([a[:20], b[:7]]), torch.cat([torch.arange(20), torch.arange(7)]), caches, md)
        first = model.compute_logits(h)
        md = _metadata([(20, 21, blocks_a), (7, 8, blocks_b)])
        h = model(torch.stack([a[20], b[7]]), torch.tensor([20, 7]), caches, md)
        second = model.compute_logits(h)
    return torch.cat([first, second])


def _rank_main(rank: int, world_size: int, init_file: str, paths: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core box
    init_tensor_parallel(rank, world_size, f"file://{init_file}", backend="gloo")
    try:
        for i, path in enumerate(paths):
            logits = run_two_steps(path, world_size)
            torch.save(logits, os.path.join(out_dir, f"rank{rank}_{i}.pt"))
    finally:
        destroy_tensor_parallel()


def test_tp2_logits_equal_tp1(tmp_path, tmp_path_factory):
    paths = [make_test_model("llama-gqa4-hd128", tmp_path_factory.getbasetemp() / "ps-test-models"),
             make_random_llama(tmp_path / "qwen2-odd-vocab", "qwen2", tie_word_embeddings=True, vocab_size=509)]
    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), paths, str(tmp_path)), nprocs=2, join=True)
    for i, path in enumerate(paths):
        want = run_two_steps(path, 1)
        assert want.shape == (29, ModelConfig.from_pretrained(path).vocab_size)
        for rank in (0, 1):  # full vocabulary, identical on both ranks
            got = torch.load(os.path.join(tmp_path, f"rank{rank}_{i}.pt"))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
