"""`GET /v1/models`, and vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(served only with `serve --enable-runtime-lora-updates`)."""

from __future__ import annotations

import functools
from typing import Annotated, Any

from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import Body

from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.lora.adapter import LoRAError
from compiled_engine.lora.manager import LoRAManager, LoRARequest
from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.openai.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from compiled_engine.server.serving import Serving


class ModelsController(Controller):
    @get("/v1/models", sync_to_thread=False)
    def models(self, request: Request[Any, Any, Any], serving: NamedDependency[Serving]) -> ModelList:
        """The model this server serves, and each LoRA adapter on it (with its `parent`)."""
        serving.check_auth(request)
        base = serving.settings.served_model_name
        cards = [ModelCard(base, serving.created, max_model_len=serving.max_model_len, root=base)]
        for name, path in serving.settings.lora_modules.items():
            cards.append(ModelCard(name, serving.created, max_model_len=serving.max_model_len, root=path, parent=base))
        return ModelList(cards)


class AdaptersController(Controller):
    """Changes `settings.lora_modules` (the adapters a request may name) with the engine's set."""

    @post("/v1/load_lora_adapter", status_code=200)
    async def load_lora_adapter(
        self,
        request: Request[Any, Any, Any],
        data: Annotated[LoadLoRAAdapterRequest, Body()],
        serving: NamedDependency[Serving],
    ) -> Response[str]:
        """Load a LoRA adapter while serving (`serve --enable-runtime-lora-updates`)."""
        serving.check_auth(request)
        name, adapters = data.lora_name, serving.settings.lora_modules
        if name == serving.settings.served_model_name:
            raise ApiError(400, f"'{name}' is the base model's name", param="lora_name")
        if name in adapters:
            raise ApiError(400, f"the LoRA adapter '{name}' is already loaded", param="lora_name")
        lora = LoRARequest(name, data.lora_path)
        await serving.engine.call(functools.partial(_add_adapter, lora))
        adapters[name] = data.lora_path
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @post("/v1/unload_lora_adapter", status_code=200)
    async def unload_lora_adapter(
        self,
        request: Request[Any, Any, Any],
        data: Annotated[UnloadLoRAAdapterRequest, Body()],
        serving: NamedDependency[Serving],
    ) -> Response[str]:
        """Unload a LoRA adapter; refused with 409 while requests use it."""
        serving.check_auth(request)
        name, adapters = data.lora_name, serving.settings.lora_modules
        if name not in adapters:
            raise ApiError(404, f"the LoRA adapter '{name}' is not loaded", "not_found_error", "lora_name")
        try:
            await serving.engine.call(functools.partial(_remove_adapter, name))
        except LoRAError as exc:
            raise ApiError(409, str(exc), "conflict_error", "lora_name", "adapter_in_use") from exc
        del adapters[name]
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")


def _lora_manager(engine: LLMEngine) -> LoRAManager:
    if not isinstance(engine.adapters, LoRAManager):
        raise LoRAError("this server serves no LoRA adapters: start it with --enable-lora")
    return engine.adapters


# Module-level, so that a data-parallel front end can send them to each replica.
def _add_adapter(lora: LoRARequest, engine: LLMEngine) -> None:
    _lora_manager(engine).add(lora)


def _remove_adapter(name: str, engine: LLMEngine) -> None:
    _lora_manager(engine).remove(name)
