"""An engine request's stream of outputs under an HTTP connection: a stream's first output before
its 200, a failure after it as the API's own last event, whole replies that a disconnect cancels,
batches whose first failure cancels the rest; and the framing of every streamed reply as
server-sent events. Cancelling an engine stream aborts its request, which returns its pages at the
next step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import msgspec
from litestar import Request
from litestar.response import Stream

from compiled_engine.engine.outputs import RequestOutput
from compiled_engine.server.common.deltas import StepDeltas, choice_deltas
from compiled_engine.server.common.errors import ApiError, ServerError, server_error

logger = logging.getLogger(__name__)

DONE = "[DONE]"  # OpenAI's last event of a stream

T = TypeVar("T")

# A stream's last event when it fails after its 200: the failure, and how many events were sent
# before it (the Responses API numbers its events).
FailureEvent = Callable[[ServerError, int], bytes]


def sse(payload: msgspec.Struct | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else msgspec.json.encode(payload)
    return b"data: " + data + b"\n\n"


def named_sse(name: str, payload: msgspec.Struct) -> bytes:
    """An event that names itself (`event:`), as the Messages and Responses streams send them."""
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"


class EventStream(Stream):
    """A Stream of server-sent events. Litestar lets the route's media type (JSON, for these
    routes) override a Stream's own, so the SSE type is forced here."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = "text/event-stream"
        return super().to_asgi_response(*args, **kwargs)


async def event_stream(
    outputs: AsyncIterator[RequestOutput],
    events: Callable[[AsyncIterator[StepDeltas]], AsyncIterator[bytes]],
    failed: FailureEvent,
) -> Stream:
    """The SSE reply that `events` makes of the request's choice deltas. The first output is
    awaited here, so that a refused request fails with its status code before the stream (and
    its 200) starts; a failure after that (a lost replica, a dead engine loop) ends the stream
    with the event `failed` makes of it, never with a cut connection."""
    try:
        first: RequestOutput | None = await outputs.__anext__()
    except StopAsyncIteration:
        first = None
    return EventStream(
        _ending_on_failure(events(choice_deltas(first, outputs)), failed), media_type="text/event-stream"
    )


async def _ending_on_failure(events: AsyncIterator[bytes], failed: FailureEvent) -> AsyncIterator[bytes]:
    sent = 0
    try:
        async for event in events:
            yield event
            sent += 1
    except Exception as exc:  # a cancelled stream (the client left) is not caught: nobody reads
        error = server_error(exc)
        if error.status == 500:
            logger.exception("a stream failed after its first event")
        else:
            logger.warning("a stream failed after its first event: %s", error.message)
        yield failed(error, sent)


async def unless_disconnected(request: Request[Any, Any, Any], work: Coroutine[Any, Any, T]) -> T:
    """Run `work` (a non-streamed reply) while watching the connection: a client that goes away
    first cancels it, which aborts its requests and returns their pages at the next step."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ApiError(
                499, "the client closed the connection; its request was aborted", code="client_closed_request"
            )
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    """Returns when the client disconnects (the body has been read, so nothing else arrives)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    assert final is not None
    return final


async def final_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run the streams together. The first to fail (a refused prompt of a batch) cancels the
    others, which aborts their requests and returns their pages, and its error is raised."""
    tasks = [asyncio.ensure_future(final_output(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        # Wait until the cancelled ones have aborted, and collect every error so that none is
        # logged as never retrieved.
        await asyncio.gather(*tasks, return_exceptions=True)
