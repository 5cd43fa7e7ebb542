"""The workspace's command-line tools: the demo, the benchmarks and the checks.

Importing this package imports :mod:`kv_serve` first, which on Linux loads a fast BLAS for
MLX's CPU backend before anything imports ``mlx`` (``KV_SERVE_BLAS=off`` keeps MLX's own).
"""

import kv_serve  # noqa: F401  (for its BLAS side effect, before any tool imports mlx)
