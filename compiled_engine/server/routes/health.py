"""`GET /health` (liveness), `GET /ready` (readiness) and `GET /metrics` (Prometheus)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from compiled_engine.server.common.errors import error_response
from compiled_engine.server.serving import Serving


class HealthController(Controller):
    @get("/health", sync_to_thread=False)
    def health(self, serving: NamedDependency[Serving]) -> Response[Any]:
        """Liveness: the process answers. With data-parallel replicas it lists them, and a replica
        lost makes the status `degraded` (still 200: the others serve); none left is a 503."""
        replicas = serving.engine.health()
        if len(replicas) == 1:
            return Response({"status": "ok"})
        alive = sum(replica.alive for replica in replicas)
        body = {
            "status": "ok" if alive == len(replicas) else "degraded" if alive else "dead",
            "engines": [
                {
                    "engine": str(replica.index),
                    "alive": replica.alive,
                    **({"error": replica.error} if replica.error else {}),
                }
                for replica in replicas
            ],
        }
        return Response(body, status_code=200 if alive else 503)

    @get("/ready", sync_to_thread=False)
    def ready(self, serving: NamedDependency[Serving]) -> Response[Any]:
        """Readiness: the model is loaded and an engine loop is alive and admitting."""
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
