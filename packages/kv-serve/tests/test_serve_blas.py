"""The fast-BLAS loader: what ``KV_SERVE_BLAS`` picks, and that tokens do not depend on it.

Each case runs in a fresh interpreter: the BLAS is decided once per process, by
``kv_serve.load_fast_blas()`` before ``mlx`` is imported.
"""

from __future__ import annotations

import ctypes.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import kv_serve

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the BLAS loader acts on Linux only"
)


def _mkl_installed() -> bool:
    try:
        metadata.version("mkl")
    except metadata.PackageNotFoundError:
        return False
    return True


def _run(code: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "KV_SERVE_BLAS"} | env
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


_REPORT = """
    import json, kv_serve
    kv_serve.load_fast_blas()
    info = kv_serve.active_blas()
    print(json.dumps({"name": info.name, "path": info.path, "reason": info.reason}))
"""


def _report(**env: str) -> dict[str, str | None]:
    report: dict[str, str | None] = json.loads(_run(_REPORT, **env))
    return report


def test_off_keeps_mlx_reference_blas() -> None:
    report = _report(KV_SERVE_BLAS="off")
    assert report == {"name": "reference", "path": None, "reason": "KV_SERVE_BLAS=off"}


@pytest.mark.skipif(not _mkl_installed(), reason="the mkl package (fast-cpu extra) is absent")
@pytest.mark.parametrize("choice", ["auto", "mkl", "MKL"])
def test_mkl_of_the_environment_is_loaded(choice: str) -> None:
    if choice == "auto" and ctypes.util.find_library("openblas"):
        pytest.skip("a system OpenBLAS comes first under auto")
    report = _report(KV_SERVE_BLAS=choice)
    assert report["name"] == "mkl"
    assert report["path"] is not None and "libmkl_rt.so" in report["path"]


def test_unknown_choice_is_reported_and_mlx_keeps_its_blas() -> None:
    report = _report(KV_SERVE_BLAS="fastest")
    assert report["name"] == "reference" and report["path"] is None
    assert report["reason"] is not None
    assert "KV_SERVE_BLAS='fastest': expected one of auto, off, openblas, mkl" in report["reason"]


def test_a_library_without_cblas_is_refused() -> None:
    libc = ctypes.util.find_library("c")
    assert libc is not None
    report = _report(KV_SERVE_BLAS=libc)
    assert report["name"] == "reference"
    assert report["reason"] is not None
    assert f"{libc} does not export cblas_sgemm" in report["reason"]


def test_a_missing_library_path_is_refused() -> None:
    report = _report(KV_SERVE_BLAS="/nonexistent/libblas.so")
    assert report["name"] == "reference"
    assert (
        report["reason"] is not None and "cannot load /nonexistent/libblas.so" in report["reason"]
    )


def test_openblas_by_name_says_how_to_install_it_when_absent() -> None:
    if ctypes.util.find_library("openblas"):
        pytest.skip("this machine has a system OpenBLAS")
    report = _report(KV_SERVE_BLAS="openblas")
    assert report["name"] == "reference"
    assert (
        report["reason"] is not None and "apt-get install libopenblas0-pthread" in report["reason"]
    )


def test_mlx_imported_first_is_reported_not_patched() -> None:
    code = """
        import json
        import mlx.core
        import kv_serve
        info = kv_serve.load_fast_blas()
        print(json.dumps({"name": info.name, "path": info.path, "reason": info.reason}))
    """
    report = json.loads(_run(code, KV_SERVE_BLAS="auto"))
    assert report["name"] == "reference" and report["path"] is None
    assert "mlx was imported before kv_serve.load_fast_blas() ran" in report["reason"]


def _tiny_tokens() -> dict[str, list[list[int]]]:
    from kv_serve import build_engine
    from kv_testing import build_tiny_model

    out = {}
    for arch in ("gemma3_text", "gpt_oss"):
        model = build_tiny_model(arch, window=16, seed=3)
        engine = build_engine(model, num_pages=256, page_size=8, max_running=4)
        prompts = [[(7 * i + j) % 64 for i in range(n)] for j, n in enumerate((5, 23, 41))]
        ids = [engine.submit(p, 40) for p in prompts]
        while engine.has_work:
            engine.step()
        out[arch] = [list(engine.output(i).tokens) for i in ids]
    return out


def _gemma_tokens(model: Any, tokenizer: Any) -> list[list[int]]:
    from kv_serve import build_engine, encode_prompt

    engine = build_engine(model, num_pages=128, page_size=16, max_running=2)
    texts = [
        "The capital of France is",
        "To bake a simple loaf of bread you need flour, water, salt and yeast. Knead the dough "
        "for ten minutes, leave it to rise for an hour, shape it, and bake it in a hot oven. "
        "If the loaf comes out dense and heavy, the most likely reason is",
    ]
    ids = [engine.submit(encode_prompt(tokenizer, t), 6) for t in texts]
    while engine.has_work:
        engine.step()
    return [list(engine.output(i).tokens) for i in ids]


def _on_the_other_blas(function: Callable[..., Any], setup: str) -> tuple[str, str, Any]:
    """Run ``function`` in a fresh process on the BLAS this session does not use.

    Returns this session's BLAS name, the other process's, and what ``function`` returned
    there (``setup`` is the code that builds its arguments, ``args``).
    """
    here = kv_serve.active_blas().name
    other = "off" if here != "reference" else "mkl"
    code = "\n".join(
        [
            "import json, kv_serve",
            "kv_serve.load_fast_blas()",
            "from typing import Any",
            textwrap.dedent(inspect.getsource(function)),
            textwrap.dedent(setup),
            f"result = {function.__name__}(*args)",
            'print(json.dumps({"blas": kv_serve.active_blas().name, "result": result}))',
        ]
    )
    report = json.loads(_run(code, KV_SERVE_BLAS=other))
    return here, report["blas"], report["result"]


@pytest.mark.skipif(not _mkl_installed(), reason="the mkl package (fast-cpu extra) is absent")
def test_tiny_model_tokens_identical_on_either_blas() -> None:
    here, there, tokens = _on_the_other_blas(_tiny_tokens, "args = ()")
    assert here != there and "reference" in (here, there)
    assert tokens == _tiny_tokens()


@pytest.mark.skipif(not _mkl_installed(), reason="the mkl package (fast-cpu extra) is absent")
def test_gemma_tokens_identical_on_either_blas(
    gemma: tuple[Any, Any], gemma_files: tuple[Path, Path]
) -> None:
    # This session's tokens on its own BLAS, from its one Gemma instance; the other BLAS's
    # from a process that loads the same conversion.
    setup = f"""
        from kv_serve import load_model
        args = load_model({str(gemma_files[1])!r})
    """
    here, there, tokens = _on_the_other_blas(_gemma_tokens, setup)
    assert here != there and "reference" in (here, there)
    assert tokens == _gemma_tokens(*gemma)
    assert all(len(t) == 6 for t in tokens)
