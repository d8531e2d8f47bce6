"""KV cache groups: which layers share a block table (vLLM V1's hybrid KV cache layout).

A model whose layers all attend to every key (Llama, Qwen, ...) has one group: every layer
reads the request's one block table, and a block holds every layer's K/V of its tokens.
A model that interleaves sliding-window layers with full ones (Gemma 2 / 3) gets groups of
``group_size`` layers of one attention type each, full groups first:

    Gemma 3, 26 layers (22 local, window W; 4 global), group_size 4:
      group 0  full     layers 5 11 17 23        block table: every block of the context
      group 1  sliding  layers 0 1 2 3           block table: blocks before the window freed
      ...
      group 6  sliding  layers 24 25 (2 of 4 slots used)

The pool holds ``group_size`` K/V tensors of ``num_blocks`` blocks each; a block id taken
by group g holds, in tensor j, the K/V of group g's j-th layer. So a block is
``group_size`` layers' worth, blocks are shared by every group from one free queue, and a
sliding group's request needs only the blocks its window can still reach: at long context
the local layers hold a fixed number of blocks each, the global ones grow.

group_size follows vLLM: the smaller type's layer count, or the larger's when the two are
within 25% (then each type fits one group and no slot is left empty).

Pure Python: the scheduler (scheduler/kv/hybrid.py) and the workers (the KV tensors, the
per-group block tables) both derive the same groups from the model's layer types.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class KVCacheGroups:
    group_size: int  # layers per group: the K/V tensors the pool holds
    windows: tuple[int | None, ...]  # per group: its sliding window, None for full attention
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, in order

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def layer_group(self, layer: int) -> int:
        return next(g for g, ls in enumerate(self.layers) if layer in ls)

    def layer_slot(self, layer: int) -> int:
        """The pool tensor holding ``layer``'s K/V: its place in its group."""
        return self.layers[self.layer_group(layer)].index(layer)

    def blocks_per_request(self, num_tokens: int, block_size: int, max_chunk: int = 0) -> int:
        """Blocks one request of ``num_tokens`` holds at most, its last chunk of up to
        ``max_chunk`` tokens included (a chunk holds its whole span in every group)."""
        logical = -(-num_tokens // block_size)
        total = 0
        for window in self.windows:
            if window is None:
                total += logical
            else:  # the last chunk's rows reach back window - 1 keys from its first row
                total += min(logical, -(-(window - 1 + max(max_chunk, 1)) // block_size) + 1)
        return total


def kv_cache_groups(layer_types: tuple[str, ...] | list[str], sliding_window: int | None,
                    kv_allocation: str = "paged", max_model_len: int | None = None,
                    block_size: int = 16) -> KVCacheGroups | None:
    """The groups of a model with sliding layers, or None: one group, every layer keeps
    every block (no sliding layer, no window, the contiguous baseline, or a ``max_model_len``
    so short that the groups' idle slots cost more than the window saves). A model whose
    every layer slides (Mistral's window) gets one sliding group of all its layers."""
    full = tuple(i for i, t in enumerate(layer_types) if t != SLIDING_ATTENTION)
    sliding = tuple(i for i, t in enumerate(layer_types) if t == SLIDING_ATTENTION)
    if not sliding or not sliding_window or kv_allocation != "paged":
        return None
    small, large = sorted((len(full), len(sliding)))
    size = large if large < small * 1.25 or not small else small  # every layer sliding: one group
    windows: list[int | None] = []
    layers: list[tuple[int, ...]] = []
    for kind, members in ((None, full), (sliding_window, sliding)):
        for start in range(0, len(members), size):
            windows.append(kind)
            layers.append(members[start:start + size])
    groups = KVCacheGroups(size, tuple(windows), tuple(layers))
    if max_model_len is not None and (groups.blocks_per_request(max_model_len, block_size) * size
                                      >= len(layer_types) * -(-max_model_len // block_size)):
        return None
    return groups
