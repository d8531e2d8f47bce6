"""A checkpoint's rope, from config.json's either dialect (transformers 4's ``rope_theta`` +
``rope_scaling``, transformers 5's ``rope_parameters``) into (theta, the scaling dict
rotary.compute_inv_freq reads, or None for plain rope): linear, dynamic (plain within
max_position_embeddings), YaRN, llama3 and Phi-3's LongRoPE, each as transformers computes
it. Anything else is refused by name (worker/model_config.py reads it through here).
"""

from __future__ import annotations

import math
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def parse_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported.")
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    return parse_rope_scaling(hf, theta, {**legacy, **params})


def parse_rope_scaling(hf: dict[str, Any], theta: float,
                        scaling: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """One rope's parameters (config.json's rope_parameters or rope_scaling) -> (theta,
    None for plain rope, or the dict rotary.compute_inv_freq reads)."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("su", "yarn") and hf.get("architectures") == ["Phi3ForCausalLM"]:
        rope_type = "longrope"  # Phi-3's old names for it (transformers' Phi3Config says so)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}.")
    if hf.get("partial_rotary_factor", 1.0) != 1.0 or scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported.")
    if rope_type == "dynamic":
        # Dynamic NTK changes the base only past max_position_embeddings (transformers'
        # dynamic_rope_update), which max_model_len never exceeds: plain rope, exactly.
        rope_type = "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope":
        return theta, _parse_longrope(hf, scaling)
    if rope_type == "linear":
        if not scaling.get("factor"):
            raise ValueError("linear rope scaling needs 'factor'.")
        return theta, {"rope_type": "linear", "factor": float(scaling["factor"])}
    if rope_type == "yarn":
        return theta, _parse_yarn(hf, scaling)
    out = {"rope_type": "llama3"}
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in scaling:
            raise ValueError(f"llama3 rope scaling needs {key!r}.")
        out[key] = float(scaling[key])
    out["original_max_position_embeddings"] = int(
        scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings") or 8192)
    return theta, out


def _parse_yarn(hf: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """YaRN (transformers' _compute_yarn_parameters): frequencies blended between the
    original and the ``factor``-slowed ones over a ramp of dimensions (beta_fast, beta_slow),
    and cos/sin scaled by attention_factor (0.1 ln(factor) + 1 unless given)."""
    max_pos = int(hf.get("max_position_embeddings") or 2048)
    original = int(scaling.get("original_max_position_embeddings") or max_pos)
    factor = float(scaling.get("factor") or max_pos / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    return {"rope_type": "yarn", "factor": factor, "attention_factor": float(attention_factor),
            "beta_fast": float(scaling.get("beta_fast") or 32), "beta_slow": float(scaling.get("beta_slow") or 1),
            "original_max_position_embeddings": original, "truncate": bool(scaling.get("truncate", True))}


def _parse_longrope(hf: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE: per-frequency factors, a short set for sequences up to the
    pretraining length and a long one past it, and a cos/sin scale (attention_factor)."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise ValueError(f"longrope rope scaling needs a list {key!r}.")
    max_pos = int(hf.get("max_position_embeddings") or 2048)
    original = int(scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                   or max_pos)
    factor = scaling.get("factor") or max_pos / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:  # the paper's default, as transformers computes it
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(f) for f in scaling["short_factor"]],
            "long_factor": [float(f) for f in scaling["long_factor"]], "attention_factor": float(attention_factor),
            "original_max_position_embeddings": original}


def pick_longrope_factors(scaling: dict[str, Any], head_dim: int, max_model_len: int) -> dict[str, Any]:
    """One factor set for the whole engine. transformers switches per sequence: the short set
    while a sequence is within original_max_position_embeddings, and once it grows past,
    the long set for every position (it recomputes the whole cache). A paged cache keeps
    the keys it rotated, so we decide once: an engine whose max_model_len fits the
    pretraining length uses the short set (exactly transformers' tokens at every length);
    a longer one uses the long set (exact for sequences past that length, not for the
    shorter ones)."""
    long = max_model_len > scaling["original_max_position_embeddings"]
    factors = scaling["long_factor" if long else "short_factor"]
    if len(factors) != head_dim // 2:
        raise ValueError(f"longrope {'long' if long else 'short'}_factor has {len(factors)} entries; "
                         f"head_dim {head_dim} needs {head_dim // 2}.")
    return {**scaling, "ext_factors": factors}
