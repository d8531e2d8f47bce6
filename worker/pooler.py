"""The pooling runner's model-side half (vLLM's ``--runner pooling``): how a checkpoint pools
its hidden states into one embedding, and the pooling itself.

Where the pooler config comes from, first found wins (vLLM's order):

    --pooler-config '{"pooling_type": "MEAN", "normalize": false}'     the operator's
    modules.json + <Pooling module path>/config.json                   sentence-transformers'
        pooling_mode_lasttoken -> LAST, pooling_mode_mean_tokens -> MEAN,
        pooling_mode_cls_token -> CLS; normalize iff a Normalize module is listed
    otherwise                                                          LAST + normalize
                                                                       (a decoder embedding
                                                                       model, Qwen3-Embedding)

Matryoshka (``dimensions``): only where config.json says so, as vLLM reads it:
``is_matryoshka: true`` (any size up to the hidden size) or ``matryoshka_dimensions: [...]``
(those sizes only).

A pooling step, per request (the model runner gives each its rows of the step's hidden
states; a chunked prompt comes in several steps):

    LAST  the row of its last prompt position, in the step that computes it
    MEAN  a running fp32 sum over its chunks (reset when a chunk starts at position 0:
          a recompute after preemption), / num_prompt_tokens at the last one
    CLS   the row of position 0, kept until the last chunk
    then the first ``dimensions`` entries, then L2-normalised if ``normalize``
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedserve.scheduler.pooling_params import POOLING_TYPES, PoolingParams

# sentence-transformers module types (their old and new import paths, as vLLM lists them).
ST_POOLING = ("sentence_transformers.models.Pooling",
              "sentence_transformers.sentence_transformer.modules.pooling.Pooling")
ST_NORMALIZE = ("sentence_transformers.models.Normalize", "sentence_transformers.base.modules.normalize.Normalize",
                "sentence_transformers.sentence_transformer.modules.normalize.Normalize")
ST_TRANSFORMER = ("sentence_transformers.models.Transformer",
                  "sentence_transformers.sentence_transformer.modules.transformer.Transformer",
                  "sentence_transformers.base.modules.transformer.Transformer")
# 1_Pooling/config.json's modes -> our types; the others are refused by name.
ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
ST_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(slots=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True
    source: str = "default"  # where it came from, for the start-up line: "default", "modules.json", "--pooler-config"

    def describe(self) -> str:
        return f"{self.pooling_type} pooling, normalize={self.normalize} ({self.source})"


def has_st_pooling(path: str) -> bool:
    """Whether ``path`` is a sentence-transformers checkpoint with a Pooling module (vLLM's
    ``--runner auto`` serves such a one for embeddings, whatever its architecture)."""
    modules = _read_json(os.path.join(path, "modules.json")) if os.path.isdir(path) else None
    return isinstance(modules, list) and any(isinstance(m, dict) and m.get("type") in ST_POOLING for m in modules)


def resolve_pooler_config(path: str, override: dict[str, Any] | None = None) -> PoolerConfig:
    """The pooler of the checkpoint at ``path`` (see the module doc); ValueError naming what
    it cannot run (a Dense layer, max pooling, ...)."""
    cfg = _from_sentence_transformers(path) if os.path.isdir(path) else None
    cfg = cfg or PoolerConfig()
    if override:
        unknown = sorted(set(override) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"--pooler-config: unknown key(s) {', '.join(unknown)} (known: pooling_type, normalize).")
        ptype = str(override.get("pooling_type", cfg.pooling_type)).upper()
        if ptype not in POOLING_TYPES:
            raise ValueError(f"--pooler-config pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{override.get('pooling_type')!r}.")
        normalize = override.get("normalize", cfg.normalize)
        if not isinstance(normalize, bool):
            raise ValueError(f"--pooler-config normalize must be true or false, got {normalize!r}.")
        cfg = PoolerConfig(ptype, normalize, "--pooler-config")
    return cfg


def _from_sentence_transformers(path: str) -> PoolerConfig | None:
    modules = _read_json(os.path.join(path, "modules.json"))
    if not isinstance(modules, list):
        return None
    pooling = None
    normalize = False
    for m in modules:
        kind = m.get("type") if isinstance(m, dict) else None
        if kind in ST_POOLING:
            pooling = m
        elif kind in ST_NORMALIZE:
            normalize = True
        elif kind not in ST_TRANSFORMER:
            raise ValueError(f"{path}/modules.json lists a {kind!r} module; only the transformer, Pooling and "
                             "Normalize modules are supported (no Dense projection).")
    if pooling is None:
        return PoolerConfig(normalize=normalize, source="modules.json")
    cfg_path = os.path.join(path, str(pooling.get("path") or ""), "config.json")
    pool_cfg = _read_json(cfg_path) or {}
    other = [k for k in ST_OTHER_MODES if pool_cfg.get(k) is True]
    if pool_cfg.get("pooling_mode") is not None:  # newer sentence-transformers write one name
        mode = str(pool_cfg["pooling_mode"]).lower()
        modes = [t for k, t in ST_MODES.items() if mode in (k, k.removeprefix("pooling_mode_"), t.lower())]
        other += [mode] if not modes else []
    else:
        modes = [t for k, t in ST_MODES.items() if pool_cfg.get(k) is True]
    if other or len(modes) > 1:
        raise ValueError(f"{cfg_path}: pooling {', '.join(other + modes)} is not supported; one of "
                         f"{', '.join(ST_MODES)} is.")
    if pool_cfg.get("include_prompt") is False:
        raise ValueError(f"{cfg_path}: include_prompt false (pooling without the instruction's tokens) is "
                         "not supported.")
    return PoolerConfig(modes[0] if modes else "LAST", normalize, "modules.json")


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def matryoshka_dimensions(hf_config: dict[str, Any]) -> tuple[bool, list[int] | None]:
    """(whether ``dimensions`` may be asked, the sizes allowed or None for any), from
    config.json's ``matryoshka_dimensions`` / ``is_matryoshka`` (vLLM's fields)."""
    dims = hf_config.get("matryoshka_dimensions")
    if dims:
        return True, [int(d) for d in dims]
    return bool(hf_config.get("is_matryoshka", False)), None


# ---------------------------------------------------------------------------- the pooling
@dataclass(slots=True)
class PoolRows:
    """One pooling request's rows in a step: hidden rows [row, row + n) are its positions
    [start, start + n); ``last``: the step computes its last prompt position."""

    req_id: str
    params: PoolingParams
    row: int
    n: int
    start: int
    num_tokens: int

    @property
    def last(self) -> bool:
        return self.start + self.n >= self.num_tokens


def pool_step(hidden: torch.Tensor, rows: list[PoolRows], partial: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """Each finishing request's vector (float32 little-endian bytes), from this step's
    ``hidden`` [tokens, hidden]. ``partial``: req_id -> the running MEAN sum or the CLS
    row of a chunked prompt, updated here (new tensors, never in place: the runner's
    journal keeps the old ones for a rollback)."""
    done: list[tuple[str, PoolingParams, torch.Tensor]] = []
    for r in rows:
        ptype = r.params.pooling_type
        if ptype == "LAST":
            if r.last:
                done.append((r.req_id, r.params, hidden[r.row + r.n - 1].float()))
            continue
        if ptype == "MEAN":
            chunk = hidden[r.row:r.row + r.n].float().sum(0)
            acc = chunk if r.start == 0 else partial[r.req_id] + chunk
            if r.last:
                done.append((r.req_id, r.params, acc / r.num_tokens))
            else:
                partial[r.req_id] = acc
            continue
        acc = hidden[r.row].float().clone() if r.start == 0 else partial[r.req_id]  # CLS
        if r.last:
            done.append((r.req_id, r.params, acc))
        else:
            partial[r.req_id] = acc
    out: dict[str, bytes] = {}
    for req_id, params, vec in done:
        partial.pop(req_id, None)
        if params.dimensions is not None:
            vec = vec[: params.dimensions]
        if params.normalize:
            vec = F.normalize(vec, p=2.0, dim=-1)
        out[req_id] = vec.cpu().numpy().astype("<f4").tobytes()
    return out
