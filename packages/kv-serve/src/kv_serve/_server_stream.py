"""Running a prepared request on the engine thread: the one loop every API drains events with.

:class:`RequestRunner` submits a request's sequences to the
:class:`~kv_serve._server_worker.EngineWorker`, takes their events into each sequence's text
(:meth:`RequestRunner.absorb`), aborts whatever still runs when the client leaves or the
request ends, and accounts the request in the server's metrics. A whole answer is
:meth:`RequestRunner.collect`; a server-sent-event stream is :meth:`RequestRunner.stream`,
which leaves the events' wire format to a :class:`StreamFormat` of the API.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kv_batching import TokenLogprob
from kv_protocol import RequestStateError

from ._server_metrics import ServerMetrics
from ._server_protocol import OpenAIError
from ._server_requests import PreparedRequest, Prompt
from ._server_text import CompletionText, TokenTexts
from ._server_tools import OutputSplitter, ToolCall, split_piece
from ._server_worker import (
    EngineWorker,
    Event,
    QueueFullError,
    Submission,
    Ticket,
    WorkerStoppedError,
)

__all__ = [
    "ClientGone",
    "RequestRunner",
    "RequestSequence",
    "StreamFormat",
    "engine_error",
    "sse",
]

#: How often a waiting handler checks whether its client is still there, seconds.
_DISCONNECT_POLL = 0.25


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


class RequestSequence:
    """One generated sequence of a request, as its events arrive."""

    def __init__(
        self, prompt_index: int, rank: int, prompt: Prompt, ticket: Ticket, text: CompletionText
    ) -> None:
        self.prompt_index = prompt_index
        self.rank = rank
        self.prompt = prompt
        self.ticket = ticket
        self.text = text
        self.entries: list[TokenLogprob] = []
        self.prompt_entries: tuple[TokenLogprob | None, ...] | None = None
        #: Prompt tokens the prefix cache served (its prefill skipped).
        self.cached_tokens = 0
        self.finish: str | None = None
        self.started = False
        #: Splits the output into content, reasoning and tool calls (chat requests with
        #: tools; every chat request on a harmony model).
        self.tools: OutputSplitter | None = None

    def score(self) -> float:
        """Mean log-probability of its tokens under the model (``best_of`` ranks by it)."""
        kept = self.entries[: len(self.text.tokens)]
        return sum(e.logprob for e in kept) / len(kept) if kept else -math.inf

    def tool_finish(self) -> str | None:
        """``tool_calls`` for a sequence that ended after calling a tool, else its reason."""
        splitter = self.tools
        if splitter is not None and splitter.calls and self.finish == "stop":
            return "tool_calls"
        return self.finish

    def stream_output(self, piece: str, last: bool) -> tuple[str, str, list[ToolCall]]:
        """A streamed step's text to show, reasoning and calls (``last``: the output ended)."""
        splitter = self.tools
        if splitter is None:
            return piece, "", []
        shown, calls = split_piece(splitter, piece, last=last)
        return shown, splitter.take_reasoning(), calls

    def streamed_output(self) -> tuple[str, str, list[ToolCall]]:
        """A streamed sequence's whole text, reasoning and calls, once it ended."""
        splitter = self.tools
        if splitter is None:
            return self.text.text, "", []
        return splitter.content, splitter.reasoning, list(splitter.calls)

    def split_output(self) -> tuple[str, list[ToolCall]]:
        """A finished, unstreamed sequence's content and tool calls (its splitter fed it all)."""
        splitter = self.tools
        if splitter is None:
            return self.text.text, []
        split_piece(splitter, self.text.text, last=True)
        return splitter.content, list(splitter.calls)


class StreamFormat(Protocol):
    """How one API writes a streamed request's events (server-sent events, one str each)."""

    def opening(self) -> Iterable[str]:
        """What the stream starts with, before any of its text."""

    def piece(self, sequence: RequestSequence, piece: str, seen: int, ended: bool) -> str:
        """What a sequence's new ``piece`` sends ("" for nothing); its tokens ``seen:`` are new."""

    def failed(self, sequence: RequestSequence, seen: int) -> str:
        """What a sequence the engine failed mid-stream sends before the stream ends."""

    def closing(self, error: OpenAIError | None) -> Iterable[str]:
        """What the stream ends with, once every sequence ended (``error``: the engine's)."""


def sse(payload: Mapping[str, Any]) -> str:
    """``payload`` as one server-sent ``data:`` event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def engine_error(event: Event) -> OpenAIError:
    """The answer to a request the engine refused (400) or failed on (500)."""
    error = event.error
    if isinstance(error, RequestStateError):
        return OpenAIError(400, f"the engine refused the request: {error}")
    return OpenAIError(
        500,
        f"the engine failed on this request: {error!r}",
        type="server_error",
        code="engine_error",
    )


def _finish_reason(reason: str) -> str:
    # "pool_exhausted" is out of context memory: the completion was cut for length.
    return {"stop": "stop", "length": "length", "pool_exhausted": "length"}.get(reason, reason)


class _AbortingStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however the stream ends (disconnects too)."""

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], None],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class RequestRunner:
    """Runs prepared requests on the engine worker and accounts them in ``metrics``."""

    def __init__(self, worker: EngineWorker, tokenizer: Any, metrics: ServerMetrics) -> None:
        self.worker = worker
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.texts = TokenTexts(tokenizer)

    def submit(
        self, prepared: PreparedRequest
    ) -> tuple[list[RequestSequence], asyncio.Queue[Event]]:
        """Queue the request's sequences (``best_of`` per prompt); their events' queue.

        A full queue is a 429 with ``Retry-After``; a stopped engine a 503.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        request = prepared.request
        texts = self.texts if request.logprobs is not None else None
        sequences: list[RequestSequence] = []
        submissions: list[Submission] = []
        for p, prompt in enumerate(prepared.prompts):
            tickets = []
            for rank in range(request.best_of):
                ticket = Ticket(loop, index=len(sequences), events=events)
                text = CompletionText(
                    self.tokenizer,
                    stop=request.stop,
                    eos_ids=prepared.hidden,
                    min_tokens=request.sampling.min_tokens,
                    texts=texts,
                )
                sequence = RequestSequence(p, rank, prompt, ticket, text)
                sequence.tools = prepared.tool_text()
                sequences.append(sequence)
                tickets.append(ticket)
            submissions.append(Submission(tuple(tickets), prompt.tokens, prompt.params))
        try:
            self.worker.submit_batch(submissions)
        except QueueFullError as err:
            raise OpenAIError(
                429,
                str(err),
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except WorkerStoppedError as err:
            raise OpenAIError(503, str(err), type="server_error", code="engine_stopped") from None
        return sequences, events

    def abort_all(self, sequences: list[RequestSequence]) -> None:
        """Abort every sequence still running (a no-op for those that ended)."""
        for sequence in sequences:
            self.worker.abort(sequence.ticket)

    async def wait(self, events: asyncio.Queue[Event], http: Request | None) -> Event:
        """The next event; with ``http``, raise :class:`ClientGone` if the client left."""
        if http is None:
            return await events.get()
        while True:
            try:
                return await asyncio.wait_for(events.get(), _DISCONNECT_POLL)
            except TimeoutError:
                if await http.is_disconnected():
                    raise ClientGone from None

    def absorb(
        self, prepared: PreparedRequest, sequence: RequestSequence, event: Event
    ) -> tuple[str, bool]:
        """Take an event into its sequence: the text to send now, and whether it ended.

        Raises the request's :class:`OpenAIError` when the engine failed the sequence.
        """
        if event.prompt_logprobs is not None:
            sequence.prompt_entries = event.prompt_logprobs
        if event.cached_tokens is not None:
            sequence.cached_tokens = event.cached_tokens
        piece = ""
        if event.tokens and not prepared.echo_only:
            piece = sequence.text.push(event.tokens)
            sequence.entries.extend(event.logprobs)
            if sequence.text.stopped:
                self.worker.abort(sequence.ticket)
                sequence.finish = "stop"
                return piece, True
        if not event.done:
            return piece, False
        sequence.ticket.closed = True
        if event.finish_reason in ("error", "aborted"):
            sequence.finish = "error"
            raise engine_error(event)
        if prepared.echo_only:
            sequence.finish = "length"
        else:
            sequence.finish = _finish_reason(str(event.finish_reason))
            piece += sequence.text.finish()
        return piece, True

    def account(
        self, prepared: PreparedRequest, sequences: list[RequestSequence], start: float
    ) -> None:
        """Count the request in the metrics: its finish, tokens and latency since ``start``."""
        reason = next((s.finish for s in sequences if s.finish == "error"), None)
        reason = reason or sequences[0].finish or "error"
        generated = sum(s.text.completion_tokens for s in sequences)
        self.metrics.finished(
            reason, prepared.prompt_tokens, generated, time.perf_counter() - start
        )

    async def collect(self, prepared: PreparedRequest, http: Request) -> list[RequestSequence]:
        """Run the request to its end; its sequences with their texts and finish reasons."""
        sequences, events = self.submit(prepared)
        start = time.perf_counter()
        first: float | None = None
        try:
            remaining = len(sequences)
            while remaining:
                event = await self.wait(events, http)
                sequence = sequences[event.index]
                if sequence.finish is not None:
                    continue  # what an aborted sequence still had on its way
                if event.tokens and first is None:
                    first = time.perf_counter()
                    self.metrics.first_token.observe(first - start)
                try:
                    _, ended = self.absorb(prepared, sequence, event)
                except OpenAIError:
                    self.account(prepared, sequences, start)
                    raise
                remaining -= ended
        finally:
            self.abort_all(sequences)  # a no-op unless the handler leaves early
        self.account(prepared, sequences, start)
        return sequences

    async def stream(
        self,
        prepared: PreparedRequest,
        http: Request,
        fmt: Callable[[list[RequestSequence]], StreamFormat],
        headers: Mapping[str, str] | None = None,
    ) -> StreamingResponse:
        """Run the request as a server-sent-event stream written by ``fmt(sequences)``.

        The client leaving aborts every sequence still running. ``headers`` are added to
        the response's.
        """
        sequences, events = self.submit(prepared)
        start = time.perf_counter()
        # Wait for the first event before answering, so a request that fails before its
        # first token (prefill error, refused by the engine) still gets its status code.
        try:
            first = await self.wait(events, http)
        except BaseException:
            self.abort_all(sequences)
            raise
        if first.done and first.finish_reason in ("error", "aborted"):
            self.abort_all(sequences)
            sequences[first.index].finish = "error"
            self.account(prepared, sequences, start)
            raise engine_error(first)
        self.metrics.first_token.observe(time.perf_counter() - start)
        out = fmt(sequences)

        async def chunks() -> AsyncIterator[str]:
            for chunk in out.opening():
                yield chunk
            error: OpenAIError | None = None
            remaining = len(sequences)
            event: Event | None = first
            last = time.perf_counter()
            while remaining:
                if event is None:
                    event = await events.get()
                    now = time.perf_counter()
                    if event.tokens:
                        self.metrics.inter_token.observe(now - last)
                        last = now
                sequence = sequences[event.index]
                arrived, event = event, None
                if sequence.finish is not None:
                    continue  # what an aborted sequence still had on its way
                seen = len(sequence.text.tokens)
                try:
                    piece, ended = self.absorb(prepared, sequence, arrived)
                except OpenAIError as err:
                    error = err
                    chunk = out.failed(sequence, seen)
                    if chunk:
                        yield chunk
                    break
                chunk = out.piece(sequence, piece, seen, ended)
                if chunk:
                    yield chunk
                remaining -= ended
            self.abort_all(sequences)
            self.account(prepared, sequences, start)
            for chunk in out.closing(error):
                yield chunk

        return _AbortingStream(chunks(), lambda: self.abort_all(sequences), headers)
