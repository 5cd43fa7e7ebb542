"""Every bad command-line value is one ``error:`` line and exit status 2, before any work.

Each case calls the entry point's ``main(argv)`` in this process, as ``python -m MODULE``
would, with the output captured; :func:`test_a_refusal_ends_the_process_with_status_2` runs
the same in real processes, so what ``main`` returns or raises is what the user's shell
sees. "Before any work" is checked twice: nothing reached stdout (the demo and the benchmark
print their report, the benchmark its workload line first) and the call returned within
seconds, far less than building a model and serving or benchmarking a workload takes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kv_serve import _cli as kv_serve_cli
from tools import (
    bench_engine,
    bench_gguf_weights,
    bench_kernels,
    bench_latency,
    bench_pool,
    bench_serve,
    cli_args,
    kv,
    profile_decode,
)

ROOT = Path(__file__).resolve().parent.parent
#: Seconds a refused command may take: at most an interpreter start and the imports (in a
#: process), never a model run.
FAST_S = 20.0
Run = Callable[..., subprocess.CompletedProcess[str]]
#: The entry point of each module that ``python -m`` runs.
MAINS: dict[str, Callable[[Sequence[str]], Any]] = {
    "tools.kv": kv.main,
    "tools.bench_pool": bench_pool.main,
    "tools.bench_kernels": lambda argv: bench_kernels.main(list(argv)),
    "tools.bench_latency": bench_latency.main,
    "tools.bench_gguf_weights": bench_gguf_weights.main,
    "tools.bench_serve": bench_serve.main,
    "tools.profile_decode": profile_decode.main,
    "kv_serve._cli": kv_serve_cli.main,
}


@pytest.fixture
def run_module(capsys: pytest.CaptureFixture[str]) -> Run:
    """``run_module(module, *args)``: ``python -m module args`` in this process."""

    def run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        start = time.perf_counter()
        try:
            status = MAINS[module](list(args))
        except SystemExit as exit_:
            status = exit_.code
        elapsed = time.perf_counter() - start
        assert elapsed < FAST_S, f"{module} {args}: took {elapsed:.1f} s, so it did work first"
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess([module, *args], status or 0, out, err)

    return run


def run_process(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    elapsed = time.perf_counter() - start
    assert elapsed < FAST_S, f"{module} {args}: took {elapsed:.1f} s, so it did work first"
    return result


def assert_refused(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    assert result.stdout == "", f"work started before the error: {result.stdout!r}"
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert fragment in lines[0], lines[0]


LIMIT = "this machine's memory"

DEMO_CASES = [
    (["--budget-mib", "nan"], "got nan"),
    (["--budget-mib", "inf"], "got inf"),
    (["--budget-mib=-inf"], "got -inf"),
    (["--budget-mib", "1e9"], LIMIT),
    (["--budget-mib", "0"], "--budget-mib"),
    (["--budget-mib", "-3"], "--budget-mib"),
    (["--budget-mib", "lots"], "must be a number, got 'lots'"),
    (["--seed", "-1"], "--seed: value must be an int in 0..4294967295, got -1"),
    (["--seed", str(2**32)], "--seed"),
    (["--seed", "1.5"], "--seed: value must be an int, got '1.5'"),
    (["--requests", "0"], "--requests: value must be an int in 1..10000, got 0"),
    (["--requests", "-1"], "--requests"),
    (["--requests", "100001"], "--requests"),
    (["--window", "0"], "--window"),
    (["--min-prompt", "0"], "--min-prompt"),
    (["--max-prompt", "-5"], "--max-prompt"),
    (["--min-tokens", "0"], "--min-tokens"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--max-tokens", str(2**21)], "--max-tokens"),
    (["--page-size", "0"], "--page-size"),
    (["--max-running", "0"], "--max-running"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
    (["--min-prompt", "9", "--max-prompt", "3"], "need --min-prompt <= --max-prompt"),
    (["--min-tokens", "9", "--max-tokens", "3"], "need --min-tokens <= --max-tokens"),
    (["--requests", "10000", "--max-prompt", "1048576"], "tokens in all"),
    (["--arch", "mamba"], "invalid choice: 'mamba'"),
    (["--fused-rope", "fast"], "invalid choice: 'fast'"),
    (["--model", "/definitely/not/here"], "no such directory"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--plot", "/definitely/not/here/pages.png"], "does not exist"),
    (["--plot", "pages.txt"], "name a .png file"),
]


@pytest.mark.parametrize(("args", "fragment"), DEMO_CASES, ids=[" ".join(a) for a, _ in DEMO_CASES])
def test_demo_refuses(run_module: Run, args: list[str], fragment: str) -> None:
    assert_refused(run_module("tools.kv", *args), fragment)


LAYOUT_CASES = [
    (["--context", "0"], "--context: value must be an int in 1..2147483647, got 0"),
    (["--context", "-5"], "--context"),
    (["--context", "8192", "0"], "--context"),
    (["--context"], "expected at least one argument"),
    (["--config", "gpt-5"], "invalid choice: 'gpt-5'"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
    (["--arch", "llama", "--config", "gemma-3-27b"], "not allowed with argument"),
    (["--model", "/definitely/not/here"], "no such directory"),
]


@pytest.mark.parametrize(
    ("args", "fragment"), LAYOUT_CASES, ids=[" ".join(a) for a, _ in LAYOUT_CASES]
)
def test_layout_refuses(run_module: Run, args: list[str], fragment: str) -> None:
    assert_refused(run_module("tools.kv", "layout", *args), fragment)


BENCH_CASES = [
    (["--requests", "-1"], "--requests"),
    (["--requests", "0"], "--requests"),
    (["--max-prompt", "0"], "--max-prompt"),
    (["--running", "0"], "--running: value must be an int in 1..10000, got 0"),
    (["--layers", "0"], "--layers"),
    (["--layers", "1"], "2 is the fewest with a full one"),
    (["--window", "0"], "--window"),
    (["--page-size", "0"], "--page-size"),
    (["--chunk", "0"], "--chunk"),
    (["--kv-fraction", "-1"], "--kv-fraction: value must be a finite number in (0.0, 1.0]"),
    (["--kv-fraction", "0"], "--kv-fraction"),
    (["--kv-fraction", "1.5"], "--kv-fraction"),
    (["--kv-fraction", "nan"], "got nan"),
    (["--fused-rope", "fast"], "invalid choice: 'fast'"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**32)], "--seed"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--requests", "10000", "--max-prompt", "1048576"], "tokens in all"),
]


@pytest.mark.parametrize(
    ("args", "fragment"), BENCH_CASES, ids=[" ".join(a) for a, _ in BENCH_CASES]
)
def test_bench_refuses(run_module: Run, args: list[str], fragment: str) -> None:
    assert_refused(run_module("tools.kv", "bench", *args), fragment)


OTHER_BENCH_CASES = [
    ("tools.bench_pool", ["--requests", "0"], "--requests"),
    ("tools.bench_pool", ["--contexts", "8192", "-1"], "--contexts"),
    ("tools.bench_pool", ["--page-size", "0"], "--page-size"),
    ("tools.bench_pool", ["--ops-requests", "0"], "--ops-requests"),
    ("tools.bench_kernels", ["--batches", "1,0"], "item 2 of '1,0'"),
    ("tools.bench_kernels", ["--contexts", "8"], "--contexts"),
    ("tools.bench_kernels", ["--attn-heads", "8,2"], "3 comma-separated ints"),
    ("tools.bench_kernels", ["--attn-heads", "8,3,64"], "not a multiple of kv_heads 3"),
    ("tools.bench_kernels", ["--attn-batch", "0"], "--attn-batch"),
    ("tools.bench_kernels", ["--min-time", "nan"], "--min-time"),
    ("tools.bench_latency", ["--streams", "0"], "--streams"),
    ("tools.bench_gguf_weights", ["--batch", "0"], "--batch"),
    ("tools.bench_gguf_weights", ["--choices", "keep"], "--choices"),
    ("tools.bench_serve", ["--kv-serve-weights", "gguf"], "--kv-serve-weights"),
    (
        "tools.bench_serve",
        ["--model", "some/mlx-lm/dir", "--kv-serve-weights", "packaged"],
        "serves the packaged gemma3-270m only",
    ),
    ("tools.profile_decode", ["--lengths", "0"], "--lengths"),
    ("tools.profile_decode", ["--lengths", "128,x"], "--lengths"),
    ("tools.profile_decode", ["--repeats", "0"], "--repeats"),
    ("tools.bench_latency", ["--stall", "0"], "--stall"),
    ("tools.bench_latency", ["--stall", "nan"], "--stall"),
    ("tools.bench_latency", ["--long-min", "900", "--long-max", "800"], "need --long-min <="),
    ("kv_serve._cli", ["serve", "--model", "x", "--prefill-stall", "0"], "or 'off', got '0'"),
    ("kv_serve._cli", ["serve", "--model", "x", "--prefill-stall", "soon"], "--prefill-stall"),
    (
        "kv_serve._cli",
        ["serve", "--model", "x", "--state-snapshot-interval", "0"],
        "expected an int >= 1, got '0'",
    ),
    (
        "kv_serve._cli",
        ["serve", "--model", "x", "--state-cache-mib", "-1"],
        "expected an int >= 0, got '-1'",
    ),
]


@pytest.mark.parametrize(
    ("module", "args", "fragment"),
    OTHER_BENCH_CASES,
    ids=[f"{m} {' '.join(a)}" for m, a, _ in OTHER_BENCH_CASES],
)
def test_other_benchmarks_refuse(
    run_module: Run, module: str, args: list[str], fragment: str
) -> None:
    assert_refused(run_module(module, *args), fragment)


def test_plot_into_a_directory_that_cannot_be_written(run_module: Run, tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert_refused(run_module("tools.kv", "--plot", str(a_file / "p.png")), "is not a directory")
    (tmp_path / "dir.png").mkdir()
    assert_refused(run_module("tools.kv", "--plot", str(tmp_path / "dir.png")), "is a directory")
    if sys.platform == "linux":
        # sysfs refuses new files even to root, whatever os.access says.
        assert_refused(run_module("tools.kv", "--plot", "/sys/kv-pages.png"), "is not writable")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert_refused(run_module("tools.kv", "--plot", str(locked / "p.png")), "is not writable")


PROCESS_CASES = [
    ("tools.kv", ["--min-prompt", "9", "--max-prompt", "3"], "need --min-prompt <= --max-prompt"),
    ("tools.kv", ["layout", "--bogus"], "unrecognized arguments: --bogus"),
    ("tools.bench_pool", ["--requests", "0"], "--requests"),
    ("kv_serve._cli", ["serve", "--model", "x", "--prefill-stall", "0"], "or 'off', got '0'"),
]


@pytest.mark.parametrize(
    ("module", "args", "fragment"),
    PROCESS_CASES,
    ids=[f"{m} {' '.join(a)}" for m, a, _ in PROCESS_CASES],
)
def test_a_refusal_ends_the_process_with_status_2(
    run_module: Run, module: str, args: list[str], fragment: str
) -> None:
    # The process as a user runs it: a check of the command (tools.kv's own), argparse's
    # (a command parser, a benchmark's), kv-serve's; each answers as its main does here.
    result = run_process(module, *args)
    assert_refused(result, fragment)
    here = run_module(module, *args)
    assert (here.returncode, here.stdout, here.stderr) == (2, "", result.stderr)


def test_the_plot_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    assert cli_args.png_file(str(tmp_path / "pages.png")) == str(tmp_path / "pages.png")
    assert list(tmp_path.iterdir()) == []


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    top = kv.build_parser()
    found = [("python -m tools.kv", top)]
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [(f"tools.kv {name}", sub) for name, sub in action.choices.items()]
    found += [
        ("tools.kv bench", bench_engine.build_parser()),
        ("tools.bench_pool", bench_pool.build_parser()),
        ("tools.bench_kernels", bench_kernels.build_parser()),
        ("tools.bench_latency", bench_latency.build_parser()),
        ("tools.profile_decode", profile_decode.build_parser()),
    ]
    return found


def test_every_option_is_validated_by_one_mechanism() -> None:
    # Each option that takes a value has choices or a checking type from tools.cli_args;
    # a bare int/float/str would let 0, -1, nan or an unwritable path through to the run.
    checked = 0
    for name, parser in _parsers():
        assert isinstance(parser, cli_args.ArgumentParser), name
        for action in parser._actions:
            if action.nargs == 0 or isinstance(action, argparse._SubParsersAction):
                continue
            where = f"{name} {'/'.join(action.option_strings)}"
            if action.choices is not None:
                assert action.type is None, where
            else:
                assert action.type is not None and action.type not in (int, float, str), where
                assert getattr(action.type, "__module__", "") == cli_args.__name__, where
            checked += 1
    assert checked >= 30


def test_a_derived_pool_larger_than_the_machine_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The default budget is computed from the model's layout; on a machine with 1 KiB it is
    # too large, and the demo says so before the engine serves anything.
    from kv_batching import DecodeEngine
    from tools import demo

    monkeypatch.setattr(demo, "memory_limit_bytes", lambda: 2**10)
    served: list[object] = []
    monkeypatch.setattr(DecodeEngine, "submit", lambda *a: served.append(a))
    config = demo.DemoConfig(requests=4, max_prompt=300, max_tokens=16, progress=False)
    with pytest.raises(demo.DemoError, match="more than this machine's memory"):
        demo.run_demo(config)
    assert served == []


def test_budget_limit_is_the_machines_memory() -> None:
    limit_mib = cli_args.memory_limit_bytes() / 2**20
    assert 0 < limit_mib <= cli_args.FALLBACK_MEMORY_BYTES / 2**20
    assert cli_args.budget_mib(f"{limit_mib / 2:.1f}") == pytest.approx(limit_mib / 2, abs=0.1)
    with pytest.raises(argparse.ArgumentTypeError, match="this machine's memory"):
        cli_args.budget_mib(f"{2 * limit_mib:.1f}")
