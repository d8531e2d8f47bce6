"""pagedserve's public entry points. Kept light: nothing here imports ray; the Serve
app and the Ray executor load ray only when they are used."""

from scheduler.sampling_params import SamplingParams
from worker.config import EngineConfig


def __getattr__(name: str):
    if name == "LLM":
        from cluster.llm import LLM

        return LLM
    if name == "LLMEngine":
        from cluster.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig"]
