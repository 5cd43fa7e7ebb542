"""The decode engine: admission by pool capacity, chunked prefill, one batched decode per step.

The engine composes four parts, each in its own module: the requests (:mod:`._requests`),
scheduling over the pool (:mod:`._scheduler`), running the model (:mod:`._model_runner`)
and sampling (:mod:`._sampling`). It owns the step transaction that ties them together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import (
    CacheLayout,
    KernelSet,
    KVCache,
    KVPool,
    KVPrefixCache,
    LayoutError,
    RequestStateError,
    UnsupportedModelError,
    check_int,
    check_int_sequence,
    check_number,
    layout_from_model,
)

from ._cache_nesting import CacheNesting
from ._decode_paths import choose_decode_paths
from ._engine_stats import (
    DEFAULT_STATS_WINDOW,
    EngineMemoryReport,
    EngineStats,
    pages_in_use,
    pool_bytes,
)
from ._model_forward import last_position_forward, vocabulary_size
from ._model_runner import ModelRunner
from ._patching import unpatch_model_attention
from ._prefill_budget import PrefillBudget
from ._requests import EngineRequest, RequestOutput, RequestStatus, RequestTable
from ._sampling import Sampler
from ._scheduler import Scheduler
from ._state_cache import (
    StateCacheFactory,
    StateSnapshot,
    group_by_state_shapes,
    model_state_caches,
    request_caches,
    request_state_bytes,
)

__all__ = ["DecodeEngine", "PrefillCacheFactory"]

logger = logging.getLogger(__name__)

#: ``make_prefill_cache(pool, request_id, layer_id)`` -> a per-request, per-layer cache.
PrefillCacheFactory = Callable[[KVPool, int, int], KVCache]


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

    Prefill budget per step (``prefill_stall``): ``None`` prefills up to ``prefill_chunk``
    tokens a step. A positive number bounds how long a step's prefill may keep the running
    requests waiting, as a multiple of the step's decode: the budget is that many decode
    times over the measured seconds per prompt token (see :class:`PrefillBudget`), at least
    a small chunk so a prompt always progresses, the whole ``prefill_chunk`` when nothing
    decodes. So a 4k-token prompt arriving mid-stream is spread over many steps instead of
    stalling every stream for its whole prefill.

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
        prefix_caching: bool | None = None,
        prefill_stall: float | None = None,
    ) -> None:
        max_running = check_int(max_running, "max_running", minimum=1)
        if state_budget_bytes is not None:
            state_budget_bytes = check_int(state_budget_bytes, "state_budget_bytes", minimum=1)
        prefill_budget = PrefillBudget(prefill_chunk, prefill_stall=prefill_stall)
        seed = check_int(seed, "seed", minimum=0, maximum=2**64 - 1)
        model_layout = layout_from_model(model)
        _check_layouts(model_layout, pool.layout)
        nesting = CacheNesting.from_model(model)
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
        self.decode_plan = choose_decode_paths(
            model,
            pool,
            kernels,
            make_prefill_cache,
            decode_path,
            vocab_size=vocab_size,
            num_layers=model_layout.num_layers,
            state_caches=make_state_caches,
            state_layer_ids=self._state_layer_ids,
            nesting=nesting,
        )
        self.make_state_caches = make_state_caches
        self.model = model
        self.pool = pool
        self.kernels = kernels
        self.make_prefill_cache = make_prefill_cache
        self.prefill_budget = prefill_budget
        self.record_pages = record_pages
        self.vocab_size = vocab_size
        self.stats = EngineStats(window=stats_window)
        self.runner = ModelRunner(
            model,
            pool,
            kernels,
            universal_layers=self.decode_plan.universal_layers,
            state_layer_ids=self._state_layer_ids,
            nesting=nesting,
            prefill_forward=self._prefill_forward,
        )
        self.runner.say_unfused_layers()
        self.scheduler = Scheduler(
            pool, self.stats, max_running=max_running, state_budget_bytes=state_budget_bytes
        )
        if self._state_layer_ids:
            # Known before the first admission, so a state budget holds from the start.
            self.scheduler.state_bytes_per_request = request_state_bytes(model, model_layout)
        self.sampler = Sampler(seed)
        self._prefix_cache = self._choose_prefix_cache(pool, prefix_caching)
        self._num_layers = model_layout.num_layers
        self._requests = RequestTable()
        # Tokens of a step that raised, handed out by the next step.
        self._undelivered: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ configuration

    def _choose_prefix_cache(self, pool: KVPool, wanted: bool | None) -> KVPrefixCache | None:
        """The pool's prefix cache if it has one that is on and the model can use it."""
        capable = isinstance(pool, KVPrefixCache) and pool.prefix_caching
        if wanted is False or (wanted is None and not capable):
            return None
        if not capable:
            raise UnsupportedModelError(
                "prefix_caching=True needs a pool built with prefix caching on (a "
                "kv_protocol.KVPrefixCache whose prefix_caching is True)"
            )
        if self._state_layer_ids:
            # A reused prefix would need each request's recurrent state at that length,
            # which is not kept: such models prefill every prompt whole.
            if wanted:
                raise UnsupportedModelError(
                    f"prefix caching is not available for {type(self.model).__name__}: its "
                    f"STATE layers {list(self._state_layer_ids)} keep no state per prefix"
                )
            return None
        return cast(KVPrefixCache, pool)

    @property
    def prefill_chunk(self) -> int:
        """The most prompt tokens one step prefills (the prefill budget's ceiling)."""
        return self.prefill_budget.prefill_chunk

    @property
    def prefix_caching(self) -> bool:
        """Whether requests reuse cached K/V of a shared prompt prefix."""
        return self._prefix_cache is not None

    @property
    def max_running(self) -> int:
        """The most requests that decode together."""
        return self.scheduler.max_running

    @property
    def state_budget_bytes(self) -> int | None:
        """Bytes of recurrent state the running requests may hold together (``None``: no cap)."""
        return self.scheduler.state_budget_bytes

    @state_budget_bytes.setter
    def state_budget_bytes(self, value: int | None) -> None:
        self.scheduler.state_budget_bytes = value

    @property
    def state_bytes_per_request(self) -> int | None:
        """Bytes of one request's recurrent state (largest seen; ``None`` until one is known)."""
        return self.scheduler.state_bytes_per_request

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
        request = EngineRequest(
            self._requests.next_id(),
            prompt,
            max_tokens,
            temperature,
            top_p,
            frozenset(stops),
            seed,
        )
        self._requests.add(request)
        self.scheduler.enqueue(request)
        return request.rid

    def release(self, request_id: int) -> RequestOutput:
        """Forget a finished request and return its final output.

        The engine drops everything it kept for the request (prompt, tokens, error), so a
        long-running caller that releases each request once it has read its output keeps the
        engine's memory bounded. Later calls that name the request raise
        ``UnknownRequestError``. A request that has not finished raises
        ``RequestStateError``: :meth:`abort` it first.
        """
        request = self._requests.get(request_id)
        if request.status is not RequestStatus.FINISHED:
            raise RequestStateError(
                f"request {request_id} is {request.status.value}; abort it before releasing it"
            )
        out = request.output()
        self._requests.forget(request.rid)
        self._undelivered.pop(request.rid, None)
        return out

    def is_finished(self, request_id: int) -> bool:
        """Whether the request has finished (cheaper than :meth:`output`: no copies)."""
        return self._requests.get(request_id).status is RequestStatus.FINISHED

    @property
    def num_requests(self) -> int:
        """Requests the engine still keeps: active ones and finished ones not released."""
        return len(self._requests)

    def abort(self, request_id: int) -> bool:
        """Stop a request and free its pages; False if it had finished already."""
        request = self._requests.get(request_id)
        if request.status is RequestStatus.FINISHED:
            return False
        self.scheduler.finish(request, "aborted")
        self.stats.aborted += 1
        return True

    def output(self, request_id: int) -> RequestOutput:
        """The request's prompt, generated tokens so far, status and finish reason."""
        return self._requests.get(request_id).output()

    @property
    def decode_paths(self) -> Mapping[int, str]:
        """Attention layer id -> ``"fast"`` (patched kernels) or ``"universal"`` (pool cache)."""
        return self.decode_plan.paths

    def close(self) -> None:
        """Abort what still runs and put the model's original attention modules back.

        The engine must not step after this; the model is as it was before the engine.
        """
        for request in self.scheduler.active():
            self.scheduler.finish(request, "aborted")
            self.stats.aborted += 1
        unpatch_model_attention(self.model)

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def has_work(self) -> bool:
        """True while any request is queued, prefilling or running."""
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        """Requests decoding now."""
        return len(self.scheduler.running)

    @property
    def num_queued(self) -> int:
        """Requests waiting for admission (preempted ones included)."""
        return len(self.scheduler.queue)

    def state_bytes_in_use(self) -> int:
        """Bytes of recurrent state the engine holds now (running and prefilling requests)."""
        return self.scheduler.state_bytes_in_use()

    def pages_in_use(self) -> Mapping[str, int] | None:
        """Pages in use per sub-pool now, if the pool can tell."""
        return pages_in_use(self.pool)

    def memory_report(self) -> EngineMemoryReport:
        """The pool's bytes and the recurrent states' bytes the engine holds now."""
        total, used = pool_bytes(self.pool)
        prefix_stats = getattr(self.pool, "prefix_cache_stats", None)
        return EngineMemoryReport(
            pool_bytes_total=total,
            pool_bytes_used=used,
            state_bytes_in_use=self.state_bytes_in_use(),
            state_bytes_per_request=self.state_bytes_per_request,
            state_budget_bytes=self.state_budget_bytes,
            prefix_cache=prefix_stats() if callable(prefix_stats) else None,
        )

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
            decoded = bool(self.scheduler.running)
            if decoded:
                self._decode(produced)
            middle = time.perf_counter()
            self._prefill(produced, middle - start if decoded else None)
        except BaseException:
            self._undelivered = produced
            raise
        finally:
            end = time.perf_counter()
            stats = self.stats
            stats.prefill_seconds += end - middle
            pages = pages_in_use(self.pool) if self.record_pages else None
            stats.record_step(len(self.scheduler.queue), len(self.scheduler.running), pages)
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
        return {r.rid: list(r.generated) for r in self._requests}

    # ------------------------------------------------------------------ internals

    def _commit(self, request: EngineRequest, tokens: Sequence[int]) -> None:
        """Tell the prefix cache the request's next positions hold these tokens' K/V."""
        if self._prefix_cache is None:
            return
        try:
            self._prefix_cache.commit_tokens(request.rid, tokens)
        except Exception as error:  # the cache only loses an entry; the request goes on
            logger.warning("prefix cache: commit for request %d failed: %r", request.rid, error)

    def _reuse_prefix(self, request: EngineRequest) -> None:
        """Start a just-admitted request at the longest prefix the cache holds."""
        cache = self._prefix_cache
        if cache is None:
            return
        tokens = request.prefill_tokens()
        try:
            hit = cache.match_prefix(tokens)
            if hit:
                cache.reuse_prefix(request.rid, tokens, hit)
        except Exception as error:  # nothing was reused; prefill computes everything
            logger.warning("prefix cache: reuse for request %d failed: %r", request.rid, error)
            return
        if hit:
            request.prefilled = hit
            self.stats.prefix_hit_tokens += hit

    def _emit(self, request: EngineRequest, token: int, produced: dict[int, list[int]]) -> None:
        request.generated.append(token)
        produced.setdefault(request.rid, []).append(token)
        if token in request.stop_tokens:
            self.scheduler.finish(request, "stop")
        elif len(request.generated) >= request.max_tokens:
            self.scheduler.finish(request, "length")

    def _decode_batch(self, batch: Sequence[EngineRequest]) -> list[int]:
        """One batched decode of ``batch``: the sampled tokens, or a rollback and a raise."""
        saved = self.sampler.save()
        lengths = [self.pool.seq_len(r.rid) for r in batch]
        try:
            out = self.runner.decode(
                [r.rid for r in batch],
                [r.generated[-1] for r in batch],
                [r.states or [] for r in batch],
            )
            sampled = self.sampler.sample(out.logits, [r.sampling_row() for r in batch])
            tic = time.perf_counter()
            # One evaluation for the tokens and the new states together.
            mx.eval(sampled, out.state_arrays())
            chosen = cast(list[int], sampled.tolist())
            self.stats.decode_device_seconds += time.perf_counter() - tic
            out.split_states()
            return chosen
        except BaseException:
            self.sampler.restore(saved)
            self.scheduler.trim_back(batch, lengths)
            raise

    def _decode(self, produced: dict[int, list[int]]) -> None:
        start = time.perf_counter()
        self.scheduler.make_decode_room()
        if not self.scheduler.running:
            return
        batch = list(self.scheduler.running)
        if self._state_layer_ids:
            # Rows decode together only where their recurrent states stack (same shapes);
            # a state that grows with the text (an n-gram context) splits the batch early on.
            groups = group_by_state_shapes(batch, lambda r: r.states or [])
        else:
            groups = [batch]
        for group in groups:
            self._decode_group(group, produced)
        self.stats.record_decode(time.perf_counter() - start, len(batch))

    def _decode_group(self, batch: list[EngineRequest], produced: dict[int, list[int]]) -> None:
        try:
            chosen = self._decode_batch(batch)
        except Exception as error:
            # Nothing of the batch was kept; find the request(s) that fail on their own.
            self.stats.decode_fallbacks += 1
            logger.warning(
                "batched decode of %d requests failed (%r); retrying them one by one",
                len(batch),
                error,
            )
            for request in batch:
                try:
                    token = self._decode_batch([request])[0]
                except Exception as alone:
                    self.scheduler.fail(request, alone)
                else:
                    self._commit(request, request.generated[-1:])
                    self._emit(request, token, produced)
        else:
            for request, token in zip(batch, chosen, strict=True):
                self._commit(request, request.generated[-1:])
                self._emit(request, token, produced)

    def _prefill_chunk(
        self, request: EngineRequest, tokens: list[int], n: int, produced: dict[int, list[int]]
    ) -> None:
        """Prefill ``tokens[prefilled : prefilled + n]``: all of it, or nothing and a raise."""
        begin = request.prefilled
        started = time.perf_counter()
        saved = self.sampler.save()
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
            logits = self.runner.prefill(tokens[begin : begin + n], request.caches)
            tic = time.perf_counter()
            if begin + n < len(tokens) or request.generated:
                # No token is sampled from this chunk: evaluate what it wrote (the caches'
                # state), not its logits, so the last layer's attention and MLP, which only
                # the logits need, are never computed (mlx-lm's prefill does the same).
                mx.eval(_written_state(request.caches))
            else:
                sampled = self.sampler.sample(logits[:, -1, :], [request.sampling_row()])
                first = cast(list[int], sampled.tolist())[0]
            if request.states:
                mx.eval([getattr(c, "cache", []) for c in request.states])
            self.stats.prefill_device_seconds += time.perf_counter() - tic
        except BaseException:
            self.sampler.restore(saved)
            # The caches' offsets may have moved past `begin`: rebuild them next time; the
            # recurrent states go back to what they were before the chunk.
            request.caches = None
            snapshot.restore()
            self.scheduler.trim_back([request], [begin])
            raise
        self.scheduler.note_state_bytes(request)
        self._commit(request, tokens[begin : begin + n])
        request.prefilled = begin + n
        self.stats.record_prefill_chunk(n)
        self.prefill_budget.note_prefill(n, time.perf_counter() - started)
        if request.prefilled < len(tokens):
            return
        self.scheduler.start_running(request)
        if first is not None:
            self._emit(request, first, produced)

    def _prefill(self, produced: dict[int, list[int]], decode_seconds: float | None) -> None:
        scheduler = self.scheduler
        budget = self.prefill_budget.tokens(decode_seconds)
        while budget > 0:
            request = scheduler.prefilling
            if request is None:
                request = scheduler.admit()
                if request is not None:
                    self._reuse_prefix(request)
            if request is None:
                if scheduler.may_admit():
                    continue  # the head of the queue failed admission; try the next one
                return
            tokens = request.prefill_tokens()
            n = scheduler.fit_chunk(request, min(budget, len(tokens) - request.prefilled))
            if n == 0:
                if not scheduler.running:
                    # Nothing else holds pages: this request alone cannot fit.
                    scheduler.finish(request, "pool_exhausted")
                    continue
                if request.prefilled == 0:
                    scheduler.requeue_unstarted(request)
                return
            try:
                self._prefill_chunk(request, tokens, n, produced)
            except Exception as error:
                scheduler.fail(request, error)
            budget -= n


def _written_state(caches: Sequence[Any]) -> list[mx.array]:
    """The arrays of the caches' ``state``: what evaluating a prefill chunk's writes needs."""
    arrays: list[mx.array] = []

    def collect(value: object) -> None:
        if isinstance(value, mx.array):
            arrays.append(value)
        elif isinstance(value, list | tuple):
            for item in value:
                collect(item)

    for cache in caches:
        collect(getattr(cache, "state", None))
    return arrays


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
