"""The server's metrics: request counters, latency histograms and their Prometheus text."""

from __future__ import annotations

from collections.abc import Mapping

from ._server_worker import WorkerSnapshot

__all__ = ["ServerMetrics", "metrics_text"]

#: Latency histogram bucket bounds, seconds (Prometheus ``le``).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _Histogram:
    """A fixed-bucket histogram (bounded memory, Prometheus cumulative buckets)."""

    def __init__(self) -> None:
        self.counts = [0] * len(_BUCKETS)
        self.total = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count one observation of ``seconds``."""
        self.total += 1
        self.sum += seconds
        for i, bound in enumerate(_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                break

    def lines(self, name: str) -> list[str]:
        """The histogram's exposition lines under ``name`` (buckets, sum, count)."""
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


def _gauge(name: str, help_text: str, value: object) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]


def _counter(name: str, help_text: str, value: object) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]


def _labelled(
    name: str, kind: str, help_text: str, label: str, values: Mapping[str, int] | Mapping[int, int]
) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    return lines + [f'{name}{{{label}="{key}"}} {value}' for key, value in values.items()]


def metrics_text(snap: WorkerSnapshot, queued: int, m: ServerMetrics) -> str:
    """The Prometheus text exposition of a server: its engine's ``snap``, its counters ``m``.

    ``queued``: the sequences waiting for admission.
    """
    lines = [
        *_gauge("kv_serve_up", "Whether the engine thread runs.", int(snap.alive)),
        *_gauge("kv_serve_requests_running", "Requests decoding in the engine.", snap.running),
        *_gauge("kv_serve_requests_queued", "Requests waiting for admission.", queued),
        *_gauge(
            "kv_serve_engine_requests",
            "Requests the engine keeps (active, unreleased).",
            snap.engine_requests,
        ),
        *_gauge(
            "kv_serve_world_size",
            "Ranks the model is sharded over (tensor parallel).",
            snap.world_size,
        ),
        *_gauge(
            "kv_serve_pool_kv_bytes",
            "Bytes of this rank's KV pool at its cap (its own KV heads).",
            snap.pool_bytes,
        ),
        *_gauge(
            "kv_serve_pool_committed_bytes",
            "Bytes the KV pool's buffers hold now (they grow with use up to the cap and shrink "
            "when idle).",
            snap.pool_committed_bytes,
        ),
        *_labelled(
            "kv_serve_pool_pages_used",
            "gauge",
            "KV pages in use per sub-pool.",
            "sub_pool",
            snap.pages_used,
        ),
        *_labelled(
            "kv_serve_pool_pages_total",
            "gauge",
            "KV pages per sub-pool (null page included).",
            "sub_pool",
            snap.pages_total,
        ),
        *_labelled(
            "kv_serve_pool_kv_bits",
            "gauge",
            "Bits per value of a sub-pool's quantized KV pages (0: the model's dtype).",
            "sub_pool",
            snap.kv_bits,
        ),
        *_gauge(
            "kv_serve_state_bytes",
            "Bytes of recurrent state the running requests hold.",
            snap.state_bytes,
        ),
        *_counter(
            "kv_serve_prefix_cache_hit_tokens_total",
            "Prompt tokens reused from the prefix cache instead of prefilled.",
            snap.prefix_hit_tokens,
        ),
        *_gauge(
            "kv_serve_prefix_cache_pages",
            "Pages no request holds that keep a prompt prefix for reuse (evictable).",
            snap.prefix_cached_pages,
        ),
        *_counter(
            "kv_serve_prefix_cache_evictions_total",
            "Cached prefix pages evicted.",
            snap.prefix_evictions,
        ),
        *_gauge(
            "kv_serve_state_snapshots",
            "Recurrent-state snapshots kept for prefix reuse.",
            snap.state_snapshots,
        ),
        *_gauge(
            "kv_serve_state_snapshot_bytes",
            "Bytes of the recurrent-state snapshots kept.",
            snap.state_snapshot_bytes,
        ),
        *_gauge(
            "kv_serve_state_snapshot_budget_bytes",
            "The snapshots' own byte budget.",
            snap.state_snapshot_budget_bytes,
        ),
        *_counter(
            "kv_serve_state_snapshot_hits_total",
            "Requests that resumed from a snapshot.",
            snap.state_snapshot_hits,
        ),
        *_counter(
            "kv_serve_speculative_steps_total",
            "Speculative steps (a proposal verified).",
            snap.speculative_steps,
        ),
        *_counter(
            "kv_serve_speculative_proposed_tokens_total",
            "Tokens proposed for verification.",
            snap.speculative_proposed,
        ),
        *_counter(
            "kv_serve_speculative_accepted_tokens_total",
            "Proposed tokens the model kept.",
            snap.speculative_accepted,
        ),
        *_counter("kv_serve_engine_steps_total", "Engine steps.", snap.steps),
        *_counter(
            "kv_serve_engine_preemptions_total",
            "Requests preempted back to the queue.",
            snap.preemptions,
        ),
        *_counter(
            "kv_serve_prompt_tokens_total",
            "Prompt tokens of finished requests.",
            m.prompt_tokens,
        ),
        *_counter(
            "kv_serve_generation_tokens_total",
            "Tokens generated for finished requests.",
            m.generation_tokens,
        ),
        *_labelled(
            "kv_serve_requests_total",
            "counter",
            "Requests that ran, by finish reason.",
            "finish_reason",
            m.requests,
        ),
        *_labelled(
            "kv_serve_requests_rejected_total",
            "counter",
            "Requests answered with an error status.",
            "status",
            m.rejected,
        ),
    ]
    for name, hist, what in (
        ("kv_serve_request_latency_seconds", m.latency, "Seconds from arrival to the end."),
        ("kv_serve_time_to_first_token_seconds", m.first_token, "Seconds to the first token."),
        ("kv_serve_inter_token_latency_seconds", m.inter_token, "Seconds between streamed steps."),
    ):
        lines += [f"# HELP {name} {what}", f"# TYPE {name} histogram"]
        lines += hist.lines(name)
    return "\n".join(lines) + "\n"
