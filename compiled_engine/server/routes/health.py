"""`GET /health` (liveness), `GET /ready` (readiness) and `GET /metrics` (Prometheus)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from compiled_engine.server.errors import error_response
from compiled_engine.server.serving import Serving


class HealthController(Controller):
    @get("/health", sync_to_thread=False)
    def health(self) -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @get("/ready", sync_to_thread=False)
    def ready(self, serving: NamedDependency[Serving]) -> Response[Any]:
        """Readiness: the model is loaded and the engine loop is alive and admitting."""
        if not serving.engine.is_alive:
            return error_response(503, "the engine loop is not running", "service_unavailable")
        if not serving.engine.accepting:
            return error_response(503, "the server is shutting down", "service_unavailable")
        return Response({"status": "ready"})


class MetricsController(Controller):
    @get("/metrics", sync_to_thread=False, media_type="text/plain; version=0.0.4")
    def prometheus(self, serving: NamedDependency[Serving]) -> bytes:
        """Prometheus metrics: requests, tokens, latencies, queue, KV pages, prefix cache."""
        return serving.metrics.render()
