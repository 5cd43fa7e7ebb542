"""The command line: the default demo as a user runs it (a process), and the other commands
and bad model inputs through ``tools.kv.main(argv)`` in this process, output captured.

Every bad option value is covered by test_cli_bad_input.py (which also checks that
``main``'s status is the process's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from kv_testing import build_tiny_model, tiny_model_config
from tools import kv

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--requests", "4", "--max-prompt", "60", "--max-tokens", "10", "--min-tokens", "4"]
Run = Callable[..., subprocess.CompletedProcess[str]]


def run_process(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.kv", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Run:
    """``run_cli(*args)``: ``python -m tools.kv args`` in this process."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        try:
            status = kv.main(list(args))
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["tools.kv", *args], status, out, err)

    return run


def assert_one_line_error(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]


def test_default_demo_runs_verifies_and_reports() -> None:
    result = run_process(*SMALL, "--quiet")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "verification: PASSED (4 requests token-identical to mlx-lm)" in out
    assert "KV at peak:" in out and "with every layer full" in out and "mlx-lm's caches" in out
    assert "decode:" in out and "tok/s" in out
    assert "pages per sub-pool" in out and "sliding-w32" in out


def test_json_output_and_fused_rope(run_cli: Run, tmp_path: Path) -> None:
    plot = tmp_path / "pages.png"
    result = run_cli(*SMALL, "--json", "--fused-rope", "reference", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["verified"] is True
    assert data["requests"] == 4
    assert data["mismatches"] == []
    assert 0 < data["peak_kv_bytes"] < data["peak_full_kv_bytes"]
    assert data["mlx_lm_measured_bytes_check"] is True
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_other_architecture_and_page_size(run_cli: Run) -> None:
    result = run_cli(*SMALL, "--arch", "gemma3_text", "--page-size", "1", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verified"] is True


def test_local_model_directory(run_cli: Run, tmp_path: Path) -> None:
    config = tiny_model_config("olmo3", window=16)
    model = build_tiny_model("olmo3", window=16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    result = run_cli(*SMALL, "--model", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["verified"] is True
    assert data["model"] == str(tmp_path)


def test_missing_model_path(run_cli: Run) -> None:
    assert_one_line_error(run_cli("--model", "/definitely/not/here"), "no such directory")


def test_directory_that_is_not_a_model(run_cli: Run, tmp_path: Path) -> None:
    assert_one_line_error(run_cli("--model", str(tmp_path)), "not an mlx-lm model directory")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert_one_line_error(run_cli("--model", str(tmp_path)), "no *.safetensors")
    (tmp_path / "model.safetensors").write_bytes(b"junk")
    assert_one_line_error(run_cli("--model", str(tmp_path)), "mlx-lm could not load it")


def test_budget_too_small_for_one_request(run_cli: Run) -> None:
    assert_one_line_error(run_cli("--budget-mib", "0.001"), "too small for one request")


def test_help_explains_every_option(run_cli: Run) -> None:
    result = run_cli("demo", "--help")
    assert result.returncode == 0
    for option in (
        "--model",
        "--arch",
        "--page-size",
        "--budget-mib",
        "--fused-rope",
        "--seed",
        "--json",
        "--plot",
    ):
        assert option in result.stdout
    top = run_cli("--help")
    assert "demo" in top.stdout and "bench" in top.stdout and "layout" in top.stdout


def test_layout_command(run_cli: Run) -> None:
    result = run_cli("layout", "--config", "gemma-3-27b", "--context", "8192")
    assert result.returncode == 0, result.stderr
    assert "62 layers: 10 full, 52 sliding, 0 state" in result.stdout
