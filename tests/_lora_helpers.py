"""Random PEFT LoRA adapters for the tiny random test models, and their oracle: the same
model in transformers with the adapter merged by ``peft`` (``merge_and_unload``).

PEFT initialises B to zero (an adapter that changes nothing); these adapters get random A
and B, scaled so the delta moves the logits enough to change greedy tokens (the tests check
that it does) without bringing the near-ties that would make a token-exact oracle flaky.
"""

from __future__ import annotations

import contextlib
import os

import torch
import transformers

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_random_adapter(base_path, out_path, *, r: int = 8, alpha: float = 16, targets=None,
                        use_rslora: bool = False, seed: int = 0, std: float = 0.05, **config) -> str:
    """A PEFT adapter directory for the model at ``base_path``, with random A and B."""
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    targets = targets if isinstance(targets, str) else list(targets or ALL_MODULES)  # a str: a regex, as PEFT takes it
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                          use_rslora=use_rslora, lora_dropout=0.0, **config)
    model = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    out_path = os.fspath(out_path)
    model.save_pretrained(out_path)
    return out_path


def merged_model(base_path, adapter_path):
    """transformers' model with the adapter merged into its weights (the oracle)."""
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter_path).merge_and_unload().eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def build_app_allowing_runtime_updates(cfg, name_prefix: str):
    """build_app(cfg) with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (vLLM's opt-in to POST
    /v1/load_lora_adapter), which the app reads where it is built; the environment is put back."""
    from pagedserve.cluster.app import build_app

    before = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        return build_app(cfg, name_prefix=name_prefix)
    finally:
        if before is None:
            del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = before


@contextlib.contextmanager
def lora_app(serve_url: str, cfg, name: str):
    """The app of ``cfg`` (runtime adapter loading allowed) on the suite's Serve as
    ``{name}-test`` at ``/{name}``: yields its URL, deletes it after."""
    from conftest import delete_app
    from ray import serve

    serve.run(build_app_allowing_runtime_updates(cfg, f"{name}-"), name=f"{name}-test", route_prefix=f"/{name}")
    try:
        yield f"{serve_url}/{name}"
    finally:
        delete_app(f"{name}-test")
