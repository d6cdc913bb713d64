"""vLLM's KV-cache events: the config in vLLM's schema, the wire form a vLLM subscriber decodes,
and a ZMQ subscriber that follows an engine's prefix cache (stores, prefix hits, evictions) to
exactly the pages its block manager holds, live and by replay."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from compiled_engine.cache.events import AllPagesCleared, PagesRemoved, PageStored
from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.serving.kv_events import UINT64, KVEventsConfig, ZmqEventPublisher, wire_events
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("one_thread")


# A subscriber's own copy of vLLM's structs (as vLLM's example subscriber declares them).
class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def test_the_config_takes_vllms_json_and_refuses_the_rest() -> None:
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"}')
    assert config.publishes and config.endpoint == "tcp://*:5557" and config.buffer_steps == 10_000
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    assert not KVEventsConfig.parse("{}").publishes
    with pytest.raises(ValueError, match="unknown field `endpont`"):
        KVEventsConfig.parse('{"endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="publisher must be 'zmq' or 'null'"):
        KVEventsConfig.parse('{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="--kv-events-config"):
        KVEventsConfig.parse("{not json")
    replica = KVEventsConfig(True, "zmq", "tcp://*:5557", "tcp://*:5560").for_replica(2)
    assert (replica.endpoint, replica.replay_endpoint) == ("tcp://*:5559", "tcp://*:5562")
    assert KVEventsConfig(endpoint="tcp://*:0").for_replica(1).endpoint == "tcp://*:0"
    assert KVEventsConfig(endpoint="inproc://kv").for_replica(1).endpoint == "inproc://kv_dp1"
    with pytest.raises(ValueError, match="its own endpoint"):
        KVEventsConfig(endpoint="ipc:///tmp/kv").for_replica(1)


def test_a_run_of_pages_is_one_block_stored_in_vllms_wire_form() -> None:
    events = wire_events(
        [
            PageStored(-5, None, (1, 2)),
            PageStored(7, -5, (3, 4)),  # continues the run
            PageStored(9, 100, (5, 6)),  # another parent: a new event
            PagesRemoved((-5,)),
            AllPagesCleared(),
        ],
        page_size=2,
        medium="CPU",
    )
    payload = msgspec.msgpack.encode(KVEventBatch(1.5, events, 0))  # type: ignore[arg-type]
    raw: Any = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3  # [ts, events, rank], as vLLM and Dynamo read it
    assert raw[1][0]["type"] == "BlockStored"
    assert raw[1][0]["block_hashes"] == [-5 & UINT64, 7] and raw[1][0]["parent_block_hash"] is None
    assert raw[1][0]["token_ids"] == [1, 2, 3, 4] and raw[1][0]["block_size"] == 2 and raw[1][0]["medium"] == "CPU"
    assert raw[1][1]["parent_block_hash"] == 100
    assert raw[1][2] == {"type": "BlockRemoved", "block_hashes": [-5 & UINT64], "medium": "CPU"}
    assert raw[1][3] == {"type": "AllBlocksCleared"}
    assert DECODER.decode(payload).events[0] == BlockStored([-5 & UINT64, 7], None, [1, 2, 3, 4], 2, None, "CPU")


def _received(
    sub: Any, expected: set[int], timeout_s: float = 10.0, at_least: int = 1
) -> list[tuple[int, KVEventBatch]]:
    """Every batch until there are `at_least`, the subscriber's mirror of them holds `expected`,
    and nothing more comes."""
    found: list[tuple[int, KVEventBatch]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            found.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        elif len(found) >= at_least and _mirror(found) == expected:
            break
    return found


def _mirror(batches: list[tuple[int, KVEventBatch]]) -> set[int]:
    held: set[int] = set()
    for _, batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            else:
                held.clear()
    return held


def test_a_subscriber_follows_the_prefix_cache_through_hits_and_evictions(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model_dir = tiny_model_factory("llama")
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), enforce_eager=True, page_size=4, num_pages=12), record_cache_events=True
    )
    config = KVEventsConfig(True, "zmq", "tcp://*:0", "tcp://*:0", topic="kv-events")
    publisher = ZmqEventPublisher(config, page_size=4, medium="CPU", data_parallel_rank=0)
    port = publisher.endpoint.rsplit(":", 1)[1]
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    time.sleep(0.5)  # a PUB drops what it sends before the subscription arrives
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    cached: dict[str, int] = {}
    try:
        prompts = {
            "first": list(range(10, 27)),  # four full pages
            "again": list(range(10, 27)),  # the same prompt: its pages are hits, not stored again
            "other": list(range(40, 70)),  # seven pages: some of the first prompt's are evicted
            "third": list(range(80, 110)),
        }
        for name, prompt in prompts.items():
            engine.add_request(prompt, greedy, request_id=name)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        cached[output.request_id] = output.num_cached_tokens
                publisher.publish(engine.take_cache_events())
        expected = {key & UINT64 for key in engine.block_manager.cached_page_keys()}
        live = _received(sub, expected)
        assert expected  # something is cached, to clear next
        assert cached["again"] == 16 and cached["first"] == 0
        assert engine.block_manager.stats.evictions > 0
        stored = [event for _, batch in live for event in batch.events if isinstance(event, BlockStored)]
        removed = [event for _, batch in live for event in batch.events if isinstance(event, BlockRemoved)]
        assert removed, "the evictions were not reported"
        all_stored = [key for event in stored for key in event.block_hashes]
        assert len(all_stored) == len(set(all_stored)), "a prefix hit stored its pages again"
        assert _mirror(live) == expected
        assert [seq for seq, _ in live] == list(range(len(live)))
        assert {batch.data_parallel_rank for _, batch in live} == {0}
        # A late subscriber catches up through the replay socket: the same batches, then the end.
        dealer = context.socket(zmq.DEALER)
        assert publisher.replay_endpoint is not None
        dealer.connect(f"tcp://127.0.0.1:{publisher.replay_endpoint.rsplit(':', 1)[1]}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[2] == b"\xff" * 8:
                break
            replayed.append((int.from_bytes(frames[2], "big"), DECODER.decode(frames[3])))
        assert [seq for seq, _ in replayed] == list(range(1, len(live)))
        assert [batch.events for _, batch in replayed] == [batch.events for _, batch in live[1:]]
        dealer.close(linger=0)
        # A reset reaches the subscriber as AllBlocksCleared, and its mirror empties with the cache.
        assert engine.reset_prefix_cache()
        publisher.publish(engine.take_cache_events())
        cleared = _received(sub, set())
        assert [type(event) for _, batch in cleared for event in batch.events] == [AllBlocksCleared]
        assert engine.block_manager.cached_page_keys() == set()
    finally:
        sub.close(linger=0)
        publisher.close()


class _HeldSocket:
    """A PUB socket whose first send waits until `release` is set (the sender thread held)."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket
        self.sending = threading.Event()
        self.release = threading.Event()

    def send_multipart(self, frames: Any) -> None:
        self.sending.set()
        assert self.release.wait(30)
        self.socket.send_multipart(frames)

    def close(self, linger: int) -> None:
        self.socket.close(linger=linger)


def test_a_batch_dropped_on_a_full_queue_leaves_a_gap_in_the_sequence_numbers() -> None:
    """A subscriber sees that it missed a batch (and can ask for a replay or resync)."""
    config = KVEventsConfig(True, "zmq", "tcp://*:0", topic="kv-events", max_queue_size=1)
    publisher = ZmqEventPublisher(config, page_size=4, medium="CPU")
    port = publisher.endpoint.rsplit(":", 1)[1]
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    time.sleep(0.5)  # a PUB drops what it sends before the subscription arrives
    held = _HeldSocket(publisher._pub)
    publisher._pub = held
    try:
        batches = [[PageStored(1000 + i, None, (1, 2, 3, 4))] for i in range(4)]
        publisher.publish(batches[0])  # taken by the sender thread, which is held in its send
        assert held.sending.wait(10)
        publisher.publish(batches[1])  # fills the queue
        publisher.publish(batches[2])  # dropped
        assert publisher.dropped == 1
        held.release.set()
        wait_until(publisher._queue.empty, "the queued batch taken by the sender")
        publisher.publish(batches[3])
        received = _received(sub, {1000, 1001, 1003}, at_least=3)
        assert [seq for seq, _ in received] == [0, 1, 3]
    finally:
        held.release.set()
        sub.close(linger=0)
        publisher.close()
