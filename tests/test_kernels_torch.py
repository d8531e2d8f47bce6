"""The fast CPU attention path agrees with the slow oracle, row for row.

Every batch comes from loadtest.kernel_checks.paged_batch.make_paged_batch: shuffled block ids, NaN in
every cache slot no sequence owns (so a stray read shows up as NaN), and NaN in `out`
before the call (so a row the path forgets to write shows up too).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import (
    paged_attention,
    paged_attention_ref,
    resolve_attention_backend,
    write_kv_cache,
    write_kv_cache_ref,
)
from pagedserve.loadtest.kernel_checks.paged_batch import make_paged_batch

# (query_lens, seq_lens): decode rows first, as the model runner lays them out, then
# a whole-prompt prefill (q_len == seq_len), chunks with earlier context, a one-token
# sequence, and a decode row whose context ends exactly on a block boundary.
MIXED = (
    [1, 1, 1, 1, 1, 5, 7, 16, 3],
    [1, 33, 64, 130, 17, 18, 7, 16, 40],
)


def _check(batch, atol, rtol, **window_softcap):
    md = batch.attn_metadata
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, md.block_table, md.seq_lens,
                              md.cu_seqlens_q, batch.scale, **window_softcap)
    out = torch.full_like(batch.q, float("nan"))
    got = paged_attention(batch.q, batch.k_cache, batch.v_cache, md, batch.scale, backend="torch", out=out,
                          **window_softcap)
    assert got is out
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.fixture
def grouped_torch_decode(monkeypatch):
    """Decode rows through the grouped-gather torch path instead of the fused C++ loop."""
    from pagedserve.kernels import attention_torch

    monkeypatch.setattr(attention_torch, "decode_attention_cpu", lambda *args, **kwargs: False)


@pytest.fixture(params=["fused", "grouped"])
def decode_path(request):
    if request.param == "grouped":
        request.getfixturevalue("grouped_torch_decode")
    return request.param


def test_fused_cpu_decode_kernel_builds_and_is_used(monkeypatch):
    """g++ is on every machine of this project's kind: the fused loop must build, and the
    torch backend must route fp32 leading decode rows through it, then each prefill chunk as
    one row group (7 rows at the end of a 20-token context: causal from position 13)."""
    from pagedserve.kernels import attention_torch, cpu_decode_attention

    assert cpu_decode_attention.available()
    calls = []
    real = attention_torch.decode_attention_cpu
    monkeypatch.setattr(attention_torch, "decode_attention_cpu",
                        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    _check(make_paged_batch([1, 1, 1, 7], [40, 3, 333, 20], 12, 4, 64, 16, seed=21), atol=1e-5, rtol=1e-5)
    assert calls == [3, 7]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (12, 4), (8, 2), (16, 2)])  # GQA 1, 3, 4, 8
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_fp32_matches_reference(num_heads, num_kv_heads, head_dim, block_size, decode_path):
    batch = make_paged_batch(*MIXED, num_heads, num_kv_heads, head_dim, block_size,
                             seed=num_heads * 1000 + head_dim + block_size)
    _check(batch, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (8, 2, 32),    # the demo model's head_dim: two 16-lane chunks per row
    (6, 2, 128),   # eight chunks in registers
    (6, 2, 96),    # six chunks: the AVX-512 block that reads q and the accumulator from L1
    (32, 2, 64),   # 16 query heads per KV head: the widest group the 16-token block takes
    (64, 2, 64),   # 32 per KV head: the portable loop
    (10, 2, 80),   # head_dim not a multiple of 16: the AVX2 block, or the portable loop
    (6, 2, 36),    # nor of 8: the portable loop
])
def test_fused_decode_other_shapes_match_reference(num_heads, num_kv_heads, head_dim):
    """The AVX-512 blocks (head_dim % 16 == 0, <= 16 heads per KV head, block <= 16; q and
    the accumulator in registers at head_dim 32, 64 and 128), the AVX2 block (head_dim % 8
    == 0) and the portable loop, each where the others do not apply; tails of 1..15 tokens."""
    batch = make_paged_batch([1] * 5, [1, 15, 16, 17, 250], num_heads, num_kv_heads, head_dim, 16,
                             seed=head_dim * 100 + num_heads)
    _check(batch, atol=1e-5, rtol=1e-5)


@pytest.fixture(params=["fused", "grouped", "sdpa"])
def any_cpu_path(request, monkeypatch):
    """The fused C++ loop for decode rows and chunks; the grouped-gather decode; and with no
    C++ at all, chunks through SDPA or the explicit soft-capped softmax (_prefill_seq)."""
    from pagedserve.kernels import attention_torch

    if request.param != "fused":
        monkeypatch.setattr(attention_torch, "decode_attention_cpu", lambda *args, **kwargs: False)
    return request.param


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (6, 2, 24), (4, 4, 32)])
def test_sliding_window_and_softcap_match_reference(window, softcap, num_heads, num_kv_heads, head_dim,
                                                    any_cpu_path):
    """Gemma's local layers (a row sees its W newest keys) and Gemma 2's soft-capped scores,
    on every CPU path: decode rows, whole prompts and chunks whose rows start their windows
    in different blocks. The blocks no row's window reaches are NaN (a hybrid KV cache freed
    them): reading one poisons the output."""
    batch = make_paged_batch([1, 1, 1, 1, 5, 7, 16, 3, 40], [1, 33, 64, 130, 18, 7, 16, 40, 100], num_heads,
                             num_kv_heads, head_dim, 16, seed=window * 31 + head_dim, sliding_window=window)
    _check(batch, atol=1e-5, rtol=1e-5, sliding_window=window, softcap=softcap)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
def test_sliding_window_over_a_quantised_cache(kv_dtype, decode_path):
    batch = make_paged_batch([1, 1, 5, 40], [33, 130, 18, 100], 4, 2, 64, 16, seed=3, sliding_window=17,
                             kv_dtype=kv_dtype)
    md = batch.attn_metadata
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, md.block_table, md.seq_lens,
                              md.cu_seqlens_q, batch.scale, k_scale=batch.k_scale, v_scale=batch.v_scale,
                              sliding_window=17)
    got = paged_attention(batch.q, batch.k_cache, batch.v_cache, md, batch.scale, "torch", None, batch.k_scale,
                          batch.v_scale, sliding_window=17)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_sliding_window_half_precision():
    batch = make_paged_batch([1, 1, 5, 40], [33, 130, 18, 100], 8, 2, 64, 16, dtype=torch.bfloat16, seed=8,
                             sliding_window=24)
    _check(batch, atol=2e-2, rtol=2e-2, sliding_window=24, softcap=30.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_half_precision(dtype):
    batch = make_paged_batch(*MIXED, 8, 2, 64, 16, dtype=dtype, seed=7)
    _check(batch, atol=2e-2, rtol=2e-2)
    assert batch.q.dtype == dtype


def test_decode_groups_with_very_different_lengths():
    # 40 decode rows from 1 to 1000 tokens: several length groups, padding inside each.
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 1001, (40,), generator=gen).tolist()
    batch = make_paged_batch([1] * 40, lens, 12, 4, 64, 16, seed=11)
    _check(batch, atol=1e-5, rtol=1e-5)


def test_decode_rows_anywhere_and_no_host_lists():
    # Decode rows between prefill chunks, and metadata without the *_cpu host lists.
    batch = make_paged_batch([3, 1, 4, 1], [3, 50, 20, 9], 8, 4, 64, 16, seed=5)
    batch.attn_metadata.seq_lens_cpu = None
    batch.attn_metadata.query_lens_cpu = None
    batch.attn_metadata.num_decode_tokens = 0
    _check(batch, atol=1e-5, rtol=1e-5)


def test_q_as_a_view_of_fused_qkv():
    # The model splits q out of one qkv projection: rows are strided, not contiguous.
    batch = make_paged_batch([1, 1, 6], [40, 9, 30], 8, 2, 64, 16, seed=21)
    qkv = torch.randn(batch.q.shape[0], (8 + 2 * 2) * 64)
    qkv[:, :8 * 64] = batch.q.reshape(-1, 8 * 64)
    batch.q = qkv[:, :8 * 64].view(-1, 8, 64)
    assert not batch.q.is_contiguous()
    _check(batch, atol=1e-5, rtol=1e-5)


def test_cpu_cache_write_equals_the_reference():
    """The C++ K/V write (write_kv_cpu, the torch backend's path on CPU) against torch's
    index_copy_: rows taken from a fused qkv (strided), slots across blocks, a skipped
    slot (-1) left untouched, a slot past the cache refused."""
    from pagedserve.kernels import cpu_decode_attention
    from pagedserve.kernels.attention_ref import write_kv_cache_ref

    assert cpu_decode_attention.available()
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, (9 + 2 * 3) * 64, generator=gen)
    k, v = qkv[:, 9 * 64:12 * 64].view(5, 3, 64), qkv[:, 12 * 64:].view(5, 3, 64)
    slots = torch.tensor([17, 31, -1, 32, 0])
    caches = [torch.randn(4, 16, 3, 64, generator=gen) for _ in range(2)]
    want = [c.clone() for c in caches]
    write_kv_cache_ref(k, v, *want, slots)
    write_kv_cache(k, v, *caches, slots)  # backend "torch": the C++ write
    torch.testing.assert_close(caches, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="past the cache"):
        write_kv_cache(k, v, *caches, torch.tensor([0, 1, 2, 3, 64]))


def test_write_then_attend_equals_reference_flow():
    """write_kv_cache puts this step's K/V where the metadata says attention reads them."""
    batch = make_paged_batch([1, 1, 6], [9, 40, 30], 8, 2, 64, 16, seed=9)
    md = batch.attn_metadata
    num_tokens = batch.q.shape[0]
    key = torch.randn(num_tokens, 2, 64)
    value = torch.randn(num_tokens, 2, 64)
    slots = md.slot_mapping.clone()
    slots[-1] = -1  # a skipped row (e.g. padding) must not be written
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)
    write_kv_cache(key, value, batch.k_cache, batch.v_cache, slots, backend="torch")
    torch.testing.assert_close(batch.k_cache, k_ref, equal_nan=True)
    flat_k = batch.k_cache.view(-1, 2, 64)
    torch.testing.assert_close(flat_k[slots[:-1]], key[:-1])
    assert not torch.equal(flat_k[md.slot_mapping[-1]], key[-1])
    _check(batch, atol=1e-5, rtol=1e-5)


def test_layers_of_one_step_share_the_plan(grouped_torch_decode):
    """The index plan is built by the first layer and reused by the next (same metadata)."""
    from pagedserve.kernels import attention_torch

    batch = make_paged_batch([1, 1, 1, 4], [300, 17, 90, 30], 12, 4, 64, 16, seed=13)
    layer2 = (batch.k_cache * -1.3, batch.v_cache + 0.7)  # NaN stays NaN in unowned slots
    _check(batch, atol=1e-5, rtol=1e-5)
    plan = attention_torch._PLAN
    batch.k_cache, batch.v_cache = layer2
    _check(batch, atol=1e-5, rtol=1e-5)
    assert attention_torch._PLAN is plan
    # A new step (new metadata object, other lengths) gets a new plan.
    _check(make_paged_batch([1, 1], [5, 6], 12, 4, 64, 16, seed=14), atol=1e-5, rtol=1e-5)
    assert attention_torch._PLAN is not plan


def test_resolve_backend():
    assert resolve_attention_backend("auto", "cpu") == "torch"
    assert resolve_attention_backend("triton", "cpu") == "triton"
    with pytest.raises(ValueError, match="attention backend"):
        resolve_attention_backend("flash", "cpu")


def test_workspace_made_in_inference_mode_is_usable_outside_it(grouped_torch_decode):
    """The engine runs under inference_mode; a later caller outside it must still work."""
    from pagedserve.kernels import attention_torch

    attention_torch._WORKSPACE.clear()
    batch = make_paged_batch([1, 1, 3], [50, 9, 12], 8, 2, 64, 16, seed=31)
    with torch.inference_mode():
        _check(batch, atol=1e-5, rtol=1e-5)
    _check(make_paged_batch([1, 1, 3], [51, 9, 12], 8, 2, 64, 16, seed=32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("alone", [False, True])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (10, 2, 80)])
def test_rows_of_one_sequence_read_its_context_once(num_heads, num_kv_heads, head_dim, alone):
    """Speculative decoding's verify rows: k + 1 decode rows over one block table with
    lengths L-k .. L (row_groups), between ordinary decode rows; each row attends up to its
    own length: rows 30 and 31 end before the block that rows 32..34 reach into. ``alone``:
    the group is the whole step (batch 1), fewer items than threads, so the kernel splits
    its rows into parts (4 threads: 2 or 3 parts of 1-2 rows)."""
    import dataclasses

    from pagedserve.kernels import attention_torch, cpu_decode_attention

    assert cpu_decode_attention.available()
    base = make_paged_batch([1, 1, 1], [300, 41, 17], num_heads, num_kv_heads, head_dim, 16, seed=head_dim)
    md = base.attn_metadata
    if alone:  # rows: [seq 1 at 30 .. 34]; groups [0, 5]
        src, lens, groups = [1] * 5, [30, 31, 32, 33, 34], [0, 5]
    else:  # rows: [seq 0] [seq 1 at 30 .. 34] [seq 2]; groups [0, 1, 6, 7]
        src, lens, groups = [0, 1, 1, 1, 1, 1, 2], [300, 30, 31, 32, 33, 34, 17], [0, 1, 6, 7]
    q = torch.randn(len(src), num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    block_table = md.block_table[src].contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.arange(len(src) + 1, dtype=torch.int32)
    ref = paged_attention_ref(q, base.k_cache, base.v_cache, block_table, seq_lens, cu, base.scale)
    grouped = dataclasses.replace(md, block_table=block_table, seq_lens=seq_lens, cu_seqlens_q=cu,
                                  num_decode_tokens=len(src), max_seq_len=300, seq_lens_cpu=lens,
                                  query_lens_cpu=[1] * len(src),
                                  decode_row_groups=torch.tensor(groups, dtype=torch.int32))
    out = torch.full_like(q, float("nan"))
    calls = []
    real, threads = attention_torch.decode_attention_cpu, torch.get_num_threads()
    attention_torch.decode_attention_cpu = lambda *a, **k: calls.append(a[-1]) or real(*a, **k)
    torch.set_num_threads(4)
    try:
        got = paged_attention(q, base.k_cache, base.v_cache, grouped, base.scale, backend="torch", out=out)
    finally:
        attention_torch.decode_attention_cpu = real
        torch.set_num_threads(threads)
    assert calls and calls[0] is grouped.decode_row_groups  # the fused kernel took the groups
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # Greedy speculation equals plain decoding only if a verify row's attention is the same
    # bits as that row's alone (a plain step's one row per sequence).
    for i in range(len(src)):
        alone_out = torch.empty_like(q[i:i + 1])
        assert cpu_decode_attention.decode_attention_cpu(q[i:i + 1], base.k_cache, base.v_cache, block_table[i:i + 1],
                                                         seq_lens[i:i + 1], base.scale, alone_out)
        assert torch.equal(alone_out, got[i:i + 1]), i
