"""The stored responses that `previous_response_id` and `GET`/`DELETE /v1/responses/{id}` reach:
in memory, bounded in count and in age, each visible only to the API key that made it."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compiled_engine.server.responses.protocol import ResponseObject

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    turns: list[dict[str, Any]]  # the conversation up to and including this response's output
    salt: str | None  # the cache salt of the API key that made it
    stored_at: float


class ResponseStore:
    """The newest `max_responses` responses younger than `max_age_s`; older ones are dropped
    as new ones come (and are not found once too old)."""

    def __init__(
        self,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_responses < 0 or max_age_s <= 0:
            raise ValueError("the response store needs max_responses >= 0 and max_age_s > 0")
        self.max_responses = max_responses
        self.max_age_s = max_age_s
        self._clock = clock
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._drop_old()
        return len(self._responses)

    def put(self, response: ResponseObject, turns: list[dict[str, Any]], salt: str | None) -> None:
        self._responses[response.id] = StoredResponse(response, turns, salt, self._clock())
        self._drop_old()
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str, salt: str | None) -> StoredResponse | None:
        self._drop_old()
        stored = self._responses.get(response_id)
        return stored if stored is not None and stored.salt == salt else None

    def delete(self, response_id: str, salt: str | None) -> bool:
        if self.get(response_id, salt) is None:
            return False
        del self._responses[response_id]
        return True

    def _drop_old(self) -> None:
        limit = self._clock() - self.max_age_s
        while self._responses:
            oldest = next(iter(self._responses.values()))
            if oldest.stored_at > limit:
                break
            self._responses.popitem(last=False)
