"""Quantised KV cache: the formats, and the torch quantise / dequantise every path agrees with.

A quantised layer cache is four tensors (the format is the value cache's torch dtype):

    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]  float8_e4m3fn | float8_e5m2 | int8
    k_scale, v_scale  [num_blocks, block_size, num_kv_heads]            uint8 (UE5M3 absmax codes)

    x[slot, h, :]  ~=  float(q[slot, h, :]) * scale[slot, h],   scale = absmax(code) / QMAX

One byte per (token, KV head) holds that row's absmax, set when the token is written
(scheduler/kv/kv_cache_dtype.py says why this layout), rounded *up* to four significant bits:
an unsigned float with a 5-bit exponent and 3 mantissa bits (UE5M3, like NVFP4's UE4M3 block
scales) covering 2^-15 .. 114,688, code 255 = NaN. The row's scale is that absmax times
``1/QMAX`` in fp32, so ``|x| / scale <= QMAX`` up to the division's last bit (clamped: nothing
is clipped), and values ``x / scale`` round to nearest even on the format's grid. Why this byte:
* It is one byte, not two: 1.5% more blocks than a bf16 scale at head_dim 64 (1.97x bf16's
  blocks instead of 1.94x), for every format.
* Four significant bits, not a power of two (OCP's E8M0): int8's error is absolute, half a
  step of scale, and the step grows by at most 9/8 here (a little more RMS error on Gaussian
  rows than with a bf16 scale) where a power of two makes it up to 2x (much more). For fp8
  either byte costs about the same small RMS increase: the row's absmax no longer lands
  exactly on QMAX, so the largest value rounds too (a small rise in mean |dlogprob| on a real
  model).
* Encoding is integer arithmetic on fp32 bits (carry into the top 3 mantissa bits, truncate,
  rebias), decoding is placing the byte's bits in fp32's exponent and mantissa fields: the
  same bytes from torch, the Triton write and the C++ loop, and no table.
A row whose absmax is below 2^-15 (3e-5) is quantised as if it were 2^-15 (int8: absolute
error up to 2^-16 / 127); a row above 114,688, beyond fp16's range, is clipped there.
Attention applies the scales to scores and probabilities, not to every element:
``q . (s_k k) = s_k (q . k)`` and ``sum_t p_t s_v,t v_t``.
"""

from __future__ import annotations

import torch

# kv_cache_dtype name (canonical, see scheduler/kv/kv_cache_dtype.py) -> storage dtype
KV_QUANT_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
QUANT_DTYPES = tuple(KV_QUANT_DTYPES.values())
# Largest magnitude each format stores: e4m3fn 448 (no inf), e5m2 57344, int8 127 (-128 unused:
# a symmetric grid keeps -x and x the same distance from zero).
QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
# The scale byte (UE5M3): code c < 255 is the absmax 2^((c >> 3) - 15) x (1 + (c & 7) / 8), i.e. fp32
# bits ((c + AMAX_CODE_BIAS) << 20); 255 is NaN (a NaN row stays poisoned in every path).
SCALE_DTYPE = torch.uint8
AMAX_MIN_EXP = -15  # code 0 is the absmax 2^-15
AMAX_MIN = 2.0 ** AMAX_MIN_EXP
AMAX_CODE_BIAS = (127 + AMAX_MIN_EXP) << 3  # fp32 bits >> 20 of AMAX_MIN
SCALE_NAN = 255
# 1 / QMAX rounded to fp32 once, so every path multiplies by the same number
INV_QMAX = {dt: float(torch.tensor(1.0 / q, dtype=torch.float32)) for dt, q in QMAX.items()}

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
    """x [..., head_dim] -> (values [..., head_dim] of ``dtype``, absmax codes [...] uint8)."""
    qmax = QMAX[dtype]
    xf = x.float()
    codes = encode_amax(xf.abs().amax(dim=-1))
    # scale ~ absmax / qmax, so only the division's last-bit rounding can pass qmax (e4m3fn has
    # no inf: 448 + 1 ulp would cast to NaN).
    y = (xf / row_scales(codes, dtype).unsqueeze(-1)).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = y.round()
    return y.to(dtype), codes


def encode_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 absmax -> the smallest UE5M3 code whose value is >= it (floored at 2^-15, saturated at
    114,688, NaN -> 255): add the carry into fp32's top 3 mantissa bits, keep exponent and those
    bits (bits >> 20), rebias."""
    a = amax.float().clamp_min(AMAX_MIN)
    bits = (a.contiguous().view(torch.int32) + 0xFFFFF) >> 20
    codes = (bits - AMAX_CODE_BIAS).clamp(0, SCALE_NAN - 1)
    return codes.masked_fill(torch.isnan(a), SCALE_NAN).to(SCALE_DTYPE)


def decode_amax(codes: torch.Tensor) -> torch.Tensor:
    """UE5M3 codes -> their absmax values, fp32 (255 -> NaN)."""
    c = codes.to(torch.int32)
    a = ((c + AMAX_CODE_BIAS) << 20).view(torch.float32)
    return a.masked_fill(c == SCALE_NAN, float("nan"))


def row_scales(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes -> each row's fp32 scale, absmax x (1 / QMAX), as every kernel computes it."""
    return decode_amax(codes) * INV_QMAX[dtype]


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(values [..., head_dim], absmax codes [...]) -> [..., head_dim] in ``dtype``."""
    return (values.float() * row_scales(scales, values.dtype).unsqueeze(-1)).to(dtype)


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
            raise ValueError(f"{name} must be a contiguous {SCALE_DTYPE} tensor (UE5M3 absmax codes) {list(want)} "
                             f"on {k_cache.device}; "
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
