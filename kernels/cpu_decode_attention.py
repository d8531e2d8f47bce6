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

fp32 only (the CPU engine's dtype for exactness against transformers); anything else, or a
machine where the extension cannot be built, falls back to the torch path. Built once per
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
#include <limits>
#include <vector>

// q [S, H, D] fp32 (one decode row per sequence), caches [NB, BS, KVH, D] fp32,
// block_table [S, MAXB] int32, seq_lens [S] int32, out [S, H, D] fp32.
void decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                      torch::Tensor out) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, MAXB = block_table.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), m(G), l(G), s(G * BS), qs(G * D);
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
        const float* kb = kp + (blk * BS * KVH + kh) * D;  // token t at kb + t * KVH * D
        const float* vb = vp + (blk * BS * KVH + kh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qs.data() + g * D;
          float* sg = s.data() + g * BS;
          float mb = m[g];
          for (int64_t t = 0; t < n; ++t) {
            const float* kt = kb + t * KVH * D;
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
            const float* vt = vb + t * KVH * D;
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
"""

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

                _MODULE = load_inline(
                    name="pagedserve_cpu_decode_attention_v2",
                    cpp_sources=_SOURCE + "\n",
                    functions=["decode_attention"],
                    extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd"],
                    verbose=False)
            except Exception as e:  # no compiler, no ninja, ...: the torch path still works
                _FAILED = True
                logger.warning("CPU decode-attention extension unavailable (%s); using the torch path.", e)
    return _MODULE


def available() -> bool:
    return _load() is not None


def decode_attention_cpu(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim] fp32, one decode row per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim] fp32
) -> bool:
    """Fills ``out`` and returns True, or returns False when it cannot (caller falls back)."""
    if (q.dtype != torch.float32 or k_cache.dtype != torch.float32 or q.device.type != "cpu"
            or q.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or out.stride(-1) != 1 or q.shape[1] % k_cache.shape[2] != 0):
        return False
    mod = _load()
    if mod is None:
        return False
    mod.decode_attention(q, k_cache, v_cache, block_table.to(torch.int32).contiguous(),
                         seq_lens.to(torch.int32).contiguous(), float(scale), out)
    return True
