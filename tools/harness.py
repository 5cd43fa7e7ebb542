"""What every benchmark in ``tools/`` shares: one rule, one driver, one yardstick for each.

- :func:`quantile`: the one percentile rule (nearest rank) behind every p50/p90/p99 printed.
- :class:`MlxLmBatch`: the one driver of mlx-lm's ``BatchGenerator`` (the baseline system),
  and :func:`run_mlx_lm` / :func:`run_engine`, the two systems on one workload.
- :func:`copy_bandwidth` and :data:`BANDWIDTH_UNIT`: the memory-copy bandwidth a KV read
  bandwidth is compared with, and the unit every bandwidth is printed in.
- :func:`machine_description`: the machine, the MLX build and the BLAS, in one line.
- :func:`build_model` and :func:`workload`: the random-weight model and workload.
- :func:`measured`: a run's peak MLX memory above what was active before it.
- :class:`Report`: a benchmark's results, kept for ``--markdown [FILE.md]``.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import math
import os
import platform
import random
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

__all__ = [
    "BANDWIDTH_UNIT",
    "MlxLmBatch",
    "Report",
    "RunResult",
    "build_model",
    "copy_bandwidth",
    "gb_per_s",
    "machine_description",
    "measured",
    "quantile",
    "run_engine",
    "run_mlx_lm",
    "timed",
    "workload",
]

_R = TypeVar("_R")


# ---------------------------------------------------------------------------- statistics


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank; ``nan`` for no values.

    Nearest rank (Hyndman and Fan's type 1, numpy's ``method="inverted_cdf"``): the smallest
    value with at least a share ``q`` of all values at or below it, i.e. the
    ``ceil(q * n)``-th smallest (the smallest for ``q = 0``). Every benchmark uses this one
    rule, because it always reports a value that was measured (a p99 step time is a step
    that happened, not a mix of two), it needs no assumption about the distribution, and a
    p99 of fewer than 100 samples is plainly the slowest one; p50 of an even count is the
    lower of the two middle values.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def timed(fn: Callable[[], object], *, min_time: float, min_iters: int = 3) -> float:
    """Median seconds (:func:`quantile` 0.5) of one ``mx.eval(fn())``, after two warm-ups.

    Repeats for at least ``min_time`` seconds and ``min_iters`` runs (at most 200 runs).
    """
    for _ in range(2):
        mx.eval(fn())
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_iters or time.perf_counter() - start < min_time:
        tic = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - tic)
        if len(samples) >= 200:
            break
    return quantile(samples, 0.5)


# ---------------------------------------------------------------------------- yardsticks

#: The unit every benchmark prints a bandwidth in: decimal gigabytes (10**9 bytes) per second.
BANDWIDTH_UNIT = "GB/s"


def gb_per_s(bytes_per_second: float) -> float:
    """``bytes_per_second`` in :data:`BANDWIDTH_UNIT`."""
    return bytes_per_second / 1e9


def copy_bandwidth(mib: int = 256, *, min_time: float = 0.5) -> float:
    """Bytes per second of an elementwise copy (``x + 0`` over ``mib`` MiB of fp32), now.

    Bytes read plus bytes written, over the median time of repeated copies (:func:`timed`):
    the memory-copy bandwidth a KV read bandwidth is compared with, measured in the same run.
    """
    x = mx.zeros((mib * 1024 * 1024 // 4,), dtype=mx.float32)
    mx.eval(x)
    return 2 * x.nbytes / timed(lambda: x + 0.0, min_time=min_time)


def machine_description() -> str:
    """One line naming this machine, the Python and MLX builds and the BLAS in use."""
    from kv_serve import active_blas, active_cpu_jit

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), "
        f"Python {platform.python_version()}, mlx {version('mlx')} "
        f"({mx.default_device().type.name}), mlx-lm {version('mlx-lm')}; "
        f"BLAS {active_blas().name}; compiled kernels {active_cpu_jit().flags or 'no flags'}"
    )


def measured(run: Callable[[], _R]) -> tuple[_R, int]:
    """``run()`` and the process's peak MLX memory above what was active before it.

    What was active before is the weights (and anything else the caller holds); the MLX
    buffer cache is emptied first so that a previous run's freed buffers do not hide this
    run's allocations.
    """
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    result = run()
    mx.synchronize()
    return result, max(0, mx.get_peak_memory() - before)


# ---------------------------------------------------------------------------- model, workload


def build_model(
    *, num_layers: int, window: int, vocab: int, hidden: int = 64, experts: int = 2
) -> Any:
    """A gpt-oss-like model whose cost is dominated by attention over long contexts.

    Random fp32 weights; alternating sliding-window / full layers with attention sinks; 8
    query / 2 KV heads of 64; MLP width ``hidden // 2``; ``experts // 2`` of ``experts``
    routed per token (at least one).
    """
    from kv_testing import build_tiny_model

    return build_tiny_model(
        "gpt_oss",
        window=window,
        num_layers=num_layers,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=max(1, hidden // 2),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=experts,
        num_experts_per_tok=max(1, experts // 2),
    )


def workload(
    n: int,
    *,
    max_prompt: int,
    min_out: int,
    max_out: int,
    vocab: int,
    seed: int,
    min_prompt: int = 16,
) -> list[tuple[list[int], int]]:
    """``n`` (prompt, max_tokens) pairs; prompt lengths log-uniform in min_prompt..max_prompt.

    A ``max_prompt`` below ``min_prompt`` makes every prompt ``max_prompt`` tokens long.
    """
    rng = random.Random(seed)
    out = []
    shortest = min(min_prompt, max_prompt)
    for _ in range(n):
        length = int(math.exp(rng.uniform(math.log(shortest), math.log(max_prompt))))
        out.append(([rng.randrange(vocab) for _ in range(length)], rng.randint(min_out, max_out)))
    return out


# ---------------------------------------------------------------------------- the two systems


@dataclass
class RunResult:
    """What one system did on the workload."""

    name: str
    seconds: float
    generated: int
    peak_kv_bytes: int
    step_seconds: list[float]
    tokens: dict[int, list[int]]
    peak_memory_bytes: int = 0
    #: Seconds from the start of the run (every request submitted then) to each first token.
    first_token_seconds: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Generated tokens per second of wall time."""
        return self.generated / self.seconds

    def step_ms(self, q: float) -> float:
        """The ``q`` quantile of the step time, in milliseconds."""
        return 1000 * quantile(self.step_seconds, q)

    def ttft(self, q: float) -> float:
        """The ``q`` quantile of the time to first token, in seconds."""
        return quantile(self.first_token_seconds, q)


def _cache_bytes(caches: Any) -> int:
    return sum(int(getattr(cache, "nbytes", 0) or 0) for cache in caches or [])


#: The model name under which :class:`MlxLmBatch` keeps prompts in an ``LRUPromptCache``.
_PROMPT_CACHE_MODEL = "model"


class MlxLmBatch:
    """mlx-lm's ``BatchGenerator``, greedy: the one driver every benchmark runs mlx-lm through.

    At most ``running`` sequences decode together; prompts are prefilled ``prefill_step``
    tokens at a time, up to ``min(8, running)`` together. Requests are submitted under the
    caller's keys; each :meth:`step` is one ``next()`` and records its seconds, every new
    token and when it came (seconds since the driver was made). With ``prompt_cache`` (an
    mlx-lm ``LRUPromptCache``) a prompt starts from the nearest cached prefix and a finished
    request's caches are stored, as ``mlx_lm.server`` does; with ``track_kv`` the bytes of the
    caches the generator holds are summed after every step and their peak kept.
    """

    def __init__(
        self,
        model: Any,
        *,
        running: int,
        prefill_step: int = 512,
        prompt_cache: Any = None,
        track_kv: bool = False,
    ) -> None:
        from mlx_lm.generate import BatchGenerator

        self._gen = BatchGenerator(
            model,
            completion_batch_size=running,
            prefill_batch_size=min(8, running),
            prefill_step_size=prefill_step,
        )
        self._prompt_cache = prompt_cache
        self._track_kv = track_kv
        self._keys: dict[int, int] = {}
        self._live: set[int] = set()
        #: Tokens, their arrival times and the submission time of each request, by key.
        self.tokens: dict[int, list[int]] = {}
        self.token_times: dict[int, list[float]] = {}
        self.submitted_at: dict[int, float] = {}
        self.step_seconds: list[float] = []
        self.peak_kv_bytes = 0
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the driver was made."""
        return time.perf_counter() - self.start

    def submit(self, key: int, prompt: list[int], max_tokens: int) -> None:
        """Queue ``prompt`` for ``max_tokens`` greedy tokens under ``key``."""
        cache, rest = None, prompt
        if self._prompt_cache is not None:
            cache, rest = self._prompt_cache.fetch_nearest_cache(_PROMPT_CACHE_MODEL, prompt)
        (uid,) = self._gen.insert(
            [rest], [max_tokens], caches=[cache] if cache is not None else None
        )
        self._keys[uid] = key
        self._live.add(uid)
        self.tokens[key] = []
        self.token_times[key] = []
        self.submitted_at[key] = self.elapsed()

    @property
    def has_work(self) -> bool:
        """Whether a submitted request has not finished."""
        return bool(self._live)

    def step(self) -> None:
        """One ``next()`` of the generator."""
        tic = time.perf_counter()
        _, responses = self._gen.next()
        now = time.perf_counter()
        self.step_seconds.append(now - tic)
        for r in responses:
            key = self._keys[r.uid]
            self.tokens[key].append(r.token)
            self.token_times[key].append(now - self.start)
            if r.finish_reason is None:
                continue
            self._live.discard(r.uid)
            cache = self._prompt_cache
            if cache is not None and r.prompt_cache is not None and r.all_tokens is not None:
                cache.insert_cache(_PROMPT_CACHE_MODEL, list(r.all_tokens), r.prompt_cache)
        if self._track_kv:
            held = _cache_bytes(self._gen._generation_batch.prompt_cache) + _cache_bytes(
                self._gen._prompt_batch.prompt_cache
            )
            self.peak_kv_bytes = max(self.peak_kv_bytes, held)

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.has_work:
            self.step()

    def close(self) -> None:
        """Release the generator (mlx-lm restores the wired memory limit it set)."""
        self._gen.close()


def run_mlx_lm(model: Any, requests: list[tuple[list[int], int]], running: int) -> RunResult:
    """mlx-lm's ``BatchGenerator`` on ``requests`` (all submitted at once), ``running`` at most."""
    driver = MlxLmBatch(model, running=running, track_kv=True)
    for i, (prompt, max_tokens) in enumerate(requests):
        driver.submit(i, prompt, max_tokens)
    driver.run()
    seconds = driver.elapsed()
    driver.close()
    return RunResult(
        "mlx-lm BatchGenerator",
        seconds,
        sum(len(t) for t in driver.tokens.values()),
        driver.peak_kv_bytes,
        driver.step_seconds,
        driver.tokens,
        first_token_seconds=[times[0] for times in driver.token_times.values() if times],
    )


def run_engine(
    model: Any,
    requests: list[tuple[list[int], int]],
    running: int,
    *,
    budget_bytes: int,
    page_size: int,
    chunk: int,
    fused: str,
    stall: float | None = None,
    defaults: bool = False,
    speculative: str | None = None,
) -> tuple[RunResult, Any, Any]:
    """kv-batching's ``DecodeEngine`` on a ``HybridKVPool`` of ``budget_bytes``.

    ``defaults=True`` ignores ``budget_bytes`` and builds the engine as ``build_engine``
    does by itself: prefix caching on, the pool capped at what ``running`` requests of the
    longest request need, its buffers growing by slabs; the result's KV bytes are then what
    the buffers held at the end (they only grow during a run). ``speculative`` is
    ``build_engine``'s (``"ngram"``: prompt lookup). Returns the result, the pool and the
    engine (for their statistics).
    """
    from kv_pool import HybridKVPool
    from kv_protocol import layout_from_model
    from kv_serve import build_engine

    layout = layout_from_model(model)
    longest = max(len(p) + m for p, m in requests)
    if defaults:
        engine = build_engine(
            model,
            max_context=longest,
            page_size=page_size,
            fused_rope=fused,
            max_running=running,
            prefill_chunk=chunk,
            prefill_stall=stall,
            speculative=speculative,
        )
        pool = engine.pool
    else:
        pool = HybridKVPool.from_budget(
            layout,
            budget_bytes,
            max_context=longest,
            concurrency=running,
            page_size=page_size,
            prefill_chunk=chunk,
        )
        engine = build_engine(
            model,
            pool=pool,
            fused_rope=fused,
            max_running=running,
            prefill_chunk=chunk,
            prefill_stall=stall,
            speculative=speculative,
        )
    ids = [engine.submit(p, m) for p, m in requests]
    steps: list[float] = []
    first: list[float] = []
    started: set[int] = set()
    start = time.perf_counter()
    while engine.has_work:
        tic = time.perf_counter()
        produced = engine.step()
        steps.append(time.perf_counter() - tic)
        for rid in produced.keys() - started:
            started.add(rid)
            first.append(time.perf_counter() - start)
    seconds = time.perf_counter() - start
    out = {i: list(engine.output(rid).tokens) for i, rid in enumerate(ids)}
    capacity = pool.memory_report().bytes_committed
    result = RunResult(
        "kv-batching DecodeEngine" + (f", speculative={speculative}" if speculative else ""),
        seconds,
        sum(len(t) for t in out.values()),
        capacity,
        steps,
        out,
        first_token_seconds=first,
    )
    return result, pool, engine


# ---------------------------------------------------------------------------- Markdown


class _Tee(io.TextIOBase):
    """Writes to ``out`` and keeps a copy."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return int(self._out.write(text))

    def flush(self) -> None:
        self._out.flush()


#: The repository's root: a path under it is written relative to it.
_ROOT = Path(__file__).resolve().parent.parent


def _portable(text: str) -> str:
    """``text`` with this checkout's and this user's paths made relative (``.``, ``~``)."""
    text = text.replace(str(_ROOT), ".")
    home = Path.home()
    return text.replace(str(home), "~") if len(home.parts) > 1 else text


def _as_markdown(text: str) -> list[str]:
    """Printed output as Markdown: tables as they are, the rest fenced as text.

    ``#`` headings move two levels down: a results file's runs are its ``##`` sections.
    """
    blocks: list[str] = []
    run: list[str] = []
    kind = ""

    def close() -> None:
        body = "\n".join(run).strip("\n")
        if body:
            blocks.append(body if kind == "md" else f"```text\n{body}\n```")
        run.clear()

    for line in text.splitlines():
        this = "md" if line.startswith(("|", "#")) else "text"
        if not line.strip():
            close()
            continue
        if this != kind:
            close()
            kind = this
        run.append("##" + line if line.startswith("#") else line)
    close()
    return blocks


def _without_markdown(args: Sequence[str]) -> list[str]:
    """``args`` less ``--markdown [FILE.md]``: the run, whatever file it is written to."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            if arg.endswith(".md") and not arg.startswith("-"):
                continue
        if arg == "--markdown":
            skip = True
            continue
        if not arg.startswith("--markdown="):
            out.append(arg)
    return out


def _merge(text: str, title: str, heading: str, section: str) -> str:
    """A results file with ``section`` in place of the one under ``heading`` (or added)."""
    if not text.strip():
        return f"# {title}\n\n{section}\n"
    parts: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.startswith("## "):
            parts.append([])
        parts[-1].append(line)
    preamble = "\n".join(parts[0]).strip("\n")
    sections = ["\n".join(part).strip("\n") for part in parts[1:]]
    for index, old in enumerate(sections):
        if old.splitlines()[0].strip() == heading:
            sections[index] = section
            break
    else:
        sections.append(section)
    return "\n\n".join([preamble, *sections]) + "\n"


def _load() -> str:
    """The 1-minute load average, where the system tells (other work slows a run down)."""
    try:
        return f"; load average {os.getloadavg()[0]:.2f} when the run ended"
    except (AttributeError, OSError):
        return ""


class Report:
    """A benchmark's results: what it prints, kept for ``--markdown`` (stdout or a file).

    Printed output is kept inside :meth:`capturing` (tables stay Markdown, other lines are
    fenced as text); :meth:`keep` adds Markdown that is not printed (a table that stdout shows
    in another form). :meth:`write` puts it in a section headed by the run's command, with
    the exact command, the machine and the date. A results file holds one benchmark: a run
    written into it replaces the section of the same run (the same options but
    ``--markdown``) and adds a new one otherwise.
    """

    def __init__(self, title: str) -> None:
        self.title = title
        self.blocks: list[str] = []

    def keep(self, markdown: str) -> None:
        """Add ``markdown`` to the report without printing it (headings from ``###``)."""
        self.blocks.append(markdown.strip("\n"))

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Print as usual inside the block, and keep what was printed."""
        tee = _Tee(sys.stdout)
        with contextlib.redirect_stdout(tee):
            yield
        self.blocks += _as_markdown(tee.kept.getvalue())

    def section(self, heading: str, command: str) -> str:
        """The report as one Markdown section: ``heading``, the command, machine and date."""
        today = datetime.datetime.now(datetime.UTC).date().isoformat()
        head = [
            heading,
            "",
            f"Command: `{command}`  ",
            f"Machine: {machine_description()}  ",
            f"Date: {today}{_load()}",
        ]
        return _portable("\n\n".join(["\n".join(head), *self.blocks]))

    def write(self, destination: str | None, *, prog: str, argv: Sequence[str] | None) -> None:
        """Write the report: nowhere (``None``), on stdout (``"-"``) or into a ``.md`` file.

        ``prog`` and ``argv`` (``sys.argv[1:]`` when ``None``) make the command it names:
        ``uv run python -m {prog} {argv}``, after ``KV_SERVE_BLAS=...`` when that is set.
        """
        if destination is None:
            return
        from kv_serve import BLAS_ENV

        args = list(sys.argv[1:] if argv is None else argv)
        # The BLAS choice is part of the run (MLX's reference BLAS or a fast one).
        env = [f"{BLAS_ENV}={os.environ[BLAS_ENV]}"] if os.environ.get(BLAS_ENV) else []
        start = [*env, "uv", "run", "python", "-m", *prog.split()]
        heading = f"## `{shlex.join([*start, *_without_markdown(args)])}`"
        section = self.section(heading, shlex.join([*start, *args]))
        if destination == "-":
            print(f"\n# {self.title}\n\n{section}")
            return
        path = Path(destination)
        old = path.read_text() if path.exists() else ""
        path.write_text(_merge(old, self.title, heading, section))
        print(f"results written to {destination}")
