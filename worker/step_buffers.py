"""StepBuffers: every step's input tensors, persistent and filled in place with numpy.

Why persistent: building Python lists and calling ``torch.tensor`` on each per step
allocates six tensors and, on CUDA, makes six synchronous host-to-device copies; and a
CUDA graph replays fixed addresses, so its inputs must live in buffers that outlive the
step. One set of buffers serves both: an eager step uses views of its first rows, a
graph step (cuda_graphs.py) the full shape that was captured.

Layout, identical on host and device; flat, so any ``[rows, width]`` view of the block
table is contiguous (the kernels want contiguous rows, and a narrow eager width keeps
the CPU decode kernel from copying the table):

    input_ids, positions, slot_mapping   [max_num_tokens]             int64
    seq_lens                             [max_num_seqs]               int32
    cu_seqlens_q                         [max_num_seqs + 1]           int32
    block_table                          [max_num_seqs * max_blocks]  int32, viewed [rows, width]

A decode-only step may be padded to ``pad_to`` rows (a captured graph's size). Padded
rows are harmless: token 0 at position 0, slot -1 (the cache write skips it), context
length 1 over block 0 (read, never written), and nobody samples them:

    rows:        [ d0 d1 d2 | pad ]        pad_to = 4
    slot_mapping [ 37 81 12 |  -1 ]
    seq_lens     [ 38 82 13 |   1 ]

A hybrid KV cache (``num_groups`` > 1, scheduler/kv/kv_groups.py) sends each request's
block ids interleaved by group ([g0 b0, g1 b0, ..., g0 b1, ...]); each group gets its own
block table and slot mapping (group 0's in the buffers above, the others' in
``block_table_g`` / ``slot_mapping_g``), and the metadata one per group (``groups``).

Host buffers are pinned when CUDA is available, so the copies to the device are
non-blocking DMA; on a CPU device the host buffers are the device tensors and nothing is
copied. A step with no sampled row never syncs with the device, so the next fill first
waits on an event recorded after this step's copies: the DMA must have read the pinned
pages before they are overwritten.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.kernels import AttentionMetadata

_FIELDS = (("input_ids", torch.int64, "tokens"), ("positions", torch.int64, "tokens"),
           ("slot_mapping", torch.int64, "tokens"), ("seq_lens", torch.int32, "seqs"),
           ("cu_seqlens_q", torch.int32, "seqs+1"), ("block_table", torch.int32, "table"))


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] views of the device buffers (padding included)
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    num_rows: int  # sequences in the batch, padding included
    padded: bool  # shaped like a captured graph: pad_to rows, the full block-table width


class StepBuffers:
    def __init__(self, *, max_num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, num_groups: int = 1) -> None:
        self.num_groups = num_groups
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.device = device
        sizes = {"tokens": max_num_tokens, "seqs": max_num_seqs, "seqs+1": max_num_seqs + 1,
                 "table": max_num_seqs * self.max_blocks_per_seq}
        on_cpu = device.type == "cpu"
        pin = not on_cpu and torch.cuda.is_available()
        # Normal tensors even when made under inference_mode: a later caller outside it
        # could not write into inference tensors.
        fields = _FIELDS + tuple((f"{name}_{g}", dtype, kind) for g in range(1, num_groups) for name, dtype, kind in
                                 (("slot_mapping", torch.int64, "tokens"), ("block_table", torch.int32, "table")))
        with torch.inference_mode(False):
            self.host = {name: torch.zeros(sizes[kind], dtype=dtype, pin_memory=pin) for name, dtype, kind in fields}
            self.dev = self.host if on_cpu else {
                name: torch.zeros(sizes[kind], dtype=dtype, device=device) for name, dtype, kind in fields}
        self.np = {name: t.numpy() for name, t in self.host.items()}
        self._copied: torch.cuda.Event | None = None

    # ---------------------------------------------------------------- views
    def views(self, num_rows: int, num_tokens: int, width: int) -> dict[str, torch.Tensor]:
        """Device views at offset 0 of every buffer: the same addresses every step."""
        d = self.dev
        v = dict(input_ids=d["input_ids"][:num_tokens], positions=d["positions"][:num_tokens],
                 slot_mapping=d["slot_mapping"][:num_tokens], seq_lens=d["seq_lens"][:num_rows],
                 cu_seqlens_q=d["cu_seqlens_q"][:num_rows + 1],
                 block_table=d["block_table"][:num_rows * width].view(num_rows, width))
        for g in range(1, self.num_groups):
            v[f"slot_mapping_{g}"] = d[f"slot_mapping_{g}"][:num_tokens]
            v[f"block_table_{g}"] = d[f"block_table_{g}"][:num_rows * width].view(num_rows, width)
        return v

    def _with_groups(self, md: AttentionMetadata, v: dict[str, torch.Tensor]) -> AttentionMetadata:
        """``md`` with one metadata per KV cache group (group 0: md's tables)."""
        if self.num_groups > 1:
            md.groups = (md, *(dataclasses.replace(md, slot_mapping=v[f"slot_mapping_{g}"],
                                                   block_table=v[f"block_table_{g}"], groups=None)
                               for g in range(1, self.num_groups)))
        return md

    def graph_metadata(self, num_rows: int) -> AttentionMetadata:
        """Metadata of a padded decode step of ``num_rows``, with no host values in it:
        inside a graph nothing may read the step's lengths on the host, so the longest
        context is bounded by ``max_model_len`` (the Triton kernel only uses it to choose
        KV splits; empty splits are skipped) and the host lists are absent."""
        v = self.views(num_rows, num_rows, self.max_blocks_per_seq)
        return self._with_groups(AttentionMetadata(
            slot_mapping=v["slot_mapping"], block_table=v["block_table"], seq_lens=v["seq_lens"],
            cu_seqlens_q=v["cu_seqlens_q"], max_seqlen_q=1, max_seq_len=self.max_model_len,
            num_decode_tokens=num_rows), v)

    # ---------------------------------------------------------------- fill
    def fill(self, input_ids: list[int], query_lens: list[int], starts: list[int], block_ids: list[list[int]],
             num_decode: int, pad_to: int | None = None, row_groups: list[int] | None = None) -> StepInputs:
        """One step's rows (decode rows first): the tokens to run, flattened; each row's
        query length, first position and block ids. ``pad_to``: a decode-only step padded
        to that many rows, at the full block-table width (the graph shapes).
        ``row_groups``: boundaries of decode rows that are one sequence's (AttentionMetadata)."""
        num_real, num_real_tokens = len(query_lens), len(input_ids)
        if pad_to is not None and (num_decode != num_real or pad_to < num_real):
            raise ValueError(f"only a decode-only step pads: {num_real} rows, {num_decode} decode, pad_to={pad_to}.")
        rows = num_real if pad_to is None else pad_to
        tokens = num_real_tokens + rows - num_real
        G = self.num_groups
        group_ids = [block_ids] if G == 1 else [[ids[g::G] for ids in block_ids] for g in range(G)]
        block_ids = group_ids[0]
        width = self.max_blocks_per_seq if pad_to is not None else max(map(len, block_ids))
        if rows > self.max_num_seqs or tokens > self.max_num_tokens or width > self.max_blocks_per_seq:
            raise ValueError(f"step of {rows} sequences, {tokens} tokens, {width} blocks per sequence exceeds the "
                             f"buffers ({self.max_num_seqs}, {self.max_num_tokens}, {self.max_blocks_per_seq}).")
        if self._copied is not None:
            self._copied.synchronize()
        h, bs = self.np, self.block_size
        q = np.asarray(query_lens, dtype=np.int64)
        start = np.asarray(starts, dtype=np.int64)
        seq_lens = h["seq_lens"][:rows]
        seq_lens[:num_real] = start + q
        seq_lens[num_real:] = 1
        cu = h["cu_seqlens_q"][:rows + 1]
        cu[0] = 0
        np.cumsum(q, out=cu[1:num_real + 1])
        cu[num_real + 1:] = np.arange(num_real_tokens + 1, tokens + 1)
        # Only the columns some row uses are written (and copied): at the graph width
        # (max_model_len / block_size) a full table would cost megabytes per step, and
        # attention never reads an entry past its row's context, so what earlier steps
        # left beyond them is harmless.
        used = max(map(len, block_ids), default=1)
        row_of = np.repeat(np.arange(num_real), q)  # the row of each real token
        pos = np.arange(num_real_tokens) - cu[row_of] + start[row_of]
        for g, ids_of_rows in enumerate(group_ids):
            suffix = f"_{g}" if g else ""
            table = h["block_table" + suffix][:rows * width].reshape(rows, width)
            table[:, :used] = 0  # rows of earlier steps, and the pad rows' block 0
            for i, blocks in enumerate(ids_of_rows):
                table[i, :len(blocks)] = blocks
            slots = h["slot_mapping" + suffix]
            slots[:num_real_tokens] = table[row_of, pos // bs].astype(np.int64) * bs + pos % bs
            slots[num_real_tokens:tokens] = -1
        h["positions"][:num_real_tokens] = pos
        h["input_ids"][:num_real_tokens] = input_ids
        for name, value in (("input_ids", 0), ("positions", 0)):
            h[name][num_real_tokens:tokens] = value
        self._to_device(rows, tokens, width, used)
        v = self.views(rows, tokens, width)
        padded = pad_to is not None
        md = self._with_groups(AttentionMetadata(
            slot_mapping=v["slot_mapping"], block_table=v["block_table"], seq_lens=v["seq_lens"],
            cu_seqlens_q=v["cu_seqlens_q"], max_seqlen_q=1 if padded else int(q.max()),
            max_seq_len=self.max_model_len if padded else int(seq_lens.max()),
            num_decode_tokens=num_decode + rows - num_real,
            seq_lens_cpu=seq_lens.tolist(), query_lens_cpu=np.diff(cu).tolist(),
            decode_row_groups=None if row_groups is None else torch.tensor(row_groups, dtype=torch.int32,
                                                                            device=self.device)), v)
        return StepInputs(v["input_ids"], v["positions"], md, rows, padded)

    def _to_device(self, rows: int, tokens: int, width: int, used: int) -> None:
        if self.dev is self.host:
            return
        counts = {"input_ids": tokens, "positions": tokens, "slot_mapping": tokens, "seq_lens": rows,
                  "cu_seqlens_q": rows + 1}
        counts.update({f"slot_mapping_{g}": tokens for g in range(1, self.num_groups)})
        for name, n in counts.items():
            self.dev[name][:n].copy_(self.host[name][:n], non_blocking=True)
        for name in ["block_table"] + [f"block_table_{g}" for g in range(1, self.num_groups)]:
            src, dst = (t[:rows * width].view(rows, width)[:, :used] for t in (self.host[name], self.dev[name]))
            dst.copy_(src, non_blocking=True)  # a strided 2-D copy when used < width
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
