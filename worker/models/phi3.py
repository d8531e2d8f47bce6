"""Phi-3 and Phi-3.5 (Phi3ForCausalLM): the Llama graph, with q/k/v and gate/up fused in the
checkpoint and LongRoPE frequency scaling. (Phi-4-mini's partial rotary embedding is
refused in model_config.py.)

    checkpoint                      here (per tensor-parallel rank)
    qkv_proj.weight  [q ; k ; v]    q_proj, k_proj, v_proj -> qkv_proj  [q_r ; k_r ; v_r]
    gate_up_proj.weight [gate ; up] gate_proj, up_proj     -> gate_up_proj [gate_r ; up_r]

A fused checkpoint tensor is cut into its parts by rows (lazily: each rank still reads
only its own heads or features) and handed on under the Llama names, so the loaders shard
each part as they shard Llama's: a rank's heads of q, of k and of v, not a third of the
fused rows. LongRoPE (short and long factor sets, a cos/sin scale) is in
worker/layers/rotary.py; model_config.py says which set an engine uses.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from pagedserve.worker.layers.linear import narrow_rows
from pagedserve.worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        parts = {".qkv_proj.": ((".q_proj.", 0, q), (".k_proj.", q, kv), (".v_proj.", q + kv, kv)),
                 ".gate_up_proj.": ((".gate_proj.", 0, cfg.intermediate_size),
                                    (".up_proj.", cfg.intermediate_size, cfg.intermediate_size))}
        for name, tensor in weights:
            fused = next((f for f in parts if f in name), None)
            if fused is None:
                yield name, tensor
                continue
            for part, start, size in parts[fused]:
                yield name.replace(fused, part), narrow_rows(tensor, start, size)
