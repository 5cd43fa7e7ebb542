"""The benchmarks' shared pieces: the quantile rule and the Markdown results files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tools import harness
from tools.harness import Report, quantile


def test_quantile_is_the_nearest_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [quantile(values, q) for q in (0.0, 0.2, 0.21, 0.5, 0.99, 1.0)] == [1, 1, 2, 3, 5, 5]
    # An even count: p50 is the lower middle value, never a mean of two.
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    # Fewer than 100 samples: p99 is the largest.
    assert quantile([float(i) for i in range(50)], 0.99) == 49.0
    assert quantile([float(i) for i in range(1, 201)], 0.99) == 198.0
    assert math.isnan(quantile([], 0.5))
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        quantile([1.0], 1.5)


def test_a_results_file_keeps_one_section_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(harness, "machine_description", lambda: "a machine")
    monkeypatch.delenv("KV_SERVE_BLAS", raising=False)
    path = tmp_path / "bench.md"
    first = Report("A benchmark")
    with first.capturing():
        print("workload: 3 requests")
        print("| system | tok/s |\n|---|---|\n| engine | 1.0 |")
    first.write(str(path), prog="tools.bench_x", argv=["--rounds", "2", "--markdown", str(path)])
    assert "workload: 3 requests" in capsys.readouterr().out
    text = path.read_text()
    assert text.startswith("# A benchmark\n\n## `uv run python -m tools.bench_x --rounds 2`\n")
    assert f"Command: `uv run python -m tools.bench_x --rounds 2 --markdown {path}`" in text
    assert "Machine: a machine" in text and "Date: " in text
    assert "```text\nworkload: 3 requests\n```" in text
    assert "| engine | 1.0 |" in text
    # The same run again replaces its section; another run adds one; the rest is kept.
    path.write_text(text.replace("# A benchmark\n", "# A benchmark\n\nWhat it measures.\n"))
    again = Report("A benchmark")
    again.keep("| system | tok/s |\n|---|---|\n| engine | 2.0 |")
    again.write(str(path), prog="tools.bench_x", argv=["--rounds", "2", f"--markdown={path}"])
    other = Report("A benchmark")
    other.keep("### one workload\n\nnumbers")
    other.write(str(path), prog="tools.bench_x", argv=["--markdown", str(path), "--quick"])
    text = path.read_text()
    assert text.count("## `uv run python -m tools.bench_x --rounds 2`") == 1
    assert "| engine | 2.0 |" in text and "| engine | 1.0 |" not in text
    assert "What it measures." in text
    assert text.index("--rounds 2`") < text.index("## `uv run python -m tools.bench_x --quick`")
    assert "### one workload" in text


def test_paths_of_this_checkout_are_written_relative(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(harness, "machine_description", lambda: "a machine")
    monkeypatch.setenv("KV_SERVE_BLAS", "off")
    report = Report("A benchmark")
    report.keep(f"BLAS: mkl ({Path(harness.__file__).resolve().parent.parent}/.venv/lib/x.so)")
    report.write("-", prog="tools.bench_x", argv=[])
    out = capsys.readouterr().out
    assert "BLAS: mkl (./.venv/lib/x.so)" in out
    # The BLAS choice is part of the command.
    assert out.startswith(
        "\n# A benchmark\n\n## `KV_SERVE_BLAS=off uv run python -m tools.bench_x`"
    )
