"""Which source files of the toolkit one decode step and one prefix hit run through.

A reader's measure of how far apart the code of one operation is: the distinct files under
``packages/*/src`` whose functions run (Python's call tracing) during

* one engine step that only decodes (four running requests of a tiny gpt-oss-like model,
  reference kernels, no prefill work left);
* the admission of a request whose prompt is a cached prefix plus a few tokens (the step that
  matches, reuses and prefills the rest).

Usage: ``uv run python -m tools.trace_files`` (``--list`` prints the files).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

PACKAGES = Path(__file__).resolve().parent.parent / "packages"


def files_run(action: Callable[[], object]) -> set[str]:
    """Files under ``packages/*/src`` with a function that ran during ``action()``."""
    seen: set[str] = set()

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(str(PACKAGES)) and "/src/" in name:
                seen.add(str(Path(name).relative_to(PACKAGES)))

    sys.setprofile(tracer)
    try:
        action()
    finally:
        sys.setprofile(None)
    return seen


def measure() -> tuple[set[str], set[str]]:
    """The files of one decode-only step, and of one prefix-hit admission."""
    from kv_serve import build_engine
    from kv_testing import build_tiny_model

    model = build_tiny_model("gpt_oss", window=8)
    engine = build_engine(model, max_running=4, max_context=128, page_size=4, prefill_chunk=64)
    prompt = [(5 * i + 3) % 50 for i in range(40)]
    for n in range(4):
        engine.submit([*prompt[:20], n + 1], 32)
    while engine.num_queued or engine.num_running < 4:
        engine.step()
    engine.step()  # warm: every running request has decoded once
    decode = files_run(engine.step)
    engine.run()
    engine.submit(prompt, 4)
    engine.run()
    engine.submit([*prompt, 7, 8], 4)
    hit = files_run(engine.step)
    engine.close()
    return decode, hit


def main(argv: Sequence[str] | None = None) -> int:
    """Print how many files a decode step and a prefix hit cross (and which, with --list)."""
    parser = argparse.ArgumentParser(prog="python -m tools.trace_files", description=__doc__)
    parser.add_argument("--list", action="store_true", help="print the files too")
    args = parser.parse_args(argv)
    decode, hit = measure()
    for label, files in (("decode step", decode), ("prefix hit", hit)):
        packages = {f.split("/")[0] for f in files}
        print(f"{label}: {len(files)} files in {len(packages)} packages")
        if args.list:
            for name in sorted(files):
                print(f"  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
