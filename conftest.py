"""Root pytest configuration shared by every package's tests and the cross-package tests.

It sets the Hypothesis profiles and, where ``kv_serve`` is installed, imports it before any
test module imports ``mlx``, so the whole session runs on the BLAS the entry points use
(``KV_SERVE_BLAS``, default ``auto``: MKL from this workspace's environment on Linux; tests
compare with oracles computed in the same process, on the same BLAS). A member's tests import
nothing from the repository root (their test support is the ``kv-testing`` member), so
``uv run --package X pytest packages/X`` needs nothing outside that member's own dependencies.
"""

from __future__ import annotations

import importlib.util
import os

from hypothesis import HealthCheck, settings

if importlib.util.find_spec("kv_serve") is not None:
    import kv_serve

    def pytest_report_header() -> str:
        """The BLAS of this test session, on pytest's header."""
        return f"BLAS: {kv_serve.active_blas().describe()}"


settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
