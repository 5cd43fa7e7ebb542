"""What the engine measures: counters, exact aggregates, bounded per-step series, pages."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from kv_protocol import PoolMemoryReport, PrefixCacheStats, check_int

from ._state_snapshots import StateSnapshotStats

__all__ = ["DEFAULT_STATS_WINDOW", "EngineMemoryReport", "EngineStats"]


#: Steps of history an engine's :class:`EngineStats` series keep by default.
DEFAULT_STATS_WINDOW = 16384


@dataclass
class EngineStats:
    """Counters, exact aggregates and bounded per-step series of a :class:`DecodeEngine`.

    Series have one entry per :meth:`DecodeEngine.step`; ``decode_step_seconds`` and
    ``decode_batch_sizes`` have one entry per batched decode (the step's decode part only),
    ``prefill_chunk_tokens`` one per prefill chunk.
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
    #: Of ``prefill_seconds`` / ``decode_seconds``: time waiting for MLX to evaluate the graph
    #: (the device's compute and the sync), and the native CPU kernels' time inside the
    #: forward (``kv_protocol.EVALUATION_CLOCK``); the rest is host work (Python, scheduling,
    #: page tables, building the graph).
    prefill_device_seconds: float = 0.0
    decode_device_seconds: float = 0.0
    #: Host time spent filling constrained rows' token masks (structured output); in decode
    #: it overlaps the device's forward, which runs meanwhile.
    mask_seconds: float = 0.0
    #: Token masks filled (one per constrained row per sampled token).
    masks_filled: int = 0
    #: Batched decodes whose tokens the vocabulary head picked itself (every row greedy and
    #: plain, the head a ``kv_protocol.GreedyHeadProjection`` that served), without the logits.
    greedy_head_steps: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    #: Batched decodes that raised and were retried request by request.
    decode_fallbacks: int = 0
    #: Prompt tokens not prefilled because their K/V were reused from the prefix cache.
    prefix_hit_tokens: int = 0
    #: Speculative decoding: verification steps, tokens proposed, accepted of them, and
    #: tokens emitted by verification steps (also counted in ``decode_tokens``).
    speculative_steps: int = 0
    speculative_proposed: int = 0
    speculative_accepted: int = 0
    speculative_tokens: int = 0
    window: int | None = DEFAULT_STATS_WINDOW
    queue_length: deque[int] = field(default_factory=deque, repr=False)
    running: deque[int] = field(default_factory=deque, repr=False)
    pages_used: deque[dict[str, int]] = field(default_factory=deque, repr=False)
    decode_step_seconds: deque[float] = field(default_factory=deque, repr=False)
    decode_batch_sizes: deque[int] = field(default_factory=deque, repr=False)
    #: Prompt tokens of each prefill chunk (one entry per chunk).
    prefill_chunk_tokens: deque[int] = field(default_factory=deque, repr=False)
    prefill_chunks: int = 0
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
        self.prefill_chunk_tokens = deque(self.prefill_chunk_tokens, maxlen=size)

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

    def record_prefill_chunk(self, tokens: int) -> None:
        """Account one prefill chunk of ``tokens`` prompt tokens."""
        self.prefill_chunks += 1
        self.prefill_tokens += tokens
        self.prefill_chunk_tokens.append(tokens)

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

    def record_speculation(self, proposed: int, accepted: int, emitted: int) -> None:
        """Account one verification of ``proposed`` tokens that kept ``accepted``."""
        self.speculative_steps += 1
        self.speculative_proposed += proposed
        self.speculative_accepted += accepted
        self.speculative_tokens += emitted
        self.decode_tokens += emitted

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed tokens of every verification (``None`` before any)."""
        if not self.speculative_proposed:
            return None
        return self.speculative_accepted / self.speculative_proposed

    @property
    def decode_host_seconds(self) -> float:
        """Decode time not spent waiting for MLX's evaluation."""
        return max(0.0, self.decode_seconds - self.decode_device_seconds)

    @property
    def prefill_host_seconds(self) -> float:
        """Prefill time not spent waiting for MLX's evaluation."""
        return max(0.0, self.prefill_seconds - self.prefill_device_seconds)

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


@dataclass(frozen=True, kw_only=True)
class EngineMemoryReport:
    """What an engine holds now: the KV pool's pages and the requests' recurrent states.

    ``pool`` is the pool's own :class:`kv_protocol.PoolMemoryReport` (pages and bytes per
    sub-pool, prefix-cache statistics); ``state_bytes_in_use`` is the recurrent state of the
    running and prefilling requests, ``state_bytes_per_request`` one request's (the largest
    seen, measured when the engine was built), ``state_budget_bytes`` the admission cap.
    ``state_snapshots`` reports the recurrent-state snapshots kept for prefix reuse (count,
    bytes against their own budget, hits; ``None`` when the engine takes none).
    """

    pool: PoolMemoryReport
    state_bytes_in_use: int
    state_bytes_per_request: int | None
    state_budget_bytes: int | None
    state_snapshots: StateSnapshotStats | None = None

    @property
    def pool_bytes_total(self) -> int:
        """Bytes of the pool's buffers."""
        return self.pool.bytes_total

    @property
    def pool_bytes_used(self) -> int:
        """Bytes of the pages requests hold."""
        return self.pool.bytes_used

    @property
    def pages_used(self) -> dict[str, int]:
        """Pages held per sub-pool."""
        return self.pool.pages_used

    @property
    def prefix_cache(self) -> PrefixCacheStats | None:
        """The pool's prefix-cache statistics (``None`` without prefix caching)."""
        return self.pool.prefix_cache

    @property
    def bytes_in_use(self) -> int:
        """KV pages held by requests plus their recurrent states."""
        return self.pool.bytes_used + self.state_bytes_in_use
