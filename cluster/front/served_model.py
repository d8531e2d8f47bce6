"""The model this front serves, as its engine replicas describe it, and what the front
counts about the requests it serves.

The replicas' info() (served name, max_model_len, tokenizer, logprob limit, ...) is asked
once, on first need; a body that names another model is a 404 (OpenAI's words). Its LoRA
adapters are models too (``resolve``): the replicas' --lora-modules, from that info, those
loaded at run time (serving_models.py), and those found in --dynamic-lora-loading-path when a
request first names one. The front's
metrics (metrics.py) carry the served name as a label, so they are made with that info:
until it has come there is nothing to count into, and every count here is skipped.
"""

from __future__ import annotations

import posixpath

from fastapi.responses import JSONResponse

from pagedserve.cluster.front.edge import error, remote_error
from pagedserve.cluster.front.metrics import ServeMetrics
from pagedserve.scheduler.lora import LoRARequest


class ServedModel:
    def __init__(self, engine) -> None:
        self._engine = engine  # the replicas' Serve handle
        self._info: dict | None = None
        self.metrics: ServeMetrics | None = None  # made with the info
        # LoRA adapter name -> its request, in the order they came (/v1/models lists them so).
        self.loras: dict[str, LoRARequest] = {}

    async def info(self) -> dict:
        if self._info is None:
            info = await self._engine.info.remote()
            for m in info.get("lora_modules") or ():
                self.loras.setdefault(m["name"], LoRARequest(m["name"], m["lora_int_id"], m["path"],
                                                             m.get("base_model_name")))
            self._info = info
            self.metrics = ServeMetrics(self._info["served_model_name"], self._info.get("kv_sizing"))
        return self._info

    async def resolve(self, model: str | None) -> tuple[LoRARequest | None, JSONResponse | None]:
        """What a body's ``model`` names: (None, None) for the base model (or no name), (its
        LoRARequest, None) for an adapter, as "<adapter>" or "<base>:<adapter>" (Ray Serve
        LLM's form), else (None, vLLM's 404)."""
        info = await self.info()
        base = info["served_model_name"]
        if model is None or model == base:
            return None, None
        name = model[len(base) + 1:] if model.startswith(base + ":") else model
        lora = self.loras.get(name)
        if lora is not None:
            return lora, None
        lora, refused = await self._dynamic(info, name)
        if lora is not None or refused is not None:
            return lora, refused
        available = ", ".join(f"`{n}`" for n in [base, *self.loras])
        return None, error(404, f"The model `{model}` does not exist. Available: {available}.")

    async def _dynamic(self, info: dict, name: str) -> tuple[LoRARequest | None, JSONResponse | None]:
        """The adapter ``name`` from --dynamic-lora-loading-path, checked by a replica (it
        reads the folder, as the workers will) and known from then on: (its request, None);
        (None, the replica's 400) for a bad one; (None, None) where there is none."""
        root = info.get("dynamic_lora_loading_path")
        # One folder name, never a path: a request must not reach outside the folder.
        if not root or not name or name in (".", "..") or "/" in name or "\\" in name:
            return None, None
        lora = LoRARequest.named(name, posixpath.join(root, name))
        try:
            await self._engine.check_lora.remote(lora)
        except Exception as e:  # arrives wrapped (RayTaskError)
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, ValueError) and "No adapter found" in str(cause):
                return None, None  # no such folder: the unknown model's 404
            return None, remote_error(e)
        return self.loras.setdefault(name, lora), None

    @staticmethod
    def response_name(info: dict, lora: LoRARequest | None) -> str:
        """The ``model`` a response names: the adapter's, or the base model's (vLLM's)."""
        return lora.lora_name if lora is not None else info["served_model_name"]

    async def max_model_len(self) -> int:
        return (await self.info())["max_model_len"]

    async def check_model(self, model: str | None) -> JSONResponse | None:
        """The 404 for a body that names a model this front does not serve (the base model
        or one of its adapters); None: it may go on."""
        return (await self.resolve(model))[1]

    def first_output(self, ttft_s: float) -> None:
        """A request's first output reached this front, ``ttft_s`` after it arrived here."""
        if self.metrics is not None:
            self.metrics.front_ttft.observe(ttft_s)

    def observe(self, final) -> None:
        """A request's last RequestOutput (None: it had none): its latencies and finish reasons."""
        if final is not None and final.metrics is not None and self.metrics is not None:
            self.metrics.observe_finished(final.metrics, max(len(c.token_ids) for c in final.outputs),
                                          [c.finish_reason for c in final.outputs])

    def observe_abort(self, requests: int = 1) -> None:
        """``requests`` engine requests ended unfinished (their client left, or they failed)."""
        if self.metrics is not None and requests > 0:
            self.metrics.count_finished(["abort"] * requests)
