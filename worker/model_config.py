"""The model's shape and numerics, parsed from a Hugging Face ``config.json`` or from a
GGUF file's metadata (``worker/loading/gguf_loader.py`` turns it into the same dict).

Only what the families in worker/models need. Both config dialects are accepted: the old one
(``rope_theta`` + ``rope_scaling``, transformers 4) and the new one (``rope_parameters``,
transformers 5). Anything we cannot run exactly is refused here with a clear
``ValueError`` rather than producing wrong tokens later.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.config import RUNNERS, check_quantization
from pagedserve.platforms import auto_dtype
from pagedserve.worker.loading.gguf_loader import check_native_types, find_gguf_file, gguf_hf_config, open_gguf
from pagedserve.scheduler.kv.kv_groups import FULL_ATTENTION, SLIDING_ATTENTION
from pagedserve.worker.loading.sliding_window import GEMMA_ARCHITECTURES, runs_sliding_window, sliding_window_layers
from pagedserve.worker.loading.rope_config import parse_rope, parse_rope_scaling, pick_longrope_factors
from pagedserve.worker.loading.quant_config import (HF_QUANT_METHODS, HFQuantConfig, parse_quant_config,
                                                    read_quantization_config)

# Architecture names in config.json we implement (worker/models registers a class for each).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "SmolLM3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# A checkpoint of the bare decoder, without its LM head (transformers' AutoModel, what
# sentence-transformers saves: Qwen3-Embedding's weights are named so): "<X>Model" runs as
# "<X>ForCausalLM" without lm_head, for embeddings only (--runner pooling).
HEADLESS_ARCHITECTURES = {a.removesuffix("ForCausalLM") + "Model": a for a in SUPPORTED_ARCHITECTURES}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16.")
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'auto', 'float32', 'bfloat16' or 'float16'.")
    return _DTYPES[key]


@dataclass
class ModelConfig:
    model_path: str
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    # None or a dict with "rope_type" ("llama3" or "longrope") and its factors.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    dtype: torch.dtype
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # The GGUF file the weights come from (a .gguf model_path, or config.json's "gguf_file").
    gguf_file: str | None = None
    # "gguf": the GGUF's weights stay in their blocks (kernels/cpu_gguf.py); "awq", "gptq",
    # "fp8": the checkpoint's quantization_config, packed (kernels/quant/); None: every weight
    # in ``dtype`` (a quantized checkpoint dequantized at load). See resolve_quantization.
    quantization: str | None = None
    # What config.json's quantization_config says (None: an unquantized checkpoint); set
    # even when --quantization none dequantizes it at load.
    quant_config: HFQuantConfig | None = None
    # SmolLM3: the layers that skip rotary embeddings (its no_rope_layers[i] == 0).
    nope_layers: tuple[int, ...] = ()
    # Mixture of experts (MOE_ARCHITECTURES): the layers whose MLP is a top-k routed block
    # of ``num_experts`` SwiGLU experts of ``moe_intermediate_size``; the others are dense.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    # Per-layer attention (loading/sliding_window.py): layer i is FULL_ATTENTION or SLIDING_ATTENTION
    # (a row sees its ``sliding_window`` newest keys); () with no window: every layer full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # The sliding layers' own rope (Gemma 3's rope_local_base_freq, default rope); None: the model's.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # Gemma: scores scaled by query_pre_attn_scalar ** -0.5 (not head_dim's); attention
    # scores (Gemma 2) and final logits soft-capped: c * tanh(x / c). None: off.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # config.json names the bare decoder (HEADLESS_ARCHITECTURES): no LM head in the weights.
    headless: bool = False
    # "generate" or "pooling" (RUNNERS, resolved); pooling: the model has no LM head and
    # ``pooler`` says how it pools (worker/pooler.py).
    runner: str = "generate"
    pooler: Any = None  # worker.pooler.PoolerConfig with the pooling runner, else None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def layer_window(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s sliding window, None where it attends to every key."""
        if self.layer_types and self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: str | torch.dtype = "auto",
                        max_model_len: int | None = None, device: str = "cpu",
                        quantization: str | None = None, runner: str = "auto",
                        pooler_config: dict[str, Any] | None = None) -> "ModelConfig":
        """``device``: where the model runs, for what ``dtype="auto"`` means there
        (platforms.auto_dtype: a float32 checkpoint or a GGUF runs in bfloat16 on CUDA) and
        for what ``quantization`` (None: implied by the checkpoint) resolves to. ``runner``
        (RUNNERS) and ``pooler_config`` (--pooler-config): see ``resolve_runner``."""
        path = os.fspath(path)
        gguf = find_gguf_file(path)
        if gguf is not None:
            cfg = cls.from_dict(gguf_hf_config(open_gguf(gguf), gguf), gguf, dtype=dtype,
                                max_model_len=max_model_len, device=device)
            cfg.quantization = resolve_quantization(quantization, cfg.gguf_file, device)
            cfg.resolve_runner(runner, pooler_config)
            return cfg
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise ValueError(f"{path!r} is not a model directory: no config.json there.")
        with open(cfg_file) as f:
            hf = json.load(f)
        cfg = cls.from_dict(hf, path, dtype=dtype, max_model_len=max_model_len, device=device)
        # Chat checkpoints (e.g. Llama 3 Instruct) list extra stop ids only here.
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            with open(gen_file) as f:
                gen_eos = json.load(f).get("eos_token_id")
            for e in gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]:
                if int(e) not in cfg.eos_token_ids:
                    cfg.eos_token_ids.append(int(e))
        cfg.quant_config = parse_quant_config(read_quantization_config(hf, path))
        cfg.quantization = resolve_quantization(quantization, cfg.gguf_file, device, cfg.quant_config)
        cfg.resolve_runner(runner, pooler_config)
        return cfg

    def resolve_runner(self, runner: str = "auto", pooler_config: dict[str, Any] | None = None) -> None:
        """Set ``runner`` and, for pooling, ``pooler`` (worker/pooler.py). "auto" is pooling
        for a sentence-transformers checkpoint (modules.json with a Pooling module, as vLLM
        decides) or a headless one, else generate. A headless checkpoint cannot generate."""
        from pagedserve.worker.pooler import has_st_pooling, resolve_pooler_config

        if runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}.")
        if runner == "auto":
            runner = "pooling" if self.headless or has_st_pooling(self.model_path) else "generate"
        if runner == "generate" and self.headless:
            raise ValueError(f"{self.model_path or 'the model'}: config.json names the bare decoder "
                             f"({self.hf_config.get('architectures')}), which has no LM head to generate with; "
                             "serve it for embeddings with --runner pooling.")
        if runner == "generate" and pooler_config:
            raise ValueError("--pooler-config applies to --runner pooling only.")
        self.runner = runner
        self.pooler = resolve_pooler_config(self.model_path, pooler_config) if runner == "pooling" else None

    @classmethod
    def from_dict(cls, hf: dict[str, Any], path: str = "", dtype: str | torch.dtype = "auto",
                  max_model_len: int | None = None, device: str = "cpu") -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        headless = arch is None and any(a in HEADLESS_ARCHITECTURES for a in archs)
        if headless:
            arch = HEADLESS_ARCHITECTURES[next(a for a in archs if a in HEADLESS_ARCHITECTURES)]
        if arch is None:
            raise ValueError(f"unsupported model architecture {archs or hf.get('model_type')!r} in "
                             f"{path or 'config'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
                             f"(and their bare decoders, {', '.join(HEADLESS_ARCHITECTURES)}, for embeddings).")

        def need(key: str) -> Any:
            if hf.get(key) is None:
                raise ValueError(f"config.json of {path or 'model'} lacks required field {key!r}.")
            return hf[key]

        hidden = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        head_dim = hf.get("head_dim")
        if head_dim is None:
            if hidden % num_heads:
                raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {num_heads} "
                                 "and config.json gives no head_dim.")
            head_dim = hidden // num_heads
        head_dim = int(head_dim)
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads}).")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}.")
        for key, value in (("hidden_size", hidden), ("num_hidden_layers", need("num_hidden_layers")),
                           ("intermediate_size", need("intermediate_size")), ("vocab_size", need("vocab_size"))):
            if int(value) < 1:
                raise ValueError(f"config.json field {key} must be >= 1, got {value}.")
        act = hf.get("hidden_act", "silu")
        if arch in GEMMA_ARCHITECTURES:  # GeGLU: gelu with the tanh approximation (hidden_activation)
            act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
            if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
                raise ValueError(f"hidden_activation {act!r} is not supported for {arch} (only 'gelu_pytorch_tanh').")
            act = "gelu_pytorch_tanh"
        elif act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu', SwiGLU).")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported.")

        attention = _gemma_fields(hf, arch) if arch in GEMMA_ARCHITECTURES else {}
        rope_theta, rope_scaling = attention.pop("rope") if attention else parse_rope(hf)
        max_pos = int(hf.get("max_position_embeddings") or 2048)
        # Sliding-window layers (loading/sliding_window.py) run their window. A family whose
        # window no layer here runs stays exact by never exceeding it.
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        if runs_sliding_window(arch):
            window = None
            if not attention:  # Gemma's came with its other fields
                attention = dict(zip(("layer_types", "sliding_window"), sliding_window_layers(hf, arch)))
        limit = min(max_pos, int(window)) if window else max_pos
        if max_model_len is None:
            max_model_len = limit
        elif not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len {max_model_len} must be in [1, {limit}] "
                             f"(max_position_embeddings{' / sliding_window' if window else ''}).")
        if arch not in GEMMA_ARCHITECTURES and (attention.get("sliding_window") or 0) >= max_model_len:
            # No row reaches past a window of max_model_len keys: every layer runs full, as
            # before (one KV cache group, the bound CPU decode path). Gemma's layer_types
            # also pick its ropes, so they stay.
            attention.update(layer_types=(), sliding_window=None)
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            rope_scaling = pick_longrope_factors(rope_scaling, head_dim, int(max_model_len))
        if (attention.get("local_rope_scaling") or {}).get("rope_type") == "longrope":
            attention["local_rope_scaling"] = pick_longrope_factors(attention["local_rope_scaling"], head_dim,
                                                                 int(max_model_len))

        if dtype == "auto":
            checkpoint = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
            torch_dtype = parse_dtype(auto_dtype(checkpoint, device))
        else:
            torch_dtype = parse_dtype(dtype)
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(e) for e in eos] if isinstance(eos, list) else [int(eos)])
        return cls(
            model_path=path, architecture=arch, hidden_size=hidden,
            num_hidden_layers=int(hf["num_hidden_layers"]), num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads, head_dim=head_dim,
            intermediate_size=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
            rope_scaling=rope_scaling, max_position_embeddings=max_pos, max_model_len=int(max_model_len),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES)),  # Gemma's default
            # Qwen2 always has q/k/v bias (hard-wired in HF, no config field).
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            hidden_act=act, dtype=torch_dtype, bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids, gguf_file=hf.get("gguf_file") or (path if path.endswith(".gguf") else None),
            nope_layers=_nope_layers(hf, arch), **_moe_fields(hf, arch), **attention, headless=headless,
            hf_config=hf)

    # ---- sizes per tensor-parallel rank -------------------------------------------------
    def verify_tensor_parallel(self, tp_size: int) -> None:
        for what, n in (("num_attention_heads", self.num_attention_heads),
                        ("num_key_value_heads", self.num_key_value_heads)):
            if n % tp_size:
                raise ValueError(f"{what} ({n}) must be divisible by tensor_parallel_size ({tp_size}).")
        for what, n in (("intermediate_size", self.intermediate_size),
                        ("moe_intermediate_size", self.moe_intermediate_size)):
            if n % tp_size:
                raise ValueError(f"{what} ({n}) must be divisible by tensor_parallel_size ({tp_size}).")

    def get_num_kv_heads(self, tp_size: int = 1) -> int:
        self.verify_tensor_parallel(tp_size)
        return self.num_key_value_heads // tp_size

    def kv_cache_groups(self, kv_allocation: str = "paged"):
        """The hybrid KV cache's groups of layers (scheduler/kv/kv_groups.py), or None (also
        where max_model_len is too short for the windows to save anything)."""
        from pagedserve.scheduler.kv.kv_groups import kv_cache_groups

        return kv_cache_groups(self.layer_types, self.sliding_window, kv_allocation, self.max_model_len)

    def kv_cache_bytes_per_token(self, tp_size: int = 1, cache_dtype: torch.dtype | str | None = None) -> int:
        """Bytes of K and V one token occupies on one rank, all layers together."""
        dt = self.dtype if cache_dtype in (None, "auto") else parse_dtype(cache_dtype)
        elem = torch.empty((), dtype=dt).element_size()
        return 2 * self.num_hidden_layers * self.get_num_kv_heads(tp_size) * self.head_dim * elem


def resolve_quantization(requested: str | None, gguf_file: str | None, device: str,
                         quant_config: HFQuantConfig | None = None) -> str | None:
    """What ``--quantization`` means for this checkpoint on ``device`` ("cpu", "cuda", or
    "auto" where it is not decided yet): "gguf" (the blocks run natively), "awq" / "gptq" /
    "fp8" (``quant_config``, the checkpoint's quantization_config, runs packed) or None.

        None (implied)  "gguf" for a GGUF on CPU and on CUDA (there, Q4_0 / Q4_1 linear
                        layers run on the Triton int4 GEMM and the rest is dequantized to
                        --dtype at load: worker/layers/quantized.py); a checkpoint with a
                        quantization_config runs as its method, on any device
        "gguf"          a GGUF, else a ValueError saying why not
        "awq" | "gptq" | "fp8"   the checkpoint's quantization_config must say so
                        ("compressed-tensors" and "modelopt" name its fp8 as vLLM does)
        "none"          every weight dequantized at load (the comparison baseline)

    A GGUF that will run natively has its tensor types checked here, so a type the kernel
    lacks is a startup error that names it (gguf_loader.check_native_types); an unsupported
    quantization_config was refused when it was parsed (worker/loading/quant_config.py)."""
    check_quantization(requested)
    if requested == "none":
        return None
    if quant_config is not None:
        if requested in (None, quant_config.method, quant_config.quant_method):
            return quant_config.method
        raise ValueError(f"--quantization {requested} does not match the checkpoint's quantization_config "
                         f"(quant_method {quant_config.quant_method!r}): leave it unset, or pass "
                         f"{quant_config.method} (none dequantizes the weights at load).")
    if requested in HF_QUANT_METHODS:
        raise ValueError(f"--quantization {requested} needs a checkpoint whose config.json has a quantization_config "
                         f"of quant_method {requested!r}; this one has none.")
    if gguf_file is None:
        if requested == "gguf":
            raise ValueError("--quantization gguf needs a GGUF checkpoint (a .gguf file, or a directory "
                             "holding one).")
        return None
    if device == "auto" and requested is None:
        return None
    from pagedserve.worker.loading.gguf_index import read_gguf_index

    check_native_types(read_gguf_index(gguf_file), gguf_file)
    return "gguf"


def _gemma_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 2 / 3: each layer's attention type, the window, both ropes, the query scale and
    the soft-caps, from either config dialect (transformers 5's layer_types and per-type
    rope_parameters, or the older sliding_window_pattern, rope_theta + rope_local_base_freq
    + rope_scaling). ``rope``: the global layers' (theta, scaling)."""
    types, window = sliding_window_layers(hf, arch)
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an encoder) is not supported.")
    params = hf.get("rope_parameters") or {}
    if arch == "Gemma3ForCausalLM":
        if params and not any(isinstance(v, dict) for v in params.values()):
            params = {FULL_ATTENTION: params}  # one dict: the global layers' (as rope_scaling was)
        full = {**(hf.get("rope_scaling") or {}), **(params.get(FULL_ATTENTION) or {})}
        local = dict(params.get(SLIDING_ATTENTION) or {})
        rope = parse_rope_scaling(hf, float(full.get("rope_theta") or hf.get("rope_theta") or 1_000_000.0), full)
        local_theta, local_scaling = parse_rope_scaling(
            hf, float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10_000.0), local)
    else:
        rope = parse_rope(hf)
        local_theta, local_scaling = rope
    softcap = hf.get("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None  # Gemma 3's has none
    return dict(rope=rope, layer_types=types, sliding_window=window,
                local_rope_theta=local_theta, local_rope_scaling=local_scaling,
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256),
                attn_logit_softcapping=float(softcap) if softcap else None,
                final_logit_softcapping=float(hf["final_logit_softcapping"]) if hf.get("final_logit_softcapping")
                else None)


def _nope_layers(hf: dict[str, Any], arch: str) -> tuple[int, ...]:
    """SmolLM3's layers without rope: ``no_rope_layers`` (1 = rope, 0 = none), or by default
    every ``no_rope_layer_interval``-th layer (transformers' SmolLM3Config)."""
    if arch != "SmolLM3ForCausalLM":
        return ()
    n = int(hf["num_hidden_layers"])
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = int(hf.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {n} layers.")
    return tuple(i for i, use_rope in enumerate(flags) if not use_rope)


def _moe_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Mixtral: every layer routes over num_local_experts experts of intermediate_size,
    top-k renormalised. Qwen3-MoE: layer i routes unless it is in mlp_only_layers or
    (i + 1) is not a multiple of decoder_sparse_step; experts of moe_intermediate_size;
    norm_topk_prob says whether top-k is renormalised."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    n = int(hf["num_hidden_layers"])
    num_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    top_k = int(hf.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})].")
    if hf.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts (shared_expert_intermediate_size) are not supported.")
    if arch == "MixtralForCausalLM":
        return dict(moe_layers=tuple(range(n)), num_experts=num_experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    if int(hf.get("moe_intermediate_size") or 1) < 1:
        raise ValueError("config.json field moe_intermediate_size must be >= 1.")
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    return dict(moe_layers=tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0),
                num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
