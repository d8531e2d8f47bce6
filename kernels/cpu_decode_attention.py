"""Decode attention on CPU as one fused C++ loop (a torch C++ extension, built on first use).

The torch path gathers every decode sequence's K/V into a padded buffer and then runs two
batched matmuls over it: K/V cross memory three times (gather read, gather write, matmul
read). This kernel walks the block table instead and reads each K/V row exactly once,
with an online softmax per (sequence, KV head) and all query heads of that KV head
sharing each loaded row (GQA):

    for (seq, kv_head) in parallel:              # at::parallel_for, torch's intra-op threads
        for block in block_table[seq]:            # 16 tokens x head_dim, contiguous per token
            s[g, t] = q[g] . k[t] * scale         # g: the query heads of this kv head
            online softmax: m, l, acc[g] += p[g, t] * v[t]
        out[g] = acc[g] / l[g]

q in fp32 only (the CPU engine's dtype for exactness against transformers); the cache in fp32
or quantised (kv_quant.py: 1-byte fp8 e4m3 / e5m2 / int8 codes, dequantised block by block
into L1 with their scales folded in, so a quantised context reads a quarter of the bytes).
Anything else, or a machine where the extension cannot be built, falls back to the torch path. Built once per
machine into torch's extension cache (~1 min with g++), then loaded in well under a second.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// Cache formats: 0 fp32; quantised (1 byte + one bf16 scale per (token, kv head)):
// 1 fp8 e4m3fn, 2 fp8 e5m2, 3 int8. A quantised block is dequantised once per (block,
// kv head) into a [BS, D] fp32 buffer with its scales folded in, so every query head of
// the group reads it from L1, and the loops below stay the fp32 ones.
// fp8 code -> fp32 in integer ops the d loop vectorises: the code's exponent and mantissa
// bits placed at fp32's positions give the value times 2^-(127 - BIAS) (its subnormals land
// on fp32 denormals, exactly), and one multiply rebiases. Were denormals flushed on this
// thread (DAZ), only subnormal codes (|x| < 2^-6 of a row's scale step) would read as 0.
template <int FMT>
static inline float fp8_to_float(uint8_t byte) {
  constexpr uint32_t MB = FMT == 1 ? 3 : 2;
  constexpr float REBIAS = FMT == 1 ? 0x1p120f : 0x1p112f;  // 2^(127 - 7), 2^(127 - 15)
  const uint32_t b = byte;
  const uint32_t bits = ((b & 0x80u) << 24) | ((b & 0x7Fu) << (23 - MB));
  return __builtin_bit_cast(float, bits) * REBIAS;
}

template <int FMT>
static inline void dequant_block(const uint8_t* src, const at::BFloat16* scales, int64_t n, int64_t row_stride,
                                 int64_t D, float* dst) {
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* row = src + t * row_stride;
    const float s = static_cast<float>(scales[t * row_stride / D]);
    float* d_row = dst + t * D;
    if constexpr (FMT == 3) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) d_row[d] = static_cast<float>(static_cast<int8_t>(row[d])) * s;
    } else {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) d_row[d] = fp8_to_float<FMT>(row[d]) * s;
    }
  }
}

// q [S, H, D] fp32 (one decode row per sequence), caches [NB, BS, KVH, D] (fp32, or
// 1-byte codes with scales [NB, BS, KVH] bf16), block_table [S, MAXB] int32,
// seq_lens [S] int32, out [S, H, D] fp32.
template <int FMT>
static void decode_attention_impl(torch::Tensor q, const void* k_data, const void* v_data,
                                  const at::BFloat16* k_scales, const at::BFloat16* v_scales, int64_t BS, int64_t KVH,
                                  torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                                  torch::Tensor out) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t G = H / KVH, MAXB = block_table.size(1);
  const float* qp = q.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), m(G), l(G), s(G * BS), qs(G * D);
    std::vector<float> kbuf(FMT ? BS * D : 0), vbuf(FMT ? BS * D : 0);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t seq = idx / KVH, kh = idx % KVH;
      const int64_t len = lens[seq];
      for (int64_t g = 0; g < G; ++g) {
        const float* src = qp + seq * q_stride + (kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qs[g * D + d] = src[d] * fscale;
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t nblocks = (len + BS - 1) / BS;
      for (int64_t b = 0; b < nblocks && b < MAXB; ++b) {
        const int64_t blk = bt[seq * MAXB + b];
        const int64_t n = std::min<int64_t>(BS, len - b * BS);
        const int64_t first = (blk * BS * KVH + kh) * D;  // token t of this head at first + t * KVH * D
        if (b + 2 < nblocks && b + 2 < MAXB) {
          // Blocks lie anywhere in the pool, so the hardware cannot guess the next one:
          // fetch the rows of the block after next while this one computes.
          constexpr int64_t esz = FMT == 0 ? 4 : 1;
          const int64_t ahead = (bt[seq * MAXB + b + 2] * BS * KVH + kh) * D * esz;
          const char* kn = static_cast<const char*>(k_data) + ahead;
          const char* vn = static_cast<const char*>(v_data) + ahead;
          for (int64_t t = 0; t < BS; ++t)
            for (int64_t c = 0; c < D * esz; c += 64) {
              __builtin_prefetch(kn + t * KVH * D * esz + c);
              __builtin_prefetch(vn + t * KVH * D * esz + c);
            }
        }
        const float* kb;
        const float* vb;
        int64_t row;  // floats between consecutive tokens of kb / vb
        if constexpr (FMT == 0) {
          kb = static_cast<const float*>(k_data) + first;
          vb = static_cast<const float*>(v_data) + first;
          row = KVH * D;
        } else {
          dequant_block<FMT>(static_cast<const uint8_t*>(k_data) + first, k_scales + first / D, n, KVH * D, D,
                             kbuf.data());
          dequant_block<FMT>(static_cast<const uint8_t*>(v_data) + first, v_scales + first / D, n, KVH * D, D,
                             vbuf.data());
          kb = kbuf.data();
          vb = vbuf.data();
          row = D;
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qs.data() + g * D;
          float* sg = s.data() + g * BS;
          float mb = m[g];
          for (int64_t t = 0; t < n; ++t) {
            const float* kt = kb + t * row;
            float dot = 0.f;
#pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
            sg[t] = dot;
            mb = std::max(mb, dot);
          }
          const float corr = std::exp(m[g] - mb);  // 0 on the first block (m = -inf)
          float sum = l[g] * corr;
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
          for (int64_t t = 0; t < n; ++t) {
            const float p = std::exp(sg[t] - mb);
            sum += p;
            const float* vt = vb + t * row;
            for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
          }
          m[g] = mb;
          l[g] = sum;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* dst = op + seq * o_stride + (kh * G + g) * D;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[g * D + d] * inv;
      }
    }
  });
}

void decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                      torch::Tensor out) {
  decode_attention_impl<0>(q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), nullptr, nullptr,
                           k_cache.size(1), k_cache.size(2), block_table, seq_lens, scale, out);
}

// k_cache / v_cache: the 1-byte codes viewed as uint8; fmt: 1 e4m3, 2 e5m2, 3 int8.
void decode_attention_quant(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_table,
                            torch::Tensor seq_lens, double scale, torch::Tensor out, int64_t fmt) {
  const void* k = k_cache.data_ptr<uint8_t>();
  const void* v = v_cache.data_ptr<uint8_t>();
  const at::BFloat16* ks = k_scale.data_ptr<at::BFloat16>();
  const at::BFloat16* vs = v_scale.data_ptr<at::BFloat16>();
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  if (fmt == 1) decode_attention_impl<1>(q, k, v, ks, vs, BS, KVH, block_table, seq_lens, scale, out);
  else if (fmt == 2) decode_attention_impl<2>(q, k, v, ks, vs, BS, KVH, block_table, seq_lens, scale, out);
  else if (fmt == 3) decode_attention_impl<3>(q, k, v, ks, vs, BS, KVH, block_table, seq_lens, scale, out);
  else TORCH_CHECK(false, "unknown quantised KV format ", fmt);
}
"""

# cache dtype -> the extension's format code
_FORMATS = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.int8: 3}

_LOCK = threading.Lock()
_MODULE = None
_FAILED = False


def _load():
    global _MODULE, _FAILED
    if _MODULE is not None or _FAILED:
        return _MODULE
    with _LOCK:
        if _MODULE is None and not _FAILED:
            if os.environ.get("PAGEDSERVE_CPU_EXT", "1") == "0":
                _FAILED = True
                return None
            try:
                from torch.utils.cpp_extension import load_inline

                # -fopenmp: at::parallel_for is inline OpenMP in torch's headers; built
                # without it the loop ran on one thread (measured: 1 and 2 threads took
                # the same time). The extension links libgomp.so.1, the soname torch's
                # own copy has, so the loader reuses the runtime torch loaded.
                _MODULE = load_inline(
                    name="pagedserve_cpu_decode_attention_v5",
                    cpp_sources=_SOURCE + "\n",
                    functions=["decode_attention", "decode_attention_quant"],
                    extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False)
            except Exception as e:  # no compiler, no ninja, ...: the torch path still works
                _FAILED = True
                logger.warning("CPU decode-attention extension unavailable (%s); using the torch path.", e)
    return _MODULE


def available() -> bool:
    return _load() is not None


def decode_attention_cpu(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim] fp32, one decode row per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32 or quantised
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim] fp32
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] bf16 (quantised cache)
    v_scale: torch.Tensor | None = None,
) -> bool:
    """Fills ``out`` and returns True, or returns False when it cannot (caller falls back)."""
    fmt = _FORMATS.get(k_cache.dtype)
    if (fmt is None or q.dtype != torch.float32 or q.device.type != "cpu" or v_cache.dtype != k_cache.dtype
            or q.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or out.stride(-1) != 1 or q.shape[1] % k_cache.shape[2] != 0):
        return False
    if fmt and (k_scale is None or v_scale is None or not k_scale.is_contiguous() or not v_scale.is_contiguous()):
        return False
    mod = _load()
    if mod is None:
        return False
    bt = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if fmt == 0:
        mod.decode_attention(q, k_cache, v_cache, bt, lens, float(scale), out)
    else:
        mod.decode_attention_quant(q, k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, bt,
                                   lens, float(scale), out, fmt)
    return True
