"""Vocabulary-parallel token embedding and LM head.

The vocabulary is split into ``tp`` contiguous shards of ``ceil(vocab / tp)`` rows
(the last one zero-padded):

    rank 0: ids [0, S)    rank 1: ids [S, 2S)   ...   S = ceil(vocab_size / tp)

Embedding: each rank looks up the ids it owns, writes zeros for the others, and an
all-reduce sums the shards. LM head: each rank computes logits for its shard, an
all-gather concatenates them and the padding columns are cut off, so every rank ends
with the full ``[n, vocab_size]`` logits.

With ``--quantization gguf`` the table stays in GGUF blocks (worker/layers/quantized.py): the
lookup dequantizes the rows it gathers, and the LM head (tied or not) runs the GGUF GEMM.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.cpu_gguf import dequantize_rows
from pagedserve.kernels.cpu_linear import Alloc, cpu_linear, pack_cpu_weight
from pagedserve.worker.layers.linear import copy_checked, loaded_shape, read_shard
from pagedserve.worker.layers.quantized import take_quant
from pagedserve.worker.parallel_state import (get_tp_rank, get_tp_size, tensor_model_parallel_all_gather,
                                   tensor_model_parallel_all_reduce)


class VocabParallelEmbedding(nn.Module):
    _quant = None  # a GGUFWeight: the table in GGUF blocks (quantize_with)

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim, dtype=params_dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rows = loaded_shape(loaded)[0]
        if rows != self.num_embeddings:
            raise ValueError(f"embedding has {rows} rows in the checkpoint, config says vocab_size "
                             f"{self.num_embeddings}.")
        n = self.vocab_end - self.vocab_start
        shard = read_shard(loaded, 0, self.vocab_start, n)
        if take_quant(self, param, 0, shard, "vocab shard"):
            return  # the padding rows are zero blocks (QuantShards.pack)
        copy_checked(param.data[:n], shard, "vocab shard")
        param.data[n:].zero_()

    def quantize_with(self, w) -> None:
        self._quant = w

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self._quant is None:
            return F.embedding(ids, self.weight)
        rows = dequantize_rows(self._quant, ids)
        return rows.view(*ids.shape, rows.shape[-1]).to(self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = self._lookup(local).masked_fill_(outside.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = h W^T over this rank's vocab shard, gathered to the full vocabulary."""

    _packed = None  # pack_cpu_weight(W, backend), or a GGUFWeight

    def quantize_with(self, w) -> None:
        self._packed = w  # the logits' GEMM; a tied table's lookup stays the embedding's

    def pack_for_cpu(self, backend: str = "onednn", alloc: Alloc | None = None) -> None:
        # The plain weight stays: with tied embeddings it is also the embedding table.
        self._packed = pack_cpu_weight(self.weight.data, backend, alloc)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            logits = cpu_linear(hidden_states, self._packed)
        else:
            logits = F.linear(hidden_states, self.weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[:, : self.num_embeddings]
        return logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding lookup; call compute_logits.")
