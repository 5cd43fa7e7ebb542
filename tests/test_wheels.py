"""Each member's wheel installs alone, as a downstream project takes it, and runs its README.

Every member is built into a wheel (``uv build``); then, per member, an empty virtual
environment gets that wheel with its ``cpu`` extra (MLX's Linux backend; on macOS the extra
installs nothing more) and the distributions its README example imports: the other members
from their built wheels, the rest from the package index, nothing from this workspace. Every
```python block of its README then runs there as a script. A member that forgot a
dependency, or whose plain ``mlx`` dependency leaves Linux without a backend, fails here.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
#: Each member's extras beside ``cpu`` (kv-serve's README serves over HTTP and reads GGUFs).
EXTRAS = {"kv-serve": ["server", "gguf"]}
#: Distributions of the top-level modules README examples import (besides the members').
DISTRIBUTIONS = {"mlx_lm": "mlx-lm", "openai": "openai"}
MEMBERS = sorted(path.parent.name for path in ROOT.glob("packages/*/pyproject.toml"))
UV = os.environ.get("UV") or shutil.which("uv")
#: Printed after an example's last line: the example itself ran to its end.
DONE = "readme example done"
#: ml-explore/mlx#3126: MLX's static destructors at exit after MLX ran on a second thread.
MLX_EXIT_ABORT = "terminate called without an active exception"

pytestmark = pytest.mark.skipif(UV is None, reason="needs uv (`uv run pytest` sets $UV)")


def _examples(member: str) -> list[str]:
    return BLOCK.findall((ROOT / "packages" / member / "README.md").read_text())


def _wheel(wheels: Path, dist: str) -> Path:
    return wheels / f"{dist.replace('-', '_')}-0.1.0-py3-none-any.whl"


def _requirements(member: str, wheels: Path) -> list[str]:
    """The member's wheel with its extras, and the distributions its README imports."""
    extras = ",".join(["cpu", *EXTRAS.get(member, [])])
    wanted = [f"{member}[{extras}] @ {_wheel(wheels, member).as_uri()}"]
    for code in _examples(member):
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                dist = top.replace("_", "-") if top.startswith("kv_") else DISTRIBUTIONS.get(top)
                if dist is not None and dist != member and dist not in wanted:
                    wanted.append(dist)
    return wanted


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every member's wheel, built from this checkout."""
    assert UV is not None
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [UV, "build", "--all-packages", "--wheel", "--out-dir", str(out), "--quiet"],
        cwd=ROOT,
        check=True,
    )
    return out


@pytest.mark.parametrize("member", MEMBERS)
def test_the_wheel_installs_alone_and_runs_its_readme(
    member: str, wheels: Path, tmp_path: Path
) -> None:
    assert UV is not None
    assert _wheel(wheels, member).is_file()
    # The other members come from their built wheels, never from an index.
    overrides = tmp_path / "overrides.txt"
    overrides.write_text(
        "".join(f"{m} @ {_wheel(wheels, m).as_uri()}\n" for m in MEMBERS if m != member)
    )
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([UV, "venv", "--quiet", "--python", base, str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    install = [UV, "pip", "install", "--quiet", "--python", str(python)]
    subprocess.run(
        [*install, "--override", str(overrides), *_requirements(member, wheels)],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    for index, code in enumerate(_examples(member)):
        done = subprocess.run(
            [str(python), "-c", f"{code}\nprint({DONE!r})"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        where = f"{member} README example {index}"
        assert DONE in done.stdout, f"{where}:\n{done.stderr[-3000:]}"
        if done.returncode != 0:
            # The example ran to its end; an MLX process that ran MLX on another thread (the
            # server's engine thread) can then abort in MLX's static destructors at exit.
            assert done.returncode == -signal.SIGABRT and MLX_EXIT_ABORT in done.stderr, where
            warnings.warn(f"{where} aborted at interpreter exit: {MLX_EXIT_ABORT}", stacklevel=1)
