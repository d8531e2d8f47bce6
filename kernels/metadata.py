"""Per-step attention metadata: the tensors that describe one mixed batch.

Built once per step by the model runner and shared by every layer. Tensors live on
the model's device; the ``*_cpu`` lists are host copies so CPU code paths never sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token (-1: skip)
    block_table: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context length incl. this step's tokens
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: row offsets of each sequence in q
    max_seqlen_q: int
    max_seq_len: int
    num_decode_tokens: int = 0  # rows of sequences with query length 1 (they come first)
    seq_lens_cpu: list[int] | None = None
    # [num_groups + 1] int32 or None: decode rows [g[i], g[i+1]) are one sequence's (the
    # drafts a speculative step verifies), over the first one's block table; the CPU decode
    # kernel then reads that context once for all of them. None: every row its own.
    decode_row_groups: torch.Tensor | None = None
    query_lens_cpu: list[int] | None = None
    # A hybrid KV cache (scheduler/kv/kv_groups.py): per group of layers, this step's
    # metadata with that group's block table and slot mapping (the rest shared); a layer
    # reads its group's. None: one group, this metadata is every layer's.
    groups: tuple["AttentionMetadata", ...] | None = None
