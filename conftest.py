"""Root pytest configuration shared by every package's tests and the cross-package tests.

It only sets the Hypothesis profiles: a member's tests import nothing from the repository root
(their test support is the ``kv-testing`` member), so ``uv run --package X pytest packages/X``
needs nothing outside that member's own dependencies.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
