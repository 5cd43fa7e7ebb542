"""Benchmark of kv-pool: KV bytes of hybrid pools vs full KV and mlx-lm, and page-op throughput.

Run: ``uv run --no-sync python -m tools.bench_pool`` (about a minute on a 2-core CPU).

1. **KV bytes**, 32 concurrent requests at 8k and 32k tokens, with the real layer layouts of
   gpt-oss-20b and Gemma-3-27B (read off mlx-lm's own model classes, built lazily; bf16 KV):
   - *pool*: a ``HybridKVPool`` sized by ``from_budget`` for exactly this workload. Each
     request in turn is prefilled in chunks of ``--chunk`` tokens up to ``N - 1`` and takes
     its first decode step (``reserve(1)``), so the figure at N is the state between decode
     steps. Bytes = pages the allocators hold x bytes per page
     (``memory_report().bytes_used``). The pool's buffers are lazy ``mx.zeros`` and are never
     evaluated, so nothing is allocated. Also reported: the peak during the prefills, and the
     worst share of full KV over the next 16 decode steps (``reserve_batch``), since page
     rounding makes the share depend on where N falls.
   - *full*: every attention layer keeps all N tokens, ``32 * N * sum(bytes per token)``.
   - *mlx-lm*: mlx-lm's own per-request caches for the same schedule (``KVCache`` on full
     layers, ``RotatingKVCache(max_size=window)`` on sliding ones, as ``make_cache`` builds
     them), measured by building one request's caches with 1 kv head x 8 dims (bf16), feeding
     the same chunks and decode step through ``update_and_fetch``, reading ``nbytes``, and
     scaling by ``(n_kv_heads * head_dim) / 8`` and by 32 requests (the requests are
     identical and their caches independent); also over the next 16 decode steps.
   - *ideal*: ``(n_full * N + n_swa * min(N, window)) / (n_layers * N)``.
   A second table runs a *ragged* batch (prompts spread over N/2 .. N, one batched decode
   step) against mlx-lm's batch caches (``KVCache.merge`` / ``RotatingKVCache.merge`` of the
   same per-request caches, as its ``BatchGenerator`` does), which pad every row to the
   longest; measured and scaled the same way.
2. **Page operations per second** for 10k requests on a gpt-oss-like layout (page size 16,
   window 128): raw allocator alloc/free, and pool ``reserve`` (prefill of 256 tokens, then
   decode steps) and ``free_request``; plus the host cost of ``batch_page_table`` and
   ``batch_slots`` for a decode batch.
3. **set_kv in place?** One-token ``set_kv`` + eval on a 128 MiB layer buffer, against a
   whole-buffer copy, with the peak-memory increase; and the same write while a lazy read of
   the buffer is still pending (which forces MLX to copy).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kv_pool import HybridKVPool, PageAllocator, required_bytes
from kv_pool._inspect import allocator
from kv_protocol import CacheLayout, KVBuffer, LayerKind, LayerSpec, layout_from_model
from tools.cli_args import (
    MAX_PAGE_SIZE,
    MAX_REQUESTS,
    MAX_TOKENS,
    ArgumentParser,
    add_run_options,
    positive_int,
)
from tools.harness import Report
from tools.model_configs import REAL_MODEL_CONFIGS, lazy_model_from_config

MODELS = {"gpt-oss-20b": "gpt-oss-20b", "Gemma-3-27B": "gemma-3-27b"}
GIB = 1024**3


def real_layout(name: str) -> CacheLayout:
    """The model's layout from mlx-lm's own class (lazy weights), KV in bf16."""
    model = lazy_model_from_config(REAL_MODEL_CONFIGS[name])
    return layout_from_model(model, dtype=mx.bfloat16)


def schedule(n_tokens: int, chunk: int) -> list[int]:
    """Prefill chunks up to ``n_tokens - 1``, then one decode token."""
    steps = [chunk] * ((n_tokens - 1) // chunk)
    if (n_tokens - 1) % chunk:
        steps.append((n_tokens - 1) % chunk)
    return [*steps, 1]


#: Decode steps after N over which the worst (largest) share of full KV is also reported:
#: page and 256-token growth make the share depend on where N falls.
AFTER = 16


def pool_bytes(
    layout: CacheLayout, n_tokens: int, requests: int, chunk: int, page_size: int
) -> tuple[int, int, float]:
    """Pool bytes held at N, peak bytes in prefill, worst ratio to full over AFTER steps.

    Bytes at N are taken after every request's first decode step.
    """
    kwargs: dict[str, Any] = {
        "max_context": n_tokens + AFTER,
        "concurrency": requests,
        "page_size": page_size,
        "prefill_chunk": chunk,
    }
    budget = required_bytes(layout, **kwargs)
    pool = HybridKVPool.from_budget(layout, budget, **kwargs)
    peak = 0
    for rid in range(requests):
        # each request: chunked prefill, then its first decode step (as an engine runs it)
        pool.add_request(rid)
        for n in schedule(n_tokens, chunk):
            pool.reserve(rid, n)
            peak = max(peak, pool.memory_report().bytes_used)
    at_n = pool.memory_report().bytes_used
    worst = 0.0
    rids = list(range(requests))
    for _ in range(AFTER):
        pool.try_reserve_batch(dict.fromkeys(rids, 1))
        report = pool.memory_report()
        worst = max(worst, report.bytes_used / report.full_equivalent_bytes)
    return at_n, peak, worst


def mlx_lm_bytes(
    layout: CacheLayout, n_tokens: int, requests: int, chunk: int
) -> tuple[int, float]:
    """mlx-lm's per-request caches for the same schedule, measured small and scaled.

    Returns the bytes at N and the worst ratio to full KV over the next ``AFTER`` steps.
    """
    heads, dim = 1, 8
    per_kind: dict[int | None, list[int]] = {}
    for window in {layout.window(i) for i in layout.attention_layer_ids}:
        cache: Any = KVCache() if window is None else RotatingKVCache(max_size=window)
        sizes = []
        for n in [*schedule(n_tokens, chunk), *([1] * AFTER)]:
            kv = mx.zeros((1, heads, n, dim), dtype=mx.bfloat16)
            mx.eval(cache.update_and_fetch(kv, kv))
            sizes.append(cache.nbytes)
        per_kind[window] = sizes[-AFTER - 1 :]
    totals = [0] * (AFTER + 1)
    for layer_id in layout.attention_layer_ids:
        g = layout.geometry(layer_id)
        scale = (g.n_kv_heads * g.head_dim * g.dtype.size) / (heads * dim * mx.bfloat16.size)
        for step, size in enumerate(per_kind[layout.window(layer_id)]):
            totals[step] += int(size * scale) * requests
    per_token = requests * layout.full_kv_bytes_per_token()
    worst = max(totals[k] / (per_token * (n_tokens + k)) for k in range(1, AFTER + 1))
    return totals[0], worst


def kv_bytes_table(requests: int, contexts: list[int], chunk: int, page_size: int) -> None:
    """Section 1."""
    print(f"\n## KV bytes: {requests} requests, prefill chunk {chunk}, page size {page_size}\n")
    print(
        "| model | N | full KV GiB | ideal / full | pool GiB | pool / full "
        f"| pool / full, worst of next {AFTER} steps | pool peak in prefill GiB "
        f"| mlx-lm GiB | mlx-lm / full | mlx-lm / full, worst of next {AFTER} steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, name in MODELS.items():
        layout = real_layout(name)
        n_full = len(layout.full_layer_ids)
        n_swa = len(layout.sliding_layer_ids)
        (window,) = {layout.window(i) for i in layout.sliding_layer_ids}
        assert window is not None
        for n_tokens in contexts:
            full = requests * n_tokens * layout.full_kv_bytes_per_token()
            at_n, peak, worst = pool_bytes(layout, n_tokens, requests, chunk, page_size)
            theirs, their_worst = mlx_lm_bytes(layout, n_tokens, requests, chunk)
            ideal = (n_full * n_tokens + n_swa * min(n_tokens, window)) / (
                layout.num_layers * n_tokens
            )
            print(
                f"| {label} ({n_full} full + {n_swa} SWA, w {window}) | {n_tokens} "
                f"| {full / GIB:.2f} | {ideal:.2%} | {at_n / GIB:.2f} | {at_n / full:.2%} "
                f"| {worst:.2%} | {peak / GIB:.2f} | {theirs / GIB:.2f} | {theirs / full:.2%} "
                f"| {their_worst:.2%} |"
            )


def ragged_lengths(requests: int, n_tokens: int) -> list[int]:
    """Prompt lengths spread evenly over ``n_tokens // 2 .. n_tokens``."""
    return [n_tokens // 2 + (n_tokens // 2) * i // max(requests - 1, 1) for i in range(requests)]


def ragged_table(requests: int, contexts: list[int], chunk: int, page_size: int) -> None:
    """Section 1b: a ragged batch, where mlx-lm's batch caches pad every row to the longest."""
    print(
        f"\n## KV bytes, ragged batch: {requests} requests with prompts spread over N/2 .. N, "
        "after one batched decode step\n"
    )
    print(
        "| model | N | full KV GiB | ideal / full | pool GiB | pool / full "
        "| mlx-lm batch GiB | mlx-lm batch / full |"
    )
    print("|---|---|---|---|---|---|---|---|")
    heads, dim = 1, 8
    for label, name in MODELS.items():
        layout = real_layout(name)
        (window,) = {layout.window(i) for i in layout.sliding_layer_ids}
        assert window is not None
        for n_tokens in contexts:
            lengths = ragged_lengths(requests, n_tokens)
            tokens = sum(n + 1 for n in lengths)
            full = tokens * layout.full_kv_bytes_per_token()
            ideal = sum(
                layout.geometry(i).bytes_per_token
                * sum(min(n + 1, layout.window(i) or n + 1) for n in lengths)
                for i in layout.attention_layer_ids
            )
            kwargs: dict[str, Any] = {
                "max_context": n_tokens + 1,
                "concurrency": requests,
                "page_size": page_size,
                "prefill_chunk": chunk,
            }
            pool = HybridKVPool.from_budget(layout, required_bytes(layout, **kwargs), **kwargs)
            for rid, n in enumerate(lengths):
                pool.add_request(rid)
                for step in schedule(n + 1, chunk)[:-1]:
                    pool.reserve(rid, step)
            pool.try_reserve_batch(dict.fromkeys(range(requests), 1))
            ours = pool.memory_report().bytes_used
            per_kind: dict[int | None, int] = {}
            for kind_window in (None, window):
                caches: list[Any] = []
                for n in lengths:
                    cache: Any = (
                        KVCache() if kind_window is None else RotatingKVCache(max_size=window)
                    )
                    for step in schedule(n + 1, chunk)[:-1]:
                        kv = mx.zeros((1, heads, step, dim), dtype=mx.bfloat16)
                        mx.eval(cache.update_and_fetch(kv, kv))
                    caches.append(cache)
                batch = type(caches[0]).merge(caches)
                kv = mx.zeros((requests, heads, 1, dim), dtype=mx.bfloat16)
                mx.eval(batch.update_and_fetch(kv, kv))
                per_kind[kind_window] = batch.nbytes
            theirs = 0
            for layer_id in layout.attention_layer_ids:
                g = layout.geometry(layer_id)
                scale = (g.n_kv_heads * g.head_dim * g.dtype.size) / (heads * dim * 2)
                theirs += int(per_kind[layout.window(layer_id)] * scale)
            print(
                f"| {label} | {n_tokens} | {full / GIB:.2f} | {ideal / full:.2%} "
                f"| {ours / GIB:.2f} | {ours / full:.2%} | {theirs / GIB:.2f} "
                f"| {theirs / full:.2%} |"
            )


def per_second(fn: Callable[[], int]) -> tuple[float, int, float]:
    """(seconds, ops, ops per second) of one call of ``fn`` returning its op count."""
    start = time.perf_counter()
    ops = fn()
    seconds = time.perf_counter() - start
    return seconds, ops, ops / seconds


def throughput(n_requests: int) -> None:
    """Section 2."""
    print(f"\n## Page operations, {n_requests} requests (page size 16, gpt-oss-like, window 128)\n")
    print("| operation | page ops | seconds | page ops/s | requests/s |")
    print("|---|---|---|---|---|")
    alloc = PageAllocator(n_requests * 16 + 1)
    held: list[int] = []

    def raw_alloc() -> int:
        for _ in range(n_requests * 16):
            held.extend(alloc.alloc(1))
        return n_requests * 16

    def raw_free() -> int:
        for page in held:
            alloc.free([page])
        return len(held)

    for label, raw in (("allocator alloc(1)", raw_alloc), ("allocator free([p])", raw_free)):
        seconds, ops, rate = per_second(raw)
        print(f"| {label} | {ops} | {seconds:.3f} | {rate:,.0f} | |")

    specs = [
        LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=128, n_kv_heads=1, head_dim=1),
        LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=1, head_dim=1),
    ]
    layout = CacheLayout(specs)
    pool = HybridKVPool(layout, num_pages=n_requests * 20 + 1, page_size=16)

    def page_ops() -> int:
        allocators = [allocator(pool, spec.name) for spec in pool.sub_pools]
        return sum(a.pages_allocated_total + a.pages_released_total for a in allocators)

    def counted(fn: Callable[[], None]) -> Callable[[], int]:
        def run() -> int:
            before = page_ops()
            fn()
            return page_ops() - before

        return run

    def prefill() -> None:
        for rid in range(n_requests):
            pool.add_request(rid)
            pool.reserve(rid, 256)

    def decode(steps: int) -> None:
        for _ in range(steps):
            for rid in range(n_requests):
                pool.reserve(rid, 1)

    def decode_batched(steps: int, batch: int) -> None:
        rids = list(range(n_requests))
        for _ in range(steps):
            for lo in range(0, n_requests, batch):
                pool.try_reserve_batch(dict.fromkeys(rids[lo : lo + batch], 1))

    def free_all() -> None:
        for rid in range(n_requests):
            pool.free_request(rid)

    rows: list[tuple[str, Callable[[], None], int]] = [
        ("pool add + reserve(256)", prefill, n_requests),
        ("pool reserve(1) x 32 decode steps", lambda: decode(32), 32 * n_requests),
        (
            "pool try_reserve_batch(B=32, 1) x 32 decode steps",
            lambda: decode_batched(32, 32),
            32 * n_requests,
        ),
        ("pool free_request", free_all, n_requests),
    ]
    for label, fn, calls in rows:
        seconds, ops, rate = per_second(counted(fn))
        print(f"| {label} | {ops} | {seconds:.3f} | {rate:,.0f} | {calls / seconds:,.0f} |")

    print(
        "\nHost cost of a decode step's one reservation (B requests of 8192 tokens, page "
        "size 16: the new slots and page tables of both sub-pools), and of its rollback:\n"
    )
    print("| B | try_reserve_batch us | rollback us |")
    print("|---|---|---|")
    for batch in (1, 32, 256):
        pool = HybridKVPool(layout, num_pages=batch * 530 + 1, page_size=16)
        rids = list(range(batch))
        for rid in rids:
            pool.add_request(rid)
            pool.reserve(rid, 8191)
            pool.reserve(rid, 1)
        demands = dict.fromkeys(rids, 1)
        reserve_s = rollback_s = 0.0
        reps = 200
        for _ in range(reps):
            start = time.perf_counter()
            got = pool.try_reserve_batch(demands)
            middle = time.perf_counter()
            assert got is not None
            pool.rollback(got)
            reserve_s += middle - start
            rollback_s += time.perf_counter() - middle
        print(f"| {batch} | {reserve_s / reps * 1e6:.1f} | {rollback_s / reps * 1e6:.1f} |")


def in_place() -> None:
    """Section 3."""
    print("\n## set_kv: in place or a whole-buffer copy?\n")
    spec = LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=8, head_dim=64)
    pool = HybridKVPool(CacheLayout([spec]), num_pages=4096, page_size=16)
    pool.add_request(0)
    slots = pool.reserve(0, 1).slots["full"]
    kv = mx.ones((1, 8, 64))

    def buffer(get: Callable[[int], KVBuffer]) -> mx.array:
        plain = get(0)
        assert isinstance(plain, mx.array)  # this pool is not quantized
        return plain

    keys, values = buffer(pool.get_key_buffer), buffer(pool.get_value_buffer)
    mx.eval(keys, values, slots, kv)
    size = keys.nbytes

    def write() -> None:
        pool.set_kv(0, slots, kv, kv)
        mx.eval(pool.get_key_buffer(0), pool.get_value_buffer(0))

    def copy() -> None:
        mx.eval(buffer(pool.get_key_buffer) + 0, buffer(pool.get_value_buffer) + 0)

    def write_with_pending_reader() -> None:
        pending = buffer(pool.get_key_buffer)[:, :16] * 2
        write()
        mx.eval(pending)

    print(f"Layer buffers: 2 x {size / 2**20:.0f} MiB (8 kv heads x 65536 slots x 64, fp32).\n")
    print("| operation | ms per call | peak memory increase MiB |")
    print("|---|---|---|")
    for label, fn in (
        ("set_kv 1 token + eval (K and V)", write),
        ("whole-buffer copy of K and V", copy),
        ("set_kv while a lazy read of the buffer is pending", write_with_pending_reader),
    ):
        fn()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        reps = 20
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        ms = (time.perf_counter() - start) / reps * 1e3
        print(f"| {label} | {ms:.3f} | {(mx.get_peak_memory() - base) / 2**20:.1f} |")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.bench_pool``, each checked while parsing."""
    parser = ArgumentParser(prog="python -m tools.bench_pool", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests",
        type=positive_int(MAX_REQUESTS),
        default=32,
        help="concurrent requests of the KV-bytes tables (default: %(default)s)",
    )
    parser.add_argument(
        "--contexts",
        type=positive_int(MAX_TOKENS),
        nargs="+",
        default=[8192, 32768],
        metavar="TOKENS",
        help="context lengths of the KV-bytes tables (default: 8192 32768)",
    )
    parser.add_argument(
        "--chunk",
        type=positive_int(MAX_TOKENS),
        default=2048,
        help="prefill chunk in tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--page-size",
        type=positive_int(MAX_PAGE_SIZE),
        default=16,
        help="tokens per pool page (default: %(default)s)",
    )
    parser.add_argument(
        "--ops-requests",
        type=positive_int(1_000_000),
        default=10_000,
        help="requests of the page-operations benchmark (default: %(default)s)",
    )
    add_run_options(parser, quick=None)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Run the three sections and print markdown tables."""
    args = build_parser().parse_args(argv)
    results = Report("Pool: KV bytes against full KV and mlx-lm, page operations per second")
    with results.capturing():
        print(f"mlx {version('mlx')}, mlx-lm {version('mlx-lm')}, device {mx.default_device()}")
        kv_bytes_table(args.requests, args.contexts, args.chunk, args.page_size)
        ragged_table(args.requests, args.contexts, args.chunk, args.page_size)
        throughput(args.ops_requests)
        in_place()
    results.write(args.markdown, prog="tools.bench_pool", argv=argv)


if __name__ == "__main__":
    main()
