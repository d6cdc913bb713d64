"""Waiting for a state, not for a time: `wait_until` polls a condition until it holds. Its deadline
only guards against a hang (generous, and the same on any machine); a test asserts the state it
waited for (a count, a gauge, a log line), never how long it took to come."""

from __future__ import annotations

import time
from collections.abc import Callable

HANG_GUARD_S = 60.0


def wait_until(
    condition: Callable[[], bool],
    what: str,
    describe: Callable[[], object] | None = None,
    timeout_s: float = HANG_GUARD_S,
    poll_s: float = 0.02,
) -> None:
    """Return once `condition()` holds; an AssertionError naming `what` (and `describe()`, the
    state last seen) if it still does not after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            seen = f" (last seen: {describe()})" if describe is not None else ""
            raise AssertionError(f"never happened: {what}{seen}")
        time.sleep(poll_s)
