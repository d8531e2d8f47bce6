"""Model registry: the ``architectures`` name in config.json -> our implementation."""

from __future__ import annotations

from torch import nn

from pagedserve.worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedserve.worker.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from pagedserve.worker.models.mixtral import MixtralForCausalLM
from pagedserve.worker.models.phi3 import Phi3ForCausalLM
from pagedserve.worker.models.qwen3 import Qwen3ForCausalLM
from pagedserve.worker.models.qwen3_moe import Qwen3MoeForCausalLM
from pagedserve.worker.models.smollm3 import SmolLM3ForCausalLM

# In model_config.SUPPORTED_ARCHITECTURES' order (a test holds the two lists equal).
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         f"{', '.join(MODEL_REGISTRY)}.") from None
