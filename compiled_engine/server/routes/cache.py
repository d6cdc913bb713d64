"""`POST /reset_prefix_cache` (vLLM's): forget every cached page, on every engine, so that no
later prompt hits what came before (a new model of the data behind the prompts, a benchmark's
cold start). Refused with 409 while requests hold pages; behind the API key."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency

from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.errors import PrefixCacheBusyError
from compiled_engine.server.common.errors import ApiError
from compiled_engine.server.serving import Serving


def _reset(engine: LLMEngine) -> None:
    """Module-level, so that a data-parallel front end can send it to each replica."""
    if not engine.reset_prefix_cache():
        raise PrefixCacheBusyError("requests hold pages of the prefix cache: reset it when the engine is idle")


class PrefixCacheController(Controller):
    @post("/reset_prefix_cache", status_code=200)
    async def reset_prefix_cache(
        self, request: Request[Any, Any, Any], serving: NamedDependency[Serving]
    ) -> Response[str]:
        """Drop every cached page (each replica's); 409 while requests hold pages."""
        serving.check_auth(request)
        try:
            await serving.engine.call(_reset)
        except PrefixCacheBusyError as exc:
            raise ApiError(409, str(exc), "conflict_error", code="prefix_cache_in_use") from exc
        return Response("", media_type="text/plain")
