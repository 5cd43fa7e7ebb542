"""The structured-output benchmark end to end on a tiny workload.

Both runs decode every request to ``max_tokens`` (the benchmark refuses a run where one
ended early), the constrained run fills masks and the free one none, and the summary lines
are printed.
"""

from __future__ import annotations

import re

import pytest

from tools import bench_structured


def test_the_structured_benchmark_runs_both_workloads(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_structured.main(["--quick", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"free (greedy)", "JSON schema (greedy)"} <= set(rows)
    # Mask work only where rows are constrained.
    assert rows["free (greedy)"].split("|")[6].strip() == "0"
    assert float(rows["JSON schema (greedy)"].split("|")[6]) > 0
    assert re.search(r"JSON schema / free: [0-9.]+x decode throughput", out)
    assert "host mask time per step of 8 rows" in out
