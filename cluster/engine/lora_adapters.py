"""LoRAAdapters: the engine's side of LoRA serving: the adapters it was started with
(``--lora-modules``) and the check every adapter passes once before a request may use it.

    --lora-modules sql=/a/sql  ─▶ LoRARequest("sql", adapter_id("sql", "/a/sql"), "/a/sql")
                                   checked at start: a bad one stops the engine, named
    a request's lora_request   ─▶ checked on its first use here (LLMEngine.make_request: a 400)
    POST /v1/load_lora_adapter ─▶ the front asks a replica to check it (``check``) first

The check reads the adapter's config and its weights file's header (worker/lora/
peft_adapter.check_peft_adapter; the weights themselves are read once, by the worker):
files, rank against ``max_lora_rank``, target modules and shapes against the model; and its
``base_model_name``, when given, against the model this engine serves.

It also keeps what the workers report after each step (worker/lora/host_cache.py): the
adapters on their host and how long a read from disk takes, which the replica publishes to
the fronts' KV routers (cluster/wire/kv_events.py).
"""

from __future__ import annotations

import threading

from pagedserve.config import EngineConfig
from pagedserve.scheduler.lora import LoRARequest
from pagedserve.worker.lora.peft_adapter import LoRAError, check_peft_adapter
from pagedserve.worker.model_config import ModelConfig

LOAD_EMA = 0.3  # weight of the newest read in load_s


class LoRAAdapters:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, base_names: tuple[str, ...]) -> None:
        """``base_names``: what the model is called here (its served name, --model as given);
        an adapter's ``base_model_name`` must be one of them."""
        self.enabled = config.enable_lora
        self.max_lora_rank = config.max_lora_rank
        self._model_config = model_config
        self._base_names = tuple(n for n in base_names if n)
        self._checked: set[int] = set()  # lora_int_ids that passed
        self.resident: tuple[int, ...] = ()  # lora_int_ids on the workers' host (their last report)
        self.load_s = 0.0  # one adapter's read from disk, averaged (EMA); 0.0: none read yet
        self._lock = threading.Lock()  # make_request runs on the tokenizer pool's threads
        self.static: dict[str, LoRARequest] = {}
        for m in config.lora_modules or ():
            if m.name in self._base_names:
                raise LoRAError(f"LoRA adapter name {m.name!r} is the base model's name; choose another.")
            req = LoRARequest.named(m.name, m.path, m.base_model_name)
            self.check(req)
            self.static[m.name] = req

    def check(self, lora_request: LoRARequest) -> None:
        """LoRAError (a ValueError) naming why ``lora_request`` cannot be served here."""
        if not self.enabled:
            raise LoRAError(f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled "
                            "(start with --enable-lora).")
        with self._lock:
            if lora_request.lora_int_id in self._checked:
                return
        base = lora_request.base_model_name
        if base is not None and self._base_names and base not in self._base_names:
            raise LoRAError(f"LoRA adapter {lora_request.lora_name!r} is for base model {base!r}, but this server "
                            f"serves {self._base_names[0]!r}.")
        check_peft_adapter(lora_request, self._model_config, self.max_lora_rank)  # raises, naming the problem
        with self._lock:
            self._checked.add(lora_request.lora_int_id)

    def observe(self, resident: tuple[int, ...] | None, load_s: tuple[float, ...]) -> None:
        """A step result's report (ModelRunnerOutput.lora_resident, .lora_load_s)."""
        if resident is not None:
            self.resident = tuple(resident)
        for s in load_s:
            self.load_s = s if self.load_s == 0.0 else (1 - LOAD_EMA) * self.load_s + LOAD_EMA * s

    def describe(self) -> list[dict]:
        """The static adapters as the front lists them (/v1/models)."""
        return [dict(name=r.lora_name, path=r.lora_path, base_model_name=r.base_model_name,
                     lora_int_id=r.lora_int_id) for r in self.static.values()]
