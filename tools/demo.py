"""The main job: serve a batch of prompts through ``DecodeEngine`` on ``HybridKVPool``.

Builds a model (an embedded tiny random-weight hybrid, a local mlx-lm directory, or a trained
model through :func:`kv_serve.load_model`: ``gemma3-270m`` or a Gemma 3 ``.gguf``), serves a
workload of prompts (random token ids of staggered lengths, or for a trained model the real
English prompts of :mod:`tools.real_prompts`), checks every request's tokens against mlx-lm
generating that prompt alone, and reports throughput and KV memory against a pool that stores
every layer in full and against mlx-lm's own caches. For a trained model it prints the texts.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import mlx.core as mx
import mlx.nn as nn

from kv_batching import DecodeEngine, unpatch_model_attention
from kv_pool import HybridKVPool, required_bytes
from kv_pool._inspect import request_ids
from kv_protocol import (
    CacheLayout,
    KVCacheError,
    LayerKind,
    layout_from_model,
)
from kv_serve import (
    GEMMA3_270M,
    active_blas,
    build_engine,
    encode_prompt,
    load_model,
    stop_token_ids,
)
from tools.cli_args import memory_limit_bytes

__all__ = [
    "DemoConfig",
    "DemoError",
    "DemoResult",
    "load_local_model",
    "mlx_lm_kv_bytes",
    "run_demo",
]

#: mlx-lm's KVCache / RotatingKVCache grow their buffers in steps of this many tokens.
MLX_LM_CACHE_STEP = 256


class DemoError(Exception):
    """A user-facing problem (bad path, budget too small ...): one line, no traceback."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything the demo run needs; the command line fills it."""

    arch: str = "gpt_oss"
    model_path: str | None = None
    window: int = 32
    requests: int = 16
    min_prompt: int = 8
    max_prompt: int = 320
    min_tokens: int = 16
    max_tokens: int = 64
    page_size: int = 16
    budget_mib: float | None = None
    max_running: int = 8
    prefill_chunk: int = 128
    fused_rope: str = "off"
    decode_path: str = "auto"
    dtype: str = "float32"
    seed: int = 0
    verify: bool = True
    plot: str | None = None
    progress: bool = True


@dataclass(kw_only=True)
class DemoResult:
    """What the demo measured."""

    model: str
    blas: str
    layout: str
    decode_paths: str
    requests: int
    prompt_tokens: int
    generated_tokens: int
    seconds: float
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    steps: int
    peak_running: int
    pool_bytes_total: int
    peak_kv_bytes: int
    peak_full_kv_bytes: int
    peak_mlx_lm_kv_bytes: int
    peak_pages: dict[str, int]
    pages_total: dict[str, int]
    verified: bool | None
    mismatches: list[int] = field(default_factory=list)
    ties: list[int] = field(default_factory=list)
    mlx_lm_measured_bytes_check: bool | None = None
    texts: list[tuple[str, str]] = field(default_factory=list)


def is_trained_model_name(text: str) -> bool:
    """Whether ``--model`` names a model :func:`kv_serve.load_model` loads with a tokenizer."""
    return text == GEMMA3_270M or text.endswith(".gguf")


def load_local_model(path: Path) -> nn.Module:
    """Load a local mlx-lm model directory (config.json + safetensors), nothing downloaded."""
    if not path.exists():
        raise DemoError(f"--model {path}: no such directory")
    if not path.is_dir():
        raise DemoError(f"--model {path}: not a directory")
    if not (path / "config.json").is_file():
        raise DemoError(f"--model {path}: not an mlx-lm model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise DemoError(f"--model {path}: not an mlx-lm model directory (no *.safetensors)")
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(path)
    except Exception as exc:  # mlx-lm raises many kinds; report them as one line
        raise DemoError(f"--model {path}: mlx-lm could not load it: {exc}") from exc
    return model  # type: ignore[no-any-return]


def mlx_lm_kv_bytes(layout: CacheLayout, seq_len: int) -> int:
    """KV bytes mlx-lm's own caches hold for one request of ``seq_len`` tokens.

    ``KVCache`` grows in 256-token steps; ``RotatingKVCache(max_size=window)`` grows in the
    same steps up to ``window`` (decode steady state).
    """
    if seq_len <= 0:
        return 0
    capacity = math.ceil(seq_len / MLX_LM_CACHE_STEP) * MLX_LM_CACHE_STEP
    total = 0
    for layer_id in layout.attention_layer_ids:
        spec = layout.spec(layer_id)
        tokens = capacity if spec.kind is LayerKind.FULL else min(capacity, spec.window or 0)
        total += tokens * spec.geometry.bytes_per_token
    return total


def _paged_full_bytes(layout: CacheLayout, seq_len: int, page_size: int) -> int:
    pages = math.ceil(seq_len / page_size)
    return pages * page_size * layout.full_kv_bytes_per_token()


def _workload(config: DemoConfig, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(config.seed)
    work = []
    for _ in range(config.requests):
        length = rng.randint(config.min_prompt, config.max_prompt)
        prompt = [rng.randrange(vocab) for _ in range(length)]
        work.append((prompt, rng.randint(config.min_tokens, config.max_tokens)))
    return work


def _vocab_size(model: nn.Module) -> int:
    args = getattr(model, "args", None)
    vocab = getattr(args, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    raise DemoError("cannot determine the model's vocab_size from model.args")


class _Progress:
    """A one-line text progress bar on a stream (no-op when disabled)."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total = max(total, 1)
        self.stream = stream
        self.enabled = enabled
        self.start = time.perf_counter()
        self.last_draw = 0.0

    def update(self, done: int, label: str) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last_draw < 0.1 and done < self.total):
            return
        self.last_draw = now
        width = 30
        filled = int(width * min(done, self.total) / self.total)
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} tokens "
            f"{rate:7.1f} tok/s  {label:<24s}"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _real_workload(
    config: DemoConfig, tokenizer: Any
) -> tuple[list[tuple[list[int], int]], list[str]]:
    from tools.real_prompts import real_prompts

    rng = random.Random(config.seed)
    work, names = [], []
    for name, text in real_prompts(config.requests):
        work.append(
            (encode_prompt(tokenizer, text), rng.randint(config.min_tokens, config.max_tokens))
        )
        names.append(name)
    return work, names


def run_demo(config: DemoConfig, *, stream: TextIO = sys.stderr) -> DemoResult:
    """Serve the workload, verify it against mlx-lm, and measure throughput and KV memory."""
    from mlx_lm.models.cache import make_prompt_cache

    from kv_testing import build_tiny_model, mlx_lm_greedy
    from tools.anchor import anchor_model
    from tools.reference import first_divergence

    tokenizer: Any = None
    stops: set[int] = set()
    if config.model_path is not None and is_trained_model_name(config.model_path):

        def say(message: str) -> None:
            if config.progress:
                stream.write(message + "\n")
                stream.flush()

        try:
            model, tokenizer = load_model(config.model_path, dtype=config.dtype, progress=say)
        except (KVCacheError, OSError) as exc:
            raise DemoError(f"--model {config.model_path}: {exc}") from exc
        name = f"{config.model_path} ({config.dtype})"
        stops = stop_token_ids(tokenizer)
    elif config.model_path is not None:
        model = load_local_model(Path(config.model_path))
        name = config.model_path
    else:
        model = build_tiny_model(config.arch, window=config.window, seed=config.seed)
        name = f"tiny random-weight {config.arch} (window {config.window})"
    try:
        layout = layout_from_model(model)
    except KVCacheError as exc:
        raise DemoError(f"{name}: {exc}") from exc
    if tokenizer is not None:
        work, prompt_names = _real_workload(config, tokenizer)
    else:
        work, prompt_names = _workload(config, _vocab_size(model)), []
    max_context = max(len(p) + n for p, n in work)
    concurrency = min(config.max_running, len(work))
    if config.budget_mib is None:
        budget = required_bytes(
            layout,
            max_context=max_context,
            concurrency=concurrency,
            page_size=config.page_size,
            prefill_chunk=config.prefill_chunk,
        )
        limit = memory_limit_bytes()
        if budget > limit:
            raise DemoError(
                f"the workload needs a {budget / 2**20:.1f} MiB KV pool for {concurrency} "
                f"requests of up to {max_context} tokens, more than this machine's memory "
                f"({limit / 2**30:.1f} GiB); lower --max-running, --max-prompt or --max-tokens"
            )
    else:
        budget = int(config.budget_mib * 2**20)
        one = required_bytes(
            layout,
            max_context=max_context,
            concurrency=1,
            page_size=config.page_size,
            prefill_chunk=config.prefill_chunk,
        )
        if budget < one:
            raise DemoError(
                f"--budget-mib {config.budget_mib:g} is too small for one request of "
                f"{max_context} tokens: it needs at least {one / 2**20:.3f} MiB"
            )
    try:
        pool = HybridKVPool.from_budget(
            layout,
            budget,
            max_context=max_context,
            concurrency=concurrency,
            page_size=config.page_size,
            prefill_chunk=config.prefill_chunk,
        )
        engine = build_engine(
            model,
            pool=pool,
            fused_rope=config.fused_rope,
            decode_path=config.decode_path,
            max_running=config.max_running,
            prefill_chunk=config.prefill_chunk,
            seed=config.seed,
        )
    except KVCacheError as exc:
        raise DemoError(str(exc)) from exc
    total_tokens = sum(n for _, n in work)
    progress = _Progress(total_tokens, stream, config.progress)
    ids = [engine.submit(prompt, n, stop_tokens=sorted(stops)) for prompt, n in work]
    pages_total = {s.name: s.num_pages for s in pool.memory_report().sub_pools}
    peak = {"kv": 0, "full": 0, "mlx": 0}
    generated = 0
    start = time.perf_counter()
    while engine.has_work:
        for tokens in engine.step().values():
            generated += len(tokens)
        report = pool.memory_report()
        lens = [pool.seq_len(rid) for rid in request_ids(pool)]
        peak["kv"] = max(peak["kv"], report.bytes_used)
        peak["full"] = max(
            peak["full"], sum(_paged_full_bytes(layout, n, config.page_size) for n in lens)
        )
        peak["mlx"] = max(peak["mlx"], sum(mlx_lm_kv_bytes(layout, n) for n in lens))
        progress.update(generated, f"running {engine.num_running:2d} queued {engine.num_queued}")
    seconds = time.perf_counter() - start
    progress.close()
    outputs = [list(engine.output(rid).tokens) for rid in ids]
    stats = engine.stats

    # The oracle runs on the model exactly as mlx-lm built it: no wrapper in the way, and
    # float32 values where the engine's model kept its embedding quantized (the same values).
    unpatch_model_attention(model)
    if tokenizer is not None and config.model_path is not None:
        model = anchor_model(model, config.model_path, dtype=config.dtype)
    verified: bool | None = None
    mismatches: list[int] = []
    ties: list[int] = []
    measured_check: bool | None = None
    # The KV dtype is the dtype the model computes in.
    dtype = layout.spec(layout.attention_layer_ids[0]).dtype if layout.attention_layer_ids else None
    if config.verify:
        if stream is not None and config.progress:
            stream.write("verifying every request against mlx-lm generating it alone ...\n")
        measured_check = True
        for index, ((prompt, n), mine) in enumerate(zip(work, outputs, strict=True)):
            caches = make_prompt_cache(model)
            ref = mlx_lm_greedy(
                model,
                prompt,
                n,
                caches=caches,
                prefill_chunk=config.prefill_chunk,
                stop_tokens=stops,
            )
            if ref != mine:
                where = (
                    first_divergence(model, prompt, ref, mine, dtype=dtype)
                    if dtype is not None and dtype != mx.float32
                    else None
                )
                (ties if where is not None and where.is_tie else mismatches).append(index)
            if sum(int(c.nbytes) for c in caches) > mlx_lm_kv_bytes(layout, len(prompt) + n):
                measured_check = False
        verified = not mismatches
    texts = (
        [
            (label, str(tokenizer.decode(tokens)))
            for label, tokens in zip(prompt_names, outputs, strict=True)
        ]
        if tokenizer is not None
        else []
    )
    if config.plot:
        _plot(engine, config.plot)
    return DemoResult(
        model=name,
        blas=active_blas().describe(),
        layout=layout.describe(),
        decode_paths=engine.decode_plan.describe(),
        requests=len(work),
        prompt_tokens=sum(len(p) for p, _ in work),
        generated_tokens=sum(len(o) for o in outputs),
        seconds=seconds,
        decode_tokens_per_s=stats.decode_tokens_per_s,
        prefill_tokens_per_s=stats.prefill_tokens_per_s,
        steps=stats.steps,
        peak_running=max(stats.running, default=0),
        pool_bytes_total=pool.memory_report().bytes_total,
        peak_kv_bytes=peak["kv"],
        peak_full_kv_bytes=peak["full"],
        peak_mlx_lm_kv_bytes=peak["mlx"],
        peak_pages=stats.peak_pages_used,
        pages_total=pages_total,
        verified=verified,
        mismatches=mismatches,
        ties=ties,
        mlx_lm_measured_bytes_check=measured_check,
        texts=texts,
    )


def _plot(engine: DecodeEngine, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise DemoError(
            "--plot needs matplotlib: install the optional extra with `uv sync --extra plot`"
        ) from exc
    stats = engine.stats
    fig, (ax_pages, ax_running) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    names = sorted({name for sample in stats.pages_used for name in sample})
    steps = list(range(1, len(stats.pages_used) + 1))
    for name in names:
        ax_pages.plot(steps, [s.get(name, 0) for s in stats.pages_used], label=name)
    ax_pages.set_ylabel("pages in use")
    ax_pages.legend(loc="upper left")
    ax_pages.set_title("KV pages per sub-pool")
    ax_running.plot(range(1, len(stats.running) + 1), stats.running, label="running")
    ax_running.plot(range(1, len(stats.queue_length) + 1), stats.queue_length, label="queued")
    ax_running.set_xlabel("engine step")
    ax_running.set_ylabel("requests")
    ax_running.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_result(result: DemoResult) -> str:
    """The human-readable report of a demo run."""
    mib = 2**20

    def ratio(a: int, b: int) -> str:
        return f"{100 * a / b:.1f}%" if b else "n/a"

    lines = [
        f"model: {result.model}",
        f"BLAS: {result.blas}",
        result.layout,
        result.decode_paths,
        f"requests: {result.requests}  prompt tokens: {result.prompt_tokens}  "
        f"generated tokens: {result.generated_tokens}  engine steps: {result.steps}  "
        f"peak running: {result.peak_running}",
        f"time: {result.seconds:.2f} s  decode: {result.decode_tokens_per_s:.1f} tok/s  "
        f"prefill: {result.prefill_tokens_per_s:.1f} tok/s",
        f"KV at peak: {result.peak_kv_bytes / mib:.3f} MiB in the hybrid pool; "
        f"{result.peak_full_kv_bytes / mib:.3f} MiB with every layer full "
        f"({ratio(result.peak_kv_bytes, result.peak_full_kv_bytes)}); "
        f"{result.peak_mlx_lm_kv_bytes / mib:.3f} MiB in mlx-lm's caches "
        f"({ratio(result.peak_kv_bytes, result.peak_mlx_lm_kv_bytes)})",
        f"pool buffers: {result.pool_bytes_total / mib:.3f} MiB",
        "pages per sub-pool (peak used / total): "
        + ", ".join(
            f"{name} {result.peak_pages.get(name, 0)}/{total}"
            for name, total in result.pages_total.items()
        ),
    ]
    for label, text in result.texts:
        lines.append(f"[{label}] ...{' '.join(text.split())}")
    tied = (
        f"; {len(result.ties)} differ only after a tie of the top two logits within the "
        f"dtype's precision: requests {result.ties}"
        if result.ties
        else ""
    )
    if result.verified is None:
        lines.append("verification: skipped (--no-verify)")
    elif result.verified:
        same = result.requests - len(result.ties)
        lines.append(f"verification: PASSED ({same} requests token-identical to mlx-lm{tied})")
    else:
        lines.append(
            f"verification: FAILED for requests {result.mismatches} (tokens differ from mlx-lm)"
        )
    return "\n".join(lines)


def result_json(result: DemoResult) -> str:
    """The machine-readable report of a demo run."""
    data: dict[str, Any] = asdict(result)
    return json.dumps(data, indent=2, sort_keys=True)
