"""The pieces of data parallelism that need no model: page keys the same in every process, the
cache events the block manager records, the router's choice, the cores and GPUs each replica
gets, and the replicas' stats added up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from compiled_engine.cache.block_manager import BlockManager
from compiled_engine.cache.events import AllPagesCleared, PagesRemoved, PageStored, prompt_page_keys, salt_key
from compiled_engine.engine.stats import EngineStats, SummedDraftStats, summed_stats
from compiled_engine.serving.placement import Placement, cpu_placements, cuda_placements, threads_for
from compiled_engine.serving.routing import PrefixRouter

PAGE = 4


def test_page_keys_are_the_same_in_another_process() -> None:
    """A front end computes a prompt's keys in its process; the replica registered them in its
    own. Python salts str hashes per process, so only integer-built keys can agree."""
    tokens = list(range(3, 40))
    code = (
        "from compiled_engine.cache.events import prompt_page_keys, salt_key;"
        f"print(prompt_page_keys({tokens}, salt_key('tenant', None, None), {PAGE}))"
    )
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    ours = prompt_page_keys(tokens, salt_key("tenant", None, None), PAGE)
    assert theirs.strip() == str(ours)
    assert len(ours) == (len(tokens) - 1) // PAGE
    assert prompt_page_keys(tokens, salt_key("other", None, None), PAGE)[0] != ours[0]


def _computed(manager: BlockManager, tokens: list[int], salt: int) -> list[int]:
    table: list[int] = []
    manager.grow(table, len(tokens))
    keys: list[int] = []
    manager.register_full_pages(table, keys, tokens, len(tokens), salt)
    manager.free(table)
    return keys


def test_the_block_manager_reports_stored_and_evicted_pages_by_the_keys_a_prompt_has() -> None:
    manager = BlockManager(num_pages=3, page_size=PAGE, record_events=True)
    salt = salt_key(None, None, None)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full pages, a partial one
    keys = _computed(manager, first, salt)
    assert keys == prompt_page_keys(first, salt, PAGE)
    assert manager.take_events() == [
        PageStored(keys[0], None, (1, 2, 3, 4)),
        PageStored(keys[1], keys[0], (5, 6, 7, 8)),
    ]
    assert manager.take_events() == []  # handed over once
    # Three pages for another prompt: the free one and the two cached ones, oldest first.
    other = _computed(manager, [9] * 12, salt)
    events = manager.take_events()
    assert PagesRemoved((keys[0],)) in events and PagesRemoved((keys[1],)) in events
    assert [event.key for event in events if isinstance(event, PageStored)] == other
    quiet = BlockManager(num_pages=3, page_size=PAGE)  # not recording: nothing kept
    _computed(quiet, first, salt)
    assert quiet.take_events() == []


def test_the_router_prefers_the_replica_that_caches_the_prompt_unless_it_is_overloaded() -> None:
    router = PrefixRouter(3, PAGE, balance_slack=2)
    keys = prompt_page_keys(list(range(20)), 7, PAGE)
    router.apply(1, [PageStored(keys[0], None, (0, 1, 2, 3)), PageStored(keys[1], keys[0], (4, 5, 6, 7))])
    router.apply(2, [PageStored(keys[0], None, (0, 1, 2, 3))])
    route = router.choose(keys)
    assert (route.replica, route.cached_pages, route.by_prefix) == (1, 2, True)
    router.replicas[1].in_flight = 2  # within the slack of the least loaded (0)
    assert router.choose(keys).replica == 1
    router.replicas[1].in_flight = 3  # overloaded: the next best cache, replica 2, is within the slack
    assert router.choose(keys).replica == 2
    router.replicas[2].in_flight = 3
    route = router.choose(keys)  # both caches overloaded: the least loaded, with no cache
    assert (route.replica, route.cached_pages, route.by_prefix) == (0, 0, False)
    router.apply(1, [PagesRemoved((keys[1],))])
    assert router.cached_pages(1, keys) == 1
    router.apply(1, [AllPagesCleared()])
    assert router.cached_pages(1, keys) == 0


def test_the_router_spreads_requests_of_equal_load_and_skips_dead_replicas() -> None:
    router = PrefixRouter(3, PAGE)
    assert [router.choose([]).replica for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    router.replicas[0].in_flight = 1
    assert {router.choose([]).replica for _ in range(4)} == {1, 2}
    router.replicas[1].cached_keys.add(5)
    router.mark_dead(1)
    assert router.cached_pages(1, [5]) == 0
    assert {router.choose([5]).replica for _ in range(4)} == {2}
    router.mark_dead(0)
    router.mark_dead(2)
    with pytest.raises(LookupError, match="no replica is alive"):
        router.choose([])


def test_replicas_split_the_cores_and_the_gpus() -> None:
    assert cpu_placements(2, [0, 1]) == [Placement((0,)), Placement((1,))]
    assert cpu_placements(2, [0, 1, 2, 3, 4]) == [Placement((0, 1, 2)), Placement((3, 4))]
    assert cpu_placements(3, [4, 5]) == [Placement((4,)), Placement((5,)), Placement((4,))]  # shared round robin
    assert threads_for(Placement((0, 1, 2, 3)), 2) == 2 and threads_for(Placement((0,)), 2) == 1
    assert threads_for(Placement(), 1) is None
    found = cuda_placements(2, 2, ["0", "1", "5", "7"])
    assert [p.cuda_devices for p in found] == ["0,1", "5,7"]
    with pytest.raises(ValueError, match="needs 4 GPUs; 3 are visible"):
        cuda_placements(2, 2, ["0", "1", "2"])


def test_the_replicas_stats_add_up() -> None:
    a = EngineStats(2, 1, 100, 40, 50, 20, weight_bytes=10, lora_max=4, lora_running=("x",))
    b = EngineStats(1, 0, 100, 90, 10, 0, weight_bytes=10, lora_max=4, lora_running=("y", "x"))
    total = summed_stats([a, b])
    assert (total.running_requests, total.waiting_requests, total.kv_pages_total, total.kv_pages_free) == (
        3,
        1,
        200,
        130,
    )
    assert (total.prefix_queried_tokens, total.prefix_hit_tokens, total.weight_bytes) == (60, 20, 20)
    assert total.lora_max == 8 and total.lora_running == ("x", "y") and total.speculative is None
    spec = summed_stats(
        [
            EngineStats(0, 0, 1, 1, 0, 0, speculative=SummedDraftStats(2, 8, 5, [2, 2, 1])),
            EngineStats(0, 0, 1, 1, 0, 0, speculative=SummedDraftStats(1, 4, 1, [1])),
        ]
    ).speculative
    assert spec == SummedDraftStats(3, 12, 6, [3, 2, 1])
    assert summed_stats([a]) is a


def test_a_replicas_log_lines_name_it_in_text_and_in_json() -> None:
    import logging

    from compiled_engine.logs import JsonFormatter

    record = logging.LogRecord("compiled_engine.x", logging.INFO, __file__, 1, "KV cache ready", None, None)
    assert json.loads(JsonFormatter({"engine": "1"}).format(record))["engine"] == "1"
    assert "engine" not in json.loads(JsonFormatter().format(record))
    code = (
        "import logging; from compiled_engine.logs import configure_logging;"
        "configure_logging('text', engine='1'); logging.getLogger('compiled_engine.x').info('ready')"
    )
    line = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr.strip()
    assert line == "INFO [engine 1] compiled_engine.x: ready"
