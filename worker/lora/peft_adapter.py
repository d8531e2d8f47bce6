"""A PEFT LoRA adapter directory, read and checked against the model it will run on.

    adapter_config.json         r, lora_alpha, use_rslora, target_modules, alpha_pattern, ...
    adapter_model.safetensors   base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in]
                                base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out, r]
                                ... for any of q/k/v/o_proj (self_attn), gate/up/down_proj (mlp),
                                or the fused qkv_proj and gate_up_proj of a checkpoint that fuses
                                them (Phi-3): one A, one B over the stacked outputs

A module's output gains ``scale * (x @ A^T) @ B^T`` with ``scale = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with rsLoRA (``use_rslora``), as PEFT computes it; ``alpha_pattern``
overrides ``lora_alpha`` per module, and each module's r is its tensors' (``rank_pattern``
included). ``B`` is kept pre-scaled, in the model's dtype.

Everything a user can get wrong is a ``LoRAError`` (a ValueError: a 400 where it comes from
a request) that names the adapter and the problem: files missing or corrupt, a rank over
``max_lora_rank``, a module the model lacks or that is not adapted here (embeddings,
lm_head, DoRA, LoRA biases, modules_to_save, a mixture-of-experts layer's experts), a
tensor of the wrong shape.

A fused module's adapter is split into its modules' (``FUSED_MODULES``): each gets the same
A and its rows of B, which computes the same delta (``x A^T B^T`` row block by row block).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from pagedserve.scheduler.lora import LoRARequest
from pagedserve.worker.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The modules an adapter may target, each in its block of the decoder layer.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
# A checkpoint's fused module -> the modules it stacks, in its output order (Phi-3's names).
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ADAPTABLE = TARGET_MODULES + tuple(FUSED_MODULES)

# Modules the model has that LoRA does not adapt here (their adapters are refused, named).
NOT_ADAPTED = ("embed_tokens", "lm_head")

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[^.]+)?\.weight$")
# adapter_config.json settings that change what a module computes beyond A and B; an adapter
# that sets one is refused rather than served wrong. (name, value that is fine)
_UNSUPPORTED = (("use_dora", False), ("lora_bias", False), ("bias", "none"), ("modules_to_save", None),
                ("trainable_token_indices", None), ("layer_replication", None),
                ("alora_invocation_tokens", None), ("use_qalora", False), ("fan_in_fan_out", False))
# The reasons vLLM gives for two of them, in its words (clients match on them).
_UNSUPPORTED_WHY = {"use_dora": "pagedserve does not yet support DoRA",
                    "modules_to_save": "pagedserve only supports modules_to_save being None"}


class LoRAError(ValueError):
    """An adapter that cannot be served, with the reason."""


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter's weights on the host: (layer, module) -> (A [r, in], scale * B [out, r])."""

    lora_request: LoRARequest
    rank: int  # the largest r of its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable module of one decoder layer, unsharded."""
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv, inter = cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _fused_shapes(shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """``shapes`` plus each fused module's (in, the sum of its modules' out)."""
    return {**shapes, **{f: (shapes[subs[0]][0], sum(shapes[m][1] for m in subs))
                         for f, subs in FUSED_MODULES.items()}}


def _alpha(config: dict, module_path: str) -> float:
    """``lora_alpha``, or the ``alpha_pattern`` entry matching the module (PEFT's rule: the
    first key that matches the end of the module's dotted path)."""
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return float(value)
    return float(config.get("lora_alpha", 8))


def read_adapter_config(lora_request: LoRARequest) -> dict:
    name, path = lora_request.lora_name, lora_request.lora_path
    where = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        # vLLM's words ("No adapter found"): the front answers them with vLLM's 404.
        raise LoRAError(f"LoRA adapter {name!r}: No adapter found for {path!r} (no adapter directory there).")
    try:
        with open(where, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} has no {CONFIG_FILE} (a PEFT adapter directory "
                        f"holds {CONFIG_FILE} and {WEIGHTS_FILE}).") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: {where} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {where} is not a JSON object.")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type is {config.get('peft_type')!r}; only LORA "
                        "adapters are served.")
    for key, fine in _UNSUPPORTED:
        value = config.get(key, fine)
        if value not in (fine, None, [], {}):
            why = _UNSUPPORTED_WHY.get(key, f"only plain LoRA on {', '.join(TARGET_MODULES)}")
            raise LoRAError(f"LoRA adapter {name!r}: {key}={value!r} is not supported ({why}).")
    return config


def check_target_modules(lora_request: LoRARequest, config: dict) -> None:
    """A ``target_modules`` list may name only modules the model has and adapts here (a
    regex string is checked through the tensors it produced instead)."""
    targets = config.get("target_modules")
    if not isinstance(targets, (list, tuple)):
        return
    for t in targets:
        if t in NOT_ADAPTED:
            raise LoRAError(f"LoRA adapter {lora_request.lora_name!r} targets module {t!r}, which is not adapted "
                            f"here (supported: {', '.join(TARGET_MODULES)}).")
        if t not in ADAPTABLE:
            raise LoRAError(f"LoRA adapter {lora_request.lora_name!r} targets module {t!r}, which the model "
                            f"does not have (its adaptable modules: {', '.join(ADAPTABLE)}).")


def _rank_error(name: str, r: int, where: str, max_lora_rank: int) -> LoRAError:
    # "is greater than max_lora_rank": vLLM's words, which its clients and tests match on.
    return LoRAError(f"LoRA adapter {name!r} has rank {r} ({where}): LoRA rank {r} is greater than "
                     f"max_lora_rank {max_lora_rank}; restart with --max-lora-rank {r} or more.")


def check_peft_adapter(lora_request: LoRARequest, model_config: ModelConfig, max_lora_rank: int) -> None:
    """Every check of ``load_peft_adapter`` that needs no weight: the config, the tensors'
    names and shapes from the safetensors header, and a file as long as the header says
    (a truncated one fails here). LoRAError naming the problem. Non-finite weights are found
    where the worker reads them (that request fails alone). The engine checks this way, so a
    request's adapter is read from disk once, by the worker."""
    _read(lora_request, model_config, max_lora_rank, None)


def load_peft_adapter(lora_request: LoRARequest, model_config: ModelConfig, max_lora_rank: int,
                      dtype: torch.dtype | None = None) -> LoRAAdapter:
    """Read and check the adapter at ``lora_request.lora_path``; its weights on the host, B
    pre-scaled, in ``dtype`` (default: the model's). LoRAError naming the problem."""
    return _read(lora_request, model_config, max_lora_rank, dtype or model_config.dtype)


def _header(path: str) -> dict[str, list[int]]:
    """A safetensors file's tensor names and shapes, from its header; ValueError if the file
    is shorter than the header's offsets (truncated) or the header is not one."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < n <= size - 8:
            raise ValueError("not a safetensors file (no header)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if 8 + n + end != size:
        raise ValueError(f"the header describes {8 + n + end} bytes, the file has {size} (truncated?)")
    return {k: list(t["shape"]) for k, t in header.items()}


def _read(lora_request: LoRARequest, model_config: ModelConfig, max_lora_rank: int,
          dtype: torch.dtype | None) -> LoRAAdapter | None:
    """The adapter's checks, and with a ``dtype`` its weights in it (None: the header only)."""
    from safetensors import safe_open

    name = lora_request.lora_name
    config = read_adapter_config(lora_request)
    check_target_modules(lora_request, config)
    # The config's r (and rank_pattern) first, as vLLM checks it: a rank over the slots' size
    # is refused before any weight is read.
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    ranks = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool)]
    if ranks and max(ranks) > max_lora_rank:
        raise _rank_error(name, max(ranks), CONFIG_FILE, max_lora_rank)
    rslora = bool(config.get("use_rslora", False))
    weights_path = os.path.join(lora_request.lora_path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        also = " (adapter_model.bin, a pickle, is not read: save with safe_serialization=True)" \
            if os.path.isfile(os.path.join(lora_request.lora_path, "adapter_model.bin")) else ""
        raise LoRAError(f"LoRA adapter {name!r}: {lora_request.lora_path!r} has no {WEIGHTS_FILE}{also}.")
    shapes = _fused_shapes(module_shapes(model_config))
    # (layer, module) -> {"A"/"B": a tensor, or its shape where only the header is read}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor | list[int]]] = {}
    try:
        if dtype is None:
            for key, shape in _header(weights_path).items():
                pairs.setdefault(_place(name, key, model_config), {})[_ab(key)] = shape
        else:
            with safe_open(weights_path, framework="pt") as f:
                for key in f.keys():
                    pairs.setdefault(_place(name, key, model_config), {})[_ab(key)] = f.get_tensor(key)
    except LoRAError:
        raise
    except Exception as e:  # a truncated or garbled file: safetensors' own error, named
        raise LoRAError(f"LoRA adapter {name!r}: {weights_path} cannot be read: {e}") from None
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights.")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None] = {}  # None: seen, not read
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: {where} has lora_{next(iter(ab))} without "
                            f"lora_{'B' if 'A' in ab else 'A'}.")
        a, b = ab["A"], ab["B"]
        a_shape, b_shape = tuple(a.shape if dtype else a), tuple(b.shape if dtype else b)
        fan_in, fan_out = shapes[module]
        r = a_shape[0] if a_shape else 0
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != fan_in or b_shape != (fan_out, r):
            raise LoRAError(f"LoRA adapter {name!r}: {where} has A {a_shape} and B {b_shape}; the "
                            f"model needs A [r, {fan_in}] and B [{fan_out}, r] (an adapter of another base "
                            "model?).")
        if r > max_lora_rank:
            raise _rank_error(name, r, where, max_lora_rank)
        for sub in FUSED_MODULES.get(module, (module,)):
            if (layer, sub) in weights:
                raise LoRAError(f"LoRA adapter {name!r}: layer {layer} adapts {sub} twice (on its own and "
                                f"within {module}).")
            weights[(layer, sub)] = None
        rank = max(rank, r)
        if dtype is None:
            continue
        alpha = _alpha(config, f"model.layers.{layer}.{_block(module)}.{module}")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        if not torch.isfinite(a).all() or not torch.isfinite(b).all():
            raise LoRAError(f"LoRA adapter {name!r}: {where} holds non-finite weights.")
        a, b = a.to(dtype).contiguous(), (b.double() * scale).to(dtype)
        at = 0
        for sub in FUSED_MODULES.get(module, (module,)):
            out = shapes[sub][1]
            weights[(layer, sub)] = (a, b[at:at + out].contiguous())
            at += out
    return None if dtype is None else LoRAAdapter(lora_request, rank, weights)


def _ab(key: str) -> str:
    return _KEY.match(key).group(4)


def _place(name: str, key: str, model_config: ModelConfig) -> tuple[int, str]:
    """(layer, module) of an adapter tensor, or LoRAError naming why it cannot be served."""
    m = _KEY.match(key)
    if re.search(r"\.(experts|block_sparse_moe)\.", key):
        raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} adapts a mixture-of-experts layer's "
                        "experts, which is not supported (adapters on its attention are).")
    if m is None or m.group(3) not in ADAPTABLE:
        part = re.search(r"(\w+)\.lora_(?:embedding_)?[AB]\b", key)
        what = m.group(3) if m else part.group(1) if part else key
        raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} adapts {what!r}, which is not "
                        f"adapted here (supported: {', '.join(ADAPTABLE)}).")
    layer, block, module = int(m.group(1)), m.group(2), m.group(3)
    if layer >= model_config.num_hidden_layers or block != _block(module):
        raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} names a layer the model lacks (it "
                        f"has {model_config.num_hidden_layers} layers).")
    if block == "mlp" and layer in model_config.moe_layers:
        raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} adapts layer {layer}'s MLP, a "
                        "mixture of experts, which is not supported (adapters on its attention are).")
    return layer, module


def _block(module: str) -> str:
    """The decoder layer's block that holds ``module``: self_attn or mlp."""
    return "self_attn" if module in ATTENTION_MODULES or module == "qkv_proj" else "mlp"
