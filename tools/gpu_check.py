"""Run every native-kernel test and a micro-benchmark on a GPU machine, in under five minutes.

Usage on a machine whose MLX has a GPU back-end (CUDA: an environment with ``mlx[cuda12]``
or ``mlx[cuda13]`` instead of ``mlx[cpu]``, e.g. ``uv sync --no-group cpu --group cuda``;
Metal: plain ``mlx`` on macOS arm64)::

    python -m tools.gpu_check            # tests, then the benchmark
    python -m tools.gpu_check --no-bench

Steps, each with its own time limit so the whole run stays under five minutes:

1. report the MLX version and which native back-end (``metal`` / ``cuda``) is available;
   without one, say so and exit with status 2 (nothing to check);
2. a smoke test that compiles both JIT kernels once and compares them with the reference on
   one small input (a failure here prints the compiler output, then the run stops); then the
   decode engine end to end on the native kernels (fused RoPE + paged attention; plain,
   8-bit and 4-bit pages) against mlx-lm's greedy tokens on the same K/V;
3. pytest on the kv-metal-kernels tests whose names contain ``native`` (on a CUDA machine
   the Metal ones skip, and the other way round);
4. ``tools.bench_kernels`` in bfloat16 with larger batches and contexts 1k-16k.

Exit status 0 only if every step passed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kv_metal_kernels import (
    NativePagedAttention,
    NativeRopeScatter,
    ReferencePagedAttention,
    ReferenceRopeScatter,
    native_backend,
)
from kv_protocol import RopeConfig

ROOT = Path(__file__).resolve().parent.parent
TEST_DIR = ROOT / "packages" / "kv-metal-kernels" / "tests"


def smoke(backend: str) -> None:
    """Compile and run both kernels once; raise AssertionError on a mismatch."""
    rng = np.random.default_rng(0)
    t, hq, hkv, d = 4, 8, 2, 64
    q = mx.array(rng.standard_normal((t, hq, d)).astype(np.float32))
    k = mx.array(rng.standard_normal((t, hkv, d)).astype(np.float32))
    pool = mx.zeros((hkv, 64, d))
    positions = mx.array([0, 5, 17, 1000], dtype=mx.int32)
    slots = mx.array([16, -1, 40, 63], dtype=mx.int32)
    rope = RopeConfig(dims=d, base=10000.0)
    want = ReferenceRopeScatter()(q, k, k, positions, slots, pool, pool, rope=rope)
    got = NativeRopeScatter(backend)(q, k, k, positions, slots, pool, pool, rope=rope)
    for g, w in zip(got, want, strict=True):
        err = float(mx.abs(g - w).max())
        assert err < 1e-3, f"rope kernel differs from reference by {err}"
    print(f"  rope + scatter kernel ok (max err {float(mx.abs(got[0] - want[0]).max()):.2e})")

    b, page_size = 3, 16
    pools = mx.array(rng.standard_normal((hkv, 8 * page_size, d)).astype(np.float32))
    table = mx.array([[1, 2, 0], [3, 0, 0], [4, 5, 6]], dtype=mx.int32)
    lens = mx.array([20, 1, 40], dtype=mx.int32)
    qd = mx.array(rng.standard_normal((b, hq, 1, d)).astype(np.float32))
    sinks = mx.array(rng.standard_normal(hq).astype(np.float32))
    for window in (None, 8):
        args = (qd, pools, pools, table, lens)
        kwargs = {"page_size": page_size, "scale": d**-0.5, "window": window, "sinks": sinks}
        want_o = ReferencePagedAttention()(*args, **kwargs)  # type: ignore[arg-type]
        got_o = NativePagedAttention(backend)(*args, **kwargs)  # type: ignore[arg-type]
        err = float(mx.abs(got_o - want_o).max())
        assert err < 1e-4, f"paged attention kernel (window={window}) differs by {err}"
    print("  paged decode attention kernel ok")


def engine_check(backend: str) -> bool:
    """The decode engine on ``backend``'s kernels against mlx-lm on the same K/V, greedy, fp32.

    Tiny gpt-oss- and Gemma-3-like models (windows crossed, sinks), plain and 8/4-bit pages;
    the oracle is mlx-lm's own caches storing what the pages give back
    (``dequantize(quantize(kv))`` for quantized ones). On a GPU, float32 products may round
    through TF32 and greedy near-ties then go either way (measured on an H200: the pure-MLX
    reference kernels on the GPU matched 3 of 4 requests on tiny Gemma 3 where the same
    machine's CPU matched 4 of 4, and the native kernels matched 3 and the reference 4 with
    8-bit pages), so each case also runs the engine on the reference kernels on the same
    device, and passes when the native kernels match mlx-lm in at most one request fewer (one
    near-tie may flip either way; a broken kernel misses them all). Prints one line per case.
    """
    import random

    from kv_batching import DecodeEngine
    from kv_caches import PoolBackedKVCache
    from kv_metal_kernels import select_kernels
    from kv_pool import HybridKVPool
    from kv_protocol import (
        KVQuantization,
        attention_module,
        find_layers,
        layout_from_model,
        rope_config_from_module,
    )
    from kv_testing import build_tiny_model, mlx_lm_greedy, stored_kv_caches

    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 9, 40, 90)]
    ok = True
    for arch in ("gpt_oss", "gemma3_text"):
        model = build_tiny_model(arch, window=8, num_layers=4, vocab_size=256, head_dim=64)
        layout = layout_from_model(model)
        module = attention_module(find_layers(model)[layout.full_layer_ids[0]])
        rope_module = getattr(module, "rope", None)
        rope, why = (
            rope_config_from_module(rope_module) if rope_module is not None else (None, "none")
        )
        for bits in (None, 8, 4):
            quant = None if bits is None else KVQuantization(bits=bits, group_size=64)
            # The oracle: mlx-lm's own caches, each storing what a page gives back.
            want = [
                mlx_lm_greedy(model, p, 16, caches=stored_kv_caches(model, quant)) for p in prompts
            ]
            matches = {}
            for kernel in dict.fromkeys((backend, "reference")):
                pool = HybridKVPool(layout, num_pages=96, page_size=16, kv_quantization=quant)
                kernels = select_kernels(
                    rope, fused_rope=kernel, attention=kernel, rope_unsupported_reason=why
                )
                engine = DecodeEngine(
                    model,
                    pool,
                    kernels,
                    lambda p, reservation, layer: PoolBackedKVCache(
                        p, reservation.request_ids[0], layer, reservation=reservation
                    ),
                    max_running=8,
                    prefill_chunk=32,
                )
                ids = [engine.submit(p, 16) for p in prompts]
                got = engine.run()
                engine.close()
                matches[kernel] = sum(got[i] == w for i, w in zip(ids, want, strict=True))
            label = "plain" if bits is None else f"{bits}-bit"
            print(
                f"  {arch}, {label} pages: requests equal to mlx-lm "
                + ", ".join(f"{k} kernels {n}/{len(prompts)}" for k, n in matches.items())
            )
            ok = ok and matches[backend] >= matches["reference"] - 1
    return ok


def run_step(name: str, cmd: list[str], timeout: float) -> bool:
    """Run one subprocess step with a time limit; True if it passed."""
    print(f"\n== {name}: {' '.join(cmd)} (limit {timeout:.0f} s)", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"== {name}: TIMED OUT after {timeout:.0f} s")
        return False
    print(f"== {name}: exit {proc.returncode} in {time.perf_counter() - start:.1f} s")
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    """Run the checks; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-bench", action="store_true", help="skip the micro-benchmark")
    parser.add_argument("--test-timeout", type=float, default=150.0)
    parser.add_argument("--bench-timeout", type=float, default=100.0)
    args = parser.parse_args(argv)

    version = importlib.metadata.version("mlx")
    backend = native_backend()
    print(f"mlx {version}; default device {mx.default_device()}; native backend: {backend}")
    if backend is None:
        print("no Metal or CUDA back-end in this MLX build: nothing to check here")
        return 2

    print("\n== smoke test (JIT compile + one comparison per kernel)")
    start = time.perf_counter()
    try:
        smoke(backend)
    except Exception as err:  # a compile error must be shown, whatever its type
        print(f"== smoke test FAILED: {type(err).__name__}: {err}")
        return 1
    print(f"== smoke test passed in {time.perf_counter() - start:.1f} s")

    print("\n== the engine end to end on the native kernels")
    start = time.perf_counter()
    engine_ok = engine_check(backend)
    verdict = "passed" if engine_ok else "FAILED"
    print(f"== engine check {verdict} in {time.perf_counter() - start:.1f} s")

    ok = run_step(
        "native tests",
        [
            sys.executable,
            "-m",
            "pytest",
            str(TEST_DIR),
            "-q",
            "-k",
            "native and not unavailable",
            "-p",
            "no:cacheprovider",
            "-rs",
        ],
        args.test_timeout,
    )
    if not args.no_bench:
        ok = (
            run_step(
                "benchmark",
                [
                    sys.executable,
                    "-m",
                    "tools.bench_kernels",
                    "--dtype",
                    "bfloat16",
                    "--attn-batch",
                    "32",
                    "--attn-heads",
                    "64,8,64",
                    "--contexts",
                    "1024,4096,16384",
                    "--min-time",
                    "0.2",
                ],
                args.bench_timeout,
            )
            and ok
        )
    ok = ok and engine_ok
    print("\nGPU CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
