"""What the KV cache of an engine holds, said once at start-up (the log line, and the dict
that ``info()`` and the KV-sizing gauges of /metrics carry): bytes per token per TP rank,
scales included (the same formula the workers divide their memory budget by), blocks,
tokens, and how many sequences of max_model_len fit."""

from __future__ import annotations

import logging

from pagedserve.scheduler.kv.kv_cache_dtype import kv_cache_bytes_per_token, kv_cache_scale_bytes_per_token

logger = logging.getLogger("pagedserve")


def log_kv_sizing(config, model_config, num_gpu_blocks: int, max_model_len: int) -> dict:
    mc, kv_dtype = model_config, config.kv_cache_dtype
    heads = mc.get_num_kv_heads(config.tensor_parallel_size)
    per_token = kv_cache_bytes_per_token(mc.num_hidden_layers, heads, mc.head_dim, kv_dtype, mc.dtype.itemsize)
    scale_bytes = kv_cache_scale_bytes_per_token(mc.num_hidden_layers, heads, kv_dtype)
    tokens = num_gpu_blocks * config.block_size
    info = {
        "kv_cache_dtype": kv_dtype,
        "kv_bytes_per_token_per_rank": per_token,
        "kv_scale_bytes_per_token_per_rank": scale_bytes,
        "num_blocks": num_gpu_blocks,
        "block_size": config.block_size,
        "num_tokens": tokens,
        "kv_gib_per_rank": per_token * tokens / 2**30,
        "max_model_len": max_model_len,
        "max_concurrency_at_max_model_len": tokens / max_model_len,
    }
    logger.info(
        "KV cache %s: %d B/token/rank (%d of them scales), %d blocks x %d tokens = %d tokens (%.3f GiB/rank); "
        "%.1f sequences of max_model_len=%d fit", kv_dtype, per_token, scale_bytes, num_gpu_blocks,
        config.block_size, tokens, info["kv_gib_per_rank"], info["max_concurrency_at_max_model_len"],
        max_model_len)
    return info
