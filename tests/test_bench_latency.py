"""The latency benchmark end to end on a tiny workload: three systems, the same tokens.

Streams decode while long prompts arrive mid-run; the engine with and without a prefill stall
bound must produce mlx-lm's greedy tokens for every request, and the table must report
every system.
"""

from __future__ import annotations

import re

import pytest

from tools import bench_latency


def test_the_latency_benchmark_runs_and_every_system_matches_mlx_lm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--streams", "3", "--stream-tokens", "20", "--arrivals", "2", "--every", "5"]
    argv += ["--long-min", "150", "--long-max", "300", "--long-tokens", "3", "--chunk", "64"]
    argv += ["--layers", "2", "--stall", "1.5"]
    assert bench_latency.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
    names = [row.split("|")[1].strip() for row in rows]
    assert names == [
        "mlx-lm BatchGenerator",
        "kv-batching DecodeEngine, 64-token chunks",
        "kv-batching DecodeEngine, prefill_stall=1.5",
    ]
    for row in rows:
        assert row.rstrip(" |").endswith("5/5"), row  # 3 streams + 2 arrivals, all equal
        p50, p99 = (float(v) for v in re.findall(r"\| ([0-9.]+) ", row)[:3:2])
        assert 0 < p50 <= p99


def test_streams_that_end_before_the_arrivals_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--streams", "1", "--stream-tokens", "4", "--arrivals", "1", "--every", "50"]
    argv += ["--long-min", "20", "--long-max", "30", "--layers", "2"]
    assert bench_latency.main(argv) == 2
    assert "lower --every" in capsys.readouterr().err
