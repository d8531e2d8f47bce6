"""What the KV cache of an engine holds, said once at start-up (the log line, and the dict
that ``info()`` and the KV-sizing gauges of /metrics carry): bytes per token per TP rank,
scales included (the same formula the workers divide their memory budget by), blocks,
tokens, and how many sequences of max_model_len fit. A hybrid KV cache (sliding-window and
full layers, scheduler/kv/kv_groups.py): a block holds one group's layers, so the bytes are
per token of a block (group_size layers), and a sequence takes a block per group and
logical block, its sliding groups only the blocks their window reaches."""

from __future__ import annotations

import logging

from pagedserve.scheduler.kv.kv_cache_dtype import kv_cache_bytes_per_token, kv_cache_scale_bytes_per_token

logger = logging.getLogger("pagedserve")


def log_kv_sizing(config, model_config, num_gpu_blocks: int, max_model_len: int) -> dict:
    mc, kv_dtype = model_config, config.kv_cache_dtype
    heads = mc.get_num_kv_heads(config.tensor_parallel_size)
    groups = mc.kv_cache_groups(config.kv_allocation)
    layers = mc.num_hidden_layers if groups is None else groups.group_size
    per_token = kv_cache_bytes_per_token(layers, heads, mc.head_dim, kv_dtype, mc.dtype.itemsize)
    scale_bytes = kv_cache_scale_bytes_per_token(layers, heads, kv_dtype)
    tokens = num_gpu_blocks * config.block_size
    per_seq = (-(-max_model_len // config.block_size) if groups is None else
               groups.blocks_per_request(max_model_len, config.block_size))  # blocks of one full sequence
    info = {
        "kv_cache_dtype": kv_dtype,
        "kv_bytes_per_token_per_rank": per_token,
        "kv_scale_bytes_per_token_per_rank": scale_bytes,
        "num_blocks": num_gpu_blocks,
        "block_size": config.block_size,
        "num_tokens": tokens,
        "kv_gib_per_rank": per_token * tokens / 2**30,
        "max_model_len": max_model_len,
        "max_concurrency_at_max_model_len": num_gpu_blocks / per_seq if groups else tokens / max_model_len,
    }
    if groups is not None:
        info["kv_groups"] = [f"{'full' if w is None else f'sliding {w}'}: {len(ls)} layers"
                             for w, ls in zip(groups.windows, groups.layers)]
        logger.info("Hybrid KV cache: %d groups of %d layers (%s); a block holds one group's layers",
                    groups.num_groups, groups.group_size, ", ".join(info["kv_groups"]))
    logger.info(
        "KV cache %s: %d B/token/rank (%d of them scales), %d blocks x %d tokens = %d tokens (%.3f GiB/rank); "
        "%.1f sequences of max_model_len=%d fit", kv_dtype, per_token, scale_bytes, num_gpu_blocks,
        config.block_size, tokens, info["kv_gib_per_rank"], info["max_concurrency_at_max_model_len"],
        max_model_len)
    return info
