"""The target flags of MLX's CPU kernel compiler: what ``KV_SERVE_JIT_FLAGS`` does.

The wrapper is checked by what it builds: flags that force-include a header defining a
marker symbol show up in the object the wrapped ``g++`` (or MLX's own JIT) produces.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from kv_serve import _cpu_jit

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++"),
]

_MARKER = "int kv_serve_jit_marker(void) { return 1729; }\n"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process state in which nothing was configured yet (PATH restored afterwards)."""
    monkeypatch.setattr(_cpu_jit, "_active", None)
    monkeypatch.setenv("PATH", os.environ["PATH"])
    monkeypatch.delenv(_cpu_jit.JIT_FLAGS_ENV, raising=False)


def _marker_flags(tmp_path: Path) -> str:
    header = tmp_path / "marker.h"
    header.write_text(f'extern "C" {_MARKER}')
    return f"-include {header}"


def test_flags_reach_the_compiler_on_path(fresh: None, tmp_path: Path) -> None:
    info = _cpu_jit.configure_cpu_jit(_marker_flags(tmp_path))
    assert "-include" in info.flags
    wrapper = shutil.which("g++")
    assert wrapper is not None and Path(wrapper).parent.name.startswith("kv-serve-jit-")
    source, library = tmp_path / "unit.cpp", tmp_path / "unit.so"
    source.write_text("int unrelated() { return 0; }\n")
    subprocess.run([wrapper, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    assert ctypes.CDLL(str(library)).kv_serve_jit_marker() == 1729
    # Idempotent: the first call decided.
    assert _cpu_jit.configure_cpu_jit("off") is info
    assert _cpu_jit.active_cpu_jit() is info


def test_off_leaves_path_alone(fresh: None) -> None:
    before = os.environ["PATH"]
    info = _cpu_jit.configure_cpu_jit("off")
    assert info.flags == "" and "off" in info.reason
    assert os.environ["PATH"] == before


@pytest.mark.parametrize(
    ("choice", "reason"),
    [
        ("-fno-such-option-kv-serve", "refuses"),
        ("-march='native", "not shell words"),
        ("''", "names no flags"),
    ],
)
def test_unusable_flags_are_not_installed(fresh: None, choice: str, reason: str) -> None:
    before = os.environ["PATH"]
    info = _cpu_jit.configure_cpu_jit(choice)
    assert info.flags == "" and reason in info.reason
    assert os.environ["PATH"] == before


def test_environment_chooses_and_a_child_finds_the_real_compiler(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = _cpu_jit._real_compiler()
    assert real is not None and not Path(real).parent.name.startswith("kv-serve-jit-")
    monkeypatch.setenv(_cpu_jit.JIT_FLAGS_ENV, "-O1")
    info = _cpu_jit.configure_cpu_jit()
    assert info.flags == "-O1"
    assert shutil.which("g++") != real
    # A child process (the PATH it inherits starts with the wrapper) wraps the real g++,
    # never the wrapper itself.
    assert _cpu_jit._real_compiler() == real


def test_mlx_builds_its_kernels_with_the_flags(tmp_path: Path) -> None:
    cache = tmp_path / "tmp"
    cache.mkdir()
    code = f"""
        import ctypes, glob, os
        import kv_serve
        kv_serve.load_fast_blas()
        import mlx.core as mx
        f = mx.compile(lambda x, y: x * y + 3.0)
        out = f(mx.arange(4, dtype=mx.float32), mx.full((4,), 2.0))
        assert out.tolist() == [3.0, 5.0, 7.0, 9.0], out
        found = [ctypes.CDLL(p).kv_serve_jit_marker() for p in glob.glob(
            os.path.join({str(cache)!r}, "mlx", "**", "*.so"), recursive=True)]
        print(found)
    """
    env = os.environ | {
        "TMPDIR": str(cache),
        _cpu_jit.JIT_FLAGS_ENV: _marker_flags(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = eval(done.stdout.strip().splitlines()[-1])
    assert found and set(found) == {1729}


def test_a_shared_directory_others_can_write_to_is_not_used(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    compiler = _cpu_jit._real_compiler()
    assert compiler is not None
    shared = _cpu_jit._shared_dir(_cpu_jit._wrapper_script(compiler, ["-O1"]))
    shared.mkdir()
    shared.chmod(0o777)  # anyone could swap the compiler in here
    info = _cpu_jit.configure_cpu_jit("-O1")
    assert info.flags == "-O1"
    used = Path(shutil.which("g++") or "").parent
    assert used != shared and used.name.startswith("kv-serve-jit-")
    assert not used.stat().st_mode & 0o022 and not (shared / "g++").exists()
    # A private shared directory is reused as it is.
    shared.chmod(0o700)
    monkeypatch.setattr(_cpu_jit, "_active", None)
    _cpu_jit.configure_cpu_jit("-O1")
    assert Path(shutil.which("g++") or "").parent == shared
