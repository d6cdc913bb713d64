"""Our KV events against vLLM's own wire schema, not against our reading of it.

The structs below declare the schema of vLLM v0.34.0 (PyPI `vllm==0.34.0`, built from commit
62d4bc3c7, as its `vllm/_version.py` records it), `vllm/distributed/kv_events.py`: the same class
and field names, field order, defaults and msgspec options (`array_like`, `omit_defaults`, `tag`),
so they encode and decode exactly as vLLM's do. Golden payloads encoded by that schema must decode
to what they hold, and what our ZMQ publisher really sends must decode with it into the events we
published: the same values, fields and key order vLLM would have sent for them.

Which vLLM releases read the same wire (checked against each release's `kv_events.py`):
- 0.24.0 to 0.34.0: the batch is the array `[ts, events, data_parallel_rank]`, each event a map
  tagged by `type`. Later releases only added optional fields with defaults (0.26 `locality`, 0.29
  `ownership`, 0.30 `session_id`, 0.33 `lookahead_token_ids`): a decoder of any of them reads ours.
- 0.23.0 and older: each event is itself an array, `["BlockStored", hashes, parent, ...]`; a
  decoder built for those reads neither ours nor vLLM's 0.24+ (checked below).
- Hashes are `bytes | int`: vLLM 0.34.0 sends 64-bit integers by default
  (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) and 32-byte digests otherwise; ours are integers.
Our side only publishes: it never decodes a payload, so none of vLLM's is read with our structs.
"""

from __future__ import annotations

import time
from typing import Any, TypeAlias

import msgspec
import pytest
import zmq

from compiled_engine.cache.events import AllPagesCleared, PagesRemoved, PageStored
from compiled_engine.serving import kv_events
from compiled_engine.serving.kv_events import UINT64, KVEventsConfig, ZmqEventPublisher

# -- vLLM v0.34.0's schema (commit 62d4bc3c7): names, order, defaults and options as vLLM has them --

ExternalBlockHash: TypeAlias = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM = msgspec.msgpack.Decoder(KVEventBatch)


# -- vLLM 0.23.0's event form (the last before 0.24.0 made events maps): only to show it differs --
# (Renamed to live beside the structs above; each tag keeps vLLM's name.)


class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class OldAllBlocksCleared(OldKVCacheEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(EventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


# -- golden payloads, encoded by the schema above ----------------------------------------------------

# What vLLM 0.34.0 sends with integer hashes (its default), data-parallel rank 1: a run of two
# blocks, a LoRA block with every optional field vLLM may add, an eviction and a reset.
GOLDEN_INT = bytes.fromhex(
    "93cb41da556e4010000094de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf01"
    "23456789abcdefcffedcba9876543210b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739801"
    "02030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e61"
    "6d65c0de0010a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573912ab1706172656e745f62"
    "6c6f636b5f68617368cffedcba9876543210a9746f6b656e5f69647394090a0b0caa626c6f636b5f73697a6504a76c"
    "6f72615f696407a66d656469756da3475055a96c6f72615f6e616d65ab73716c2d61646170746572aa65787472615f"
    "6b6579739191ab73716c2d61646170746572a967726f75705f69647800b26b765f63616368655f737065635f6b696e"
    "64ae66756c6c5f617474656e74696f6ebc6b765f63616368655f737065635f736c6964696e675f77696e646f77cd10"
    "00a86c6f63616c697479a54c4f43414ca96f776e657273686970a3637075aa73657373696f6e5f6964a3732d31b36c"
    "6f6f6b61686561645f746f6b656e5f69647391920d0e84a474797065ac426c6f636b52656d6f766564ac626c6f636b"
    "5f68617368657391cf0123456789abcdefa66d656469756da3475055a967726f75705f6964780081a474797065b041"
    "6c6c426c6f636b73436c656172656401"
)
GOLDEN_INT_BATCH = KVEventBatch(
    1767225600.25,
    [
        BlockStored([0x0123456789ABCDEF, 0xFEDCBA9876543210], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None),
        BlockStored(
            [42],
            0xFEDCBA9876543210,
            [9, 10, 11, 12],
            4,
            7,
            "GPU",
            "sql-adapter",
            extra_keys=[("sql-adapter",)],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            kv_cache_spec_sliding_window=4096,
            locality="LOCAL",
            ownership="cpu",
            session_id="s-1",
            lookahead_token_ids=[[13, 14]],
        ),
        BlockRemoved([0x0123456789ABCDEF], "GPU", group_idx=0),
        AllBlocksCleared(),
    ],
    1,
)

# With `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` (32-byte digests) and no rank (an array-like struct
# keeps its defaults: the rank goes as nil).
DIGEST_A, DIGEST_B = bytes(range(32)), bytes(range(32, 64))
GOLDEN_BYTES = bytes.fromhex(
    "93cb41da556e4010000092de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c420"
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fb1706172656e745f626c6f636b5f68"
    "617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756d"
    "a3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573"
    "92c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fc42020212223242526272829"
    "2a2b2c2d2e2f303132333435363738393a3b3c3d3e3fa66d656469756da3475055c0"
)
GOLDEN_BYTES_BATCH = KVEventBatch(
    1767225600.25,
    [BlockStored([DIGEST_A], None, [1, 2, 3, 4], 4, None, "GPU", None), BlockRemoved([DIGEST_A, DIGEST_B], "GPU")],
)


def _same_wire(payload: bytes, batch: KVEventBatch) -> None:
    """`payload` is what vLLM's encoder writes for `batch`: the same msgpack values, every map's keys
    in vLLM's order, and no field vLLM lacks (a strict subscriber refuses fields it does not know).
    Only the width of a map's header may differ, which no msgpack reader sees."""
    ours: Any = msgspec.msgpack.decode(payload)
    theirs: Any = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert ours == theirs
    assert [list(event) for event in ours[1]] == [list(event) for event in theirs[1]]


@pytest.mark.parametrize(
    ("golden", "batch"), [(GOLDEN_INT, GOLDEN_INT_BATCH), (GOLDEN_BYTES, GOLDEN_BYTES_BATCH)], ids=["int", "bytes"]
)
def test_vllms_golden_payloads_decode_with_its_schema(golden: bytes, batch: KVEventBatch) -> None:
    assert VLLM.decode(golden) == batch
    assert msgspec.msgpack.encode(batch) == golden  # the schema above is the one that wrote them
    raw: Any = msgspec.msgpack.decode(golden)
    assert isinstance(raw, list) and len(raw) == 3 and isinstance(raw[1][0], dict)
    assert [event["type"] for event in raw[1]] == [type(event).__name__ for event in batch.events]


def test_our_encoding_is_vllms_field_for_field() -> None:
    """Each event kind, the widest hashes and a run of pages, without the socket."""
    events = kv_events.wire_events(
        [PageStored(-1, None, (7,) * 4), PageStored(1, -1, (8,) * 4), PagesRemoved((-1,)), AllPagesCleared()],
        page_size=4,
        medium="CPU",
    )
    payload = msgspec.msgpack.Encoder().encode(kv_events.EventBatch(12.5, events, 0))
    expected = KVEventBatch(
        12.5,
        [
            BlockStored([UINT64, 1], None, [7] * 4 + [8] * 4, 4, None, "CPU", None),
            BlockRemoved([UINT64], "CPU"),
            AllBlocksCleared(),
        ],
        0,
    )
    assert VLLM.decode(payload) == expected
    _same_wire(payload, expected)


def test_what_our_publisher_sends_decodes_as_vllms_events() -> None:
    config = KVEventsConfig(True, "zmq", "tcp://*:0", topic="kv-events")
    publisher = ZmqEventPublisher(config, page_size=4, medium="GPU", data_parallel_rank=2)
    sub: Any = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{publisher.endpoint.rsplit(':', 1)[1]}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    time.sleep(0.5)  # a PUB drops what it sends before the subscription arrives
    root, child, other = -0x0123456789ABCDEF, 0x7EDCBA9876543210, 99
    try:
        publisher.publish([PageStored(root, None, (1, 2, 3, 4)), PageStored(child, root, (5, 6, 7, 8))])
        publisher.publish([PageStored(other, child, (9, 10, 11, 12)), PagesRemoved((root, child)), AllPagesCleared()])
        received = []
        for _ in range(2):
            assert sub.poll(10_000), "no batch came"
            received.append(sub.recv_multipart())
    finally:
        sub.close(linger=0)
        publisher.close()
    assert [(topic, int.from_bytes(seq, "big")) for topic, seq, _ in received] == [(b"kv-events", 0), (b"kv-events", 1)]
    first, second = (VLLM.decode(payload) for _, _, payload in received)
    assert first.data_parallel_rank == second.data_parallel_rank == 2
    assert first.events == [BlockStored([root & UINT64, child], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None)]
    assert second.events == [
        BlockStored([other], child, [9, 10, 11, 12], 4, None, "GPU", None),
        BlockRemoved([root & UINT64, child], "GPU"),
        AllBlocksCleared(),
    ]
    stored = first.events[0]
    assert isinstance(stored, BlockStored) and stored.block_size == 4 and stored.parent_block_hash is None
    assert (stored.lora_id, stored.lora_name, stored.medium) == (None, None, "GPU")
    assert stored.extra_keys is None and stored.group_idx is None and stored.lookahead_token_ids is None
    for (_, _, payload), batch in zip(received, (first, second), strict=True):
        _same_wire(payload, batch)


def test_a_subscriber_built_for_vllm_0_23_or_older_reads_neither_ours_nor_vllms() -> None:
    ours = msgspec.msgpack.encode(
        kv_events.EventBatch(1.0, kv_events.wire_events([PageStored(5, None, (1, 2))], 2, "GPU"), 0)
    )
    old = msgspec.msgpack.Decoder(OldKVEventBatch)
    for payload in (ours, GOLDEN_INT):
        with pytest.raises(msgspec.ValidationError, match="Expected `array`, got `object`"):
            old.decode(payload)
