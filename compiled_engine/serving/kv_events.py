"""vLLM's KV-cache events over ZMQ, so that cache-aware routers (llm-d's precise prefix scorer,
Dynamo's KV router, vLLM's own examples) can follow our prefix cache as they follow vLLM's.

`serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'` takes vLLM's schema.

The wire is vLLM's, from 0.24.0 to 0.34.0 (`tests/test_kv_events_wire.py` pins v0.34.0):
- each engine step that changed the cache sends one message of three frames on a PUB socket: the
  topic, the sequence number (8 bytes, big-endian, from 0), and a msgpack `EventBatch`;
- an `EventBatch` is the array `[ts, [event, ...], data_parallel_rank]`;
- each event is a map tagged by `type`: `BlockStored` (a run of consecutive full pages: their
  hashes, the hash of the page before them, their tokens, the page size), `BlockRemoved` (evicted
  pages' hashes), `AllBlocksCleared`;
- hashes are the prefix cache's own page keys as unsigned 64-bit integers, chained through
  `parent_block_hash` exactly as the cache chains them;
- with a `replay_endpoint`, a ROUTER socket answers `[identity, b"", start_seq]` with every
  buffered message from `start_seq` on (`[b"", topic, seq, payload]` each), then `[b"", b"",
  b"\\xff" * 8, b""]`, so a subscriber that missed messages can catch up.

The endpoint binds when it holds `*` or `::` or is `ipc://`/`inproc://`, and connects otherwise
(the subscriber binds), as vLLM does. A data-parallel replica i publishes on the endpoints' port
plus i (port 0 is left alone) with `data_parallel_rank` i.

Sending runs on a thread of its own that owns the sockets (ZMQ sockets are not thread-safe): the
engine loop only converts its events and queues them, and a full queue drops the batch with a
warning rather than slow the engine. Batches are numbered as they are queued, so a dropped one
leaves a gap in the sequence numbers that a subscriber can see (and then resynchronize).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec

from compiled_engine.cache.events import AllPagesCleared, CacheEvent, PagesRemoved, PageStored

logger = logging.getLogger(__name__)

UINT64 = (1 << 64) - 1
END_OF_REPLAY = b"\xff" * 8


class KVEventsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """vLLM's `--kv-events-config`, field for field."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches the replay socket keeps
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the sender thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv events {name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The JSON of `--kv-events-config`; a ValueError naming what is wrong."""
        try:
            return msgspec.json.decode(text, type=cls)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ValueError(f"--kv-events-config: {exc}") from None

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    def for_replica(self, index: int) -> KVEventsConfig:
        """The endpoints of data-parallel replica `index`: each TCP port plus `index`."""
        return msgspec.structs.replace(
            self,
            endpoint=offset_endpoint(self.endpoint, index),
            replay_endpoint=None if self.replay_endpoint is None else offset_endpoint(self.replay_endpoint, index),
        )


def offset_endpoint(endpoint: str, index: int) -> str:
    if index == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{index}"
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit():
            return endpoint if port == "0" else f"{host}:{int(port) + index}"
    raise ValueError(f"cannot give data-parallel replica {index} its own endpoint from {endpoint!r}")


# -- the wire structs: vLLM's names, fields and order -------------------------------------------


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def wire_events(events: Sequence[CacheEvent], page_size: int, medium: str) -> list[KVEvent]:
    """The cache's events as vLLM's: consecutive stored pages (each the parent of the next) in one
    `BlockStored`, as vLLM reports a run of blocks that became full together."""
    found: list[KVEvent] = []
    for event in events:
        if isinstance(event, PageStored):
            last = found[-1] if found else None
            parent = None if event.parent_key is None else event.parent_key & UINT64
            if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
                last.block_hashes.append(event.key & UINT64)
                last.token_ids.extend(event.token_ids)
            else:
                found.append(
                    BlockStored([event.key & UINT64], parent, list(event.token_ids), page_size, None, medium, None)
                )
        elif isinstance(event, PagesRemoved):
            found.append(BlockRemoved([key & UINT64 for key in event.keys], medium))
        elif isinstance(event, AllPagesCleared):
            found.append(AllBlocksCleared())
    return found


class ZmqEventPublisher:
    """Publishes one engine's cache events (`publish`, from the engine's loop) on its endpoints."""

    def __init__(self, config: KVEventsConfig, page_size: int, medium: str, data_parallel_rank: int = 0) -> None:
        import zmq  # pyzmq, only where events are published

        self.config = config
        self.page_size = page_size
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self.dropped = 0  # batches dropped because the queue was full
        self._encoder = msgspec.msgpack.Encoder()
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._context: Any = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if _binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the port chosen, for ":0"
        self._replay: Any = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            self._replay.bind(config.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0  # numbered as published: a batch dropped leaves a gap subscribers see
        self._thread = threading.Thread(target=self._send_loop, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[CacheEvent]) -> None:
        if not events:
            return
        batch = EventBatch(time.time(), wire_events(events, self.page_size, self.medium), self.data_parallel_rank)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, self._encoder.encode(batch)))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("kv events: the queue is full; %d batches dropped so far", self.dropped)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (for up to `timeout_s`), then close the sockets."""
        with contextlib.suppress(queue.Full):  # else the thread, a daemon, ends with the process
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout=timeout_s)

    def _send_loop(self) -> None:
        import zmq

        topic = self.config.topic.encode()
        try:
            while True:
                self._answer_replays()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    return
                seq, payload = item
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
        except zmq.ZMQError:
            logger.exception("kv events: the publisher stopped")
        finally:
            self._pub.close(linger=500)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _answer_replays(self) -> None:
        import zmq

        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("kv events: a replay request of %d frames was ignored", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            topic = self.config.topic.encode()
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((identity, b"", topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", b"", END_OF_REPLAY, b""))


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
