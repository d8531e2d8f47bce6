"""The rotation that makes a quantised KV cache accurate: an orthonormal Hadamard matrix.

A quantised cache stores each (token, KV head) row of head_dim values with one scale,
its absmax / qmax (kernels/kv_quant.py). Real models' keys have outlier channels: a few
of the head_dim values are far larger than the rest (RoPE's low-frequency pairs, massive
activations), so the row's scale is set by them and the other values get a handful of
int8 steps. Rotating every row by an orthonormal R spreads each outlier over all
channels, and attention does not change:

    scores:  (q R) . (k R) = q R R^T k^T = q . k               (R orthonormal)
    output:  sum_t p_t (v_t R) = (sum_t p_t v_t) R = o R  ->  o = (o R) R^T

R is the Sylvester Hadamard matrix / sqrt(head_dim) (symmetric, so R^T = R and
R @ R = I), as in QuaRot's KV-cache quantisation. It is applied after RoPE (RoPE's
rotation and R do not commute), to q, k and v going into the cache and attention, and
to the output coming out: four [n, heads, d] @ [d, d] products, ~2 * d flops per value,
a small fraction of a decode step's GEMMs. Only quantised caches rotate; the
unquantised path is untouched. A head_dim that is not a power of two gets a fixed
random orthonormal matrix (seeded QR): the same guarantee, slightly less even spread.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def _rotation_fp64(head_dim: int) -> torch.Tensor:
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        return h / head_dim ** 0.5
    g = torch.Generator().manual_seed(head_dim)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q


_cache: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def kv_rotation(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[head_dim, head_dim] R with R @ R^T = I (symmetric for powers of two)."""
    key = (head_dim, dtype, torch.device(device))
    rot = _cache.get(key)
    if rot is None:
        rot = _cache[key] = _rotation_fp64(head_dim).to(dtype=dtype, device=device)
    return rot

