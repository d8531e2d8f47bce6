"""KV-cache write in Triton: this step's K/V rows into their slots, quantised when asked.

    slot = block_id * block_size + offset   (slot_mapping[t] < 0: row t is skipped,
                                             e.g. padding of a captured batch)

One program per token copies its [num_kv_heads, head_dim] K and V rows; the block
offset is computed in int64 because block_id * stride_blk overflows int32 in large pools.

Quantised caches (kv_quant.py): each (token, head) row's absmax is rounded up to its UE5M3
code (integer ops on the fp32 bits, as torch's encode_amax), its scale is that absmax times
1 / QMAX, and its values x / scale, clamped to +-QMAX, are rounded to the format's grid in fp32
before the cast (round to nearest even, as torch's cast does), so the bytes equal the torch
reference's whatever rounding mode this Triton's fp8 cast uses.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.kv_quant import (AMAX_CODE_BIAS, AMAX_MIN, INV_QMAX, QMAX, SCALE_NAN, check_fp8_device,
                                         check_scales)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# QUANT codes (a tl.constexpr): 0 plain copy, 1 fp8 e4m3fn, 2 fp8 e5m2, 3 int8
_QUANT = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.int8: 3}

if triton is not None:
    # kv_quant's scale-code constants, as compile-time constants of the kernels
    _AMAX_CODE_BIAS = tl.constexpr(AMAX_CODE_BIAS)
    _SCALE_NAN = tl.constexpr(SCALE_NAN)
    _AMAX_MIN = tl.constexpr(AMAX_MIN)

    @triton.jit
    def _to_grid(y, QUANT: tl.constexpr):
        """fp32 y (|y| <= QMAX) rounded to nearest even on the format's grid, still fp32."""
        if QUANT == 3:
            return (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: fp32 addition rounds to an integer
        MB: tl.constexpr = 3 if QUANT == 1 else 2  # mantissa bits
        MIN_NORMAL: tl.constexpr = 0.015625 if QUANT == 1 else 6.103515625e-05  # 2^-6, 2^-14
        SUB_MAGIC: tl.constexpr = 16384.0 if QUANT == 1 else 128.0  # ulp(magic) = subnormal step
        a = tl.abs(y)
        bits = a.to(tl.int32, bitcast=True)
        drop: tl.constexpr = 23 - MB
        bits = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & ~((1 << drop) - 1)
        normal = bits.to(tl.float32, bitcast=True)
        sub = (a + SUB_MAGIC) - SUB_MAGIC
        r = tl.where(a < MIN_NORMAL, sub, normal)
        # y's sign bit onto |y| rounded, so -0.0 stays -0.0 (torch's cast keeps it: byte 0x80)
        sign = y.to(tl.int32, bitcast=True) & -2147483648
        return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _store_row(cache_ptr, scale_ptr, x, slot, offs_h, mask, h_ok,
                   stride_blk, stride_tok, stride_head,
                   NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
                   QMAX: tl.constexpr, INV_QMAX: tl.constexpr, offs_d):
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        dst = cache_ptr + blk * stride_blk + off * stride_tok + offs_h[:, None] * stride_head + offs_d[None, :]
        if QUANT == 0:
            tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
        else:
            xf = x.to(tl.float32)
            amax = tl.max(tl.abs(xf), 1)
            # The absmax's UE5M3 code: carry into fp32's top 3 mantissa bits, keep exponent and
            # those bits, rebias; floored at code 0 (2^-15), saturated at 254, NaN -> 255.
            a = tl.maximum(amax, _AMAX_MIN)
            code = ((a.to(tl.int32, bitcast=True) + 0xFFFFF) >> 20) - _AMAX_CODE_BIAS
            code = tl.minimum(tl.maximum(code, 0), _SCALE_NAN - 1)
            code = tl.where(amax != amax, _SCALE_NAN, code)
            tl.store(scale_ptr + slot * NUM_KV_HEADS + offs_h, code.to(tl.uint8), mask=h_ok)  # [num_slots, heads]
            s = ((code + _AMAX_CODE_BIAS) << 20).to(tl.float32, bitcast=True) * INV_QMAX
            y = tl.minimum(tl.maximum(xf / s[:, None], -QMAX), QMAX)
            tl.store(dst, _to_grid(y, QUANT).to(cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _write_kv_cache_kernel(
        key_ptr,  # [num_tokens, num_kv_heads, head_dim]
        value_ptr,  # [num_tokens, num_kv_heads, head_dim]
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] uint8 absmax codes, contiguous (QUANT only)
        v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] uint8 absmax codes, contiguous (QUANT only)
        slot_mapping_ptr,  # [num_tokens] int64
        stride_key_tok, stride_key_head,
        stride_value_tok, stride_value_head,
        stride_kc_blk, stride_kc_tok, stride_kc_head,
        stride_vc_blk, stride_vc_tok, stride_vc_head,
        NUM_KV_HEADS: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        QUANT: tl.constexpr,  # 0 copy, 1 fp8 e4m3, 2 fp8 e5m2, 3 int8
        QMAX: tl.constexpr,
        INV_QMAX: tl.constexpr,  # 1 / QMAX in fp32 (kv_quant.INV_QMAX)
    ):
        tok = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
        if slot < 0:
            return
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        h_ok = offs_h < NUM_KV_HEADS
        mask = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        # Padding lanes load 0: they never raise a row's absmax.
        k = tl.load(key_ptr + tok * stride_key_tok + offs_h[:, None] * stride_key_head + offs_d[None, :], mask=mask,
                    other=0.0)
        v = tl.load(value_ptr + tok * stride_value_tok + offs_h[:, None] * stride_value_head + offs_d[None, :],
                    mask=mask, other=0.0)
        _store_row(k_cache_ptr, k_scale_ptr, k, slot, offs_h, mask, h_ok, stride_kc_blk, stride_kc_tok,
                   stride_kc_head, NUM_KV_HEADS, BLOCK_SIZE, QUANT, QMAX, INV_QMAX, offs_d)
        _store_row(v_cache_ptr, v_scale_ptr, v, slot, offs_h, mask, h_ok, stride_vc_blk, stride_vc_tok,
                   stride_vc_head, NUM_KV_HEADS, BLOCK_SIZE, QUANT, QMAX, INV_QMAX, offs_d)


def write_kv_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0: skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] uint8 codes (quantised cache)
    v_scale: torch.Tensor | None = None,
) -> None:
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package; use backend='torch' on this machine.")
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim]; got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}.")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be [num_blocks, block_size, "
                         f"{key.shape[1]}, {key.shape[2]}].")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0] or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{key.shape[0]}]; got {slot_mapping.dtype} {tuple(slot_mapping.shape)}.")
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("head_dim must be the contiguous (stride 1) dimension of key, value and the caches.")
    if len({t.device for t in (key, value, k_cache, v_cache, slot_mapping)}) != 1:
        raise ValueError("key, value, caches and slot_mapping must be on one device.")
    quantized = check_scales(k_cache, v_cache, k_scale, v_scale)
    if quantized:
        check_fp8_device(k_cache.dtype, k_cache.device)
    else:
        k_scale = v_scale = k_cache  # unused pointers
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=1 << max(0, (num_kv_heads - 1).bit_length()),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=1 << max(0, (head_dim - 1).bit_length()),
        BLOCK_SIZE=k_cache.shape[1], QUANT=_QUANT.get(k_cache.dtype, 0),
        QMAX=QMAX.get(k_cache.dtype, 0.0), INV_QMAX=INV_QMAX.get(k_cache.dtype, 0.0),
    )
