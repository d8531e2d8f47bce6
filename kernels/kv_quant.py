"""Quantised KV cache: the formats, and the torch quantise / dequantise every path agrees with.

A quantised layer cache is four tensors (the format is the value cache's torch dtype):

    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]  float8_e4m3fn | float8_e5m2 | int8
    k_scale, v_scale  [num_blocks, block_size, num_kv_heads]            bfloat16

    x[slot, h, :]  ~=  float(q[slot, h, :]) * float(scale[slot, h])

One scale per (token, KV head), set from that row's absmax when the token is written
(scheduler/kv_cache_dtype.py says why this layout). A row's scale is ``absmax / QMAX``
rounded *up* to bf16 (floored at 2^-126 so an all-zero row divides by something): bf16
because fp16's range ends too soon (an e5m2 row of absmax < 3.5 would need a subnormal fp16
scale, and lose its precision), up so that ``|x| / scale <= QMAX`` and nothing is clipped;
the grid is at most 2^-8 coarser for it. Values ``x / scale`` round to nearest even. Attention applies
the scales to scores and probabilities, not to every element:
``q . (s_k k) = s_k (q . k)`` and ``sum_t p_t s_v,t v_t``.
"""

from __future__ import annotations

import torch

# kv_cache_dtype name (canonical, see scheduler/kv_cache_dtype.py) -> storage dtype
KV_QUANT_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
QUANT_DTYPES = tuple(KV_QUANT_DTYPES.values())
# Largest magnitude each format stores: e4m3fn 448 (no inf), e5m2 57344, int8 127 (-128 unused:
# a symmetric grid keeps -x and x the same distance from zero).
QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
SCALE_DTYPE = torch.bfloat16
MIN_SCALE = 2.0 ** -126  # the smallest normal: no denormal arithmetic anywhere

_ALIASES = {"fp8": "fp8_e4m3"}


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANT_DTYPES


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of a cache: the model's for "auto", else the quantised format's."""
    name = _ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name == "auto":
        return model_dtype
    if name not in KV_QUANT_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or one of {sorted(KV_QUANT_DTYPES)}, got "
                         f"{kv_cache_dtype!r}.")
    return KV_QUANT_DTYPES[name]


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (values [..., head_dim] of ``dtype``, scales [...] bf16)."""
    qmax = QMAX[dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = round_up_bf16((amax / qmax).clamp_min(MIN_SCALE))
    # scale >= absmax / qmax, so only the division's last-bit rounding can pass qmax (e4m3fn has
    # no inf: 448 + 1 ulp would cast to NaN).
    y = (xf / scale.float().unsqueeze(-1)).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = y.round()
    return y.to(dtype), scale


def round_up_bf16(s: torch.Tensor) -> torch.Tensor:
    """Positive fp32 -> the smallest bf16 >= it (bf16 is fp32's top 16 bits: carry, then truncate)."""
    bits = s.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -65536).view(torch.float32).to(SCALE_DTYPE)


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(values [..., head_dim], scales [...]) -> [..., head_dim] in ``dtype``."""
    return (values.float() * scales.float().unsqueeze(-1)).to(dtype)


def check_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> bool:
    """True for a quantised cache with well-formed scales, False for a plain one; else ValueError."""
    if not is_quantized(k_cache):
        if is_quantized(v_cache) or k_scale is not None or v_scale is not None:
            raise ValueError(f"scales go with a quantised cache ({QUANT_DTYPES}); got k_cache {k_cache.dtype}, "
                             f"v_cache {v_cache.dtype}.")
        return False
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache formats differ: {k_cache.dtype} vs {v_cache.dtype}.")
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_cache.dtype} cache needs k_scale and v_scale.")
    want = tuple(k_cache.shape[:3])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(s.shape) != want or s.dtype != SCALE_DTYPE or not s.is_contiguous() or s.device != k_cache.device:
            raise ValueError(f"{name} must be a contiguous {SCALE_DTYPE} tensor {list(want)} on {k_cache.device}; "
                             f"got {s.dtype} {list(s.shape)} on {s.device}.")
    return True


def check_fp8_device(dtype: torch.dtype, device: torch.device) -> None:
    """Triton's fp8 e4m3 type (fp8e4nv) needs sm_89+ (Ada, Hopper); say so before compiling.
    e5m2 and int8 load and convert on every architecture Triton supports."""
    if dtype == torch.float8_e4m3fn and torch.device(device).type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise RuntimeError(f"--kv-cache-dtype fp8 (e4m3) needs a GPU of compute capability 8.9+ "
                               f"(Ada/Hopper); this one is {major}.{minor}. Use fp8_e5m2 or int8.")
