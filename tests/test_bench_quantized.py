"""The quantized-pages benchmarks end to end on tiny models.

``capacity``: more requests fit the same budget as the pages shrink, and the unquantized
engine serves the workload. ``accuracy``: the unquantized pool's loss is mlx-lm's own (the
same model over its own caches), and the quantized rows report their change and agreement.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kv_testing import save_tiny_model_dir
from tools import bench_quantized


def table_rows(out: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("| ") and not line.startswith("| system") and "KV pages" not in line
    ]


def test_capacity_grows_as_pages_shrink(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_quantized.main(["capacity", "--quick", "--layers", "2"]) == 0
    rows = table_rows(capsys.readouterr().out)
    names = [r[0] for r in rows]
    assert names[:3] == ["engine, fp32 pages", "engine, 8-bit pages", "engine, 4-bit pages"]
    fits = [int(r[1]) for r in rows[:3]]
    assert 1 <= fits[0] < fits[1] < fits[2]
    done, total = rows[0][4].split("/")
    assert done == total  # the reference itself


def test_accuracy_of_the_unquantized_pool_is_mlx_lm_s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = save_tiny_model_dir(tmp_path / "tiny", "gemma3_text", head_dim=64)
    argv = ["accuracy", "--model", str(model_dir), "--tokens", "6", "--prompts", "3"]
    assert bench_quantized.main([*argv, "--chunk", "64", "--group-size", "32"]) == 0
    out = capsys.readouterr().out
    reference = float(re.findall(r"own caches: loss ([0-9.]+)", out)[0])
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["fp32", "8-bit", "4-bit"]
    assert float(rows[0][1]) == pytest.approx(reference, abs=2e-4)
    for row in rows[1:]:
        assert row[3].endswith("%") and 0 <= float(row[3][:-1]) <= 100
        assert row[4].endswith("%") and 0 <= float(row[4][:-1]) <= 100
