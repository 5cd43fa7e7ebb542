"""Micro-benchmarks of kv-metal-kernels: fused RoPE + pool scatter and paged decode attention.

Run: ``uv run --no-sync python -m tools.bench_kernels`` (about 2 minutes on a 2-core CPU).

1. A memory-copy bandwidth measured in the same run (``x + 0`` over 256 MiB: read + write).
2. RoPE + pool scatter per decode step (one layer), fused kernel vs unfused
   (``mx.fast.rope`` on q and k with per-row offsets, then slice assignment into the pools),
   for B in {1, 8, 32} and the gpt-oss (64 q / 8 kv heads, d 64) and Llama-like
   (32 q / 8 kv, d 128) geometries.
3. Decode attention of one layer at contexts 1k-16k (ragged lengths, each request between
   a sixteenth of the context and the context): paged reference (bucketed, and one call), a native
   paged kernel where one exists, and a dense contiguous batch ``(B, Hkv, max_len, D)`` with
   one SDPA, reporting the KV bytes actually needed per second and their share of the copy
   bandwidth; plus a sliding layer (window 128) at each context.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from kv_metal_kernels import (
    NativePagedAttention,
    NativeRopeScatter,
    ReferencePagedAttention,
    ReferenceRopeScatter,
    native_backend,
)
from kv_protocol import PagedDecodeAttention, RopeConfig, RopeScatterKernel
from tools.cli_args import (
    MAX_REQUESTS,
    MAX_TOKENS,
    ArgumentParser,
    add_run_options,
    finite_float,
    int_list,
    positive_int,
)
from tools.harness import BANDWIDTH_UNIT, Report, copy_bandwidth, gb_per_s, timed

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
GEOMETRIES = {"gpt-oss": (64, 8, 64), "llama": (32, 8, 128)}


def _rope_case(
    dtype: mx.Dtype,
    b: int,
    heads: tuple[int, int, int],
    fused: RopeScatterKernel,
    min_time: float,
) -> tuple[float, float]:
    """Seconds per decode step (one layer): (unfused, fused)."""
    hq, hkv, d = heads
    rng = np.random.default_rng(0)
    rope = RopeConfig(dims=d, base=150000.0)
    num_slots = 16384
    q = mx.array(rng.standard_normal((b, hq, d)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((b, hkv, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((b, hkv, d)).astype(np.float32)).astype(dtype)
    positions = mx.array(rng.integers(100, 4000, b).astype(np.int32))
    slots = mx.array(rng.permutation(num_slots)[:b].astype(np.int32))
    pools = {
        "k": mx.zeros((hkv, num_slots, d), dtype=dtype),
        "v": mx.zeros((hkv, num_slots, d), dtype=dtype),
    }
    mx.eval(q, k, v, positions, slots, pools["k"], pools["v"])

    def fused_step() -> list[mx.array]:
        # Rebinding the pools before evaluation lets MLX scatter in place.
        q_rot, k_rot, pools["k"], pools["v"] = fused(
            q, k, v, positions, slots, pools["k"], pools["v"], rope=rope
        )
        return [q_rot, k_rot, pools["k"], pools["v"]]

    def unfused_step() -> list[mx.array]:
        q_rot = mx.fast.rope(
            q[:, :, None, :], d, traditional=False, base=rope.base, scale=1.0, offset=positions
        )
        k_rot = mx.fast.rope(
            k[:, :, None, :], d, traditional=False, base=rope.base, scale=1.0, offset=positions
        )
        k_pool, v_pool = pools["k"], pools["v"]
        k_pool[:, slots] = k_rot[:, :, 0, :].swapaxes(0, 1)
        v_pool[:, slots] = v.swapaxes(0, 1)
        pools["k"], pools["v"] = k_pool, v_pool
        return [q_rot, k_rot, k_pool, v_pool]

    return timed(unfused_step, min_time=min_time), timed(fused_step, min_time=min_time)


def bench_rope(
    dtype: mx.Dtype, batches: list[int], fused: RopeScatterKernel, min_time: float
) -> list[str]:
    """Rows of the RoPE + scatter table (microseconds per decode step, one layer)."""
    rows = []
    for geometry, (hq, hkv, d) in GEOMETRIES.items():
        for b in batches:
            t_unfused, t_fused = _rope_case(dtype, b, (hq, hkv, d), fused, min_time)
            rows.append(
                f"| {geometry} ({hq}/{hkv}/d{d}) | {b} | {t_unfused * 1e6:.0f} | "
                f"{t_fused * 1e6:.0f} | {t_unfused / t_fused:.2f}x |"
            )
    return rows


def _paged_setup(
    rng: np.random.Generator,
    lens: list[int],
    hkv: int,
    d: int,
    page_size: int,
    dtype: mx.Dtype,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 1
    table = np.zeros((len(lens), max(need)), np.int32)
    perm = rng.permutation(np.arange(1, num_pages))
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used : used + n]
        used += n
    shape = (hkv, num_pages * page_size, d)
    k_pool = mx.random.normal(shape).astype(dtype)
    v_pool = mx.random.normal(shape).astype(dtype)
    seq_lens = mx.array(np.array(lens, np.int32))
    page_table = mx.array(table)
    mx.eval(k_pool, v_pool, seq_lens, page_table)
    return k_pool, v_pool, page_table, seq_lens


def _attention_case(
    dtype: mx.Dtype,
    ctx: int,
    b: int,
    heads: tuple[int, int, int],
    kernels: dict[str, PagedDecodeAttention],
    min_time: float,
) -> list[tuple[str, str, float, int]]:
    """(variant, window, seconds, KV bytes needed) for one context length."""
    hq, hkv, d = heads
    page_size = 16
    rng = np.random.default_rng(ctx)
    lens = [int(x) for x in rng.integers(ctx // 16, ctx + 1, b)]
    k_pool, v_pool, page_table, seq_lens = _paged_setup(rng, lens, hkv, d, page_size, dtype)
    q = mx.random.normal((b, hq, 1, d)).astype(dtype)
    scale = d**-0.5
    width = max(lens)
    kd = mx.random.normal((b, hkv, width, d)).astype(dtype)
    vd = mx.random.normal((b, hkv, width, d)).astype(dtype)
    mask = (mx.arange(width)[None, :] < seq_lens[:, None])[:, None, None, :]
    mx.eval(q, kd, vd, mask)
    full_bytes = 2 * sum(lens) * hkv * d * dtype.size
    window = 128
    win_bytes = 2 * sum(min(n, window) for n in lens) * hkv * d * dtype.size

    def dense() -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, kd, vd, scale=scale, mask=mask)

    results = [("dense contiguous batch + SDPA", "-", timed(dense, min_time=min_time), full_bytes)]
    for name, kernel in kernels.items():
        for win in (None, window):

            def call(kernel: PagedDecodeAttention = kernel, win: int | None = win) -> mx.array:
                return kernel(
                    q,
                    k_pool,
                    v_pool,
                    page_table,
                    seq_lens,
                    page_size=page_size,
                    scale=scale,
                    window=win,
                )

            seconds = timed(call, min_time=min_time)
            label = "-" if win is None else str(win)
            results.append((name, label, seconds, full_bytes if win is None else win_bytes))
    return results


def bench_attention(
    dtype: mx.Dtype,
    contexts: list[int],
    b: int,
    heads: tuple[int, int, int],
    copy_bw: float,
    min_time: float,
) -> list[str]:
    """Rows of the decode attention table."""
    kernels: dict[str, PagedDecodeAttention] = {
        "paged reference (bucketed)": ReferencePagedAttention(buckets=4),
        "paged reference (one call)": ReferencePagedAttention(buckets=1),
    }
    native = native_backend()
    if native is not None:
        kernels[f"paged {native} kernel"] = NativePagedAttention(native)
    rows = []
    for ctx in contexts:
        results = _attention_case(dtype, ctx, b, heads, kernels, min_time)
        dense_t = results[0][2]
        for name, window, seconds, kv_bytes in results:
            rate = kv_bytes / seconds
            rows.append(
                f"| {ctx} | {window} | {name} | {seconds * 1e3:.2f} | {seconds / dense_t:.2f} | "
                f"{gb_per_s(rate):.2f} | {100 * rate / copy_bw:.1f}% |"
            )
    return rows


def build_parser() -> ArgumentParser:
    """The options of ``python -m tools.bench_kernels``, each checked while parsing."""
    parser = ArgumentParser(
        prog="python -m tools.bench_kernels", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument(
        "--batches",
        type=int_list(1, MAX_REQUESTS),
        default=[1, 8, 32],
        metavar="B,B,...",
        help="RoPE batch sizes (default: 1,8,32)",
    )
    parser.add_argument(
        "--contexts",
        type=int_list(16, MAX_TOKENS),
        default=[1024, 2048, 4096, 8192, 16384],
        metavar="N,N,...",
        help="attention contexts, each >= 16 (default: 1024,2048,4096,8192,16384)",
    )
    parser.add_argument(
        "--attn-batch",
        type=positive_int(MAX_REQUESTS),
        default=8,
        help="requests per attention call (default: %(default)s)",
    )
    parser.add_argument(
        "--attn-heads",
        type=int_list(1, 1024, length=3),
        default=[8, 2, 64],
        metavar="Q,KV,D",
        help="attention q_heads,kv_heads,head_dim; q_heads a multiple of kv_heads "
        "(default: 8,2,64)",
    )
    parser.add_argument(
        "--min-time",
        type=finite_float(0.0, 600.0, min_inclusive=False),
        default=0.5,
        help="seconds per measurement, in (0, 600] (default: %(default)s)",
    )
    parser.add_argument("--skip-rope", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    add_run_options(parser, quick=None)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmarks and print markdown tables."""
    parser = build_parser()
    args = parser.parse_args(argv)
    hq, hkv, _ = args.attn_heads
    if hq % hkv:
        parser.error(f"argument --attn-heads: q_heads {hq} is not a multiple of kv_heads {hkv}")
    results = Report("Kernels: fused RoPE + pool scatter and paged decode attention")
    with results.capturing():
        _run(args)
    results.write(args.markdown, prog="tools.bench_kernels", argv=argv)


def _run(args: argparse.Namespace) -> None:
    hq, hkv, d = args.attn_heads
    dtype = DTYPES[args.dtype]
    native = native_backend()
    print(f"device: {mx.default_device()}, native backend: {native}, dtype: {args.dtype}")
    copy_bw = copy_bandwidth()
    print(f"memory copy bandwidth (read + write): {gb_per_s(copy_bw):.2f} {BANDWIDTH_UNIT}\n")
    if not args.skip_rope:
        fused: RopeScatterKernel = (
            NativeRopeScatter(native) if native is not None else ReferenceRopeScatter()
        )
        print(f"RoPE + pool scatter per decode step, one layer (fused = {fused.name})\n")
        print("| geometry (q/kv/d) | B | unfused us | fused us | speed-up |")
        print("|---|---|---|---|---|")
        for row in bench_rope(dtype, args.batches, fused, args.min_time):
            print(row)
        print()
    if not args.skip_attention:
        print(
            f"Decode attention, one layer, B={args.attn_batch}, {hq} q / {hkv} kv heads, "
            f"d {d}, page 16, ragged lengths uniform in [ctx/16, ctx]\n"
        )
        print(f"| context | window | variant | ms | vs dense | KV {BANDWIDTH_UNIT} | of copy bw |")
        print("|---|---|---|---|---|---|---|")
        for row in bench_attention(
            dtype, args.contexts, args.attn_batch, (hq, hkv, d), copy_bw, args.min_time
        ):
            print(row)


if __name__ == "__main__":
    main()
