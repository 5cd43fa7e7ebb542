"""The workspace's command-line tools: the demo, the benchmarks and the checks.

Importing this package first calls :func:`kv_serve.load_fast_blas`, which on Linux loads a
fast BLAS for MLX's CPU backend before any tool imports ``mlx`` (``KV_SERVE_BLAS=off`` keeps
MLX's own).
"""

import kv_serve

kv_serve.load_fast_blas()
