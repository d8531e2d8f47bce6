"""KV-cache dtypes by name (vLLM's ``--kv-cache-dtype`` vocabulary) and what a token costs.

Pure arithmetic, so the scheduler-side tools (``pagedserve kv-size``, the benchmarks) and the
workers size the pool with the same formula. Quantised formats keep one 1-byte scale per
(token, KV head), for K and for V, next to the 1-byte values (the row's absmax as a UE5M3
code; kernels/kv_quant.py says why that byte):

    bytes/token/layer = 2 (K, V) x num_kv_heads x (head_dim x 1 + 1)      quantised
                      = 2 (K, V) x num_kv_heads x head_dim x model bytes    "auto"

Why per-(token, head) and not per-tensor (vLLM's floor): a row is quantised once, when its
token is written, from its own absmax, so there is no calibration pass and no scale that
has to be fixed before the first request; outliers in one token or head cost only that
row's resolution; and the bytes of a block are a pure function of the tokens written into
it, so prefix-cache sharing and recompute after preemption see the same bytes as before.
Per-block scales would need a block's rows re-quantised whenever a new token raises its
absmax. The price is 1 byte per 64-128 values: 0.8-1.5% of the quantised pool.
"""

from __future__ import annotations

# name -> canonical format; "fp8" means e4m3, as in vLLM.
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
                   "int8": "int8"}
QUANTIZED_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")
KV_SCALE_BYTES = 1  # one scale byte per (token, KV head) of K, and one of V


def canonical_kv_cache_dtype(name: str) -> str:
    """'auto', 'fp8_e4m3', 'fp8_e5m2' or 'int8'; ValueError for anything else."""
    try:
        return KV_CACHE_DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {name!r}.") from None


def is_quantized(name: str) -> bool:
    return canonical_kv_cache_dtype(name) in QUANTIZED_FORMATS


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                             model_dtype_bytes: int) -> int:
    """Bytes one token takes in the pool (all layers, K and V, scales included).
    ``num_kv_heads`` is per rank for a worker's shard, or the whole model's."""
    if is_quantized(kv_cache_dtype):
        per_row = head_dim + KV_SCALE_BYTES
    else:
        per_row = head_dim * model_dtype_bytes
    return 2 * num_layers * num_kv_heads * per_row


def kv_cache_scale_bytes_per_token(num_layers: int, num_kv_heads: int, kv_cache_dtype: str) -> int:
    """The part of ``kv_cache_bytes_per_token`` that is scales (0 for "auto")."""
    return 2 * num_layers * num_kv_heads * KV_SCALE_BYTES if is_quantized(kv_cache_dtype) else 0
