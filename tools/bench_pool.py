"""Benchmark of kv-pool: KV bytes of hybrid pools vs full KV and mlx-lm, and page-op throughput.

Run: ``uv run --no-sync python -m tools.bench_pool`` (about a minute on a 2-core CPU).

1. **KV bytes**, 32 concurrent requests at 8k and 32k tokens, with the real layer layouts of
   gpt-oss-20b and Gemma-3-27B (read off mlx-lm's own model classes, built lazily; bf16 KV):
   - *pool*: a ``HybridKVPool`` sized by ``from_budget`` for exactly this workload. Each
     request is prefilled in chunks of ``--chunk`` tokens up to ``N - 1`` and then takes one
     decode step (``reserve(1)``), so the figure is the steady state between decode steps.
     Bytes = pages the allocators hold x bytes per page (``memory_report().bytes_used``). The
     pool's buffers are lazy ``mx.zeros`` and are never evaluated, so nothing is allocated.
     The peak while the last request's final prefill chunk is reserved is reported too.
   - *full*: every attention layer keeps all N tokens, ``32 * N * sum(bytes per token)``.
   - *mlx-lm*: mlx-lm's own per-request caches for the same schedule (``KVCache`` on full
     layers, ``RotatingKVCache(max_size=window)`` on sliding ones, as ``make_cache`` builds
     them), measured by building one request's caches with 1 kv head x 8 dims (bf16), feeding
     the same chunks and decode step through ``update_and_fetch``, reading ``nbytes``, and
     scaling by ``(n_kv_heads * head_dim) / 8`` and by 32 requests (the requests are
     identical and their caches independent).
   - *ideal*: ``(n_full * N + n_swa * min(N, window)) / (n_layers * N)``.
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
from importlib.metadata import version
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kv_pool import HybridKVPool, PageAllocator
from kv_protocol import CacheLayout, LayerKind, LayerSpec, layout_from_model
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


def pool_bytes(
    layout: CacheLayout, n_tokens: int, requests: int, chunk: int, page_size: int
) -> tuple[int, int]:
    """(steady bytes after the decode step, peak bytes during prefill) held by the pool."""
    kwargs: dict[str, Any] = {
        "max_context": n_tokens,
        "concurrency": requests,
        "page_size": page_size,
        "prefill_chunk": chunk,
    }
    budget = HybridKVPool.required_bytes(layout, **kwargs)
    pool = HybridKVPool.from_budget(layout, budget, **kwargs)
    steps = schedule(n_tokens, chunk)
    peak = 0
    for rid in range(requests):
        pool.add_request(rid)
        for n in steps[:-1]:
            pool.reserve(rid, n)
            peak = max(peak, pool.memory_report().bytes_used)
    for rid in range(requests):
        pool.reserve(rid, steps[-1])
    return pool.memory_report().bytes_used, peak


def mlx_lm_bytes(layout: CacheLayout, n_tokens: int, requests: int, chunk: int) -> int:
    """mlx-lm's per-request caches for the same schedule, measured small and scaled."""
    heads, dim = 1, 8
    total = 0
    per_kind: dict[int | None, int] = {}
    for layer_id in layout.attention_layer_ids:
        window = layout.window(layer_id)
        if window not in per_kind:
            cache: Any = KVCache() if window is None else RotatingKVCache(max_size=window)
            for n in schedule(n_tokens, chunk):
                kv = mx.zeros((1, heads, n, dim), dtype=mx.bfloat16)
                mx.eval(cache.update_and_fetch(kv, kv))
            per_kind[window] = cache.nbytes
        g = layout.geometry(layer_id)
        scale = (g.n_kv_heads * g.head_dim * g.dtype.size) / (heads * dim * mx.bfloat16.size)
        total += int(per_kind[window] * scale)
    return total * requests


def kv_bytes_table(requests: int, contexts: list[int], chunk: int, page_size: int) -> None:
    """Section 1."""
    print(f"\n## KV bytes: {requests} requests, prefill chunk {chunk}, page size {page_size}\n")
    print(
        "| model | N | full KV GiB | pool GiB (steady) | pool / full | ideal | pool peak GiB "
        "| mlx-lm GiB | mlx-lm / full |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, name in MODELS.items():
        layout = real_layout(name)
        n_full = len(layout.full_layer_ids)
        n_swa = len(layout.sliding_layer_ids)
        windows = {layout.window(i) for i in layout.sliding_layer_ids}
        (window,) = windows
        assert window is not None
        for n_tokens in contexts:
            full = requests * n_tokens * layout.full_kv_bytes_per_token()
            steady, peak = pool_bytes(layout, n_tokens, requests, chunk, page_size)
            ours = mlx_lm_bytes(layout, n_tokens, requests, chunk)
            ideal = (n_full * n_tokens + n_swa * min(n_tokens, window)) / (
                layout.num_layers * n_tokens
            )
            print(
                f"| {label} ({n_full} full + {n_swa} SWA, w {window}) | {n_tokens} "
                f"| {full / GIB:.2f} | {steady / GIB:.2f} | {steady / full:.2%} | {ideal:.2%} "
                f"| {peak / GIB:.2f} | {ours / GIB:.2f} | {ours / full:.2%} |"
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

    for label, fn in (("allocator alloc(1)", raw_alloc), ("allocator free([p])", raw_free)):
        seconds, ops, rate = per_second(fn)
        print(f"| {label} | {ops} | {seconds:.3f} | {rate:,.0f} | |")

    specs = [
        LayerSpec(layer_id=0, kind=LayerKind.SLIDING, window=128, n_kv_heads=1, head_dim=1),
        LayerSpec(layer_id=1, kind=LayerKind.FULL, n_kv_heads=1, head_dim=1),
    ]
    layout = CacheLayout(specs)
    pool = HybridKVPool(layout, num_pages=n_requests * 20 + 1, page_size=16)

    def used() -> int:
        return sum(r.pages_used for r in pool.memory_report().sub_pools)

    def prefill() -> int:
        for rid in range(n_requests):
            pool.add_request(rid)
            pool.reserve(rid, 256)
        return used()

    def decode(steps: int) -> Callable[[], int]:
        def run() -> int:
            ops = 0
            for _ in range(steps):
                before = [pool.num_free_pages(n) for n in pool.sub_pool_names]
                for rid in range(n_requests):
                    pool.reserve(rid, 1)
                after = [pool.num_free_pages(n) for n in pool.sub_pool_names]
                # pages allocated + pages released; releases show as frees, net = difference
                ops += sum(abs(b - a) for b, a in zip(before, after, strict=True))
            return ops

        return run

    def free_all() -> int:
        ops = used()
        for rid in range(n_requests):
            pool.free_request(rid)
        return ops

    rows: list[tuple[str, Callable[[], int], int]] = [
        ("pool add + reserve(256)", prefill, n_requests),
        ("pool reserve(1) x 16 decode steps", decode(16), 16 * n_requests),
        ("pool free_request", free_all, n_requests),
    ]
    for label, fn, calls in rows:
        seconds, ops, rate = per_second(fn)
        print(f"| {label} | {ops} | {seconds:.3f} | {rate:,.0f} | {calls / seconds:,.0f} |")

    print("\nHost cost of the per-step batch queries (B requests of 8192 tokens, page size 16):\n")
    print("| B | batch_page_table (full) us | batch_page_table (sliding) us | batch_slots us |")
    print("|---|---|---|---|")
    for batch in (1, 32, 256):
        pool = HybridKVPool(layout, num_pages=batch * 530 + 1, page_size=16)
        rids = list(range(batch))
        for rid in rids:
            pool.add_request(rid)
            pool.reserve(rid, 8191)
            pool.reserve(rid, 1)
        positions = [8191] * batch
        timings = []
        for fn in (
            lambda: pool.batch_page_table(rids, "full"),
            lambda: pool.batch_page_table(rids, "sliding-w128"),
            lambda: pool.batch_slots(rids, "full", positions),
        ):
            fn()
            reps = 200
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            timings.append((time.perf_counter() - start) / reps * 1e6)
        print(f"| {batch} | {timings[0]:.1f} | {timings[1]:.1f} | {timings[2]:.1f} |")


def in_place() -> None:
    """Section 3."""
    print("\n## set_kv: in place or a whole-buffer copy?\n")
    spec = LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=8, head_dim=64)
    pool = HybridKVPool(CacheLayout([spec]), num_pages=4096, page_size=16)
    pool.add_request(0)
    slots = pool.reserve(0, 1)["full"]
    kv = mx.ones((1, 8, 64))
    mx.eval(pool.get_key_buffer(0), pool.get_value_buffer(0), slots, kv)
    size = pool.get_key_buffer(0).nbytes

    def write() -> None:
        pool.set_kv(0, slots, kv, kv)
        mx.eval(pool.get_key_buffer(0), pool.get_value_buffer(0))

    def copy() -> None:
        mx.eval(pool.get_key_buffer(0) + 0, pool.get_value_buffer(0) + 0)

    def write_with_pending_reader() -> None:
        pending = pool.get_key_buffer(0)[:, :16] * 2
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


def main() -> None:
    """Run the three sections and print markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--ops-requests", type=int, default=10_000)
    args = parser.parse_args()
    print(f"mlx {version('mlx')}, mlx-lm {version('mlx-lm')}, device {mx.default_device()}")
    kv_bytes_table(args.requests, args.contexts, args.chunk, args.page_size)
    throughput(args.ops_requests)
    in_place()


if __name__ == "__main__":
    main()
