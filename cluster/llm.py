"""The offline API, vLLM-style: ``LLM(...).generate(prompts, sampling_params)``, and
``LLM(..., runner="pooling").embed(prompts)`` for an embedding model."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence

from pagedserve.cluster.engine.llm_engine import LLMEngine
from pagedserve.cluster.executors import executor_class_for
from pagedserve.cluster.wire.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedserve.scheduler.lora import LoRARequest
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.config import EngineConfig


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = set(kwargs) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown arguments: {', '.join(sorted(unknown))}.")
        config = EngineConfig(model=model, **kwargs)
        if config.device == "auto" and "ray" in sys.modules:
            import ray

            if ray.is_initialized():  # joined to a cluster: decide from what it has
                from pagedserve.cluster.placement import decide_for_cluster

                config = decide_for_cluster(config)
        # Otherwise the engine decides for this node (platforms.decide_here).
        self.engine = LLMEngine(config, executor_class_for(config))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. ``lora_request``:
        the adapter of every prompt, or one per prompt (None: the base model), as vLLM's."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params.")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests.")
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
                rid = f"offline-{next(self._counter)}"
                self.engine.add_request(rid, prompt, params,
                                        priority=priority[i] if priority is not None else 0,
                                        lora_request=loras[i])
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def embed(self, prompts: str | Sequence[str] | Sequence[list[int]],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed`` (the pooling runner: ``runner="pooling"``, or a checkpoint
        that implies it): each prompt's pooled hidden state, in input order, as
        ``out.outputs.embedding``. ``pooling_params``: ``dimensions`` (Matryoshka models) and
        ``normalize`` (None: the model's)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = SamplingParams(max_tokens=None, detokenize=False, truncate_prompt_tokens=truncate_prompt_tokens)
        ids = []
        try:
            for prompt in prompts:
                rid = f"offline-{next(self._counter)}"
                self.engine.add_request(rid, prompt, params, pooling=pooling_params or PoolingParams())
                ids.append(rid)
            outs = self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.embedding), o.prompt_token_ids) for o in outs]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[rid] for rid in ids]

    def stats(self) -> dict:
        stats = self.engine.get_stats()
        return {name: getattr(stats, name) for name in stats.__dataclass_fields__} \
            if hasattr(stats, "__dataclass_fields__") else dict(vars(stats))

    def shutdown(self) -> None:
        self.engine.shutdown()
