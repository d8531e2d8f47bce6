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
"""

from __future__ import annotations

from fastapi.responses import JSONResponse, PlainTextResponse

from pagedserve.cluster.front.edge import error, remote_error
from pagedserve.cluster.front.openai.schemas import ModelCard, ModelList
from pagedserve.cluster.front.served_model import ServedModel
from pagedserve.scheduler.lora import LoRARequest


class OpenAIServingModels:
    def __init__(self, engine, model: ServedModel, allow_runtime_updates: bool) -> None:
        self._engine = engine  # the replicas' Serve handle: check_lora
        self._model = model
        self._allow = allow_runtime_updates

    async def list_models(self) -> JSONResponse:
        info = await self._model.info()
        base = info["served_model_name"]
        # As vLLM: root is --model as the user gave it, never the directory it resolved to
        # (the default model's prepared cache entry is nobody's business).
        cards = [ModelCard(id=base, root=info["model_root"], max_model_len=info["max_model_len"])]
        cards += [ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name or base)
                  for name, lora in self._model.loras.items()]
        return JSONResponse(ModelList(data=cards).model_dump())

    async def load_lora_adapter(self, body: dict) -> JSONResponse | PlainTextResponse:
        if not self._allow:
            return error(404, "Not Found")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            return error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        info = await self._model.info()
        if name in self._model.loras or name == info["served_model_name"]:
            return error(400, f"The lora adapter '{name}' has already been loaded.")
        lora = LoRARequest.named(name, path)
        try:
            await self._engine.check_lora.remote(lora)
        except Exception as e:  # arrives wrapped (RayTaskError); a ValueError is the adapter's: 400
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, ValueError) and "No adapter found" in str(cause):
                return error(404, str(cause).splitlines()[-1])  # no such directory: vLLM's NotFoundError
            return remote_error(e)
        if name in self._model.loras:  # loaded by a concurrent call meanwhile
            return error(400, f"The lora adapter '{name}' has already been loaded.")
        self._model.loras[name] = lora
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, body: dict) -> JSONResponse | PlainTextResponse:
        if not self._allow:
            return error(404, "Not Found")
        name = body.get("lora_name")
        if not name or not isinstance(name, str):
            return error(400, "either 'lora_name' and 'lora_int_id' needs to be provided.")
        await self._model.info()  # the static adapters are known before one is removed
        if self._model.loras.pop(name, None) is None:
            return error(404, f"The lora adapter '{name}' cannot be found.")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
