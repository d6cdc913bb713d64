"""The Litestar app: the controllers of each API (openai/, responses/, anthropic/) and its own
(routes/) over one `Serving`, with the request-counting middleware, the error handlers and the
OpenAPI docs."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Litestar, Request
from litestar.di import Provide
from litestar.exceptions import SerializationException
from litestar.logging.config import LoggingConfig
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin

from compiled_engine.errors import RequestError
from compiled_engine.server.anthropic.routes import MessagesController
from compiled_engine.server.common.errors import handle_exception, request_error_handler
from compiled_engine.server.openai.chat import ChatController
from compiled_engine.server.openai.completions import CompletionsController
from compiled_engine.server.openai.embeddings import EmbeddingsController
from compiled_engine.server.openai.models import AdaptersController, ModelsController
from compiled_engine.server.openai.tokenize import DetokenizeController, TokenizeController
from compiled_engine.server.responses.routes import ResponsesController
from compiled_engine.server.routes.cache import PrefixCacheController
from compiled_engine.server.routes.chat_page import ChatPageController
from compiled_engine.server.routes.docs_page import PlainDocsRenderPlugin
from compiled_engine.server.routes.health import HealthController, MetricsController
from compiled_engine.server.serving import Serving
from compiled_engine.server.settings import DEFAULT_MAX_BODY_BYTES, ServerSettings
from compiled_engine.serving.client import EngineClient

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ServerSettings", "create_app"]


class BodyRequest(Request[Any, Any, Any]):
    """Litestar's request, but a JSON body nested too deeply for the decoder (it recurses once
    per level) is refused like any other undecodable body: a 400, not a RecursionError and a 500."""

    async def json(self) -> Any:
        try:
            return await super().json()
        except RecursionError as exc:
            # Litestar answers a SerializationException from the body decoder with a 400.
            raise SerializationException("the JSON body is nested too deeply to decode") from exc


def controllers(settings: ServerSettings) -> list[type[Controller]]:
    """The routes this server serves, in the order the OpenAPI schema lists them."""
    served: list[type[Controller]] = [
        HealthController,
        MetricsController,
        ModelsController,
        CompletionsController,
        ChatController,
        MessagesController,
        ResponsesController,
        EmbeddingsController,
        TokenizeController,
        DetokenizeController,
        PrefixCacheController,
    ]
    if settings.runtime_lora_updates:
        served.append(AdaptersController)
    if settings.chat_page:
        served.append(ChatPageController)
    return served


def create_app(engine: EngineClient, settings: ServerSettings) -> Litestar:
    serving = Serving(engine, settings)
    return Litestar(
        route_handlers=controllers(settings),
        dependencies={"serving": Provide(lambda: serving, sync_to_thread=False)},
        middleware=[serving.metrics.middleware],
        exception_handlers={Exception: handle_exception, RequestError: request_error_handler()},
        request_class=BodyRequest,
        request_max_body_size=settings.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="compiled_engine",
            version="0.1.0",
            path="/docs",
            render_plugins=[PlainDocsRenderPlugin(), JsonRenderPlugin()],
        ),
        # Litestar would otherwise reconfigure the root logger of whatever process embeds the app.
        logging_config=LoggingConfig(configure_root_logger=False),
    )
