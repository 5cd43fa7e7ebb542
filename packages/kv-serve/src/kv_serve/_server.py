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
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from fastapi import FastAPI, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kv_batching import DecodeEngine, SamplingParams, SpeculationConfig, TokenLogprob
from kv_pool import pages_per_request
from kv_protocol import (
    RequestStateError,
    TokenConstraintFactory,
    check_int,
    kv_quantization_choice,
)

from ._engine import DEFAULT_KV_SLAB_BYTES, build_engine
from ._load import stop_token_ids
from ._lockstep import LockstepEngine
from ._ranks import RankGroup
from ._server_harmony import HarmonyText, harmony_call_grammar, is_harmony
from ._server_messages import (
    MessageEvents,
    anthropic_error,
    message_body,
    messages_to_chat,
    stop_reason,
)
from ._server_metrics import ServerMetrics, metrics_text
from ._server_page import PAGE_HTML, status_payload
from ._server_protocol import (
    CompletionRequest,
    OpenAIError,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from ._server_text import (
    CompletionText,
    IncrementalDecoder,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
)
from ._server_tools import (
    OutputSplitter,
    ToolCall,
    ToolCallText,
    ToolFormat,
    ToolRequest,
    split_piece,
)
from ._server_worker import (
    EngineWorker,
    Event,
    QueueFullError,
    RequestParams,
    Submission,
    Ticket,
    WorkerStoppedError,
)
from ._sizes import NGRAM_SPECULATIVE_TOKENS
from ._structured import GrammarCompiler, GrammarError

__all__ = ["KVServer", "RunningServer", "ServerMetrics"]

logger = logging.getLogger("kv_serve.server")

#: How often a waiting handler checks whether its client is still there, seconds.
_DISCONNECT_POLL = 0.25


class _ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


@dataclass
class _Prompt:
    """One prompt of a request: its tokens, the text ``echo`` gives back, its engine params.

    ``skip_special``: the prompt was text, so its special tokens (BOS) are no part of the
    echoed text. ``skip_first``: a token-id prompt starting with the BOS that encoding a text
    adds; it is not echoed either, so a text and its token ids echo the same.
    """

    tokens: list[int]
    echo_text: str
    skip_special: bool
    skip_first: bool
    params: RequestParams
    _pieces: tuple[list[str], list[int]] | None = None

    def pieces(self, tokenizer: Any) -> tuple[list[str], list[int]]:
        """Each prompt token's text and where it starts in the echoed text."""
        if self._pieces is None:
            decoder = IncrementalDecoder(tokenizer, skip_special_tokens=self.skip_special)
            skipped = 1 if self.skip_first else 0
            pieces: list[str] = [""] * skipped
            offsets: list[int] = [0] * skipped
            at = 0
            for token in self.tokens[skipped:]:
                offsets.append(at)
                pieces.append(decoder.push(token))
                at += len(pieces[-1])
            pieces[-1] += decoder.flush()
            self._pieces = pieces, offsets
        return self._pieces


@dataclass
class _Prepared:
    """A checked request: its prompts with their engine parameters."""

    request: CompletionRequest
    prompts: list[_Prompt]
    chat: bool
    #: Token ids that end a sequence without text: end-of-sequence and stop_token_ids.
    hidden: frozenset[int]
    #: How the model writes tool calls, when the request's output is searched for them.
    tool_format: ToolFormat | None = None
    #: The model answers in harmony channels (gpt-oss): every chat output is split.
    harmony: bool = False

    def tool_text(self) -> OutputSplitter | None:
        """A splitter of one sequence's output into content and tool calls (or ``None``)."""
        tools = self.request.tools
        if self.harmony and self.chat:
            parse = tools is not None and tools.parses
            return HarmonyText(parse=parse, single=tools is not None and not tools.parallel)
        if self.tool_format is None or tools is None:
            return None
        return ToolCallText(self.tool_format, tools.tools, single=not tools.parallel)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt alone is answered (one token is run)."""
        return self.request.echo and self.request.max_tokens == 0

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the request (each prompt once, whatever ``n``)."""
        return sum(len(p.tokens) for p in self.prompts)


class _Sequence:
    """One generated sequence of a request, as its events arrive."""

    def __init__(
        self, prompt_index: int, rank: int, prompt: _Prompt, ticket: Ticket, text: CompletionText
    ) -> None:
        self.prompt_index = prompt_index
        self.rank = rank
        self.prompt = prompt
        self.ticket = ticket
        self.text = text
        self.entries: list[TokenLogprob] = []
        self.prompt_entries: tuple[TokenLogprob | None, ...] | None = None
        self.finish: str | None = None
        self.started = False
        #: Splits the output into content, reasoning and tool calls (chat requests with
        #: tools; every chat request on a harmony model).
        self.tools: OutputSplitter | None = None

    def score(self) -> float:
        """Mean log-probability of its tokens under the model (``best_of`` ranks by it)."""
        kept = self.entries[: len(self.text.tokens)]
        return sum(e.logprob for e in kept) / len(kept) if kept else -math.inf


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
    ``max_queued`` sequences wait for admission (a request arriving then gets 429 with
    ``Retry-After``; each of its prompts' ``n`` sequences counts).
    ``prefill_stall`` bounds how long a prompt's prefill may hold up the streams decoding
    beside it, ``kv_bits`` / ``kv_group_size`` / ``kv_quantize`` store the pool's pages
    quantized, and ``state_snapshot_interval`` / ``state_cache_bytes`` govern the recurrent
    state snapshots that let models with STATE layers reuse prefixes, and ``speculative`` /
    ``num_speculative_tokens`` turn on speculative decoding (see :func:`kv_serve.build_engine`;
    a bad value fails :meth:`start`, where the engine is built). The KV pool's buffers grow by
    slabs of about ``kv_slab_bytes`` as its pages are first needed, up to the budget, and are
    cut back whenever the engine is idle (the cached prefixes stay); ``None`` allocates the
    whole budget at start.

    ``ranks`` (a :class:`kv_serve.RankGroup`, the model sharded with
    :func:`kv_serve.shard_model`) serves one tensor-parallel group: rank 0 builds a
    :class:`kv_serve.LockstepEngine` and serves HTTP as usual, every other rank calls
    :meth:`follow` instead of :meth:`serve`. ``/metrics`` reports ``kv_serve_world_size`` and
    the leader's own pool bytes.
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
        state_snapshot_interval: int | None = None,
        state_cache_bytes: int | None = None,
        speculative: str | SpeculationConfig | None = None,
        num_speculative_tokens: int = NGRAM_SPECULATIVE_TOKENS,
        ranks: RankGroup | None = None,
        make_engine: Callable[[], DecodeEngine] | None = None,
        kv_slab_bytes: int | None = DEFAULT_KV_SLAB_BYTES,
    ) -> None:
        # Refuse a bad quantization here, not later on the engine thread.
        kv_quantization_choice(kv_bits, kv_group_size, kv_quantize)
        self.model_name = model_name
        self.tokenizer = tokenizer
        self._harmony = is_harmony(tokenizer)
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
                    state_snapshot_interval=state_snapshot_interval,
                    state_cache_bytes=state_cache_bytes,
                    speculative=speculative,
                    num_speculative_tokens=num_speculative_tokens,
                    ranks=ranks,
                    kv_slab_bytes=kv_slab_bytes,
                )

        elif ranks is not None:
            raise RequestStateError("give ranks= or make_engine=, not both")
        self.ranks = ranks
        self._make_engine = make_engine
        self.worker = EngineWorker(make_engine, max_queued=max_queued)
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self._eos: frozenset[int] = frozenset()
        self._texts = TokenTexts(tokenizer)
        # Built at the first structured-output request (reading the vocabulary takes a while).
        self._grammars: GrammarCompiler | None = None
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

    def follow(self) -> None:
        """Serve as a follower rank: build the engine, apply the leader's steps until it stops.

        For ranks other than 0 of a tensor-parallel group (``ranks``): they answer no HTTP
        requests; rank 0's server sends them every request and step (see
        :class:`kv_serve.LockstepEngine`).
        """
        if self.ranks is None or self.ranks.is_leader:
            raise RequestStateError("follow() is for follower ranks (ranks= other than rank 0)")
        engine = self._make_engine()
        if not isinstance(engine, LockstepEngine):
            raise RequestStateError("a follower's engine must be a LockstepEngine")
        eos = frozenset(t for t in stop_token_ids(self.tokenizer) if t < engine.vocab_size)
        compilers: list[GrammarCompiler] = []

        def grammar(text: str) -> TokenConstraintFactory:
            if not compilers:
                compilers.append(GrammarCompiler(self.tokenizer, engine.vocab_size, eos))
            return compilers[0].grammar(text)

        engine.set_grammar_source(grammar)
        logger.info(
            "rank %d of %d: engine ready, KV pool %d bytes (this rank's heads)",
            self.ranks.rank,
            self.ranks.size,
            engine.memory_report().pool.bytes_total,
        )
        try:
            engine.follow()
        finally:
            engine.close()

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
            raise self._no_model(request.model)

    def _no_model(self, name: str) -> OpenAIError:
        return OpenAIError(
            404,
            f"The model {name!r} does not exist; this server serves {self.model_name!r}",
            param="model",
            code="model_not_found",
        )

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kv-serve",
            "max_model_len": self.max_context,
        }

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
            extra: dict[str, Any] = {}
            if request.tools is not None:
                extra["tools"] = [t.template_form() for t in request.tools.tools]
            ids: Any = self.tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=True, **extra
            )
        except Exception as err:  # a template's raise_exception (roles out of order, ...)
            raise OpenAIError(
                400, f"the chat template refused the messages: {err}", param="messages"
            ) from None
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def _fit(self, prompt_tokens: int, max_tokens: int, where: str = "") -> None:
        total = prompt_tokens + max_tokens
        if total > self.max_context:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, "
                f"you requested {total} tokens ({prompt_tokens} in the prompt{where}, "
                f"{max_tokens} in the completion). Please reduce the prompt or max_tokens.",
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
                    f"the request can never fit the KV pool: {prompt_tokens} prompt{where} + "
                    f"{max_tokens} completion tokens need {needs[sub.name]} pages of sub-pool "
                    f"{sub.name!r}, which has {usable}; reduce the prompt or max_tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )

    def _sampling(self, request: CompletionRequest) -> SamplingParams:
        fields = request.sampling
        vocab = self.worker.vocab_size
        k = request.logprobs
        if k is None and request.best_of > request.n:
            k = 0  # best_of ranks the sequences by their tokens' logprobs
        try:
            return SamplingParams(
                temperature=fields.temperature,
                top_p=fields.top_p,
                top_k=fields.top_k if 0 < fields.top_k < vocab else 0,
                min_p=fields.min_p,
                presence_penalty=fields.presence_penalty,
                frequency_penalty=fields.frequency_penalty,
                repetition_penalty=fields.repetition_penalty,
                logit_bias=fields.logit_bias,
                min_tokens=fields.min_tokens,
                seed=fields.seed,
                logprobs=k,
                prompt_logprobs=request.logprobs if request.echo else None,
                constraint=self._constraint(request),
            )
        except RequestStateError as err:
            raise OpenAIError(400, str(err)) from None

    def _tool_format(self, tools: ToolRequest | None) -> ToolFormat | None:
        """How the served model writes tool calls; a request that needs one it lacks is a 400."""
        if tools is None or not tools.parses or self._harmony:
            return None
        tokenizer = self.tokenizer
        parser = getattr(tokenizer, "tool_parser", None)
        start = getattr(tokenizer, "tool_call_start", None)
        end = getattr(tokenizer, "tool_call_end", None)
        if not getattr(tokenizer, "has_tool_calling", False) or parser is None or not end:
            raise OpenAIError(
                400,
                f"{self.model_name!r} has no tool-call format mlx-lm recognises in its chat "
                'template, so its tools cannot be called; give tool_choice "none" to render '
                "them only",
                param="tools",
                code="unsupported_parameter",
            )
        is_json = str(getattr(parser, "__module__", "")).endswith(".json_tools")
        return ToolFormat(str(start), str(end), parser, json=is_json)

    def _tool_constraint(
        self, tools: ToolRequest, fmt: ToolFormat | None
    ) -> TokenConstraintFactory | None:
        enforced = tools.enforced
        if not enforced or (fmt is None and not self._harmony):
            return None
        if fmt is not None and not fmt.json:
            raise OpenAIError(
                400,
                f"tool_choice {tools.choice!r} is enforced with a grammar of JSON tool calls "
                f"(<tool_call>{{...}}</tool_call>, Hermes / Qwen style) or of harmony calls; "
                f"{self.model_name!r} writes them as {fmt.start}...{fmt.end}, which it cannot "
                "enforce",
                param="tool_choice",
                code="unsupported_parameter",
            )
        functions = [(t.name, t.parameters) for t in enforced]
        try:
            if fmt is None:  # harmony
                return self._grammar_compiler().lark(harmony_call_grammar(functions))
            return self._grammar_compiler().tool_calls(
                functions, start=fmt.start, end=fmt.end, parallel=tools.parallel
            )
        except GrammarError as err:
            raise OpenAIError(
                400,
                f"tools: a function's parameters cannot be compiled into a grammar: {err}",
                param="tools",
                code="invalid_json_schema",
            ) from None

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            try:
                self._grammars = GrammarCompiler(self.tokenizer, self.worker.vocab_size, self._eos)
            except GrammarError as err:
                raise OpenAIError(
                    400,
                    f"response_format: structured output is not available for this model: {err}",
                    param="response_format",
                    code="unsupported_parameter",
                ) from None
        return self._grammars

    def _constraint(self, request: CompletionRequest) -> TokenConstraintFactory | None:
        """The request's grammar (a JSON format, a required tool call), or ``None``.

        A schema that does not compile is a 400 naming it.
        """
        if request.tools is not None and request.tools.enforced:
            return self._tool_constraint(request.tools, self._tool_format(request.tools))
        fmt = request.response_format
        if fmt is None:
            return None
        grammars = self._grammar_compiler()
        try:
            return grammars.json_schema(fmt.schema)
        except GrammarError as err:
            param = "response_format.json_schema.schema"
            raise OpenAIError(
                400,
                f"{param} cannot be compiled into a grammar: {err}",
                param=param,
                code="invalid_json_schema",
            ) from None

    def _prepare(self, body: dict[str, Any], *, chat: bool) -> _Prepared:
        vocab = self.worker.vocab_size or None
        if chat:
            request = parse_chat_request(body, vocab_size=vocab)
        else:
            request = parse_completion_request(body, vocab_size=vocab)
        self._check_model(request)
        fields = request.sampling
        extra = frozenset(fields.stop_token_ids)
        stops = extra if fields.ignore_eos else self._eos | extra
        hidden = self._eos | extra
        sampling = self._sampling(request)
        sources: list[tuple[list[int], str, bool, bool]] = []
        if chat:
            sources.append((self._chat_tokens(request), "", False, False))
        bos = getattr(self.tokenizer, "bos_token_id", None)
        for prompt in request.prompts:
            if isinstance(prompt, str):
                tokens = [int(i) for i in self.tokenizer.encode(prompt)]
                sources.append((tokens, prompt, True, False))
            else:
                skip = bos is not None and prompt[0] == bos
                echo = str(self.tokenizer.decode(list(prompt[1:] if skip else prompt)))
                sources.append((list(prompt), echo, False, skip))
        prompts: list[_Prompt] = []
        for i, (tokens, echo_text, skip_special, skip_first) in enumerate(sources):
            where = f" {i}" if len(sources) > 1 else ""
            if not tokens:
                raise OpenAIError(400, f"the prompt{where} encodes to no tokens", param="prompt")
            max_tokens = request.max_tokens
            if max_tokens is None:
                max_tokens = max(1, self.max_context - len(tokens))
            max_tokens = max(1, max_tokens)  # echo with max_tokens 0 runs one, unseen
            self._fit(len(tokens), max_tokens, where)
            params = RequestParams(max_tokens=max_tokens, sampling=sampling, stop_tokens=stops)
            prompts.append(_Prompt(tokens, echo_text, skip_special, skip_first, params))
        return _Prepared(
            request, prompts, chat, hidden, self._tool_format(request.tools), self._harmony
        )

    def _submit(self, prepared: _Prepared) -> tuple[list[_Sequence], asyncio.Queue[Event]]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        request = prepared.request
        texts = self._texts if request.logprobs is not None else None
        sequences: list[_Sequence] = []
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
                sequence = _Sequence(p, rank, prompt, ticket, text)
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

    def _abort_all(self, sequences: list[_Sequence]) -> None:
        for sequence in sequences:
            self.worker.abort(sequence.ticket)  # a no-op for those that ended

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
    def _tool_finish(sequence: _Sequence) -> str | None:
        """``tool_calls`` for a sequence that ended after calling a tool, else its reason."""
        splitter = sequence.tools
        if splitter is not None and splitter.calls and sequence.finish == "stop":
            return "tool_calls"
        return sequence.finish

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

    def _usage_of(self, prepared: _Prepared, sequences: list[_Sequence]) -> dict[str, int]:
        generated = sum(s.text.completion_tokens for s in sequences)
        return self._usage(prepared.prompt_tokens, generated)

    async def _wait(self, events: asyncio.Queue[Event], http: Request | None) -> Event:
        """The next event; with ``http``, raise :class:`_ClientGone` if the client left."""
        if http is None:
            return await events.get()
        while True:
            try:
                return await asyncio.wait_for(events.get(), _DISCONNECT_POLL)
            except TimeoutError:
                if await http.is_disconnected():
                    raise _ClientGone from None

    def _absorb(self, prepared: _Prepared, sequence: _Sequence, event: Event) -> tuple[str, bool]:
        """Take an event into its sequence: the text to send now, and whether it ended.

        Raises the request's :class:`OpenAIError` when the engine failed the sequence.
        """
        if event.prompt_logprobs is not None:
            sequence.prompt_entries = event.prompt_logprobs
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
            raise self._engine_error(event)
        if prepared.echo_only:
            sequence.finish = "length"
        else:
            sequence.finish = self._finish_reason(str(event.finish_reason))
            piece += sequence.text.finish()
        return piece, True

    def _logprobs(
        self, prepared: _Prepared, sequence: _Sequence, start: int, stop: int, *, prompt: bool
    ) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice for its generated tokens ``start:stop``."""
        k = prepared.request.logprobs
        if k is None:
            return None
        text = sequence.text
        entries: list[TokenLogprob | None] = list(sequence.entries[start:stop])
        if prepared.chat:
            content = chat_logprobs(
                text.pieces[start:stop],
                text.raw[start:stop],
                sequence.entries[start:stop],
                self._texts,
                k,
            )
            return {"content": content, "refusal": None}
        tokens = text.pieces[start:stop]
        shift = len(sequence.prompt.echo_text) if prepared.request.echo else 0
        offsets = [o + shift for o in text.offsets[start:stop]]
        if prompt and prepared.request.echo:
            prompt_tokens, prompt_offsets = sequence.prompt.pieces(self.tokenizer)
            found = sequence.prompt_entries
            prompt_entries: list[TokenLogprob | None] = (
                list(found) if found is not None else [None] * len(prompt_tokens)
            )
            tokens = prompt_tokens + tokens
            offsets = prompt_offsets + offsets
            entries = prompt_entries + entries
        return completion_logprobs(tokens, offsets, entries, self._texts, k)

    def _choice(self, prepared: _Prepared, sequence: _Sequence, index: int) -> dict[str, Any]:
        request = prepared.request
        text = sequence.text
        choice: dict[str, Any] = {"index": index}
        if prepared.chat:
            choice["message"] = {"role": "assistant", "content": text.text}
            splitter = sequence.tools
            if splitter is not None:
                split_piece(splitter, text.text, last=True)
                message: dict[str, Any] = {"role": "assistant", "content": splitter.content}
                if splitter.reasoning:
                    message["reasoning_content"] = splitter.reasoning
                if splitter.calls:
                    message["content"] = splitter.content or None
                    message["tool_calls"] = [call.openai() for call in splitter.calls]
                choice["message"] = message
        else:
            echo = sequence.prompt.echo_text if request.echo else ""
            choice["text"] = echo + text.text
        choice["logprobs"] = self._logprobs(prepared, sequence, 0, len(text.tokens), prompt=True)
        choice["finish_reason"] = self._tool_finish(sequence)
        if request.return_token_ids:
            choice["token_ids"] = list(text.tokens)
            choice["prompt_token_ids"] = list(sequence.prompt.tokens)
        return choice

    def _choices(self, prepared: _Prepared, sequences: list[_Sequence]) -> list[dict[str, Any]]:
        n = prepared.request.n
        choices = []
        for p in range(len(prepared.prompts)):
            mine = [s for s in sequences if s.prompt_index == p]
            if len(mine) > n:  # best_of: the n with the highest mean logprob
                mine = sorted(mine, key=lambda s: -s.score())[:n]
            choices += [self._choice(prepared, s, p * n + j) for j, s in enumerate(mine)]
        return choices

    def _account(self, prepared: _Prepared, sequences: list[_Sequence], start: float) -> None:
        reason = next((s.finish for s in sequences if s.finish == "error"), None)
        reason = reason or sequences[0].finish or "error"
        generated = sum(s.text.completion_tokens for s in sequences)
        self.metrics.finished(
            reason, prepared.prompt_tokens, generated, time.perf_counter() - start
        )

    async def _complete(self, prepared: _Prepared, http: Request) -> Response:
        sequences = await self._collect(prepared, http)
        chat = prepared.chat
        body = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": self._choices(prepared, sequences),
            "usage": self._usage_of(prepared, sequences),
        }
        return JSONResponse(body)

    async def _collect(self, prepared: _Prepared, http: Request) -> list[_Sequence]:
        """Run the request to its end; its sequences with their texts and finish reasons."""
        sequences, events = self._submit(prepared)
        start = time.perf_counter()
        first: float | None = None
        try:
            remaining = len(sequences)
            while remaining:
                event = await self._wait(events, http)
                sequence = sequences[event.index]
                if sequence.finish is not None:
                    continue  # what an aborted sequence still had on its way
                if event.tokens and first is None:
                    first = time.perf_counter()
                    self.metrics.first_token.observe(first - start)
                try:
                    _, ended = self._absorb(prepared, sequence, event)
                except OpenAIError:
                    self._account(prepared, sequences, start)
                    raise
                remaining -= ended
        finally:
            self._abort_all(sequences)  # a no-op unless the handler leaves early
        self._account(prepared, sequences, start)
        return sequences

    def _chunk_choice(
        self,
        prepared: _Prepared,
        sequence: _Sequence,
        piece: str,
        reason: str | None,
        seen: int,
    ) -> dict[str, Any]:
        """One streamed choice: ``piece``, and the logprobs and ids of tokens ``seen:``."""
        request = prepared.request
        first = not sequence.started
        sequence.started = True
        index = sequence.prompt_index * request.n + sequence.rank
        choice: dict[str, Any] = {"index": index}
        now = len(sequence.text.tokens)
        if prepared.chat:
            choice["delta"] = {"content": piece} if piece or now > seen else {}
            splitter = sequence.tools
            if splitter is not None:
                shown, calls = split_piece(splitter, piece, last=reason is not None)
                delta: dict[str, Any] = {"content": shown} if shown or now > seen else {}
                thought = splitter.take_reasoning()
                if thought:
                    delta["reasoning_content"] = thought
                if calls:
                    first_index = len(splitter.calls) - len(calls)
                    delta["tool_calls"] = [
                        call.openai(first_index + k) for k, call in enumerate(calls)
                    ]
                choice["delta"] = delta
                if reason is not None:
                    reason = self._tool_finish(sequence)
        else:
            echo = sequence.prompt.echo_text if first and request.echo else ""
            choice["text"] = echo + piece
        choice["logprobs"] = self._logprobs(prepared, sequence, seen, now, prompt=first)
        choice["finish_reason"] = reason
        if request.return_token_ids:
            choice["token_ids"] = sequence.text.tokens[seen:now]
            if first:
                choice["prompt_token_ids"] = list(sequence.prompt.tokens)
        return choice

    async def _stream(self, prepared: _Prepared, http: Request) -> Response:
        sequences, events = self._submit(prepared)
        start = time.perf_counter()
        # Wait for the first event before answering, so a request that fails before its
        # first token (prefill error, refused by the engine) still gets its status code.
        try:
            first = await self._wait(events, http)
        except BaseException:
            self._abort_all(sequences)
            raise
        if first.done and first.finish_reason in ("error", "aborted"):
            self._abort_all(sequences)
            sequences[first.index].finish = "error"
            self._account(prepared, sequences, start)
            raise self._engine_error(first)
        self.metrics.first_token.observe(time.perf_counter() - start)
        rid = f"{'chatcmpl' if prepared.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        request = prepared.request
        kind = "chat.completion.chunk" if prepared.chat else "text_completion"

        def payload(choices: list[dict[str, Any]], *, usage: bool = False) -> str:
            body: dict[str, Any] = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if usage or request.continuous_usage:
                body["usage"] = self._usage_of(prepared, sequences)
            return _sse(body)

        async def stream() -> AsyncIterator[str]:
            error: OpenAIError | None = None
            if prepared.chat:
                empty: dict[str, Any] | None = None
                if request.logprobs is not None:
                    empty = {"content": [], "refusal": None}
                for sequence in sequences:
                    index = sequence.prompt_index * request.n + sequence.rank
                    role = {"role": "assistant", "content": ""}
                    choice = {"index": index, "delta": role, "logprobs": empty}
                    yield payload([{**choice, "finish_reason": None}])
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
                if sequence.finish is None:
                    seen = len(sequence.text.tokens)
                    try:
                        piece, ended = self._absorb(prepared, sequence, event)
                    except OpenAIError as err:
                        error, piece, ended = err, "", True
                    new = len(sequence.text.tokens) > seen
                    extra = request.logprobs is not None or request.return_token_ids
                    echo = request.echo and not sequence.started
                    if piece or ended or echo or (new and (extra or request.continuous_usage)):
                        reason = sequence.finish if ended else None
                        choice = self._chunk_choice(prepared, sequence, piece, reason, seen)
                        yield payload([choice])
                    remaining -= ended
                    if error is not None:
                        break
                event = None
            self._abort_all(sequences)
            self._account(prepared, sequences, start)
            if error is not None:
                yield _sse(error.body())
            if request.include_usage:
                yield payload([], usage=True)
            yield "data: [DONE]\n\n"

        return _AbortingStream(stream(), on_close=lambda: self._abort_all(sequences))

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

    # ------------------------------------------------------------------ Anthropic's Messages

    def _messages_prepared(self, body: dict[str, Any]) -> tuple[_Prepared, bool]:
        mapped = messages_to_chat(body)
        return self._prepare(mapped.chat, chat=True), mapped.stream

    async def _handle_messages(self, http: Request) -> Response:
        try:
            prepared, stream = self._messages_prepared(parse_json_body(await http.body()))
            if stream:
                return await self._messages_stream(prepared, http)
            sequences = await self._collect(prepared, http)
        except OpenAIError as err:
            self.metrics.reject(err.status)
            return JSONResponse(anthropic_error(err), status_code=err.status)
        except _ClientGone:
            self.metrics.reject(499)
            gone = OpenAIError(499, "the client disconnected", code="client_gone")
            return JSONResponse(anthropic_error(gone), status_code=499)
        sequence = sequences[0]
        content, calls = self._split(sequence)
        return JSONResponse(
            message_body(
                model=self.model_name,
                text=content,
                calls=calls,
                finish=sequence.finish,
                stop_string=sequence.text.stop_string,
                input_tokens=prepared.prompt_tokens,
                output_tokens=sequence.text.completion_tokens,
            )
        )

    @staticmethod
    def _split(sequence: _Sequence) -> tuple[str, list[ToolCall]]:
        """A finished sequence's content and tool calls."""
        splitter = sequence.tools
        if splitter is None:
            return sequence.text.text, []
        split_piece(splitter, sequence.text.text, last=True)
        return splitter.content, list(splitter.calls)

    async def _messages_stream(self, prepared: _Prepared, http: Request) -> Response:
        sequences, events = self._submit(prepared)
        sequence = sequences[0]
        start = time.perf_counter()
        try:
            first = await self._wait(events, http)
        except BaseException:
            self._abort_all(sequences)
            raise
        if first.done and first.finish_reason in ("error", "aborted"):
            self._abort_all(sequences)
            sequence.finish = "error"
            self._account(prepared, sequences, start)
            raise self._engine_error(first)
        self.metrics.first_token.observe(time.perf_counter() - start)
        out = MessageEvents(self.model_name, prepared.prompt_tokens)

        async def stream() -> AsyncIterator[str]:
            yield out.start()
            event: Event | None = first
            ended = False
            while not ended:
                if event is None:
                    event = await events.get()
                try:
                    piece, ended = self._absorb(prepared, sequence, event)
                except OpenAIError as err:
                    self._abort_all(sequences)
                    self._account(prepared, sequences, start)
                    yield out.error(err)
                    return
                event = None
                calls: list[ToolCall] = []
                splitter = sequence.tools
                if splitter is not None:
                    piece, calls = split_piece(splitter, piece, last=ended)
                chunk = out.text(piece)
                for call in calls:
                    chunk += out.tool_use(call)
                if chunk:
                    yield chunk
            self._abort_all(sequences)
            self._account(prepared, sequences, start)
            made = sequence.tools.calls if sequence.tools is not None else []
            stop = sequence.text.stop_string
            reason = stop_reason(sequence.finish, made, stop)
            yield out.stop(reason, stop, sequence.text.completion_tokens)

        return _AbortingStream(stream(), on_close=lambda: self._abort_all(sequences))

    async def _count_tokens(self, http: Request) -> Response:
        try:
            mapped = messages_to_chat(parse_json_body(await http.body()), count_only=True)
            request = parse_chat_request(mapped.chat, vocab_size=self.worker.vocab_size or None)
            self._check_model(request)
            count = len(self._chat_tokens(request))
        except OpenAIError as err:
            self.metrics.reject(err.status)
            return JSONResponse(anthropic_error(err), status_code=err.status)
        return JSONResponse({"input_tokens": count})

    # ------------------------------------------------------------------ metrics

    def metrics_text(self) -> str:
        """The Prometheus text exposition of the server's state."""
        return metrics_text(self.worker.snapshot(), self.worker.waiting, self.metrics)

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

        @app.get("/")
        async def page() -> Response:
            return HTMLResponse(PAGE_HTML)

        @app.get("/status")
        async def status() -> Response:
            return JSONResponse(
                status_payload(
                    model=self.model_name,
                    chat=bool(getattr(self.tokenizer, "chat_template", None)),
                    snapshot=self.worker.snapshot(),
                    prompt_tokens=self.metrics.prompt_tokens,
                    generation_tokens=self.metrics.generation_tokens,
                )
            )

        @app.get("/metrics")
        async def metrics() -> Response:
            return PlainTextResponse(self.metrics_text(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [self._model_card()]})

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str) -> Response:
            if model_id != self.model_name:
                return _error_response(self._no_model(model_id))
            return JSONResponse(self._model_card())

        @app.post("/v1/completions")
        async def completions(http: Request) -> Response:
            return await self._handle(http, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(http: Request) -> Response:
            return await self._handle(http, chat=True)

        @app.post("/v1/messages")
        async def messages(http: Request) -> Response:
            return await self._handle_messages(http)

        @app.post("/v1/messages/count_tokens")
        async def count_tokens(http: Request) -> Response:
            return await self._count_tokens(http)

        return app


@dataclass(frozen=True)
class RunningServer:
    """A server started by :meth:`KVServer.running`: the server and its base URL."""

    server: KVServer
    url: str
