"""`serve`: load the engine, start its loop, and run the app under uvicorn until a signal."""

from __future__ import annotations

import functools
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn

from compiled_engine.cache.events import CacheEvent
from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.server.app import ServerSettings, create_app
from compiled_engine.serving.client import EngineClient
from compiled_engine.serving.handle import ThreadHandle
from compiled_engine.serving.kv_events import KVEventsConfig, ZmqEventPublisher
from compiled_engine.serving.loop import build_engine
from compiled_engine.serving.replica import replica_handles

logger = logging.getLogger("compiled_engine.server")

# Seconds uvicorn waits, past the grace period, for the streams aborted then to send their end.
ABORTED_STREAMS_END_S = 3


def run_server(
    config: EngineConfig,
    host: str,
    port: int,
    api_keys: tuple[str, ...],
    served_model_name: str | None,
    max_waiting_requests: int,
    max_body_bytes: int,
    shutdown_grace_s: float,
    lora_modules: dict[str, str] | None = None,
    runtime_lora_updates: bool = False,
    chat_page: bool = True,
    request_log: bool = True,
    log_prompts: bool = False,
    log_format: str = "text",
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    kv_events: KVEventsConfig | None = None,
) -> int:
    started = time.perf_counter()
    lora_modules = dict(lora_modules or {})
    if (lora_modules or runtime_lora_updates) and not config.enable_lora:
        raise ValueError("--lora-modules and --enable-runtime-lora-updates need --enable-lora")
    publishers = _EventPublishers(kv_events, config)
    client: EngineClient
    if config.data_parallel_size > 1:
        front_end = EngineClient(
            replica_handles(config, lora_modules, log_format), max_waiting_requests, publishers.publish
        )
        front_end.start()
        client = front_end
    else:
        client = _start_engine(config, lora_modules, max_waiting_requests, publishers)
        _log_loaded(client.engine, time.perf_counter() - started)
    name = served_model_name or (config.model or "SmolLM2-135M-Instruct")
    if name in lora_modules:
        raise ValueError(f"the adapter name {name!r} is the served model's name")
    settings = ServerSettings(
        name,
        api_keys,
        max_body_bytes,
        lora_modules,
        runtime_lora_updates,
        chat_page,
        request_log,
        log_prompts,
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
    )
    app = create_app(client, settings)
    app.on_shutdown.append(lambda: client.shutdown(grace_s=shutdown_grace_s))
    logger.info("serving on http://%s:%d/v1 (OpenAPI schema at /docs/openapi.json)", host, port)
    if chat_page:
        logger.info("chat page: http://%s:%d/", host, port)
    config_ = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        # Past the grace period the requests still in flight are aborted (`on_grace_expired`);
        # uvicorn closes connections only after that, so aborted streams still send their end.
        timeout_graceful_shutdown=math.ceil(shutdown_grace_s) + ABORTED_STREAMS_END_S,
        # JSON logs: uvicorn's own lines go through the root handler too, as JSON.
        log_config=None if log_format == "json" else uvicorn.config.LOGGING_CONFIG,
    )
    server = _DrainingServer(config_, client.stop_accepting, shutdown_grace_s, client.abort_all)
    if client.watched:
        threading.Thread(
            target=_exit_when_the_loop_dies, args=(client, server), name="engine-watchdog", daemon=True
        ).start()
    try:
        server.run()
    finally:
        client.shutdown(grace_s=0)  # drained already, unless uvicorn never started
        publishers.close()
    return 1 if client.error is not None else 0


class _EventPublishers:
    """The KV-event publishers of `--kv-events-config`: one per engine (a replica's on its
    endpoints' ports plus its index), bound at start, so that a taken port fails the start."""

    def __init__(self, config: KVEventsConfig | None, engine_config: EngineConfig) -> None:
        if config is not None and config.enable_kv_cache_events and not engine_config.enable_prefix_caching:
            logger.warning("--kv-events-config: the prefix cache is off (--no-prefix-caching), so no event comes")
        medium = "GPU" if engine_config.resolved_device().type == "cuda" else "CPU"
        self._publishers: dict[int, ZmqEventPublisher] = {}
        if config is not None and config.publishes:
            for index in range(engine_config.data_parallel_size):
                publisher = ZmqEventPublisher(config.for_replica(index), engine_config.page_size, medium, index)
                logger.info("kv events of engine %d: %s", index, publisher.endpoint)
                self._publishers[index] = publisher

    @property
    def enabled(self) -> bool:
        return bool(self._publishers)

    def publish(self, index: int, events: list[CacheEvent]) -> None:
        if events and index in self._publishers:
            self._publishers[index].publish(events)

    def close(self) -> None:
        for publisher in self._publishers.values():
            publisher.close()


def _start_engine(
    config: EngineConfig, lora_modules: dict[str, str], max_waiting_requests: int, publishers: _EventPublishers
) -> EngineClient:
    """The engine loop, started, with the adapters of `--lora-modules` loaded."""
    record = publishers.enabled
    sink = publishers.publish if record else None
    # The engine is built on the loop thread that will run it (see serving/handle.py).
    handle = ThreadHandle(functools.partial(build_engine, config, lora_modules, record))
    client = EngineClient([handle], max_waiting_requests, sink)
    client.start()
    return client


def _log_loaded(engine: LLMEngine, load_s: float) -> None:
    runner = engine.runner
    logger.info(
        "model %s loaded in %.1f s on %s, dtype %s; KV cache %d pages of %d tokens; max_model_len %d; "
        "weights %.2f GiB, KV cache %.2f GiB",
        engine.model_dir,
        load_s,
        runner.device,
        str(runner.dtype).removeprefix("torch."),
        runner.num_pages,
        runner.page_size,
        engine.max_model_len,
        engine.weight_bytes / 2**30,
        engine.kv_cache_bytes / 2**30,
    )


def _exit_when_the_loop_dies(
    client: EngineClient, server: uvicorn.Server, poll_s: float = 1.0, not_ready_s: float = 2.0
) -> None:
    """With tensor parallelism a lost rank cannot be brought back from this process: once a
    worker is gone (the client's watchdog checks, even when idle) or the loop has died, report not
    ready for a moment (load balancers see it), then exit non-zero. With data-parallel replicas,
    the same once the last one is gone."""
    while client.is_alive:
        time.sleep(poll_s)
    if client.error is not None:
        logger.error("the engine died (%s); the server exits", client.error)
        time.sleep(not_ready_s)
        server.should_exit = True


class _DrainingServer(uvicorn.Server):
    """uvicorn drains on SIGINT/SIGTERM, then re-raises the signal so the process dies of it; a
    drained shutdown is a clean one, so we exit 0 instead. `on_drain` runs as the signal arrives:
    from then on every new request, on a new or a kept-alive connection, is refused with 503 and
    Retry-After (uvicorn alone would still serve kept-alive ones until its loop notices).
    `on_grace_expired` runs `grace_s` later if the server is still draining: it aborts what is
    still in flight, so that streams end with finish reason `abort` instead of a cut connection."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_drain: Callable[[], None] | None = None,
        grace_s: float = 0.0,
        on_grace_expired: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.on_drain = on_drain
        self.grace_s = grace_s
        self.on_grace_expired = on_grace_expired
        self._grace_timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.on_drain is not None:
            self.on_drain()
        if self.on_grace_expired is not None and self._grace_timer is None:
            self._grace_timer = threading.Timer(self.grace_s, self.on_grace_expired)
            self._grace_timer.daemon = True
            self._grace_timer.start()
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


@contextmanager
def serve_in_background(client: EngineClient, served_model_name: str = "bench") -> Iterator[str]:
    """Our server for `client` (started) on a free loopback port, in a thread of this
    process, for the serving bench. Yields the base URL; stops the server and the engine loop on
    exit."""
    app = create_app(client, ServerSettings(served_model_name))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = int(listener.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, name="bench-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        client.shutdown(grace_s=5)
        listener.close()
