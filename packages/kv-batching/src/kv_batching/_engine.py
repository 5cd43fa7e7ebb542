"""The decode engine: admission by pool capacity, chunked prefill, one batched decode per step.

This module is the engine's public face: construction (the checks, the model's decode
routes and the parts are :func:`~kv_batching._engine_assembly.assemble`'s), requests in and
out, and :meth:`DecodeEngine.step`, which runs the step's two phases in order: the decode
phase (:mod:`._decode_phase`, speculative verification in :mod:`._verification`) and the
prefill phase (:mod:`._prefill_phase`, forks in :mod:`._forks`), both ending in the update
phase (:mod:`._outputs`, state snapshots in :mod:`._snapshot_policy`). They share one
:class:`~kv_batching._engine_core.EngineCore`: the pool, the scheduler (:mod:`._scheduler`),
the model runner (:mod:`._model_runner`), the sampler (:mod:`._sampling`), the requests
(:mod:`._requests`) and the stats.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import (
    KernelSet,
    KVPool,
    KVPoolMemory,
    RequestStateError,
    check_int,
)

from ._agreement import RankAgreement
from ._decode_paths import DecodePlan
from ._engine_assembly import assemble
from ._engine_config import EngineConfig
from ._engine_core import PrefillCacheFactory
from ._engine_stats import EngineMemoryReport, EngineStats
from ._intake import UNSET, new_requests, short_sampling
from ._model_surgery import ModelChange
from ._requests import RequestOutput, RequestStatus
from ._sampling import SamplingParams, TokenLogprob
from ._snapshot_policy import DEFAULT_STATE_CACHE_BYTES, rewind
from ._state_cache import StateCacheFactory

__all__ = ["DEFAULT_STATE_CACHE_BYTES", "DecodeEngine", "PrefillCacheFactory"]


class DecodeEngine:
    """Serve many generation requests on one model through a paged KV pool.

    The settings are one :class:`EngineConfig` (``config``, checked when it is made); each of
    its fields may also be given by keyword (``max_running=4``), replacing the config's.

    ``make_prefill_cache(pool, reservation, layer_id)`` builds the per-layer caches a prompt
    chunk is prefilled through (the original model path, in chunks of at most
    ``prefill_chunk`` tokens per step); their K/V land in ``pool``, at the slots the chunk's
    reservation holds. Then all running
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

    Decode routes (``decode_path``): each attention layer takes the patched fast path (its
    module wrapped in place by :func:`patch_model_attention`: paged attention, and the
    fused RoPE + scatter kernel where it serves the layer) where the wrapper's probe
    reproduces the module exactly, and the universal path (a pool-backed cache handed to the
    unmodified module) otherwise; ``"universal"`` puts every layer there, ``"fast"`` refuses
    a module the probe rejects. :attr:`decode_plan` reports each layer's route (``fused``,
    ``unfused``, ``universal``), decided once here. Building the engine runs one ragged batched
    decode step through the pool against prefill of the same tokens, so a model neither
    path serves is refused here with ``UnsupportedModelError``, never at decode time.
    Building **modifies the model** (the fast layers' attention modules are wrapped, and
    with ``fast_activations`` on MLX's CPU the wide SiLU / tanh-GELU gated MLPs are swapped
    for :class:`~kv_batching._fast_mlp.FastGatedMLP`, the same function with a vectorised
    activation, used only in the engine's own forwards: about a third of a Gemma 3 prefill;
    ``changes``, the caller's own :class:`~kv_batching._model_surgery.ModelChange` list,
    are installed first). Every change goes through one
    :class:`~kv_batching._model_surgery.ModelSurgery`: a refusal while building undoes them
    all, and :meth:`close` (or leaving a ``with`` block) puts the originals back.

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

    The scheduler makes one pool reservation per decode batch and per prefill chunk
    (``try_reserve_batch``) and rolls it back if the step fails; the decode step and the
    prefill caches take their slots from it. With prefix caching, each request's block
    hashes are computed once, kept with the request and extended as it decodes.

    On a model with recurrent STATE layers, prefix caching keeps snapshots of each request's
    state (``state_snapshot_interval``: every that many tokens, a multiple of the pool's
    prefix boundary; also at each prompt's last boundary and the last boundary a request
    decoded past) under the prefix's block hash, within ``state_cache_bytes``; a hit is the
    longest boundary where the pool serves the prefix and a snapshot is kept, and prefill
    resumes from a copy of it (see :mod:`kv_batching._state_snapshots`). ``step_snapshots``
    keeps each running request's state before its last decode step for :meth:`restore`.

    On tensor-parallel ranks (a model sharded over ``mx.distributed``) every rank runs its
    own engine with the same requests; ``agreement`` (a :class:`RankAgreement`) makes each
    step's sampled tokens and prefill budget the leader rank's, the only decisions not
    fixed by the requests themselves. Speculative decoding is refused together with it.

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
        config: EngineConfig | None = None,
        *,
        make_state_caches: StateCacheFactory | None = None,
        agreement: RankAgreement | None = None,
        changes: Sequence[ModelChange] = (),
        **settings: Any,
    ) -> None:
        config = EngineConfig.from_settings(config, settings)
        parts = assemble(
            model,
            pool,
            kernels,
            make_prefill_cache,
            config,
            make_state_caches=make_state_caches,
            agreement=agreement,
            changes=changes,
        )
        self._config = config
        self._model = model
        self._core = parts.core
        self._decode_phase = parts.decode_phase
        self._prefill_phase = parts.prefill_phase
        self._snapshots = parts.snapshots
        self._decode_plan = parts.decode_plan
        self._vocab_size = parts.vocab_size
        self._prefill_forward = parts.prefill_forward
        # Tokens of a step that raised, handed out by the next step.
        self._undelivered: dict[int, list[int]] = {}

    @property
    def config(self) -> EngineConfig:
        """The settings this engine was built with (checked, in their normal forms)."""
        return self._config

    @property
    def pool(self) -> KVPool:
        """The pool the engine's requests hold their K/V in (read it; the engine drives it)."""
        return self._core.pool

    @property
    def stats(self) -> EngineStats:
        """Counters, aggregates and bounded per-step series of this engine."""
        return self._core.stats

    @property
    def vocab_size(self) -> int:
        """Token ids are ``0 .. vocab_size - 1``."""
        return self._vocab_size

    @property
    def decode_plan(self) -> DecodePlan:
        """Each attention layer's decode route (``fused``, ``unfused``, ``universal``), and why."""
        return self._decode_plan

    @property
    def prefix_caching(self) -> bool:
        """Whether requests reuse cached K/V of a shared prompt prefix."""
        return self._core.prefix_cache is not None

    @property
    def max_running(self) -> int:
        """The most requests that decode together."""
        return self._core.scheduler.max_running

    @property
    def state_budget_bytes(self) -> int | None:
        """Bytes of recurrent state the running requests may hold together (``None``: no cap).

        Each running request counts its state and, with state snapshots, the copies it keeps
        (the last boundary it decoded past; with ``step_snapshots``, its state before the
        last step).
        """
        return self._core.scheduler.state_budget_bytes

    @state_budget_bytes.setter
    def state_budget_bytes(self, value: int | None) -> None:
        self._core.scheduler.state_budget_bytes = value

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt_tokens: Iterable[int] | mx.array,
        max_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        temperature: float = UNSET,
        top_p: float = UNSET,
        stop_tokens: Iterable[int] | mx.array = (),
        seed: int | None = UNSET,
    ) -> int:
        """Queue a request; returns its id. Nothing runs until :meth:`step`.

        ``sampling`` says how it picks its tokens (:class:`SamplingParams`; greedy by
        default); ``temperature``, ``top_p`` and ``seed`` are the short form of the same
        fields (giving both forms is an error). With a seed the request samples from its own
        random stream: its n-th token depends only on the seed, n and its logits, never on
        the other requests of the batch, preemption or retries. Without one it samples from
        the engine's stream (``seed`` of the engine). The request finishes (``"stop"``) when
        it samples one of ``stop_tokens``.

        Every argument is checked first (token ids in ``0 .. vocab_size - 1``, the logit
        bias's too, ints that are not bools or floats, finite numbers in range); a bad one
        raises ``RequestStateError`` (a ``ValueError``) and nothing is queued, no request id
        is used.
        """
        return self.submit_n(
            prompt_tokens,
            max_tokens,
            1,
            sampling=short_sampling(sampling, temperature, top_p, seed),
            stop_tokens=stop_tokens,
        )[0]

    def submit_n(
        self,
        prompt_tokens: Iterable[int] | mx.array,
        max_tokens: int,
        n: int,
        *,
        sampling: SamplingParams | None = None,
        stop_tokens: Iterable[int] | mx.array = (),
    ) -> list[int]:
        """Queue ``n`` sequences of one prompt; returns their ids (consecutive).

        The prompt is prefilled once: when its prefill samples the first token, each other
        sequence samples its own first token from the same logits and takes a fork of the
        first one's pages (whole pages shared, the last partial page copied) and of its
        recurrent state, and decodes on its own from there. Sequence ``i`` samples with seed
        ``(sampling.seed + i) % 2**64`` when the params have a seed (so it equals that seed
        submitted alone), from the engine's stream otherwise. A sequence that cannot be
        forked then (no free page for the copy, no running slot, a pool that cannot fork)
        prefills the prompt itself later. Each id is an ordinary request afterwards.

        Refused at once (``RequestStateError``, nothing queued) when the ``n`` sequences of
        ``len(prompt) + max_tokens`` tokens could never be in the pool together, counting the
        prompt's full pages once; other checks as for :meth:`submit`.
        """
        requests = new_requests(
            self._core.requests.next_id(),
            prompt_tokens,
            max_tokens,
            n,
            sampling=sampling,
            stop_tokens=stop_tokens,
            vocab_size=self._vocab_size,
            pool=self._core.pool,
        )
        for request in requests:
            self._core.requests.add(request)
        self._core.scheduler.enqueue(requests[0])
        return [r.rid for r in requests]

    def token_logprobs(self, request_id: int, start: int = 0) -> tuple[TokenLogprob, ...]:
        """The generated tokens' logprobs from index ``start`` on (the request asked for them).

        For streaming: after each :meth:`step`, the tokens that step produced. A request that
        did not ask for logprobs raises ``RequestStateError``.
        """
        request = self._core.requests.get(request_id)
        if request.logprobs is None:
            raise RequestStateError(
                f"request {request_id} did not ask for logprobs (SamplingParams.logprobs)"
            )
        start = check_int(start, "start", minimum=0)
        return tuple(request.logprobs[start:])

    def release(self, request_id: int) -> RequestOutput:
        """Forget a finished request and return its final output.

        The engine drops everything it kept for the request (prompt, tokens, error), so a
        long-running caller that releases each request once it has read its output keeps the
        engine's memory bounded. Later calls that name the request raise
        ``UnknownRequestError``. A request that has not finished raises
        ``RequestStateError``: :meth:`abort` it first.
        """
        request = self._core.requests.get(request_id)
        if request.status is not RequestStatus.FINISHED:
            raise RequestStateError(
                f"request {request_id} is {request.status.value}; abort it before releasing it"
            )
        out = request.output()
        self._core.requests.forget(request.rid)
        self._undelivered.pop(request.rid, None)
        return out

    def is_finished(self, request_id: int) -> bool:
        """Whether the request has finished (cheaper than :meth:`output`: no copies)."""
        return self._core.requests.get(request_id).status is RequestStatus.FINISHED

    @property
    def num_requests(self) -> int:
        """Requests the engine still keeps: active ones and finished ones not released."""
        return len(self._core.requests)

    def abort(self, request_id: int) -> bool:
        """Stop a request and free its pages; False if it had finished already."""
        request = self._core.requests.get(request_id)
        if request.status is RequestStatus.FINISHED:
            return False
        self._core.scheduler.finish(request, "aborted")
        self._core.stats.aborted += 1
        return True

    def restore(self, request_id: int, position: int) -> None:
        """Roll a running request back to its first ``position`` tokens of text.

        The request then holds ``position`` positions (its prompt and the first ``position -
        len(prompt)`` generated tokens) and decodes the token at ``position`` next, as it did
        after that step: generated tokens past it are dropped (with their logprobs), the pool
        gives back the positions past it, and the recurrent state (a model with STATE layers)
        becomes the snapshot taken there: the request's state before its last decode step
        (``step_snapshots=True``), or a snapshot kept at a prefix boundary of its own text.
        ``position`` runs from ``len(prompt)`` to the request's current length.

        ``RequestStateError`` for a request that is not running, a position out of range, a
        state model with no snapshot at ``position`` or a request whose output is constrained
        (its grammar state cannot be rolled back); ``CacheStateError`` when the pool cannot
        give the positions back (a sliding window no longer holds what the position needs).
        Nothing changes on any error.
        """
        request = self._core.requests.get(request_id)
        if request.status is not RequestStatus.RUNNING:
            raise RequestStateError(
                f"request {request_id} is {request.status.value}; only a running request can "
                "be restored to an earlier position"
            )
        rewind(request, position, self._core, self._snapshots)

    def output(self, request_id: int) -> RequestOutput:
        """The request's prompt, generated tokens so far, status and finish reason."""
        return self._core.requests.get(request_id).output()

    def close(self) -> None:
        """Abort what still runs and undo every change made to the model, last first.

        The engine must not step after this; the model is as it was before the engine.
        """
        for request in self._core.scheduler.active():
            self._core.scheduler.finish(request, "aborted")
            self._core.stats.aborted += 1
        self._core.runner.surgery.undo()

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def has_work(self) -> bool:
        """True while any request is queued, prefilling or running."""
        return self._core.scheduler.has_work

    @property
    def num_running(self) -> int:
        """Requests decoding now."""
        return len(self._core.scheduler.running)

    @property
    def num_queued(self) -> int:
        """Requests waiting: in the queue (preempted ones too) or for their prompt's prefill."""
        return len(self._core.scheduler.queue) + len(self._core.scheduler.waiting())

    def memory_report(self) -> EngineMemoryReport:
        """What the engine holds now: the pool's pages and bytes, the recurrent states' bytes."""
        report = self._core.pool.memory_report()
        scheduler = self._core.scheduler
        return EngineMemoryReport(
            pool=report,
            state_bytes_in_use=scheduler.state_bytes_in_use(),
            state_bytes_per_request=scheduler.state_bytes_per_request,
            state_budget_bytes=scheduler.state_budget_bytes,
            state_snapshots=None if self._snapshots is None else self._snapshots.cache.stats(),
        )

    def shrink_pool(self, *, drop_cached: bool = False) -> int:
        """Give back pool memory nobody needs now; return the bytes given back.

        A pool whose buffers grow with use (:class:`kv_protocol.KVPoolMemory`, e.g. a
        ``HybridKVPool`` with ``slab_pages``) cuts them back to what the running requests and
        (unless ``drop_cached``) the cached prefixes hold; any other pool gives back 0.
        Between steps only; nothing a request holds moves.
        """
        pool = self._core.pool
        if not isinstance(pool, KVPoolMemory):
            return 0
        return pool.shrink(drop_cached=drop_cached)

    def fingerprint(self) -> int:
        """A 31-bit hash of the scheduling state.

        It covers which requests run, prefill and wait, how long each is, and the pages each
        sub-pool has in use. Engines that were given the same requests and made the same
        decisions have the same fingerprint (tensor-parallel ranks compare theirs to catch a
        divergence).
        """
        scheduler = self._core.scheduler
        prefilling = scheduler.prefilling
        state = (
            [(r.rid, r.prefilled, len(r.generated)) for r in scheduler.running],
            None if prefilling is None else (prefilling.rid, prefilling.prefilled),
            [r.rid for r in scheduler.queue],
            sorted(self._core.pool.memory_report().pages_used.items()),
        )
        return zlib.crc32(repr(state).encode()) & 0x7FFFFFFF

    @property
    def state_snapshot_interval(self) -> int | None:
        """Tokens between recurrent-state snapshots (``None``: no snapshots are taken)."""
        return self._snapshots.interval if self._snapshots is not None else None

    # ------------------------------------------------------------------ driving

    def step(self) -> dict[int, list[int]]:
        """One engine step: a batched decode of the running requests, then prefill work.

        Returns the tokens produced in this step per request id (plus those of an earlier
        step that raised before it could return them).
        """
        scheduler, stats = self._core.scheduler, self._core.stats
        produced = self._undelivered
        self._undelivered = {}
        start = time.perf_counter()
        middle = start
        try:
            decoded = bool(scheduler.running)
            if decoded:
                self._decode_phase.run(produced)
            middle = time.perf_counter()
            if scheduler.prefilling is not None or scheduler.queue:
                self._prefill_phase.run(produced, middle - start if decoded else None)
        except BaseException:
            self._undelivered = produced
            raise
        finally:
            end = time.perf_counter()
            stats.prefill_seconds += end - middle
            pages = (
                self._core.pool.memory_report().pages_used if self._config.record_pages else None
            )
            stats.record_step(len(scheduler.queue), len(scheduler.running), pages)
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
        return {r.rid: list(r.generated) for r in self._core.requests}
