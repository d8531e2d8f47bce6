"""/v1/models and the LoRA adapters loaded at run time, as vLLM's OpenAIServingModels:

    GET  /v1/models               the base model, then each adapter: id = its name, root = its
                                  path, parent = its base_model_name or the base model's id
    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}: a replica checks the adapter
                                  against its model (cluster/engine/lora_adapters.py: a 400
                                  naming the problem, a 404 where there is no adapter at
                                  that path, as vLLM), then requests may name it
    POST /v1/unload_lora_adapter  {"lora_name"}: new requests may no longer name it; those
                                  running finish with it (their plans carry its path)

The two POST routes answer only when the app was built with VLLM_ALLOW_RUNTIME_LORA_UPDATING
set (vLLM's opt-in; IngressConfig.allow_runtime_lora_updating), and a 404 otherwise, as if
absent. An adapter is loaded in the replicas' workers on its first request, not here.

Several models in one app (Ray Serve LLM's llm_configs): each has its own engine deployment
and ServedModel; ``pick`` says which one a body's ``model`` names (a base model, one of its
adapters, "<base>:<adapter>"). No ``model`` is Ray Serve LLM's 400, a name none serves
vLLM's 404, both listing the served names; an app of one model leaves both to it (vLLM's).
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse, PlainTextResponse

from pagedserve.cluster.front.edge import error, remote_error
from pagedserve.cluster.front.openai.schemas import ModelCard, ModelList
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.scheduler.lora import LoRARequest


class OpenAIServingModels:
    def __init__(self, engines: list, models: list[ServedModel], allow_runtime_updates: bool) -> None:
        self._engines = engines  # each model's replicas' Serve handle: check_lora
        self._models = models
        self._allow = allow_runtime_updates

    async def _infos(self) -> list[dict]:
        return list(await asyncio.gather(*(m.info() for m in self._models)))

    async def names(self) -> list[str]:
        """Every name a request may give: each base model, then its adapters."""
        infos = await self._infos()
        return [n for i, m in zip(infos, self._models) for n in (i["served_model_name"], *m.loras)]

    async def pick(self, model: str | None) -> tuple[int | None, JSONResponse | None]:
        """(the index of the model ``model`` names, None), or (None, the 400/404)."""
        if len(self._models) == 1:
            return 0, None  # its ServedModel answers for any name (its 404 is vLLM's)
        infos = await self._infos()
        bases = [i["served_model_name"] for i in infos]
        if model is None:
            return None, error(400, "Model parameter is required when multiple models are configured. "
                                    f"Available models: {bases}", param="model")
        for k, base in enumerate(bases):
            if model == base or model.startswith(base + ":"):
                return k, None
        for k, m in enumerate(self._models):
            if model in m.loras:
                return k, None
        for k, (m, i) in enumerate(zip(self._models, infos)):
            if i.get("dynamic_lora_loading_path"):  # an adapter found in its folder now
                lora, refused = await m.resolve(model)
                if lora is not None or (refused is not None and refused.status_code != 404):
                    return k, None
        available = ", ".join(f"`{n}`" for n in await self.names())
        return None, error(404, f"The model `{model}` does not exist. Available: {available}.", param="model")

    async def list_models(self) -> JSONResponse:
        cards = []
        for info, model in zip(await self._infos(), self._models):
            base = info["served_model_name"]
            # As vLLM: root is --model as the user gave it, never the directory it resolved to
            # (the default model's prepared cache entry is nobody's business).
            cards.append(ModelCard(id=base, root=info["model_root"], max_model_len=info["max_model_len"]))
            cards += [ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name or base)
                      for name, lora in model.loras.items()]
        return JSONResponse(ModelList(data=cards).model_dump())

    async def _base_of(self, body: dict) -> tuple[int | None, JSONResponse | None]:
        """The model an adapter is loaded for: the only one, or the body's ``base_model_name``
        (vLLM's LoRAModulePath field)."""
        if len(self._models) == 1:
            return 0, None
        base = body.get("base_model_name")
        bases = [i["served_model_name"] for i in await self._infos()]
        if base not in bases:
            return None, error(400, f"base_model_name names the served model the adapter is for, one of {bases}; "
                                    f"got {base!r}.", param="base_model_name")
        return bases.index(base), None

    async def load_lora_adapter(self, body: dict) -> JSONResponse | PlainTextResponse:
        if not self._allow:
            return error(404, "Not Found")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            return error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        k, bad = await self._base_of(body)
        if bad is not None:
            return bad
        if name in await self.names():
            return error(400, f"The lora adapter '{name}' has already been loaded.")
        model = self._models[k]
        lora = LoRARequest.named(name, path)
        try:
            await self._engines[k].check_lora.remote(lora)
        except Exception as e:  # arrives wrapped (RayTaskError); a ValueError is the adapter's: 400
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, ValueError) and "No adapter found" in str(cause):
                return error(404, str(cause).splitlines()[-1])  # no such directory: vLLM's NotFoundError
            return remote_error(e)
        if name in await self.names():  # loaded by a concurrent call meanwhile
            return error(400, f"The lora adapter '{name}' has already been loaded.")
        model.loras[name] = lora
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, body: dict) -> JSONResponse | PlainTextResponse:
        if not self._allow:
            return error(404, "Not Found")
        name = body.get("lora_name")
        if not name or not isinstance(name, str):
            return error(400, "either 'lora_name' and 'lora_int_id' needs to be provided.")
        await self._infos()  # the static adapters are known before one is removed
        if not any(m.loras.pop(name, None) is not None for m in self._models):
            return error(404, f"The lora adapter '{name}' cannot be found.")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
