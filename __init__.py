"""pagedserve: LLM serving with continuous batching and PagedAttention on Ray Serve.

The public offline API, as vLLM users know it::

    from pagedserve import LLM, SamplingParams
    from pagedserve import LoRARequest   # an adapter per request (vLLM's vllm.lora.request)
    from pagedserve import PoolingParams # LLM(..., runner="pooling").embed(prompts, PoolingParams(dimensions=...))

The installed distribution has this one top-level name. Its sub-packages are the
repository's top-level folders (setuptools maps them in pyproject.toml):

    pagedserve.scheduler  pure Python: requests, block pool, prefix cache, the scheduler
    pagedserve.kernels    tensors only: paged attention and KV-cache writes
    pagedserve.worker     the model, its weights and KV shard, the sampler (one per rank)
    pagedserve.cluster    the engine loop, the Ray control plane, the Serve/OpenAI front, the CLI
    pagedserve.loadtest   load generator and benchmarks (nothing imports it)

Kept light: importing ``pagedserve`` loads neither torch nor ray; ``LLM`` and
``LLMEngine`` load the engine on first use.
"""

import os
import sys

# Run from inside the checkout (``python -m ...`` or ``python -c`` in the repository root), the
# root is first on sys.path and the repository's folders import as top-level names: ``kernels``
# then shadows Hugging Face's ``kernels`` distribution, which transformers imports at load (a
# dependency of transformers since 5.25), and ``import transformers.activations`` fails. The
# folders are only ever ``pagedserve.<folder>`` (pyproject maps them); the root is not a path
# entry of this distribution, so it leaves sys.path on the first import of pagedserve.
_checkout = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
del _checkout

# OpenMP threads that wait for the next parallel region spin for a while (libgomp's default:
# 300,000 spins). On a CPU that other processes also use (the Ray proxy, the ingress, the
# tokenizer, another tenant), the spinning takes the core the late thread needs: a short
# spin serves more tokens on a shared core, at a small cost on a quiet machine.
# Set before torch loads libgomp; a value the user exported wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

from pagedserve.scheduler.lora import LoRARequest  # noqa: E402
from pagedserve.scheduler.pooling_params import PoolingParams  # noqa: E402
from pagedserve.scheduler.sampling_params import SamplingParams  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from pagedserve.cluster.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedserve.cluster.engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedserve.cluster.wire import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "LoRARequest", "PoolingParams", "RequestOutput",
           "CompletionOutput"]
