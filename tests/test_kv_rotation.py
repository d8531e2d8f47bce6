"""The Hadamard rotation of quantised KV rows (worker/layers/kv_rotation.py).

- it is orthonormal for every head_dim the models use, so attention is unchanged in exact
  arithmetic: scores and outputs computed from rotated q, k, v (and the output rotated
  back) equal the plain ones;
- on keys with outlier channels (as real models' keys have), int8 rows quantised after
  the rotation give attention scores several times closer to the exact ones than rows
  quantised as they are: the reason it is there;
- the model applies it on a quantised cache only: the plain cache's outputs are the oracle's
  (tests/test_engine_oracle.py) and a quantised run stays close to the plain run.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.kv_quant import dequantize_rows, quantize_rows
from pagedserve.worker.layers.kv_rotation import kv_rotation


@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
def test_rotation_is_orthonormal_and_attention_is_unchanged(head_dim):
    rot = kv_rotation(head_dim, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(rot @ rot.mT, torch.eye(head_dim, dtype=torch.float64), atol=1e-12, rtol=0)
    if head_dim & (head_dim - 1) == 0:  # Sylvester Hadamard: symmetric, entries +-1/sqrt(d)
        assert torch.equal(rot, rot.mT)
        assert torch.allclose(rot.abs(), torch.full_like(rot, head_dim ** -0.5))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, head_dim, generator=g, dtype=torch.float64) for n in (5, 9, 9))
    p = (q @ k.T).softmax(-1)
    p_rot = ((q @ rot) @ (k @ rot).T).softmax(-1)
    torch.testing.assert_close(p_rot, p, atol=1e-12, rtol=0)
    torch.testing.assert_close((p_rot @ (v @ rot)) @ rot.mT, p @ v, atol=1e-12, rtol=0)


def test_rotated_int8_keys_with_outlier_channels_score_closer():
    head_dim, g = 64, torch.Generator().manual_seed(1)
    k = torch.randn(512, head_dim, generator=g)
    k[:, [3, 35]] *= 40.0  # one RoPE pair of outlier channels
    q = torch.randn(64, head_dim, generator=g)
    exact = q @ k.T
    plain = q @ dequantize_rows(*quantize_rows(k, torch.int8)).T
    rot = kv_rotation(head_dim, torch.float32, torch.device("cpu"))
    rotated = (q @ rot) @ dequantize_rows(*quantize_rows(k @ rot, torch.int8)).T
    err_plain, err_rot = (exact - plain).abs().mean(), (exact - rotated).abs().mean()
    assert err_rot * 3 < err_plain, (float(err_rot), float(err_plain))


def test_model_rotates_only_on_a_quantised_cache(tmp_path, monkeypatch):
    """Every layer of an int8 run rotates, a plain run never does (its outputs are the
    oracle's), and the int8 run starts as the plain one (its first tokens)."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.worker.models import llama
    from pagedserve.worker.loading.random_models import make_test_model

    path = make_test_model("llama-gqa2-hd64", tmp_path)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [100, 3, 3, 40, 41]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(kv: str) -> list[list[int]]:
        llm = LLM(model=str(path), dtype="float32", kv_cache_dtype=kv, max_model_len=128,
                  num_gpu_blocks_override=32)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    calls = []
    real = llama.kv_rotation
    monkeypatch.setattr(llama, "kv_rotation", lambda *a: calls.append(a) or real(*a))
    plain = run("auto")
    assert calls == []
    quantised = run("int8")
    assert [t[:2] for t in quantised] == [t[:2] for t in plain]
    assert len(calls) >= 2 * 2 and all(c[0] == 64 for c in calls)  # 2 layers x >= 2 steps
