"""The decode engine: admission by pool capacity, chunked prefill, one batched decode per step."""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import (
    CacheLayout,
    KernelSet,
    KVCache,
    KVPool,
    LayoutError,
    RequestStateError,
    UnknownRequestError,
    UnsupportedModelError,
    as_int,
    check_int,
    check_int_sequence,
    check_number,
    layout_from_model,
)

from ._cache_nesting import CacheNesting
from ._context import BatchedDecodeContext, PoolAddressing
from ._decode_paths import DecodePlan, check_batched_decode, plan_decode_paths
from ._layer_cache import batched_layer_caches
from ._model_forward import last_position_forward, vocabulary_size
from ._patching import patch_model_attention, unpatch_model_attention
from ._sampling import sample_top_p, token_key
from ._state_cache import (
    StateCacheFactory,
    StateSnapshot,
    install_stacked_states,
    model_state_caches,
    request_caches,
    state_nbytes,
)

__all__ = [
    "DEFAULT_STATS_WINDOW",
    "DecodeEngine",
    "EngineStats",
    "PrefillCacheFactory",
    "RequestOutput",
    "RequestStatus",
    "pages_in_use",
]

logger = logging.getLogger(__name__)

#: ``make_prefill_cache(pool, request_id, layer_id)`` -> a per-request, per-layer cache.
PrefillCacheFactory = Callable[[KVPool, int, int], KVCache]


class RequestStatus(enum.Enum):
    """Where a request is in the engine."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestOutput:
    """A snapshot of one request: its tokens so far and why it finished (if it did).

    ``finish_reason`` is ``"stop"`` (a stop token was generated, and is included),
    ``"length"`` (``max_tokens`` reached), ``"aborted"``, ``"pool_exhausted"`` (the request
    alone does not fit in the pool), ``"error"`` (its prefill or decode raised; ``error``
    holds the exception) or ``None`` while it runs.
    """

    request_id: int
    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    status: RequestStatus
    finish_reason: str | None
    error: BaseException | None = None


#: Steps of history an engine's :class:`EngineStats` series keep by default.
DEFAULT_STATS_WINDOW = 16384


@dataclass
class EngineStats:
    """Counters, exact aggregates and bounded per-step series of a :class:`DecodeEngine`.

    Series have one entry per :meth:`DecodeEngine.step`; ``decode_step_seconds`` and
    ``decode_batch_sizes`` have one entry per batched decode (the step's decode part only).
    They are deques that keep the latest ``window`` entries (``None``: every entry, for
    short offline runs that plot them), so a long-running engine's statistics stay bounded.
    The counters and the aggregates (``max_queue_length``, ``max_running``,
    ``max_decode_batch_size``, ``decode_batch_size_total``, ``max_decode_step_seconds``,
    :attr:`peak_pages_used`) are exact over the engine's whole life, whatever the window.
    """

    steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    window: int | None = DEFAULT_STATS_WINDOW
    queue_length: deque[int] = field(default_factory=deque, repr=False)
    running: deque[int] = field(default_factory=deque, repr=False)
    pages_used: deque[dict[str, int]] = field(default_factory=deque, repr=False)
    decode_step_seconds: deque[float] = field(default_factory=deque, repr=False)
    decode_batch_sizes: deque[int] = field(default_factory=deque, repr=False)
    max_queue_length: int = 0
    max_running: int = 0
    max_decode_batch_size: int = 0
    decode_batch_size_total: int = 0
    max_decode_step_seconds: float = 0.0
    _peak_pages: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.window is not None:
            self.window = check_int(self.window, "window", minimum=1)
        size = self.window
        self.queue_length = deque(self.queue_length, maxlen=size)
        self.running = deque(self.running, maxlen=size)
        self.pages_used = deque(self.pages_used, maxlen=size)
        self.decode_step_seconds = deque(self.decode_step_seconds, maxlen=size)
        self.decode_batch_sizes = deque(self.decode_batch_sizes, maxlen=size)

    def record_step(self, queue_length: int, running: int, pages: Mapping[str, int] | None) -> None:
        """Account one engine step: the queue length and running count after it, and pages."""
        self.steps += 1
        self.queue_length.append(queue_length)
        self.running.append(running)
        self.max_queue_length = max(self.max_queue_length, queue_length)
        self.max_running = max(self.max_running, running)
        if pages is not None:
            sample = dict(pages)
            self.pages_used.append(sample)
            peak = self._peak_pages
            for name, count in sample.items():
                if count > peak.get(name, -1):
                    peak[name] = count

    def record_decode(self, seconds: float, batch_size: int) -> None:
        """Account one batched decode of ``batch_size`` requests that took ``seconds``."""
        self.decode_steps += 1
        self.decode_tokens += batch_size
        self.decode_seconds += seconds
        self.decode_step_seconds.append(seconds)
        self.decode_batch_sizes.append(batch_size)
        self.max_decode_batch_size = max(self.max_decode_batch_size, batch_size)
        self.decode_batch_size_total += batch_size
        self.max_decode_step_seconds = max(self.max_decode_step_seconds, seconds)

    @property
    def mean_decode_batch_size(self) -> float:
        """Requests per batched decode, over every decode (exact, not windowed)."""
        return self.decode_batch_size_total / self.decode_steps if self.decode_steps else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens prefilled per second of prefill time."""
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated by batched decode per second of decode time."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def peak_pages_used(self) -> dict[str, int]:
        """The largest page count seen per sub-pool (over every recorded step)."""
        peak = dict(self._peak_pages)
        for sample in self.pages_used:
            for name, pages in sample.items():
                peak[name] = max(peak.get(name, 0), pages)
        return peak


class _Request:
    __slots__ = (
        "caches",
        "error",
        "finish_reason",
        "generated",
        "in_pool",
        "max_tokens",
        "prefilled",
        "prompt",
        "rid",
        "seed",
        "states",
        "status",
        "stop_tokens",
        "temperature",
        "top_p",
    )

    def __init__(
        self,
        rid: int,
        prompt: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_tokens: frozenset[int],
        seed: int | None = None,
    ) -> None:
        self.rid = rid
        self.seed = seed
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.stop_tokens = stop_tokens
        self.generated: list[int] = []
        self.status = RequestStatus.QUEUED
        self.finish_reason: str | None = None
        self.prefilled = 0
        self.caches: list[Any] | None = None
        self.states: list[Any] | None = None
        self.in_pool = False
        self.error: BaseException | None = None

    def prefill_tokens(self) -> list[int]:
        # After a preemption the generated tokens but the pending last one are re-prefilled.
        return self.prompt + self.generated[:-1]


def pages_in_use(pool: object) -> dict[str, int] | None:
    """Pages in use per sub-pool, if the pool tells (``memory_report()`` / ``pages_in_use()``)."""
    report = getattr(pool, "memory_report", None)
    if callable(report):
        subs = getattr(report(), "sub_pools", None)
        if subs is not None:
            return {str(s.name): int(s.pages_used) for s in subs}
    direct = getattr(pool, "pages_in_use", None)
    if callable(direct):
        return {str(k): int(v) for k, v in dict(direct()).items()}
    return None


def _plan_and_check(
    model: nn.Module,
    pool: KVPool,
    kernels: KernelSet,
    make_prefill_cache: PrefillCacheFactory,
    decode_path: str,
    *,
    vocab_size: int,
    num_layers: int,
    state_caches: StateCacheFactory | None = None,
    state_layer_ids: tuple[int, ...] = (),
    nesting: CacheNesting | None = None,
) -> DecodePlan:
    """Choose the layers' decode paths, wrap the fast ones and check one batched step.

    Under ``auto``, a model whose check fails with some layers on the fast path is tried
    again with every layer universal. A model neither path serves is unpatched and refused
    with ``UnsupportedModelError`` and the reason.
    """
    plan = plan_decode_paths(model, pool.layout, decode_path, nesting=nesting)
    patch_model_attention(model, pool.layout, layers=plan.fast_layers)
    problem = check_batched_decode(
        model,
        pool,
        kernels,
        make_prefill_cache,
        plan,
        vocab_size=vocab_size,
        num_layers=num_layers,
        state_caches=state_caches,
        state_layer_ids=state_layer_ids,
        nesting=nesting,
    )
    if problem is not None and decode_path == "auto" and plan.fast_layers:
        unpatch_model_attention(model)
        fallback = plan_decode_paths(model, pool.layout, "universal", nesting=nesting)
        retry = check_batched_decode(
            model,
            pool,
            kernels,
            make_prefill_cache,
            fallback,
            vocab_size=vocab_size,
            num_layers=num_layers,
            state_caches=state_caches,
            state_layer_ids=state_layer_ids,
            nesting=nesting,
        )
        if retry is None:
            logger.warning(
                "%s: the patched fast path failed the build-time check (%s); every layer "
                "takes the universal path",
                type(model).__name__,
                problem,
            )
            reason = f"the fast path failed the build-time check: {problem}"
            return DecodePlan(paths=fallback.paths, reasons={i: reason for i in fallback.paths})
        problem = retry
    if problem is not None:
        unpatch_model_attention(model)
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot be served by batched decode: {problem} "
            f"({plan.describe()}); its attention must call cache.update_and_fetch and build "
            "its mask with cache.make_mask, as mlx-lm's caches expect"
        )
    return plan


def _check_layouts(model_layout: CacheLayout, pool_layout: CacheLayout) -> None:
    if model_layout.num_layers != pool_layout.num_layers:
        raise LayoutError(
            f"the pool was built for {pool_layout.num_layers} layers but the model has "
            f"{model_layout.num_layers}"
        )
    for mine, theirs in zip(model_layout.specs, pool_layout.specs, strict=True):
        same = (
            mine.kind is theirs.kind
            and mine.window == theirs.window
            and mine.n_kv_heads == theirs.n_kv_heads
            and mine.head_dim == theirs.head_dim
        )
        if not same:
            raise LayoutError(
                f"layer {mine.layer_id}: the model has {mine.kind.value} window={mine.window} "
                f"{mine.n_kv_heads}x{mine.head_dim} but the pool's layout has "
                f"{theirs.kind.value} window={theirs.window} {theirs.n_kv_heads}x{theirs.head_dim}"
            )


class DecodeEngine:
    """Serve many generation requests on one model through a paged KV pool.

    ``make_prefill_cache(pool, request_id, layer_id)`` builds the per-layer caches a new
    request's prompt is prefilled through (the original model path, in chunks of at most
    ``prefill_chunk`` tokens per step); their K/V land in ``pool``. Then all running
    requests (at most ``max_running``) decode together: one model call per step on a ``(B,
    1)`` batch whose attention modules are patched to read and write ``pool`` through
    ``kernels``. A request that does not fit waits in the queue; when the running requests
    themselves outgrow the pool the newest is preempted back to the queue (its pages freed,
    its tokens kept and re-prefilled later), so no running request fails because another
    arrived. Every page is freed when a request finishes or is aborted.

    Sampling is greedy at ``temperature == 0``; otherwise temperature and nucleus
    (``top_p``) sampling from a key seeded by ``seed``.

    Token ids are checked against the vocabulary at :meth:`submit` (``vocab_size``, read off
    the model's embedding table unless given). A step is a transaction: if anything raises
    inside it, what the step reserved in the pool is given back and every request is either
    as it was before the step or finished with ``finish_reason == "error"`` and the
    exception in :attr:`RequestOutput.error`. An ``Exception`` in one request's prefill
    (model, cache factory, sampling) finishes that request; a failed batched decode is
    retried request by request in the same step, so only the requests that fail alone are
    finished. Anything else (``KeyboardInterrupt``, ``SystemExit``) is re-raised after the
    rollback with every request as it was; the tokens the step had produced by then are
    returned by the next :meth:`step`. The engine goes on serving after either.

    Decode paths (``decode_path``): each attention layer takes the patched fast path (its
    module wrapped in place by :func:`patch_model_attention`: fused RoPE + scatter, paged
    attention kernels) where the wrapper's probe reproduces the module exactly, and the
    universal path (:class:`PoolDecodeCache` handed to the unmodified module) otherwise;
    ``"universal"`` puts every layer there, ``"fast"`` refuses a module the probe rejects.
    :attr:`decode_paths` reports the choice. Building the engine runs one ragged batched
    decode step through the pool against prefill of the same tokens, so a model neither
    path serves is refused here with ``UnsupportedModelError``, never at decode time.
    Building **modifies the model** (the fast layers' attention modules are wrapped);
    :meth:`close` (or leaving a ``with`` block) puts the originals back.

    With ``prefill_last_logits`` (the default) prefill chunks project only their last
    position onto the vocabulary when :func:`last_position_forward` proves that exact for
    this model; otherwise the model runs whole.

    Bounded memory for long-running callers (a server): the engine keeps every request it was
    given until :meth:`release` forgets a finished one (its output is read once, then
    dropped), and :attr:`stats` keeps its per-step series over the last ``stats_window``
    steps (``None``: all of them) with exact counters and aggregates.
    """

    def __init__(
        self,
        model: nn.Module,
        pool: KVPool,
        kernels: KernelSet,
        make_prefill_cache: PrefillCacheFactory,
        *,
        max_running: int = 16,
        prefill_chunk: int = 512,
        seed: int = 0,
        record_pages: bool = True,
        vocab_size: int | None = None,
        prefill_last_logits: bool = True,
        stats_window: int | None = DEFAULT_STATS_WINDOW,
        decode_path: str = "auto",
        make_state_caches: StateCacheFactory | None = None,
        state_budget_bytes: int | None = None,
    ) -> None:
        max_running = check_int(max_running, "max_running", minimum=1)
        if state_budget_bytes is not None:
            state_budget_bytes = check_int(state_budget_bytes, "state_budget_bytes", minimum=1)
        prefill_chunk = check_int(prefill_chunk, "prefill_chunk", minimum=1)
        seed = check_int(seed, "seed", minimum=0, maximum=2**64 - 1)
        model_layout = layout_from_model(model)
        _check_layouts(model_layout, pool.layout)
        self._nesting = CacheNesting.from_model(model)
        self._state_layer_ids = model_layout.state_layer_ids
        if self._state_layer_ids and make_state_caches is None:
            make_state_caches = model_state_caches(model, model_layout)
        table_rows = vocabulary_size(model)
        if vocab_size is None:
            if table_rows is None:
                raise UnsupportedModelError(
                    f"cannot tell the vocabulary size of {type(model).__name__} (no embedding "
                    "table, no args.vocab_size): pass vocab_size= to DecodeEngine"
                )
            vocab_size = table_rows
        vocab_size = check_int(vocab_size, "vocab_size", minimum=1)
        if table_rows is not None and vocab_size > table_rows:
            raise UnsupportedModelError(
                f"vocab_size={vocab_size} is larger than the model's embedding table "
                f"({table_rows} rows)"
            )
        self._prefill_forward = (
            last_position_forward(model, vocab_size) if prefill_last_logits else None
        )
        self.decode_plan = _plan_and_check(
            model,
            pool,
            kernels,
            make_prefill_cache,
            decode_path,
            vocab_size=vocab_size,
            num_layers=model_layout.num_layers,
            state_caches=make_state_caches,
            state_layer_ids=self._state_layer_ids,
            nesting=self._nesting,
        )
        self.make_state_caches = make_state_caches
        self.state_budget_bytes = state_budget_bytes
        #: Bytes of one request's recurrent state (largest seen; ``None`` until one is known).
        self.state_bytes_per_request: int | None = None
        self._universal_layers = self.decode_plan.universal_layers
        self.model = model
        self.pool = pool
        self.kernels = kernels
        self.make_prefill_cache = make_prefill_cache
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.record_pages = record_pages
        self.vocab_size = vocab_size
        self.stats = EngineStats(window=stats_window)
        self._addressing = PoolAddressing.from_pool(pool)
        self._num_layers = model_layout.num_layers
        self._requests: dict[int, _Request] = {}
        self._queue: deque[_Request] = deque()
        self._prefilling: _Request | None = None
        self._running: list[_Request] = []
        self._next_id = 0
        self._key = mx.random.key(seed)
        # Tokens of a step that raised, handed out by the next step.
        self._undelivered: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt_tokens: Iterable[int] | mx.array,
        max_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_tokens: Iterable[int] | mx.array = (),
        seed: int | None = None,
    ) -> int:
        """Queue a request; returns its id. Nothing runs until :meth:`step`.

        With a ``seed`` (``0 .. 2**64 - 1``) the request samples from its own random stream:
        its n-th token depends only on the seed, n and its logits, never on the other
        requests of the batch, preemption or retries. Without one it samples from the
        engine's stream (``seed`` of the engine).

        Every argument is checked first (token ids in ``0 .. vocab_size - 1``, ints that are
        not bools or floats, finite numbers); a bad one raises ``RequestStateError`` (a
        ``ValueError``) and nothing is queued, no request id is used.
        """
        top = self.vocab_size - 1
        prompt = check_int_sequence(
            _host_tokens(prompt_tokens, "prompt_tokens"), "prompt_tokens", minimum=0, maximum=top
        )
        if not prompt:
            raise RequestStateError("prompt_tokens must hold at least one token")
        max_tokens = check_int(max_tokens, "max_tokens", minimum=1)
        temperature = check_number(temperature, "temperature", minimum=0.0)
        top_p = check_number(top_p, "top_p", minimum=0.0, maximum=1.0, min_inclusive=False)
        stops = check_int_sequence(
            _host_tokens(stop_tokens, "stop_tokens"), "stop_tokens", minimum=0, maximum=top
        )
        if seed is not None:
            seed = check_int(seed, "seed", minimum=0, maximum=2**64 - 1)
        rid = self._next_id
        self._next_id += 1
        request = _Request(rid, prompt, max_tokens, temperature, top_p, frozenset(stops), seed)
        self._requests[rid] = request
        self._queue.append(request)
        return rid

    def _get(self, request_id: int) -> _Request:
        key = as_int(request_id)
        if key is None:
            raise RequestStateError(f"request ids are ints, got {request_id!r}")
        request = self._requests.get(key)
        if request is None:
            if 0 <= key < self._next_id:
                raise UnknownRequestError(
                    f"request {request_id} was released from this engine (its output was "
                    "delivered and forgotten)"
                )
            raise UnknownRequestError(f"request {request_id} was never submitted to this engine")
        return request

    def release(self, request_id: int) -> RequestOutput:
        """Forget a finished request and return its final output.

        The engine drops everything it kept for the request (prompt, tokens, error), so a
        long-running caller that releases each request once it has read its output keeps the
        engine's memory bounded. Later calls that name the request raise
        ``UnknownRequestError``. A request that has not finished raises
        ``RequestStateError``: :meth:`abort` it first.
        """
        request = self._get(request_id)
        if request.status is not RequestStatus.FINISHED:
            raise RequestStateError(
                f"request {request_id} is {request.status.value}; abort it before releasing it"
            )
        out = self.output(request_id)
        del self._requests[request.rid]
        self._undelivered.pop(request.rid, None)
        return out

    def is_finished(self, request_id: int) -> bool:
        """Whether the request has finished (cheaper than :meth:`output`: no copies)."""
        return self._get(request_id).status is RequestStatus.FINISHED

    @property
    def num_requests(self) -> int:
        """Requests the engine still keeps: active ones and finished ones not released."""
        return len(self._requests)

    def abort(self, request_id: int) -> bool:
        """Stop a request and free its pages; False if it had finished already."""
        request = self._get(request_id)
        if request.status is RequestStatus.FINISHED:
            return False
        self._finish(request, "aborted")
        self.stats.aborted += 1
        return True

    def output(self, request_id: int) -> RequestOutput:
        """The request's prompt, generated tokens so far, status and finish reason."""
        r = self._get(request_id)
        return RequestOutput(
            r.rid, tuple(r.prompt), tuple(r.generated), r.status, r.finish_reason, r.error
        )

    @property
    def decode_paths(self) -> Mapping[int, str]:
        """Attention layer id -> ``"fast"`` (patched kernels) or ``"universal"`` (pool cache)."""
        return self.decode_plan.paths

    def close(self) -> None:
        """Abort what still runs and put the model's original attention modules back.

        The engine must not step after this; the model is as it was before the engine.
        """
        active = [*self._running, *self._queue]
        if self._prefilling is not None:
            active.append(self._prefilling)
        for request in active:
            self._finish(request, "aborted")
            self.stats.aborted += 1
        unpatch_model_attention(self.model)

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def has_work(self) -> bool:
        """True while any request is queued, prefilling or running."""
        return bool(self._queue or self._running or self._prefilling is not None)

    @property
    def num_running(self) -> int:
        """Requests decoding now."""
        return len(self._running)

    @property
    def num_queued(self) -> int:
        """Requests waiting for admission (preempted ones included)."""
        return len(self._queue)

    # ------------------------------------------------------------------ driving

    def step(self) -> dict[int, list[int]]:
        """One engine step: a batched decode of the running requests, then prefill work.

        Returns the tokens produced in this step per request id (plus those of an earlier
        step that raised before it could return them).
        """
        produced = self._undelivered
        self._undelivered = {}
        start = time.perf_counter()
        middle = start
        try:
            if self._running:
                self._decode(produced)
            middle = time.perf_counter()
            self._prefill(produced)
        except BaseException:
            self._undelivered = produced
            raise
        finally:
            end = time.perf_counter()
            stats = self.stats
            stats.prefill_seconds += end - middle
            pages = pages_in_use(self.pool) if self.record_pages else None
            stats.record_step(len(self._queue), len(self._running), pages)
        return produced

    def stream(self) -> Iterator[tuple[int, int]]:
        """Step until idle, yielding ``(request_id, token)`` as tokens are produced."""
        while self.has_work:
            for rid, tokens in self.step().items():
                for token in tokens:
                    yield rid, token

    def run(self) -> dict[int, list[int]]:
        """Step until idle; returns every submitted request's generated tokens."""
        while self.has_work:
            self.step()
        return {rid: list(r.generated) for rid, r in self._requests.items()}

    # ------------------------------------------------------------------ internals

    def _emit(self, request: _Request, token: int, produced: dict[int, list[int]]) -> None:
        request.generated.append(token)
        produced.setdefault(request.rid, []).append(token)
        if token in request.stop_tokens:
            self._finish(request, "stop")
        elif len(request.generated) >= request.max_tokens:
            self._finish(request, "length")

    def _release(self, request: _Request) -> None:
        """Give back every page the request holds in the pool (if it holds any)."""
        request.caches = None
        request.states = None
        if request.in_pool:
            request.in_pool = False
            self.pool.free_request(request.rid)

    def _finish(self, request: _Request, reason: str) -> None:
        if request in self._running:
            self._running.remove(request)
        if self._prefilling is request:
            self._prefilling = None
        if request.status is RequestStatus.QUEUED and request in self._queue:
            self._queue.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.stats.finished += 1

    def _fail(self, request: _Request, error: Exception) -> None:
        """Finish ``request`` with reason ``"error"``, keeping the exception."""
        logger.error(
            "request %d failed and was finished with reason 'error': %r", request.rid, error
        )
        request.error = error
        self.stats.errors += 1
        self._finish(request, "error")

    def _preempt(self, request: _Request) -> None:
        if request in self._running:
            self._running.remove(request)
        if self._prefilling is request:
            self._prefilling = None
        self._release(request)
        request.prefilled = 0
        request.status = RequestStatus.QUEUED
        self._queue.appendleft(request)
        self.stats.preemptions += 1

    def _make_decode_room(self) -> None:
        while self._running:
            if self.pool.can_reserve({r.rid: 1 for r in self._running}):
                return
            if self._prefilling is not None:
                self._preempt(self._prefilling)
            elif len(self._running) == 1:
                self._finish(self._running[0], "pool_exhausted")
            else:
                self._preempt(self._running[-1])

    def _rollback(self, batch: Sequence[_Request], lengths: Sequence[int]) -> None:
        """Trim each request of ``batch`` back to its length before the step."""
        for request, length in zip(batch, lengths, strict=True):
            if request.in_pool:
                extra = self.pool.seq_len(request.rid) - length
                if extra > 0:
                    self.pool.trim_request(request.rid, extra)

    def _decode_batch(self, batch: Sequence[_Request]) -> list[int]:
        """One batched decode of ``batch``: the sampled tokens, or a rollback and a raise."""
        key = self._key
        lengths = [self.pool.seq_len(r.rid) for r in batch]
        try:
            ctx = BatchedDecodeContext.from_pool(
                self.pool, [r.rid for r in batch], self.kernels, addressing=self._addressing
            )
            tokens = mx.array([[r.generated[-1]] for r in batch], dtype=mx.int32)
            caches = batched_layer_caches(ctx, self._universal_layers)
            stacked = install_stacked_states(
                caches, self._state_layer_ids, [r.states or [] for r in batch]
            )
            logits = self.model(tokens, cache=self._nesting.nest(caches))
            sampled = self._sample(logits[:, -1, :], batch)
            # One evaluation for the tokens and the new states together.
            mx.eval(sampled, [state.view.cache for state in stacked])
            for state in stacked:
                state.split()
            return cast(list[int], sampled.tolist())
        except BaseException:
            self._key = key
            self._rollback(batch, lengths)
            raise

    def _decode(self, produced: dict[int, list[int]]) -> None:
        start = time.perf_counter()
        self._make_decode_room()
        if not self._running:
            return
        batch = list(self._running)
        try:
            chosen = self._decode_batch(batch)
        except Exception as error:
            # Nothing of the batch was kept; find the request(s) that fail on their own.
            logger.warning(
                "batched decode of %d requests failed (%r); retrying them one by one",
                len(batch),
                error,
            )
            for request in batch:
                try:
                    token = self._decode_batch([request])[0]
                except Exception as alone:
                    self._fail(request, alone)
                else:
                    self._emit(request, token, produced)
        else:
            for request, token in zip(batch, chosen, strict=True):
                self._emit(request, token, produced)
        self.stats.record_decode(time.perf_counter() - start, len(batch))

    def _fit_chunk(self, request: _Request, n: int) -> int:
        demands = {r.rid: 1 for r in self._running}
        while n >= 1:
            demands[request.rid] = n
            if self.pool.can_reserve(demands):
                return n
            n //= 2
        return 0

    def _state_room(self) -> bool:
        """Whether one more request's recurrent state fits ``state_budget_bytes``."""
        per = self.state_bytes_per_request
        if self.state_budget_bytes is None or per is None:
            return True
        return (len(self._running) + 1) * per <= self.state_budget_bytes

    def state_bytes_in_use(self) -> int:
        """Bytes of recurrent state the engine holds now (running and prefilling requests)."""
        holders = [*self._running, *([self._prefilling] if self._prefilling else [])]
        return sum(state_nbytes(r.states) for r in holders if r.states is not None)

    def _admit(self) -> _Request | None:
        if not self._queue or len(self._running) >= self.max_running:
            return None
        if not self._state_room():
            return None
        request = self._queue[0]
        try:
            self.pool.add_request(request.rid)
        except Exception as error:
            self._queue.popleft()
            self._fail(request, error)
            return None
        self._queue.popleft()
        request.in_pool = True
        request.caches = None
        request.prefilled = 0
        request.status = RequestStatus.PREFILLING
        self._prefilling = request
        return request

    def _prefill_chunk(
        self, request: _Request, tokens: list[int], n: int, produced: dict[int, list[int]]
    ) -> None:
        """Prefill ``tokens[prefilled : prefilled + n]``: all of it, or nothing and a raise."""
        begin = request.prefilled
        key = self._key
        first: int | None = None
        snapshot = StateSnapshot(request.states or [])
        try:
            if request.states is None and self.make_state_caches is not None:
                request.states = self.make_state_caches()
                snapshot = StateSnapshot(request.states)
            if request.caches is None:
                # (Re)built at the pool's length, which is `begin` after any rollback.
                request.caches = request_caches(
                    self._num_layers,
                    self._state_layer_ids,
                    request.states or [],
                    lambda layer_id: self.make_prefill_cache(self.pool, request.rid, layer_id),
                )
            self.pool.reserve(request.rid, n)
            chunk = mx.array(tokens[begin : begin + n], dtype=mx.int32)
            model_caches = self._nesting.nest(request.caches)
            if self._prefill_forward is not None:
                logits = self._prefill_forward(chunk[None], model_caches)
            else:
                logits = self.model(chunk[None], cache=model_caches)
            if begin + n < len(tokens) or request.generated:
                mx.eval(logits)
            else:
                first = cast(list[int], self._sample(logits[:, -1, :], [request]).tolist())[0]
            if request.states:
                mx.eval([getattr(c, "cache", []) for c in request.states])
        except BaseException:
            self._key = key
            # The caches' offsets may have moved past `begin`: rebuild them next time; the
            # recurrent states go back to what they were before the chunk.
            request.caches = None
            snapshot.restore()
            self._rollback([request], [begin])
            raise
        if request.states:
            held = state_nbytes(request.states)
            self.state_bytes_per_request = max(self.state_bytes_per_request or 0, held)
        request.prefilled = begin + n
        self.stats.prefill_tokens += n
        if request.prefilled < len(tokens):
            return
        self._prefilling = None
        request.caches = None
        request.status = RequestStatus.RUNNING
        self._running.append(request)
        if first is not None:
            self._emit(request, first, produced)

    def _prefill(self, produced: dict[int, list[int]]) -> None:
        budget = self.prefill_chunk
        while budget > 0:
            request = self._prefilling if self._prefilling is not None else self._admit()
            if request is None:
                if self._queue and len(self._running) < self.max_running and self._state_room():
                    continue  # the head of the queue failed admission; try the next one
                return
            tokens = request.prefill_tokens()
            n = self._fit_chunk(request, min(budget, len(tokens) - request.prefilled))
            if n == 0:
                if not self._running:
                    # Nothing else holds pages: this request alone cannot fit.
                    self._finish(request, "pool_exhausted")
                    continue
                if request.prefilled == 0:
                    self._prefilling = None
                    self._release(request)
                    request.status = RequestStatus.QUEUED
                    self._queue.appendleft(request)
                return
            try:
                self._prefill_chunk(request, tokens, n, produced)
            except Exception as error:
                self._fail(request, error)
            budget -= n

    def _sample(self, logits: mx.array, batch: Sequence[_Request]) -> mx.array:
        greedy = mx.argmax(logits, axis=-1)
        if all(r.temperature == 0.0 for r in batch):
            return greedy
        self._key, key = mx.random.split(self._key)
        sampled = sample_top_p(
            logits,
            [r.temperature if r.temperature > 0 else 1.0 for r in batch],
            [r.top_p for r in batch],
            key,
        )
        if any(r.seed is not None and r.temperature > 0 for r in batch):
            rows = [
                sample_top_p(
                    logits[i : i + 1],
                    [r.temperature],
                    [r.top_p],
                    token_key(r.seed, len(r.generated)),
                )[0]
                if r.seed is not None and r.temperature > 0
                else sampled[i]
                for i, r in enumerate(batch)
            ]
            sampled = mx.stack(rows)
        use = mx.array([r.temperature > 0 for r in batch])
        return mx.where(use, sampled, greedy)

    def pages_in_use(self) -> Mapping[str, int] | None:
        """Pages in use per sub-pool now, if the pool can tell."""
        return pages_in_use(self.pool)


def _host_tokens(tokens: object, what: str) -> object:
    """Token ids as host values: an ``mx.array`` of an integer dtype becomes a list."""
    if isinstance(tokens, mx.array):
        if not mx.issubdtype(tokens.dtype, mx.integer) or tokens.ndim > 1:
            raise RequestStateError(
                f"{what} must be a 1-D integer array or a sequence of ints, got an array of "
                f"shape {tuple(tokens.shape)} and dtype {tokens.dtype}"
            )
        return tokens.reshape(-1).tolist()
    return tokens
