"""The decode engine: admission by pool capacity, chunked prefill, one batched decode per step.

The engine composes four parts, each in its own module: the requests (:mod:`._requests`),
scheduling over the pool (:mod:`._scheduler`), running the model (:mod:`._model_runner`)
and sampling (:mod:`._sampling`). It owns the step transaction that ties them together.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import (
    EVALUATION_CLOCK,
    CacheLayout,
    KernelSet,
    KVCache,
    KVLifetime,
    KVPool,
    KVPoolMemory,
    KVPrefixCache,
    KVRequestForking,
    LayoutError,
    RequestStateError,
    Reservation,
    UnsupportedModelError,
    check_int,
    check_int_sequence,
    layout_from_model,
)

from ._agreement import RankAgreement
from ._cache_nesting import CacheNesting
from ._constraints import collect_token_masks
from ._decode_paths import DecodePlan, choose_decode_paths
from ._decode_step import PoolAddressing
from ._engine_stats import DEFAULT_STATS_WINDOW, EngineMemoryReport, EngineStats
from ._fast_mlp import patch_model_mlps, unpatch_model_mlps
from ._model_forward import (
    decode_forward,
    last_position_forward,
    vocabulary_size,
)
from ._model_runner import DecodeOutput, ModelRunner
from ._patching import unpatch_model_attention
from ._prefill_budget import PrefillBudget
from ._ragged_state import install_ragged_state_mixers
from ._requests import EngineRequest, RequestOutput, RequestStatus, RequestTable
from ._sampling import (
    SampledTokens,
    Sampler,
    SamplingParams,
    TokenLogprob,
    TokenMasks,
    log_softmax_top,
    plain_greedy,
)
from ._scheduler import Scheduler
from ._speculative import BatchProposer, SpeculationConfig, SpeculationState, StepRates
from ._state_cache import (
    StateCacheFactory,
    copy_state_caches,
    group_by_state_shapes,
    model_state_caches,
    request_caches,
    request_state_bytes,
)
from ._state_snapshots import StateSnapshot, StateSnapshotCache

__all__ = ["DEFAULT_STATE_CACHE_BYTES", "DecodeEngine", "PrefillCacheFactory"]

logger = logging.getLogger(__name__)

#: A keyword argument not given (``None`` is a value the checks refuse or take).
_UNSET: Any = object()

#: Bytes of recurrent-state snapshots an engine keeps for prefix reuse unless told otherwise.
DEFAULT_STATE_CACHE_BYTES = 1 << 30

#: The default snapshot interval is the largest multiple of the prefix boundary up to this.
_SNAPSHOT_INTERVAL_TOKENS = 256

#: ``make_prefill_cache(pool, reservation, layer_id)`` -> the cache of one layer for one
#: prefill chunk: ``reservation`` holds the chunk's request (alone), its start length and the
#: chunk's reserved slots; the cache writes the chunk's K/V there (see
#: ``kv_caches.PoolBackedKVCache``) and reads what attention needs.
PrefillCacheFactory = Callable[[KVPool, Reservation, int], KVCache]


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
    activation, used only in the engine's own forwards: about a third of a Gemma 3 prefill);
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
        state_snapshot_interval: int | None = None,
        state_cache_bytes: int | None = None,
        step_snapshots: bool = False,
        speculation: SpeculationConfig | None = None,
        agreement: RankAgreement | None = None,
        fast_activations: bool = True,
    ) -> None:
        max_running = check_int(max_running, "max_running", minimum=1)
        if not isinstance(fast_activations, bool):
            raise RequestStateError(f"fast_activations must be a bool, got {fast_activations!r}")
        if speculation is not None and not isinstance(speculation, SpeculationConfig):
            raise RequestStateError(
                f"speculation must be a SpeculationConfig or None, got {type(speculation)!r}"
            )
        if speculation is not None and agreement is not None:
            raise RequestStateError(
                "speculative decoding does not run on tensor-parallel ranks (speculation= "
                "and agreement= together); serve with one of them"
            )
        self._agreement = agreement
        self._speculation = speculation
        self._step_rates = (
            StepRates() if speculation is not None and speculation.compare_rates else None
        )
        if state_budget_bytes is not None:
            state_budget_bytes = check_int(state_budget_bytes, "state_budget_bytes", minimum=1)
        prefill_budget = PrefillBudget(prefill_chunk, prefill_stall=prefill_stall)
        seed = check_int(seed, "seed", minimum=0, maximum=2**64 - 1)
        model_layout = layout_from_model(model)
        _check_layouts(model_layout, pool.layout)
        nesting = CacheNesting.from_model(model)
        self._state_layer_ids = model_layout.state_layer_ids
        self._model = model
        # Checked before anything is built (the decode paths patch the model).
        self._prefix_cache = self._choose_prefix_cache(pool, prefix_caching)
        self._snapshots, self._snapshot_interval = self._choose_snapshots(
            state_snapshot_interval, state_cache_bytes
        )
        if not isinstance(step_snapshots, bool):
            raise RequestStateError(f"step_snapshots must be a bool, got {step_snapshots!r}")
        self._step_snapshots = step_snapshots and bool(self._state_layer_ids)
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
        #: A large quantized head projected natively on the CPU (``kernels.quantized_head``).
        quantized_head = getattr(kernels, "quantized_head", None)
        #: Evaluation inside the forward (native CPU kernels'), counted as device time.
        self._head_clock = EVALUATION_CLOCK
        self._prefill_forward = (
            last_position_forward(model, vocab_size, quantized_head)
            if prefill_last_logits
            else None
        )
        head_decode_forward = decode_forward(model, vocab_size, quantized_head)
        self._decode_plan = choose_decode_paths(
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
            prefill_forward=self._prefill_forward,
            decode_forward=head_decode_forward,
        )
        self._make_state_caches = make_state_caches
        self._pool = pool
        self._make_prefill_cache = make_prefill_cache
        self._prefill_budget = prefill_budget
        self._record_pages = record_pages
        self._vocab_size = vocab_size
        self._stats = EngineStats(window=stats_window)
        self._runner = ModelRunner(
            model,
            pool,
            kernels,
            addressing=PoolAddressing.from_pool(pool, self._decode_plan.routes),
            state_layer_ids=self._state_layer_ids,
            nesting=nesting,
            prefill_forward=self._prefill_forward,
            decode_forward=head_decode_forward,
            # Outside the runner's forwards a swapped MLP is the model's own call.
            fast_mlps=fast_activations and patch_model_mlps(model) > 0,
        )
        self._head_clock.take()  # the construction probes' evaluations
        if speculation is not None and self._state_layer_ids and make_state_caches is not None:
            # Proposals verify inside the shared step when every recurrent mixer runs a
            # request's rows in order (else each verification is a forward of its own).
            self._runner.ragged_state_mixers = install_ragged_state_mixers(
                model, nesting, model_layout.num_layers, self._state_layer_ids, make_state_caches
            )
        self._scheduler = Scheduler(
            pool, self._stats, max_running=max_running, state_budget_bytes=state_budget_bytes
        )
        if self._state_layer_ids:
            # Known before the first admission, so a state budget holds from the start.
            self._scheduler.state_bytes_per_request = request_state_bytes(model, model_layout)
        self._sampler = Sampler(seed, agree=None if agreement is None else agreement.tokens)
        self._num_layers = model_layout.num_layers
        #: Prompt positions one chunk computes full-vocabulary logits for (prompt logprobs):
        #: about 64 MiB of float32 logits.
        self._logit_rows = max(1, 2**24 // vocab_size)
        self._requests = RequestTable()
        # Tokens of a step that raised, handed out by the next step.
        self._undelivered: dict[int, list[int]] = {}
        self._scheduler.state_copies = (
            1 + int(self._snapshots is not None) + int(self._step_snapshots)
        )
        if self._snapshots is not None and self._prefix_cache is not None:
            # A snapshot is kept no longer than the pool keeps the page ending at it.
            self._prefix_cache.add_eviction_listener(self._snapshots.forget_block)
            self._scheduler.on_leave = self._keep_last_snapshot

    # ------------------------------------------------------------------ configuration

    def _choose_prefix_cache(self, pool: KVPool, wanted: bool | None) -> KVPrefixCache | None:
        """The pool's prefix cache if it has one and the model can use it."""
        cache = pool.prefix_cache
        if wanted is False or (wanted is None and cache is None):
            return None
        if cache is None:
            raise UnsupportedModelError(
                "prefix_caching=True needs a pool built with prefix caching on (a pool whose "
                "prefix_cache is not None)"
            )
        return cache

    def _choose_snapshots(
        self, interval: int | None, budget: int | None
    ) -> tuple[StateSnapshotCache | None, int]:
        """The recurrent-state snapshot cache and its interval (prefix caching, STATE layers).

        Both arguments are checked whatever the model, so a bad value is refused even where
        it would have no effect.
        """
        cache = self._prefix_cache
        boundary = cache.boundary if cache is not None else None
        if interval is not None:
            interval = check_int(interval, "state_snapshot_interval", minimum=1)
            if boundary is not None and interval % boundary:
                raise RequestStateError(
                    f"state_snapshot_interval={interval} is not a multiple of the pool's prefix "
                    f"boundary of {boundary} tokens (the page sizes' least common multiple); "
                    f"use a positive multiple of {boundary}"
                )
        if budget is not None:
            budget = check_int(budget, "state_cache_bytes", minimum=0)
        if cache is None or boundary is None or not self._state_layer_ids:
            return None, 0
        if interval is None:
            interval = max(boundary, _SNAPSHOT_INTERVAL_TOKENS // boundary * boundary)
        return StateSnapshotCache(DEFAULT_STATE_CACHE_BYTES if budget is None else budget), interval

    @property
    def pool(self) -> KVPool:
        """The pool the engine's requests hold their K/V in (read it; the engine drives it)."""
        return self._pool

    @property
    def stats(self) -> EngineStats:
        """Counters, aggregates and bounded per-step series of this engine."""
        return self._stats

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
        return self._prefix_cache is not None

    @property
    def max_running(self) -> int:
        """The most requests that decode together."""
        return self._scheduler.max_running

    @property
    def state_budget_bytes(self) -> int | None:
        """Bytes of recurrent state the running requests may hold together (``None``: no cap).

        Each running request counts its state and, with state snapshots, the copies it keeps
        (the last boundary it decoded past; with ``step_snapshots``, its state before the
        last step).
        """
        return self._scheduler.state_budget_bytes

    @state_budget_bytes.setter
    def state_budget_bytes(self, value: int | None) -> None:
        self._scheduler.state_budget_bytes = value

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt_tokens: Iterable[int] | mx.array,
        max_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        temperature: float = _UNSET,
        top_p: float = _UNSET,
        stop_tokens: Iterable[int] | mx.array = (),
        seed: int | None = _UNSET,
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
            sampling=self._sampling(sampling, temperature, top_p, seed),
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
        params = sampling if sampling is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestStateError(f"sampling must be a SamplingParams, got {params!r}")
        n = check_int(n, "n", minimum=1)
        top = self._vocab_size - 1
        prompt = check_int_sequence(
            _host_tokens(prompt_tokens, "prompt_tokens"), "prompt_tokens", minimum=0, maximum=top
        )
        if not prompt:
            raise RequestStateError("prompt_tokens must hold at least one token")
        max_tokens = check_int(max_tokens, "max_tokens", minimum=1)
        stops = check_int_sequence(
            _host_tokens(stop_tokens, "stop_tokens"), "stop_tokens", minimum=0, maximum=top
        )
        bad = [t for t in params.logit_bias if t > top]
        if bad:
            raise RequestStateError(
                f"logit_bias names token ids {bad} past the vocabulary (ids are 0..{top})"
            )
        if n > 1:
            self._check_sequences_fit(len(prompt), max_tokens, n)
        requests = []
        for i in range(n):
            seed = None if params.seed is None else (params.seed + i) % 2**64
            request = EngineRequest(
                self._requests.next_id() + i, prompt, max_tokens, params, frozenset(stops), seed
            )
            requests.append(request)
        leader, followers = requests[0], requests[1:]
        for follower in followers:
            follower.leader = leader
        leader.followers = followers
        for request in requests:
            self._requests.add(request)
        self._scheduler.enqueue(leader)
        return [r.rid for r in requests]

    def _sampling(
        self, sampling: SamplingParams | None, temperature: float, top_p: float, seed: int | None
    ) -> SamplingParams:
        """The request's params from ``sampling`` or the short keyword form (not both)."""
        given = [
            name
            for name, value in (("temperature", temperature), ("top_p", top_p), ("seed", seed))
            if value is not _UNSET
        ]
        if sampling is not None:
            if given:
                raise RequestStateError(
                    f"give sampling= or {', '.join(given)}, not both (they set the same fields)"
                )
            return sampling
        return SamplingParams(
            temperature=0.0 if temperature is _UNSET else temperature,
            top_p=1.0 if top_p is _UNSET else top_p,
            seed=None if seed is _UNSET else seed,
        )

    def _check_sequences_fit(self, prompt_len: int, max_tokens: int, n: int) -> None:
        """Refuse ``n`` sequences that could never be in the pool together."""
        total = prompt_len + max_tokens
        for sub in self._pool.memory_report().sub_pools:
            lifetime = KVLifetime(sub.window)
            own = lifetime.peak_pages(total, sub.page_size)
            # Full pages of the prompt are shared by every sequence of a full sub-pool.
            shared = prompt_len // sub.page_size if sub.window is None else 0
            need = own + (n - 1) * max(own - shared, 0)
            if need > sub.num_pages - 1:
                raise RequestStateError(
                    f"n={n} sequences of {total} tokens need at least {need} pages of sub-pool "
                    f"{sub.name!r} together, which holds {sub.num_pages - 1}; ask for fewer "
                    "sequences or tokens"
                )

    def token_logprobs(self, request_id: int, start: int = 0) -> tuple[TokenLogprob, ...]:
        """The generated tokens' logprobs from index ``start`` on (the request asked for them).

        For streaming: after each :meth:`step`, the tokens that step produced. A request that
        did not ask for logprobs raises ``RequestStateError``.
        """
        request = self._requests.get(request_id)
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
        self._scheduler.finish(request, "aborted")
        self._stats.aborted += 1
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
        request = self._requests.get(request_id)
        if request.status is not RequestStatus.RUNNING:
            raise RequestStateError(
                f"request {request_id} is {request.status.value}; only a running request can "
                "be restored to an earlier position"
            )
        position = check_int(position, "position", minimum=0)
        length = _kv_length(request)
        if not len(request.prompt) <= position <= length:
            raise RequestStateError(
                f"request {request_id} can be restored to positions {len(request.prompt)}.."
                f"{length} (its prompt to its current length), not {position}"
            )
        if getattr(request, "constraint", None) is not None:
            raise RequestStateError(
                f"request {request_id} decodes under a constraint whose state cannot be rolled back"
            )
        states: list[Any] | None = None
        if self._state_layer_ids:
            snapshot = self._snapshot_at(request, position)
            if snapshot is None:
                raise RequestStateError(
                    f"request {request_id} has no state snapshot at position {position}: "
                    "restore to the position before its last decode step (step_snapshots=True) "
                    "or to a prefix boundary where a snapshot is kept"
                )
            states = snapshot.caches()
        self._pool.trim_request(request.rid, length - position)
        text = request.prompt + request.generated
        if request.hashes is not None:
            request.hashes.truncate(position, text)
        kept = position - len(request.prompt) + 1
        del request.generated[kept:]
        if request.logprobs is not None:
            del request.logprobs[kept:]
        if states is not None:
            request.states = states
        pending = request.pending_snapshot
        if pending is not None and pending.position > position:
            request.pending_snapshot = None
        request.step_snapshot = None

    def _snapshot_at(self, request: EngineRequest, position: int) -> StateSnapshot | None:
        """A snapshot of ``request``'s own state after ``position`` tokens, if one is kept."""
        for own in (request.step_snapshot, request.pending_snapshot):
            if own is not None and own.position == position:
                return own
        hashes, snapshots = request.hashes, self._snapshots
        if hashes is None or snapshots is None or position % self._boundary or position == 0:
            return None
        if position > hashes.num_tokens:
            return None
        return snapshots.get(hashes.prefix_hash(position))

    def output(self, request_id: int) -> RequestOutput:
        """The request's prompt, generated tokens so far, status and finish reason."""
        return self._requests.get(request_id).output()

    def close(self) -> None:
        """Abort what still runs and put the model's original attention modules back.

        The engine must not step after this; the model is as it was before the engine.
        """
        for request in self._scheduler.active():
            self._scheduler.finish(request, "aborted")
            self._stats.aborted += 1
        unpatch_model_attention(self._model)
        unpatch_model_mlps(self._model)
        if self._runner.ragged_state_mixers is not None:
            self._runner.ragged_state_mixers.uninstall()

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def has_work(self) -> bool:
        """True while any request is queued, prefilling or running."""
        return self._scheduler.has_work

    @property
    def num_running(self) -> int:
        """Requests decoding now."""
        return len(self._scheduler.running)

    @property
    def num_queued(self) -> int:
        """Requests waiting: in the queue (preempted ones too) or for their prompt's prefill."""
        return len(self._scheduler.queue) + len(self._scheduler.waiting())

    def memory_report(self) -> EngineMemoryReport:
        """What the engine holds now: the pool's pages and bytes, the recurrent states' bytes."""
        report = self._pool.memory_report()
        scheduler = self._scheduler
        return EngineMemoryReport(
            pool=report,
            state_bytes_in_use=scheduler.state_bytes_in_use(),
            state_bytes_per_request=scheduler.state_bytes_per_request,
            state_budget_bytes=scheduler.state_budget_bytes,
            state_snapshots=None if self._snapshots is None else self._snapshots.stats(),
        )

    def shrink_pool(self, *, drop_cached: bool = False) -> int:
        """Give back pool memory nobody needs now; return the bytes given back.

        A pool whose buffers grow with use (:class:`kv_protocol.KVPoolMemory`, e.g. a
        ``HybridKVPool`` with ``slab_pages``) cuts them back to what the running requests and
        (unless ``drop_cached``) the cached prefixes hold; any other pool gives back 0.
        Between steps only; nothing a request holds moves.
        """
        pool = self._pool
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
        scheduler = self._scheduler
        prefilling = scheduler.prefilling
        state = (
            [(r.rid, r.prefilled, len(r.generated)) for r in scheduler.running],
            None if prefilling is None else (prefilling.rid, prefilling.prefilled),
            [r.rid for r in scheduler.queue],
            sorted(self._pool.memory_report().pages_used.items()),
        )
        return zlib.crc32(repr(state).encode()) & 0x7FFFFFFF

    @property
    def state_snapshot_interval(self) -> int | None:
        """Tokens between recurrent-state snapshots (``None``: no snapshots are taken)."""
        return self._snapshot_interval if self._snapshots is not None else None

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
            decoded = bool(self._scheduler.running)
            if decoded:
                self._decode(produced)
            middle = time.perf_counter()
            if self._scheduler.prefilling is not None or self._scheduler.queue:
                self._prefill(produced, middle - start if decoded else None)
        except BaseException:
            self._undelivered = produced
            raise
        finally:
            end = time.perf_counter()
            stats = self._stats
            stats.prefill_seconds += end - middle
            pages = self._pool.memory_report().pages_used if self._record_pages else None
            stats.record_step(len(self._scheduler.queue), len(self._scheduler.running), pages)
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

    def _commit(self, request: EngineRequest, length: int) -> None:
        """Tell the prefix cache the request's positions below ``length`` hold their K/V."""
        cache, hashes = self._prefix_cache, request.hashes
        if cache is None or hashes is None:
            return
        try:
            cache.commit(request.rid, hashes, length)
        except Exception as error:  # the cache only loses an entry; the request goes on
            logger.warning("prefix cache: commit for request %d failed: %r", request.rid, error)

    def _reuse_prefix(self, request: EngineRequest) -> None:
        """Start a just-admitted request at the longest prefix the cache holds.

        A request asking for its prompt's logprobs reuses nothing (every prompt position's
        logits are computed) but still hashes its text, so that what it writes is cached.
        """
        cache = self._prefix_cache
        if cache is None:
            return
        snapshots = self._snapshots
        states: list[Any] | None = None
        try:
            if request.hashes is None:
                # Once per request: its tokens' hashes then grow with what it decodes.
                request.hashes = cache.hash_tokens(request.prefill_tokens())
            if request.prompt_logprobs_missing:
                return
            hashes = request.hashes
            if self._state_layer_ids:
                # A recurrent state cannot be cut back: a prefix is usable only where a
                # snapshot of the state after it is kept.
                if snapshots is None:
                    return
                hit = cache.match_prefix(
                    hashes, usable=lambda length: hashes.prefix_hash(length) in snapshots
                )
                if hit:
                    snapshot = snapshots.get(hashes.prefix_hash(hit.length))
                    if snapshot is None:  # usable() saw it a moment ago
                        return
                    states = snapshot.caches()
            else:
                hit = cache.match_prefix(hashes)
            cache.reuse_prefix(request.rid, hit)
        except Exception as error:  # nothing was reused; prefill computes everything
            logger.warning("prefix cache: reuse for request %d failed: %r", request.rid, error)
            return
        if hit:
            request.prefilled = hit.length
            if states is not None and snapshots is not None:
                request.states = states
                snapshots.note_hit(hit.length)
            self._stats.prefix_hit_tokens += hit.length

    def _emit(
        self,
        request: EngineRequest,
        token: int,
        produced: dict[int, list[int]],
        logprob: TokenLogprob | None = None,
    ) -> None:
        request.generated.append(token)
        if request.speculation is not None and self._speculation is not None:
            request.speculation.observe(token, self._speculation)
        if request.logprobs is not None and logprob is not None:
            request.logprobs.append(logprob)
        produced.setdefault(request.rid, []).append(token)
        complete = False
        constraint = request.constraint
        if constraint is not None and token not in request.stop_tokens:
            try:
                constraint.accept_token(token)
                complete = constraint.is_finished
            except Exception as error:  # the grammar broke: this request ends with it
                self._scheduler.fail(request, error)
                return
        if token in request.stop_tokens or complete:
            self._scheduler.finish(request, "stop")
        elif len(request.generated) >= request.max_tokens:
            self._scheduler.finish(request, "length")

    def _decode_batch(
        self, batch: Sequence[EngineRequest], reservation: Reservation
    ) -> list[tuple[int, TokenLogprob | None]]:
        """One batched decode of ``batch`` on its reservation; a rollback and a raise on error."""
        saved = self._sampler.save()
        try:
            out = self._runner.decode(
                reservation,
                [r.generated[-1] for r in batch],
                [r.states or [] for r in batch],
            )
            rows = [r.sampling_row() for r in batch]
            masks = self._token_masks(batch, out)
            sampled = None
            if masks is None and all(plain_greedy(row.params) for row in rows):
                tokens = out.greedy_tokens()
                if tokens is not None:
                    sampled = self._sampler.picked(tokens)
                    self._stats.greedy_head_steps += 1
            if sampled is None:
                sampled = self._sampler.sample(out.logits, rows, masks)
            tic = time.perf_counter()
            # One evaluation for the tokens, their logprobs and the new states together.
            mx.eval(sampled.arrays(), out.state_arrays())
            chosen = list(zip(sampled.token_list(), sampled.logprobs(), strict=True))
            self._stats.decode_device_seconds += time.perf_counter() - tic + self._head_clock.take()
            out.split_states()
            return chosen
        except BaseException:
            self._sampler.restore(saved)
            self._scheduler.rollback(reservation)
            raise

    def _token_masks(
        self, batch: Sequence[EngineRequest], source: mx.array | DecodeOutput
    ) -> TokenMasks | None:
        """The constrained rows' token masks, or ``None`` when no row has one.

        The logits are ``source``, or a decode output's (read only when a row is constrained).
        The logits' evaluation starts first, so the host fills the masks while the device
        runs the forward; nothing is done (the logits are not read) when no row is
        constrained.
        """
        if all(r.constraint is None for r in batch):
            return None
        logits = source.logits if isinstance(source, DecodeOutput) else source
        mx.async_eval(logits)
        tic = time.perf_counter()
        masks = collect_token_masks([r.constraint for r in batch], logits.shape[-1])
        self._stats.mask_seconds += time.perf_counter() - tic
        self._stats.masks_filled += len(masks.rows) if masks is not None else 0
        return masks

    def _decode(self, produced: dict[int, list[int]]) -> None:
        start = time.perf_counter()
        rows: list[EngineRequest] | None = None
        drafts: dict[int, list[int]] = {}
        spec = self._speculation
        shared = spec is not None and self._runner.verifies_in_batch
        size = len(self._scheduler.running)
        rates = self._step_rates
        emitted_before = 0 if rates is None else sum(len(t) for t in produced.values())
        if shared:
            # Proposals are verified as extra rows of the shared step.
            # Where plain steps are faster at this batch size nothing is proposed at all
            # (the proposals' host time counts in a step's rate too).
            if rates is None or rates.verify(size):
                drafts = self._proposals(list(self._scheduler.running), batched=True)
        elif spec is not None and len(self._scheduler.running) <= spec.max_batch:
            rows = [r for r in list(self._scheduler.running) if not self._speculate(r, produced)]
            if not rows:
                self._stats.decode_seconds += time.perf_counter() - start
                return
        try:
            reservation = self._scheduler.reserve_decode(
                rows, {rid: len(d) for rid, d in drafts.items()}
            )
        except Exception as error:
            # The pool raised instead of granting or refusing: nothing was reserved, and
            # each request is tried alone (the group's fallback).
            logger.warning("the decode step's reservation raised %r", error)
            reservation = None
        running = self._scheduler.running
        batch = list(running) if rows is None else [r for r in rows if r in running]
        if not batch:
            return
        if self._state_layer_ids:
            # Rows decode together only where their recurrent states stack (same shapes);
            # a state that grows with the text (an n-gram context) splits the batch early on.
            groups = group_by_state_shapes(batch, lambda r: r.states or [])
        else:
            groups = [batch]
        if len(groups) == 1:
            if reservation is not None and any(n > 1 for n in reservation.n_tokens):
                try:
                    self._verify_batch(batch, reservation, drafts, produced)
                except Exception as error:
                    # Rolled back: the step decodes one token per request instead.
                    logger.warning("batched verification failed (%r); decoding plainly", error)
                    self._stats.decode_fallbacks += 1
                    self._decode_group(batch, self._scheduler.reserve_rows(batch), produced)
                self._stats.record_decode(time.perf_counter() - start, len(batch))
                self._record_rate(size, True, emitted_before, produced, start)
                return
            self._decode_group(batch, reservation, produced)
            if shared:
                self._record_rate(size, False, emitted_before, produced, start)
        else:
            # The whole batch fits; each group takes its own part of that room.
            if reservation is not None:
                self._scheduler.rollback(reservation)
            for group in groups:
                self._decode_group(group, self._scheduler.reserve_rows(group), produced)
        self._stats.record_decode(time.perf_counter() - start, len(batch))

    def _record_rate(
        self,
        size: int,
        verified: bool,
        emitted_before: int,
        produced: Mapping[int, list[int]],
        start: float,
    ) -> None:
        """Feed a shared step's tokens per second to :class:`StepRates`."""
        if self._step_rates is None:
            return
        emitted = sum(len(tokens) for tokens in produced.values()) - emitted_before
        self._step_rates.record(size, verified, emitted, time.perf_counter() - start)

    def _verify_batch(
        self,
        batch: list[EngineRequest],
        reservation: Reservation,
        drafts: Mapping[int, list[int]],
        produced: dict[int, list[int]],
    ) -> None:
        """One shared decode step in which some requests also verify their proposals.

        A request the reservation holds ``k + 1`` positions for runs its last token and its
        proposal of ``k`` as ``k + 1`` rows of the step (each attending up to its own
        position); the others take one row and are sampled as in a plain step. Nothing is
        kept unless the whole forward and every choice went through: on an error the
        sampler and the reservation are put back and the error raised.
        """
        counts = reservation.n_tokens
        inputs: list[list[int]] = []
        for request, n in zip(batch, counts, strict=True):
            draft = drafts.get(request.rid, []) if n > 1 else []
            if len(draft) != n - 1:
                raise RequestStateError(
                    f"request {request.rid} was reserved {n} positions for a proposal of "
                    f"{len(draft)} tokens"
                )
            inputs.append([request.generated[-1], *draft])
        first = [0]
        for n in counts:
            first.append(first[-1] + n)
        plain = [i for i, n in enumerate(counts) if n == 1]
        # A recurrent state comes out of the step advanced through every row of its request;
        # a verification that keeps fewer tokens goes back to the state before the step.
        befores = [
            None if r.states is None else StateSnapshot(r.states, start)
            for r, start in zip(batch, reservation.start_lengths, strict=True)
        ]
        saved = self._sampler.save()
        try:
            out = self._runner.decode(reservation, inputs, [r.states or [] for r in batch])
            chosen: dict[int, tuple[int, TokenLogprob | None]] = {}
            pending: list[Any] = []
            sampled = None
            plain_rows = mx.array([first[i] for i in plain], dtype=mx.int32) if plain else None
            # Every request plainly greedy: the head picks every row's token, no logits.
            picked = (
                out.greedy_tokens()
                if all(plain_greedy(r.params) and r.constraint is None for r in batch)
                else None
            )
            logits: mx.array | None = None
            if picked is not None:
                self._stats.greedy_head_steps += 1
                argmax = picked
                if plain_rows is not None:
                    sampled = self._sampler.picked(picked[plain_rows])
                    pending.append(sampled.arrays())
            else:
                logits = out.logits
                if plain_rows is not None:
                    plain_batch = [batch[i] for i in plain]
                    rows_of_plain = logits[plain_rows]
                    masks = self._token_masks(plain_batch, rows_of_plain)
                    sampled = self._sampler.sample(
                        rows_of_plain, [r.sampling_row() for r in plain_batch], masks
                    )
                    pending.append(sampled.arrays())
                argmax = logits.argmax(axis=-1)
            tic = time.perf_counter()
            mx.eval(pending, argmax, out.state_arrays())
            self._stats.decode_device_seconds += time.perf_counter() - tic + self._head_clock.take()
            if sampled is not None:
                picks = zip(sampled.token_list(), sampled.logprobs(), strict=True)
                chosen = dict(zip(plain, picks, strict=True))
            greedy_all = [int(t) for t in cast(list[int], argmax.tolist())]
            verdicts: dict[int, tuple[int, int]] = {}
            for i, request in enumerate(batch):
                if counts[i] == 1:
                    continue
                rows = slice(first[i], first[i + 1])
                greedy = greedy_all[rows] if request.params.greedy else None
                request_logits = None if logits is None else logits[rows]
                verdicts[i] = self._accept(request, inputs[i][1:], request_logits, greedy)
        except BaseException:
            self._sampler.restore(saved)
            self._scheduler.rollback(reservation)
            raise
        out.split_states()
        replayed = self._replay_mixers(batch, out, first, inputs, verdicts, befores)
        for i, request in enumerate(batch):
            if i in verdicts:
                accepted, token = verdicts[i]
                start = reservation.start_lengths[i]
                before = None if i in replayed else befores[i]
                self._keep_verified(
                    request,
                    inputs[i][1:],
                    accepted,
                    token,
                    start,
                    produced,
                    before,
                    self._state_after(out, first[i], befores[i]),
                )
            else:
                if self._step_snapshots:
                    request.step_snapshot = befores[i]
                self._advance(request, chosen[i], reservation.lengths[i], produced)

    def _state_after(
        self, out: DecodeOutput, first_row: int, before: StateSnapshot | None
    ) -> Callable[[int], list[Any]] | None:
        """The state after the first ``n`` of a request's rows in the step ``out``.

        By the mixers alone, from its state ``before`` the step (its rows start at step row
        ``first_row``); ``None`` where the mixers do not run the step's rows.
        """
        mixers = self._runner.ragged_state_mixers
        if mixers is None or before is None:
            return None
        snapshot = before

        def state_after(n: int) -> list[Any]:
            assert mixers is not None
            states = mixers.replay(out.states, [first_row], [n], [snapshot.caches()])[0]
            mx.eval([getattr(c, "cache", []) for c in states])
            return states

        return state_after

    def _replay_mixers(
        self,
        batch: list[EngineRequest],
        out: DecodeOutput,
        first: list[int],
        inputs: list[list[int]],
        verdicts: Mapping[int, tuple[int, int]],
        befores: Sequence[StateSnapshot | None],
    ) -> set[int]:
        """Put back the states of verifications that keep fewer tokens than they ran.

        Their recurrent mixers run again from the state before the step on the kept rows'
        inputs, all such requests at once (:meth:`RaggedStateMixers.replay`); returns the
        indices in ``batch`` done so. On an error nothing is changed and the requests replay
        by a forward of their own in :meth:`_keep_verified`.
        """
        mixers = self._runner.ragged_state_mixers
        partial: list[tuple[int, int]] = []
        for i, (accepted, token) in verdicts.items():
            kept = _kept_count(batch[i], [*inputs[i][1 : accepted + 1], token])
            if befores[i] is not None and kept < len(inputs[i]):
                partial.append((i, kept))
        if mixers is None or not partial:
            return set()
        try:
            states = mixers.replay(
                out.states,
                [first[i] for i, _ in partial],
                [kept for _, kept in partial],
                [cast(StateSnapshot, befores[i]).caches() for i, _ in partial],
            )
            mx.eval([getattr(c, "cache", []) for state in states for c in state])
        except Exception as error:
            logger.warning("replaying the mixers of a verifying step failed: %r", error)
            return set()
        for (i, _), state in zip(partial, states, strict=True):
            batch[i].states = state
        return {i for i, _ in partial}

    # ------------------------------------------------------------------ speculation

    def _speculates(self, request: EngineRequest) -> bool:
        """Whether ``request`` may verify proposals: its logits are used as the model gives them.

        Greedy requests then keep exactly plain decoding's tokens; sampled ones (temperature,
        ``top_k``, ``top_p``, ``min_p``, seeded or not) keep its distribution
        (:meth:`Sampler.verify_draft`). Penalised, biased, ``min_tokens``,
        logprob-reporting and constrained requests decode one token at a time.
        """
        params = request.params
        return (
            not params.processes_logits and params.logprobs is None and request.constraint is None
        )

    def _speculate(self, request: EngineRequest, produced: dict[int, list[int]]) -> bool:
        """A speculative step of ``request``; False when it decodes with the batch instead.

        The request's last token and a proposal of ``k`` tokens run as one chunk of ``k +
        1`` positions; the longest prefix of the proposal that equals the model's greedy
        tokens is kept, with the model's token after it. The positions of rejected tokens
        go back to the pool; a recurrent state is put back as it was and advanced through
        the kept tokens alone.
        """
        draft = self._proposal(request, batched=False)
        if not draft:
            return False
        inputs = [request.generated[-1], *draft]
        try:
            reservation = self._scheduler.reserve_verify(request, len(inputs))
        except Exception as error:  # the pool raised: nothing was reserved
            logger.warning("speculative reservation of request %d raised %r", request.rid, error)
            return False
        if reservation is None:
            return False
        length = _kv_length(request)
        before = None if request.states is None else StateSnapshot(request.states, length)
        saved = self._sampler.save()
        try:
            caches = request_caches(
                self._num_layers,
                self._state_layer_ids,
                request.states or [],
                lambda layer_id: self._make_prefill_cache(self._pool, reservation, layer_id),
            )
            logits = self._runner.verify(inputs, caches)[0]
            tic = time.perf_counter()
            mx.eval(logits, [getattr(c, "cache", []) for c in request.states or []])
            self._stats.decode_device_seconds += time.perf_counter() - tic + self._head_clock.take()
            greedy = (
                [int(t) for t in cast(list[int], logits.argmax(axis=-1).tolist())]
                if request.params.greedy
                else None
            )
            accepted, token = self._accept(request, draft, logits, greedy)
        except Exception as error:
            self._sampler.restore(saved)
            request.states = None if before is None else before.caches()
            self._scheduler.rollback(reservation)
            logger.warning("speculative step of request %d failed: %r", request.rid, error)
            return False
        self._keep_verified(request, draft, accepted, token, length, produced, before)
        return True

    def _proposal(self, request: EngineRequest, *, batched: bool) -> list[int]:
        """The proposal ``request`` verifies this step, or ``[]`` (it decodes one token)."""
        return self._proposals([request], batched=batched).get(request.rid, [])

    def _proposals(
        self, requests: Sequence[EngineRequest], *, batched: bool
    ) -> dict[int, list[int]]:
        """The proposals ``requests`` verify this step, by request id (absent: none).

        ``batched``: a proposal would be verified as extra rows of the shared decode step
        (:meth:`SpeculationState.pays_in_batch`), else by a forward of its own
        (:meth:`SpeculationState.pays_at`). A proposal that does not pay yet is shadowed. A
        :class:`BatchProposer` guesses for all of them in one call.
        """
        config = self._speculation
        if config is None:
            return {}
        batch = len(self._scheduler.running)
        wanted: list[tuple[EngineRequest, int, bool]] = []
        for request in requests:
            if not self._speculates(request):
                continue
            state = request.speculation
            if state is None:
                state = request.speculation = SpeculationState(config.num_tokens)
            if batched:
                pays = state.pays_in_batch(batch, config.min_acceptance, shadow=config.shadow)
            else:
                pays = state.pays_at(batch, shadow=config.shadow)
            if not pays and state.shadowing:
                continue
            k = min(state.length(), request.max_tokens - len(request.generated) - 1)
            if k > 0:
                wanted.append((request, k, pays))
        if not wanted:
            return {}
        proposer = config.proposer
        texts = [r.prompt + r.generated for r, _, _ in wanted]
        ks = [k for _, k, _ in wanted]
        if isinstance(proposer, BatchProposer):
            guesses = proposer.propose_batch(texts, ks)
        else:
            guesses = [proposer.propose(text, k) for text, k in zip(texts, ks, strict=True)]
        drafts: dict[int, list[int]] = {}
        for (request, k, pays), guess in zip(wanted, guesses, strict=True):
            draft = [int(t) for t in guess][:k]
            if not draft:
                continue
            if pays:
                drafts[request.rid] = draft
            else:
                # Beside other requests without a record: compare the proposal with what the
                # request decodes in the batch (free), instead of verifying it.
                assert request.speculation is not None
                request.speculation.shadow(draft)
        return drafts

    def _accept(
        self,
        request: EngineRequest,
        draft: list[int],
        logits: mx.array | None,
        greedy: list[int] | None,
    ) -> tuple[int, int]:
        """``(accepted, token)``: how much of ``draft`` is kept and the token after it.

        ``logits`` are the ``(len(draft) + 1, vocab)`` rows of the request's last token and
        its proposal (``None`` where the head picked a greedy step's tokens without them);
        ``greedy`` their argmax for a greedy request (exactly plain decoding's tokens),
        ``None`` for a sampled one (the rejection rule of :meth:`Sampler.verify_draft`,
        which keeps the request's distribution).
        """
        if greedy is not None:
            accepted = 0
            while accepted < len(draft) and draft[accepted] == greedy[accepted]:
                accepted += 1
            return accepted, greedy[accepted]
        if logits is None:
            raise RequestStateError("a sampled request's proposal is verified on its logits")
        base = request.sampling_row()
        rows = [replace(base, generated=base.generated + i) for i in range(len(draft) + 1)]
        return self._sampler.verify_draft(logits, draft, rows)

    def _keep_verified(
        self,
        request: EngineRequest,
        draft: list[int],
        accepted: int,
        token: int,
        length: int,
        produced: dict[int, list[int]],
        before: StateSnapshot | None = None,
        state_after: Callable[[int], list[Any]] | None = None,
    ) -> None:
        """Keep a verification's outcome: trim the rest, commit and emit the kept tokens.

        The pool holds ``len(draft) + 1`` new positions from ``length`` (the last token and
        the proposal); what follows the kept tokens goes back, and a recurrent state
        (``before`` the step) is put back and advanced through the kept tokens alone. With
        state snapshots, the last prefix boundary the kept tokens reach is snapshotted as a
        plain step's would be: from the state after them, or ``state_after(n)`` (the state
        after the step's first ``n`` rows) for a boundary inside them.
        """
        config = self._speculation
        state = request.speculation
        assert config is not None and state is not None
        inputs = [request.generated[-1], *draft]
        emitted = [*draft[:accepted], token]
        kept = _kept_count(request, emitted)
        try:
            self._pool.trim_request(request.rid, len(inputs) - kept)
            if before is not None and kept < len(inputs):
                self._replay_state(request, before, inputs[:kept])
        except Exception as error:
            self._scheduler.fail(request, error)
            return
        state.record(len(draft), accepted, config)
        self._stats.record_speculation(len(draft), accepted, kept)
        request.step_snapshot = None
        if request.hashes is not None:
            request.hashes.extend(inputs[:kept])
            self._commit(request, length + kept)
            if self._snapshots is not None and request.states:
                self._snapshot_verified(request, length, length + kept, state_after)
        for emitted_token in emitted[:kept]:
            self._emit(request, emitted_token, produced)

    def _snapshot_verified(
        self,
        request: EngineRequest,
        start: int,
        end: int,
        state_after: Callable[[int], list[Any]] | None,
    ) -> None:
        """Snapshot the state at the last prefix boundary a verification passed, if known.

        The verification took ``request`` from ``start`` to ``end`` tokens; the boundary is
        the last in ``(start, end]`` (see :meth:`_snapshot_decoded`): at ``end`` the state is
        the request's own, inside from ``state_after``.
        """
        boundary = end // self._boundary * self._boundary
        if boundary <= start:
            return
        if boundary == end:
            self._snapshot_decoded(request, end)
            return
        if state_after is None:
            return
        try:
            states = state_after(boundary - start)
        except Exception as error:  # the snapshot is an optimisation: go on without it
            logger.warning("state snapshot of request %d not taken: %r", request.rid, error)
            return
        self._snapshot_decoded(request, boundary, states)

    def _replay_state(
        self, request: EngineRequest, before: StateSnapshot, tokens: list[int]
    ) -> None:
        """Put ``request``'s recurrent state back to ``before`` and run ``tokens`` through it.

        The pool holds ``tokens``' positions (already written, with the same K/V): they are
        given back and reserved again for the chunk that rewrites them.
        """
        self._pool.trim_request(request.rid, len(tokens))
        request.states = before.caches()
        reservation = self._scheduler.reserve_verify(request, len(tokens))
        if reservation is None:
            raise RequestStateError(
                f"the pool no longer holds room to replay request {request.rid}'s state"
            )
        try:
            caches = request_caches(
                self._num_layers,
                self._state_layer_ids,
                request.states,
                lambda layer_id: self._make_prefill_cache(self._pool, reservation, layer_id),
            )
            self._runner.prefill(tokens, caches)
            mx.eval(_written_state(caches), [getattr(c, "cache", []) for c in request.states])
        except BaseException:
            self._scheduler.rollback(reservation)
            request.states = before.caches()
            raise

    def _advance(
        self,
        request: EngineRequest,
        chosen: tuple[int, TokenLogprob | None],
        length: int,
        produced: dict[int, list[int]],
    ) -> None:
        """The request's decode step went through: commit what it wrote, emit its token."""
        if request.hashes is not None:
            request.hashes.extend(request.generated[-1:])
            self._commit(request, length)
            if self._snapshots is not None and request.states:
                self._snapshot_decoded(request, length)
        self._emit(request, chosen[0], produced, chosen[1])

    # ------------------------------------------------------------------ state snapshots

    def _next_snapshot(self, begin: int, total: int) -> int:
        """Tokens from ``begin`` to the next snapshot point of a text of ``total`` tokens.

        Snapshot points are the multiples of the interval and the text's last prefix
        boundary (its end rounded down to a page of every sub-pool); past the last one, the
        rest of the text.
        """
        stop = (begin // self._snapshot_interval + 1) * self._snapshot_interval
        end = self._last_boundary(total)
        if begin < end < stop:
            stop = end
        return min(stop, total) - begin

    def _is_snapshot_point(self, position: int, total: int) -> bool:
        """Whether a prefill chunk ending at ``position`` of ``total`` tokens is snapshotted."""
        if position <= 0:
            return False
        return position % self._snapshot_interval == 0 or position == self._last_boundary(total)

    def _last_boundary(self, total: int) -> int:
        """The last prefix boundary of a text of ``total`` tokens (0 if it has none)."""
        return total // self._boundary * self._boundary

    @property
    def _boundary(self) -> int:
        cache = self._prefix_cache
        return 1 if cache is None else cache.boundary

    def _keep_snapshot(self, request: EngineRequest, snapshot: StateSnapshot) -> None:
        """Keep ``snapshot`` (of ``request``'s state) under its prefix's hash."""
        hashes, snapshots = request.hashes, self._snapshots
        if hashes is None or snapshots is None or not snapshot.nbytes:
            return
        try:
            snapshots.put(hashes.prefix_hash(snapshot.position), snapshot)
        except Exception as error:  # only a later request's reuse is lost
            logger.warning("state snapshot of request %d not kept: %r", request.rid, error)

    def _snapshot_decoded(
        self, request: EngineRequest, length: int, states: Sequence[Any] | None = None
    ) -> None:
        """After a decode step to ``length`` tokens: snapshot the state at a boundary.

        At an interval it is kept at once; at another boundary it becomes the request's
        pending snapshot, kept when the request leaves the pool (finished or preempted), so a
        later turn of the conversation or the request's own re-admission resumes there.
        ``states`` is the state after ``length`` tokens when it is not the request's own.
        """
        if length % self._boundary:
            return
        # A decode row's state is a slice of the batch's; the copy holds only its own.
        own = (request.states or []) if states is None else states
        snapshot = StateSnapshot(own, length, detach=True)
        mx.eval(snapshot.arrays())
        if length % self._snapshot_interval == 0:
            self._keep_snapshot(request, snapshot)
            request.pending_snapshot = None
        else:
            request.pending_snapshot = snapshot

    def _keep_last_snapshot(self, request: EngineRequest) -> None:
        """``request`` leaves the pool with a sound state: keep its pending snapshot."""
        pending = request.pending_snapshot
        if pending is not None:
            self._keep_snapshot(request, pending)
            request.pending_snapshot = None

    def _decode_group(
        self,
        batch: list[EngineRequest],
        reservation: Reservation | None,
        produced: dict[int, list[int]],
    ) -> None:
        if self._step_snapshots:
            for request in batch:
                request.step_snapshot = StateSnapshot(request.states or [], _kv_length(request))
        try:
            if reservation is None:
                raise RequestStateError(
                    f"the pool no longer holds room for requests {[r.rid for r in batch]}"
                )
            chosen = self._decode_batch(batch, reservation)
        except Exception as error:
            # Nothing of the batch was kept; find the request(s) that fail on their own.
            self._stats.decode_fallbacks += 1
            logger.warning(
                "batched decode of %d requests failed (%r); retrying them one by one",
                len(batch),
                error,
            )
            for request in batch:
                try:
                    alone = self._scheduler.reserve_rows([request])
                    if alone is None:
                        raise RequestStateError(
                            f"the pool no longer holds room for request {request.rid}"
                        ) from error
                    picked = self._decode_batch([request], alone)[0]
                except Exception as failure:
                    self._scheduler.fail(request, failure)
                else:
                    self._advance(request, picked, alone.lengths[0], produced)
        else:
            for request, picked, length in zip(batch, chosen, reservation.lengths, strict=True):
                self._advance(request, picked, length, produced)

    def _prefill_chunk(
        self,
        request: EngineRequest,
        tokens: list[int],
        reservation: Reservation,
        produced: dict[int, list[int]],
    ) -> None:
        """Prefill the chunk ``reservation`` holds: all of it, or nothing and a raise."""
        begin, n = request.prefilled, reservation.n_tokens[0]
        started = time.perf_counter()
        saved = self._sampler.save()
        first: SampledTokens | None = None
        forks: list[EngineRequest] = []
        prompt_part: tuple[int, SampledTokens] | None = None
        # The state before the chunk, put back if the chunk fails.
        before = None if request.states is None else StateSnapshot(request.states, begin)
        try:
            if request.states is None and self._make_state_caches is not None:
                request.states = self._make_state_caches()
            caches = request_caches(
                self._num_layers,
                self._state_layer_ids,
                request.states or [],
                lambda layer_id: self._make_prefill_cache(self._pool, reservation, layer_id),
            )
            # Prompt logprobs need the logits of every position the chunk predicts a prompt
            # token from (position j predicts token j + 1).
            targets = tokens[begin + 1 : min(begin + n + 1, len(request.prompt))]
            every = bool(targets) and request.prompt_logprobs_missing
            # No token is sampled from a chunk before the prompt's end (or of a request
            # that already generated: a resumed one).
            sampled = not (begin + n < len(tokens) or request.generated)
            logits = self._runner.prefill(
                tokens[begin : begin + n], caches, every_position=every, sampled=sampled
            )
            tic = time.perf_counter()
            pending: list[mx.array] = []
            if every:
                width = request.params.prompt_logprobs or 0
                chosen, ids, values = log_softmax_top(
                    logits[0, : len(targets)], mx.array(targets, dtype=mx.int32), width
                )
                part = SampledTokens(
                    tokens=mx.array(targets, dtype=mx.int32),
                    logprob_rows=tuple(range(len(targets))),
                    widths=(width,) * len(targets),
                    chosen=chosen,
                    top_ids=ids,
                    top_logprobs=values,
                )
                prompt_part = (begin + 1, part)
                pending.extend(part.arrays())
            if not sampled:
                # No token is sampled from this chunk: evaluate what it wrote (the caches'
                # state), not its logits, so the last layer's attention and MLP, which only
                # the logits need, are never computed (mlx-lm's prefill does the same).
                mx.eval(_written_state(caches), pending)
            else:
                forks = self._forks(request)
                rows = [r.sampling_row() for r in (request, *forks)]
                last = logits[:, -1, :]
                if forks:
                    last = mx.broadcast_to(last, (len(rows), last.shape[-1]))
                first = self._sampler.sample(last, rows, self._token_masks([request, *forks], last))
                mx.eval(first.arrays(), pending)
            if request.states:
                mx.eval([getattr(c, "cache", []) for c in request.states])
            self._stats.prefill_device_seconds += (
                time.perf_counter() - tic + self._head_clock.take()
            )
        except BaseException:
            self._sampler.restore(saved)
            # The recurrent states go back to what they were before the chunk, the pool to
            # the request's length before it.
            request.states = None if before is None else before.caches()
            self._scheduler.rollback(reservation)
            raise
        self._scheduler.note_state_bytes(request)
        if prompt_part is not None and request.prompt_logprobs is not None:
            start, part = prompt_part
            request.prompt_logprobs[start : start + len(part.logprob_rows)] = part.logprobs()
        self._commit(request, begin + n)
        request.prefilled = begin + n
        if self._snapshots is not None and self._is_snapshot_point(begin + n, len(tokens)):
            self._keep_snapshot(request, StateSnapshot(request.states or [], begin + n))
        self._stats.record_prefill_chunk(n)
        self._prefill_budget.note_prefill(n, time.perf_counter() - started)
        if request.prefilled < len(tokens):
            return
        self._scheduler.start_running(request)
        if first is None:
            return
        picked = list(zip(first.token_list(), first.logprobs(), strict=True))
        # The other sequences of the prompt take a fork of its pages before the first one
        # emits (a stop token would free them).
        for follower, pick in zip(forks, picked[1:], strict=True):
            self._start_fork(request, follower, pick, produced)
        self._release_followers(request)
        self._emit(request, picked[0][0], produced, picked[0][1])

    def _forks(self, request: EngineRequest) -> list[EngineRequest]:
        """The waiting sequences of ``request``'s prompt that can fork from it now."""
        if not request.followers or not isinstance(self._pool, KVRequestForking):
            return []
        room = self._scheduler.max_running - len(self._scheduler.running)
        return [f for f in request.followers if f.status is RequestStatus.QUEUED][: max(room, 0)]

    def _start_fork(
        self,
        leader: EngineRequest,
        follower: EngineRequest,
        chosen: tuple[int, TokenLogprob | None],
        produced: dict[int, list[int]],
    ) -> None:
        """Give ``follower`` a fork of ``leader``'s pages and state, and its first token."""
        pool = cast(KVRequestForking, self._pool)
        length = leader.prefilled
        try:
            pool.fork_request(leader.rid, follower.rid, length)
        except Exception as error:  # no page for the tail copy: it prefills on its own
            logger.info("request %d prefills on its own (fork failed: %r)", follower.rid, error)
            return
        leader.followers.remove(follower)
        follower.leader = None
        follower.in_pool = True
        follower.prefilled = length
        follower.states = copy_state_caches(leader.states) if leader.states else None
        if leader.hashes is not None:
            follower.hashes = leader.hashes.copy()
        if follower.prompt_logprobs is not None and leader.prompt_logprobs is not None:
            follower.prompt_logprobs[:] = leader.prompt_logprobs
        self._scheduler.start_running(follower)
        self._emit(follower, chosen[0], produced, chosen[1])

    def _release_followers(self, request: EngineRequest) -> None:
        """Sequences still waiting for ``request`` go to the queue to prefill on their own."""
        for follower in list(request.followers):
            follower.leader = None
            self._scheduler.enqueue(follower)
        request.followers.clear()

    def _prefill(self, produced: dict[int, list[int]], decode_seconds: float | None) -> None:
        scheduler = self._scheduler
        budget = self._prefill_budget.tokens(decode_seconds)
        if self._agreement is not None:
            budget = self._agreement.prefill_budget(budget)
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
            wanted = min(budget, len(tokens) - request.prefilled)
            if self._snapshots is not None:
                # Chunks end where snapshots are taken, so a snapshot costs no forward.
                wanted = min(wanted, self._next_snapshot(request.prefilled, len(tokens)))
            if request.prompt_logprobs_missing:
                wanted = min(wanted, self._logit_rows)
            try:
                reservation = scheduler.reserve_chunk(request, wanted)
            except Exception as error:  # the pool raised: nothing was reserved
                scheduler.fail(request, error)
                continue
            if reservation is None:
                if not scheduler.running:
                    # Nothing else holds pages: this request alone cannot fit.
                    scheduler.finish(request, "pool_exhausted")
                    continue
                if request.prefilled == 0:
                    scheduler.requeue_unstarted(request)
                return
            try:
                self._prefill_chunk(request, tokens, reservation, produced)
            except Exception as error:
                scheduler.fail(request, error)
            budget -= reservation.n_tokens[0]


def _kept_count(request: EngineRequest, emitted: Sequence[int]) -> int:
    """How many of a verification's ``emitted`` tokens ``request`` keeps.

    All of them, or up to and including a stop token or the one that reaches ``max_tokens``.
    """
    kept = 0
    for token in emitted:
        kept += 1
        if token in request.stop_tokens or len(request.generated) + kept >= request.max_tokens:
            break
    return kept


def _kv_length(request: EngineRequest) -> int:
    """Positions a running request holds: its text but the last token (the next input)."""
    return len(request.prompt) + len(request.generated) - 1


def _written_state(caches: Sequence[Any]) -> list[mx.array]:
    """The arrays of the caches' ``state``: what evaluating a prefill chunk's writes needs.

    An explicit stack, not a recursive closure: a closure that calls itself is a reference
    cycle, which would keep the list (the pool's buffers of that moment) alive until the
    cycle collector ran, and buffers a growing pool has replaced with that.
    """
    arrays: list[mx.array] = []
    stack: list[object] = [getattr(cache, "state", None) for cache in reversed(caches)]
    while stack:
        value = stack.pop()
        if isinstance(value, mx.array):
            arrays.append(value)
        elif isinstance(value, list | tuple):
            stack.extend(reversed(value))
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
