"""``kv-serve serve``: an OpenAI-compatible HTTP server on one engine thread.

FastAPI on uvicorn (the stack vLLM and SGLang use). The endpoints run on uvicorn's event
loop and never touch MLX: prompts are tokenized there and handed to the
:class:`~kv_serve._server_worker.EngineWorker`, whose thread owns MLX and the
``DecodeEngine``; tokens come back per request and are decoded there incrementally
(:class:`~kv_serve._server_text.CompletionText`: no split UTF-8 characters, stop strings
matched across token boundaries). A client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kv_batching import DecodeEngine
from kv_pool import pages_per_request
from kv_protocol import RequestStateError, check_int, kv_quantization_choice

from ._engine import build_engine
from ._load import stop_token_ids
from ._server_protocol import (
    CompletionRequest,
    OpenAIError,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from ._server_text import CompletionText
from ._server_worker import (
    EngineWorker,
    Event,
    QueueFullError,
    SamplingParams,
    Ticket,
    WorkerStoppedError,
)

__all__ = ["KVServer", "RunningServer", "ServerMetrics"]

logger = logging.getLogger("kv_serve.server")

#: Latency histogram bucket bounds, seconds (Prometheus ``le``).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: How often a waiting handler checks whether its client is still there, seconds.
_DISCONNECT_POLL = 0.25


class _ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


class _Histogram:
    """A fixed-bucket histogram (bounded memory, Prometheus cumulative buckets)."""

    def __init__(self) -> None:
        self.counts = [0] * len(_BUCKETS)
        self.total = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.total += 1
        self.sum += seconds
        for i, bound in enumerate(_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                break

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip(_BUCKETS, self.counts, strict=True):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.total}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.total}")
        return out


class ServerMetrics:
    """Request counters and latency histograms of a server (updated on its event loop)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests: dict[str, int] = {}
        self.rejected: dict[int, int] = {}
        self.latency = _Histogram()
        self.first_token = _Histogram()
        self.inter_token = _Histogram()

    def finished(self, reason: str, prompt: int, generated: int, seconds: float) -> None:
        """Account a request that ran (whatever its end)."""
        self.requests[reason] = self.requests.get(reason, 0) + 1
        self.prompt_tokens += prompt
        self.generation_tokens += generated
        self.latency.observe(seconds)

    def reject(self, status: int) -> None:
        """Account a request answered with an error status before or instead of running."""
        self.rejected[status] = self.rejected.get(status, 0) + 1


@dataclass
class _Prepared:
    """A checked request with its prompt tokens and engine parameters."""

    request: CompletionRequest
    prompt: list[int]
    params: SamplingParams
    chat: bool


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _sse(payload: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _AbortingStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however the stream ends (disconnects too)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class KVServer:
    """An OpenAI-compatible server of one model: endpoints, engine thread, metrics.

    ``make_engine`` (default: :func:`kv_serve.build_engine` with the sizing arguments) runs on
    the engine thread. Requests whose prompt plus ``max_tokens`` exceed ``max_context``, or
    that could never fit the pool even alone, are refused with 400 at once; at most
    ``max_queued`` requests wait for admission (429 with ``Retry-After`` beyond).
    ``prefill_stall`` bounds how long a prompt's prefill may hold up the streams decoding
    beside it, and ``kv_bits`` / ``kv_group_size`` / ``kv_quantize`` store the pool's pages
    quantized (see :func:`kv_serve.build_engine`).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        model_name: str,
        max_running: int = 16,
        max_queued: int = 128,
        max_context: int = 4096,
        kv_budget_bytes: int | None = None,
        page_size: int = 16,
        prefill_chunk: int = 512,
        seed: int = 0,
        prefix_caching: bool = True,
        prefill_stall: float | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        kv_quantize: str = "all",
        make_engine: Callable[[], DecodeEngine] | None = None,
    ) -> None:
        # Refuse a bad quantization here, not later on the engine thread.
        kv_quantization_choice(kv_bits, kv_group_size, kv_quantize)
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_context = check_int(max_context, "max_context", minimum=1)
        max_running = check_int(max_running, "max_running", minimum=1)
        max_queued = check_int(max_queued, "max_queued", minimum=0)
        if make_engine is None:

            def make_engine() -> DecodeEngine:
                return build_engine(
                    model,
                    kv_budget_bytes=kv_budget_bytes,
                    page_size=page_size,
                    max_running=max_running,
                    max_context=self.max_context,
                    prefill_chunk=prefill_chunk,
                    seed=seed,
                    record_pages=False,
                    prefix_caching=prefix_caching,
                    prefill_stall=prefill_stall,
                    kv_bits=kv_bits,
                    kv_group_size=kv_group_size,
                    kv_quantize=kv_quantize,
                )

        self.worker = EngineWorker(make_engine, max_queued=max_queued)
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self._eos: frozenset[int] = frozenset()
        self.app = self._build_app()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the engine thread (builds the engine there)."""
        self.worker.start()
        vocab = self.worker.vocab_size
        self._eos = frozenset(t for t in stop_token_ids(self.tokenizer) if t < vocab)
        limits = ", ".join(
            f"{s.name}: {s.num_pages} x {s.page_size}" for s in self.worker.pool_limits
        )
        logger.info("engine ready: vocab %d, pool %s", vocab, limits)

    def stop(self) -> None:
        """Stop the engine thread."""
        self.worker.stop()

    def serve(self, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info") -> None:
        """Start the engine and serve HTTP on ``host:port`` until interrupted."""
        import uvicorn

        self.start()
        try:
            uvicorn.run(self.app, host=host, port=port, log_level=log_level, access_log=False)
        finally:
            self.stop()

    @contextlib.contextmanager
    def running(self, host: str = "127.0.0.1", port: int = 0) -> Iterator[RunningServer]:
        """Start the engine and uvicorn on a thread; stop both when the block ends.

        ``port=0`` picks a free port; the block gets a :class:`RunningServer` with the URL.
        """
        import socket

        import uvicorn

        self.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        config = uvicorn.Config(self.app, log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="kv-serve-http", daemon=True
        )
        thread.start()
        try:
            deadline = time.monotonic() + 30.0
            while not server.started:
                if not thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("uvicorn did not start")
                time.sleep(0.01)
            bound = sock.getsockname()
            yield RunningServer(self, f"http://{bound[0]}:{bound[1]}")
        finally:
            server.should_exit = True
            thread.join(30.0)
            sock.close()
            self.stop()

    # ------------------------------------------------------------------ requests

    def _check_model(self, request: CompletionRequest) -> None:
        if request.model != self.model_name:
            raise OpenAIError(
                404,
                f"The model {request.model!r} does not exist; this server serves "
                f"{self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _chat_tokens(self, request: CompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(
                400,
                f"this model's tokenizer has no chat template: {self.model_name!r} cannot serve "
                "/v1/chat/completions; use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        try:
            ids: Any = self.tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=True
            )
        except Exception as err:  # a template's raise_exception (roles out of order, ...)
            raise OpenAIError(
                400, f"the chat template refused the messages: {err}", param="messages"
            ) from None
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def _prompt_tokens(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list):
            vocab = self.worker.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise OpenAIError(
                    400,
                    f"prompt token ids must be in 0..{vocab - 1}, got {bad[0]}",
                    param="prompt",
                )
            return list(prompt)
        return [int(i) for i in self.tokenizer.encode(prompt)]

    def _fit(self, prompt_tokens: int, max_tokens: int) -> None:
        total = prompt_tokens + max_tokens
        if total > self.max_context:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, "
                f"you requested {total} tokens ({prompt_tokens} in the prompt, {max_tokens} in "
                "the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        layout = self.worker.layout
        limits = self.worker.pool_limits
        if layout is None or not limits:
            return
        # A request alone needs at least this many pages (prefilled a token at a time).
        needs = pages_per_request(
            layout,
            max_context=total,
            page_size={s.name: s.page_size for s in limits},
            prefill_chunk=1,
        )
        for sub in limits:
            usable = sub.num_pages - 1
            if needs.get(sub.name, 0) > usable:
                raise OpenAIError(
                    400,
                    f"the request can never fit the KV pool: {prompt_tokens} prompt + "
                    f"{max_tokens} completion tokens need {needs[sub.name]} pages of sub-pool "
                    f"{sub.name!r}, which has {usable}; reduce the prompt or max_tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )

    def _prepare(self, body: dict[str, Any], *, chat: bool) -> _Prepared:
        request = parse_chat_request(body) if chat else parse_completion_request(body)
        self._check_model(request)
        prompt = self._chat_tokens(request) if chat else self._prompt_tokens(request)
        if not prompt:
            raise OpenAIError(400, "the prompt encodes to no tokens", param="prompt")
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.max_context - len(prompt))
        self._fit(len(prompt), max_tokens)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stop_tokens=self._eos,
            # OpenAI's seed may be negative; the engine's stream takes 0 .. 2**64 - 1.
            seed=None if request.seed is None else request.seed % 2**64,
        )
        return _Prepared(request, prompt, params, chat)

    def _submit(self, prepared: _Prepared) -> Ticket:
        ticket = Ticket(asyncio.get_running_loop())
        try:
            self.worker.submit(ticket, prepared.prompt, prepared.params)
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
        return ticket

    @staticmethod
    def _engine_error(event: Event) -> OpenAIError:
        error = event.error
        if isinstance(error, RequestStateError):
            return OpenAIError(400, f"the engine refused the request: {error}")
        return OpenAIError(
            500,
            f"the engine failed on this request: {error!r}",
            type="server_error",
            code="engine_error",
        )

    @staticmethod
    def _finish_reason(reason: str) -> str:
        # "pool_exhausted" is out of context memory: the completion was cut for length.
        return {"stop": "stop", "length": "length", "pool_exhausted": "length"}.get(reason, reason)

    def _usage(self, prompt: int, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    async def _wait(self, ticket: Ticket, http: Request | None) -> Event:
        """The ticket's next event; with ``http``, abort if its client goes away meanwhile."""
        if http is None:
            return await ticket.events.get()
        while True:
            try:
                return await asyncio.wait_for(ticket.events.get(), _DISCONNECT_POLL)
            except TimeoutError:
                if await http.is_disconnected():
                    self.worker.abort(ticket)
                    raise _ClientGone from None

    def _choice(
        self, prepared: _Prepared, text: str, reason: str | None, tokens: list[int] | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if prepared.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = reason
        if tokens is not None:
            choice["token_ids"] = tokens
        return choice

    async def _complete(self, prepared: _Prepared, http: Request) -> Response:
        ticket = self._submit(prepared)
        text = CompletionText(self.tokenizer, stop=prepared.request.stop, eos_ids=self._eos)
        start = time.perf_counter()
        first: float | None = None
        try:
            while True:
                event = await self._wait(ticket, http)
                if event.tokens:
                    if first is None:
                        first = time.perf_counter()
                        self.metrics.first_token.observe(first - start)
                    text.push(event.tokens)
                    if text.stopped:
                        self.worker.abort(ticket)
                        reason = "stop"
                        break
                if event.done:
                    ticket.closed = True
                    if event.finish_reason == "error" or event.finish_reason == "aborted":
                        self._account(prepared, text, "error", start)
                        raise self._engine_error(event)
                    reason = self._finish_reason(str(event.finish_reason))
                    text.finish()
                    break
        finally:
            self.worker.abort(ticket)  # a no-op unless the handler leaves early
        self._account(prepared, text, reason, start)
        kind = "chat.completion" if prepared.chat else "text_completion"
        ids = list(text.tokens) if prepared.request.return_token_ids else None
        body = {
            "id": f"{'chatcmpl' if prepared.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [self._choice(prepared, text.text, reason, ids)],
            "usage": self._usage(len(prepared.prompt), text.completion_tokens),
        }
        return JSONResponse(body)

    def _account(
        self, prepared: _Prepared, text: CompletionText, reason: str, start: float
    ) -> None:
        self.metrics.finished(
            reason, len(prepared.prompt), text.completion_tokens, time.perf_counter() - start
        )

    async def _stream(self, prepared: _Prepared, http: Request) -> Response:
        ticket = self._submit(prepared)
        start = time.perf_counter()
        # Wait for the first event before answering, so a request that fails before its
        # first token (prefill error, refused by the engine) still gets its status code.
        try:
            first = await self._wait(ticket, http)
        except BaseException:
            self.worker.abort(ticket)
            raise
        if first.done:
            ticket.closed = True
        if first.done and first.finish_reason in ("error", "aborted"):
            self.metrics.finished("error", len(prepared.prompt), 0, time.perf_counter() - start)
            raise self._engine_error(first)
        self.metrics.first_token.observe(time.perf_counter() - start)
        rid = f"{'chatcmpl' if prepared.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        chat = prepared.chat
        want_ids = prepared.request.return_token_ids

        def chunk(piece: str | None, reason: str | None, ids: list[int] | None) -> str:
            choice: dict[str, Any] = {"index": 0}
            if chat:
                choice["delta"] = {} if piece is None else {"content": piece}
            else:
                choice["text"] = piece or ""
            choice["logprobs"] = None
            choice["finish_reason"] = reason
            if want_ids and ids is not None:
                choice["token_ids"] = ids
            payload = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
            }
            return _sse(payload)

        async def events() -> AsyncIterator[str]:
            text = CompletionText(self.tokenizer, stop=prepared.request.stop, eos_ids=self._eos)
            reason = "error"
            error: OpenAIError | None = None
            event: Event | None = first
            last = time.perf_counter()
            if chat:
                yield _sse(
                    {
                        "id": rid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": self.model_name,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            while True:
                if event is None:
                    event = await ticket.events.get()
                    now = time.perf_counter()
                    if event.tokens:
                        self.metrics.inter_token.observe(now - last)
                        last = now
                if event.tokens:
                    seen = len(text.tokens)
                    piece = text.push(event.tokens)
                    if piece or want_ids:
                        yield chunk(piece, None, text.tokens[seen:])
                    if text.stopped:
                        self.worker.abort(ticket)
                        reason = "stop"
                        break
                if event.done:
                    ticket.closed = True
                    if event.finish_reason in ("error", "aborted"):
                        error = self._engine_error(event)
                        reason = "error"
                    else:
                        reason = self._finish_reason(str(event.finish_reason))
                    tail = text.finish() if error is None else ""
                    if tail:
                        yield chunk(tail, None, [])
                    break
                event = None
            self._account(prepared, text, reason, start)
            yield chunk(None if chat else "", reason, None)
            if error is not None:
                yield _sse(error.body())
            if prepared.request.include_usage:
                yield _sse(
                    {
                        "id": rid,
                        "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": self._usage(len(prepared.prompt), text.completion_tokens),
                    }
                )
            yield "data: [DONE]\n\n"

        return _AbortingStream(events(), on_close=lambda: self.worker.abort(ticket))

    async def _handle(self, http: Request, *, chat: bool) -> Response:
        try:
            body = parse_json_body(await http.body())
            prepared = self._prepare(body, chat=chat)
            if prepared.request.stream:
                return await self._stream(prepared, http)
            return await self._complete(prepared, http)
        except OpenAIError as err:
            self.metrics.reject(err.status)
            return _error_response(err)
        except _ClientGone:
            self.metrics.reject(499)
            return _error_response(OpenAIError(499, "the client disconnected", code="client_gone"))

    # ------------------------------------------------------------------ metrics

    def metrics_text(self) -> str:
        """The Prometheus text exposition of the server's state."""
        snap = self.worker.snapshot()
        m = self.metrics
        lines = [
            "# HELP kv_serve_up Whether the engine thread runs.",
            "# TYPE kv_serve_up gauge",
            f"kv_serve_up {int(snap.alive)}",
            "# HELP kv_serve_requests_running Requests decoding in the engine.",
            "# TYPE kv_serve_requests_running gauge",
            f"kv_serve_requests_running {snap.running}",
            "# HELP kv_serve_requests_queued Requests waiting for admission.",
            "# TYPE kv_serve_requests_queued gauge",
            f"kv_serve_requests_queued {self.worker.waiting}",
            "# HELP kv_serve_engine_requests Requests the engine keeps (active, unreleased).",
            "# TYPE kv_serve_engine_requests gauge",
            f"kv_serve_engine_requests {snap.engine_requests}",
            "# HELP kv_serve_pool_pages_used KV pages in use per sub-pool.",
            "# TYPE kv_serve_pool_pages_used gauge",
        ]
        lines += [
            f'kv_serve_pool_pages_used{{sub_pool="{n}"}} {v}' for n, v in snap.pages_used.items()
        ]
        lines += [
            "# HELP kv_serve_pool_pages_total KV pages per sub-pool (null page included).",
            "# TYPE kv_serve_pool_pages_total gauge",
        ]
        lines += [
            f'kv_serve_pool_pages_total{{sub_pool="{n}"}} {v}' for n, v in snap.pages_total.items()
        ]
        lines += [
            "# HELP kv_serve_pool_kv_bits Bits per value of a sub-pool's quantized KV pages "
            "(0: the model's dtype).",
            "# TYPE kv_serve_pool_kv_bits gauge",
        ]
        lines += [f'kv_serve_pool_kv_bits{{sub_pool="{n}"}} {v}' for n, v in snap.kv_bits.items()]
        lines += [
            "# HELP kv_serve_state_bytes Bytes of recurrent state the running requests hold.",
            "# TYPE kv_serve_state_bytes gauge",
            f"kv_serve_state_bytes {snap.state_bytes}",
            "# HELP kv_serve_prefix_cache_hit_tokens_total Prompt tokens reused from the prefix "
            "cache instead of prefilled.",
            "# TYPE kv_serve_prefix_cache_hit_tokens_total counter",
            f"kv_serve_prefix_cache_hit_tokens_total {snap.prefix_hit_tokens}",
            "# HELP kv_serve_prefix_cache_pages Pages no request holds that keep a prompt "
            "prefix for reuse (evictable).",
            "# TYPE kv_serve_prefix_cache_pages gauge",
            f"kv_serve_prefix_cache_pages {snap.prefix_cached_pages}",
            "# HELP kv_serve_prefix_cache_evictions_total Cached prefix pages evicted.",
            "# TYPE kv_serve_prefix_cache_evictions_total counter",
            f"kv_serve_prefix_cache_evictions_total {snap.prefix_evictions}",
            "# HELP kv_serve_engine_steps_total Engine steps.",
            "# TYPE kv_serve_engine_steps_total counter",
            f"kv_serve_engine_steps_total {snap.steps}",
            "# HELP kv_serve_engine_preemptions_total Requests preempted back to the queue.",
            "# TYPE kv_serve_engine_preemptions_total counter",
            f"kv_serve_engine_preemptions_total {snap.preemptions}",
            "# HELP kv_serve_prompt_tokens_total Prompt tokens of finished requests.",
            "# TYPE kv_serve_prompt_tokens_total counter",
            f"kv_serve_prompt_tokens_total {m.prompt_tokens}",
            "# HELP kv_serve_generation_tokens_total Tokens generated for finished requests.",
            "# TYPE kv_serve_generation_tokens_total counter",
            f"kv_serve_generation_tokens_total {m.generation_tokens}",
            "# HELP kv_serve_requests_total Requests that ran, by finish reason.",
            "# TYPE kv_serve_requests_total counter",
        ]
        lines += [
            f'kv_serve_requests_total{{finish_reason="{r}"}} {n}' for r, n in m.requests.items()
        ]
        lines += [
            "# HELP kv_serve_requests_rejected_total Requests answered with an error status.",
            "# TYPE kv_serve_requests_rejected_total counter",
        ]
        lines += [
            f'kv_serve_requests_rejected_total{{status="{s}"}} {n}' for s, n in m.rejected.items()
        ]
        for name, hist, what in (
            ("kv_serve_request_latency_seconds", m.latency, "Seconds from arrival to the end."),
            ("kv_serve_time_to_first_token_seconds", m.first_token, "Seconds to the first token."),
            (
                "kv_serve_inter_token_latency_seconds",
                m.inter_token,
                "Seconds between streamed steps.",
            ),
        ):
            lines += [f"# HELP {name} {what}", f"# TYPE {name} histogram"]
            lines += hist.lines(name)
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ app

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kv-serve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            error = OpenAIError(exc.status_code, str(exc.detail), type=kind)
            return _error_response(error)

        @app.exception_handler(Exception)
        async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
            logger.exception("unhandled error in a handler")
            error = OpenAIError(500, f"internal error: {exc!r}", type="server_error")
            return _error_response(error)

        @app.get("/health")
        async def health() -> Response:
            if self.worker.alive:
                return JSONResponse({"status": "ok"})
            return JSONResponse({"status": "engine stopped"}, status_code=503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return PlainTextResponse(self.metrics_text(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.model_name,
                            "object": "model",
                            "created": self.created,
                            "owned_by": "kv-serve",
                            "max_model_len": self.max_context,
                        }
                    ],
                }
            )

        @app.post("/v1/completions")
        async def completions(http: Request) -> Response:
            return await self._handle(http, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(http: Request) -> Response:
            return await self._handle(http, chat=True)

        return app


@dataclass(frozen=True)
class RunningServer:
    """A server started by :meth:`KVServer.running`: the server and its base URL."""

    server: KVServer
    url: str
