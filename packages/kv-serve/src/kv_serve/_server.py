"""``kv-serve serve``: an OpenAI-compatible HTTP server on one engine thread.

FastAPI on uvicorn (the stack vLLM and SGLang use). The endpoints run on uvicorn's event
loop and never touch MLX: prompts are tokenized there and handed to the
:class:`~kv_serve._server_worker.EngineWorker`, whose thread owns MLX and the
``DecodeEngine``; tokens come back per request and are decoded there incrementally
(:class:`~kv_serve._server_text.CompletionText`: no split UTF-8 characters, stop strings
matched across token boundaries). A client that disconnects aborts its request.

:class:`KVServer` wires the parts: one module per API (:mod:`._serving_chat`,
:mod:`._serving_completions`, :mod:`._serving_messages`, :mod:`._serving_models`,
:mod:`._server_page`), all checked by one :class:`~kv_serve._server_requests.RequestPreparer`
and run by one :class:`~kv_serve._server_stream.RequestRunner`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kv_protocol import (
    RequestStateError,
    TokenConstraintFactory,
)

from ._config import ServerConfig
from ._engine import build_engine
from ._load import stop_token_ids
from ._lockstep import LockstepEngine, ServedEngine
from ._ranks import RankGroup
from ._server_harmony import is_harmony
from ._server_metrics import ServerMetrics
from ._server_page import PageEndpoints
from ._server_policy import OutputPolicy
from ._server_protocol import OpenAIError
from ._server_requests import RequestPreparer
from ._server_response_output import ResponseStore
from ._server_stream import RequestRunner
from ._server_worker import EngineWorker
from ._serving_chat import ChatCompletions
from ._serving_completions import Completions
from ._serving_messages import AnthropicMessages
from ._serving_models import ServerEndpoints
from ._serving_openai import error_response
from ._serving_responses import OpenAIResponses
from ._serving_tokenize import Tokenization
from ._structured import GrammarCompiler

__all__ = ["KVServer", "RunningServer", "ServerMetrics"]

logger = logging.getLogger("kv_serve.server")


class KVServer:
    """An OpenAI-compatible server of one model: endpoints, engine thread, metrics.

    Its settings are one :class:`ServerConfig` (``config``: the served name, the queue, a
    :class:`PoolConfig` and a :class:`kv_batching.EngineConfig`); any field of the three may
    also be given by keyword (``model_name="m"``, ``max_running=4``), replacing the config's.
    ``make_engine`` (default: :func:`kv_serve.build_engine` with the config) runs on
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
        config: ServerConfig | None = None,
        *,
        ranks: RankGroup | None = None,
        make_engine: Callable[[], ServedEngine] | None = None,
        **settings: Any,
    ) -> None:
        config = ServerConfig.from_settings(config, settings)
        self.config = config
        model_name = config.model_name
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_context = config.pool.max_context
        if make_engine is None:

            def make_engine() -> ServedEngine:
                return build_engine(
                    model,
                    dataclasses.replace(config.engine, record_pages=False),
                    pool_config=config.pool,
                    speculative=config.speculative,
                    num_speculative_tokens=config.num_speculative_tokens,
                    ranks=ranks,
                )

        elif ranks is not None:
            raise RequestStateError("give ranks= or make_engine=, not both")
        self.ranks = ranks
        self._make_engine = make_engine
        self.worker = EngineWorker(make_engine, max_queued=config.max_queued)
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self._policy = OutputPolicy(
            tokenizer, model_name=model_name, harmony=is_harmony(tokenizer), worker=self.worker
        )
        self._requests = RequestPreparer(
            tokenizer,
            model_name,
            self.max_context,
            self.worker,
            self._policy,
            max_tokens_default=config.max_tokens_default,
        )
        self._runner = RequestRunner(self.worker, tokenizer, self.metrics)
        self._endpoints = ServerEndpoints(
            model_name, self.max_context, self.created, self.worker, self.metrics
        )
        #: Finished responses of ``/v1/responses`` kept for ``previous_response_id``.
        self.responses = ResponseStore()
        self.app = self._build_app()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the engine thread (builds the engine there)."""
        self.worker.start()
        vocab = self.worker.vocab_size
        self._policy.eos = frozenset(t for t in stop_token_ids(self.tokenizer) if t < vocab)
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

    def metrics_text(self) -> str:
        """The Prometheus text exposition of the server's state."""
        return self._endpoints.metrics_text()

    # ------------------------------------------------------------------ app

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kv-serve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            error = OpenAIError(exc.status_code, str(exc.detail), type=kind)
            return error_response(error)

        @app.exception_handler(Exception)
        async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
            logger.exception("unhandled error in a handler")
            error = OpenAIError(500, f"internal error: {exc!r}", type="server_error")
            return error_response(error)

        server = self._endpoints
        page = PageEndpoints(self.model_name, self.tokenizer, self.worker, self.metrics)
        chat = ChatCompletions(self._requests, self._runner)
        completions = Completions(self._requests, self._runner)
        messages = AnthropicMessages(self._requests, self._runner)
        responses = OpenAIResponses(self._requests, self._runner, self.responses)
        tokenization = Tokenization(self._requests, self.max_context)
        routes: list[tuple[str, str, Callable[..., Any]]] = [
            ("GET", "/health", server.health),
            ("GET", "/", page.page),
            ("GET", "/status", page.status),
            ("GET", "/metrics", server.metrics_page),
            ("GET", "/v1/models", server.models),
            ("GET", "/v1/models/{model_id:path}", server.model),
            ("POST", "/v1/completions", completions.create),
            ("POST", "/v1/chat/completions", chat.create),
            ("POST", "/v1/responses", responses.create),
            ("GET", "/v1/responses/{response_id}", responses.retrieve),
            ("DELETE", "/v1/responses/{response_id}", responses.delete),
            ("POST", "/v1/messages", messages.create),
            ("POST", "/v1/messages/count_tokens", messages.count_tokens),
            ("POST", "/tokenize", tokenization.tokenize),
            ("POST", "/detokenize", tokenization.detokenize),
        ]
        for method, path, endpoint in routes:
            app.add_api_route(path, endpoint, methods=[method])
        return app


@dataclass(frozen=True)
class RunningServer:
    """A server started by :meth:`KVServer.running`: the server and its base URL."""

    server: KVServer
    url: str
