"""Target flags for the kernels MLX's CPU backend compiles at run time.

``mx.compile`` on the CPU fuses a chain of elementwise operations into one C++ kernel that
MLX builds with ``g++ -std=c++17 -O3`` (found on ``PATH``) and caches under
``$TMPDIR/mlx``. Linux wheels add no target flags there, so those kernels are built for the
baseline x86-64 (SSE2) whatever the CPU. The engine's vectorised activations and softmax
are such kernels: built with ``-march=native`` the tanh-GELU gated product of a 512 x 2048
chunk takes 2.6 against 8.6 ms on a 2-core AMD EPYC (AVX-512), and a Gemma 3 270M prefill
of 512 tokens about 6% less time.

:func:`configure_cpu_jit` puts a ``g++`` first on this process's ``PATH`` (and its
children's) that runs the real one with the flags added; it lives in a directory under the
temp dir that only this user can write to. ``KV_SERVE_JIT_FLAGS`` chooses
them: ``auto`` (the default: ``-march=native`` where the compiler accepts it), ``off``, or
the flags themselves. Kernels MLX cached before, built without them, are reused as they
are (correct, only not faster): clear ``$TMPDIR/mlx`` to rebuild them. A cache shared by
machines of different CPUs would need ``off`` (a kernel built for one may not run on the
other).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["JIT_FLAGS_ENV", "CpuJitInfo", "active_cpu_jit", "configure_cpu_jit"]

_log = logging.getLogger("kv_serve.cpu_jit")

#: The environment variable that chooses the flags (see the module docstring).
JIT_FLAGS_ENV = "KV_SERVE_JIT_FLAGS"
_AUTO_FLAGS = "-march=native"
#: The directory name prefix of the wrappers, so a child process finds the real compiler.
_WRAPPER_PREFIX = "kv-serve-jit-"


@dataclass(frozen=True, kw_only=True)
class CpuJitInfo:
    """The flags MLX's CPU kernel compiler runs with in this process (``""``: none), and why."""

    flags: str
    reason: str

    def describe(self) -> str:
        """One line for logs."""
        return f"{self.flags or 'no flags'}: {self.reason}"


_active: CpuJitInfo | None = None


def _real_compiler() -> str | None:
    """The first ``g++`` on ``PATH`` that is not one of these wrappers."""
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not entry or Path(entry).name.startswith(_WRAPPER_PREFIX):
            continue
        found = shutil.which("g++", path=entry)
        if found:
            return found
    return None


def _accepts(compiler: str, flags: list[str]) -> bool:
    """Whether ``compiler`` builds a translation unit with ``flags`` (a few ms)."""
    try:
        done = subprocess.run(
            [compiler, *flags, "-x", "c++", "-c", "-o", os.devnull, "-"],
            input=b"int kv_serve_probe() { return 0; }\n",
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _wrapper_script(compiler: str, flags: list[str]) -> str:
    return f'#!/bin/sh\nexec {shlex.quote(compiler)} {shlex.join(flags)} "$@"\n'


def _shared_dir(script: str) -> Path:
    """Where processes of this user with the same wrapper share it (under the temp dir)."""
    digest = hashlib.sha256(script.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"{_WRAPPER_PREFIX}{os.getuid()}-{digest}"


def _private(path: Path) -> bool:
    """A real directory of this user that nobody else may write to (not a symlink)."""
    info = os.lstat(path)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


def _install(compiler: str, flags: list[str]) -> Path:
    """A directory holding a ``g++`` that runs ``compiler`` with ``flags`` first.

    The shared directory is used only if this user owns it and nobody else can write to
    it (anything else there could swap the compiler MLX runs); otherwise a fresh private
    one is made.
    """
    script = _wrapper_script(compiler, flags)
    directory = _shared_dir(script)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    if not _private(directory):
        directory = Path(tempfile.mkdtemp(prefix=_WRAPPER_PREFIX))
    wrapper = directory / "g++"
    if not (wrapper.is_file() and wrapper.read_text() == script):
        staged = directory / f"g++.{os.getpid()}"
        staged.write_text(script)
        staged.chmod(0o755)
        staged.replace(wrapper)
    return directory


def configure_cpu_jit(choice: str | None = None) -> CpuJitInfo:
    """Give MLX's CPU kernel compiler ``choice``'s flags (default ``$KV_SERVE_JIT_FLAGS``).

    Idempotent: the first call decides, later calls return what it did. Flags the compiler
    refuses or that are not shell words, or no ``g++`` on ``PATH``, leave MLX as it is
    (logged, never raised: an entry point never fails on it, and a kernel that cannot be
    built would fail every forward that needs it).
    """
    global _active
    if _active is not None:
        return _active
    if choice is None:
        choice = os.environ.get(JIT_FLAGS_ENV, "auto")
    choice = choice.strip() or "auto"
    if not sys.platform.startswith("linux"):
        _active = CpuJitInfo(flags="", reason=f"{sys.platform}: left to MLX")
        return _active
    if choice.lower() == "off":
        _active = CpuJitInfo(flags="", reason=f"{JIT_FLAGS_ENV}=off")
        return _active
    try:
        words = shlex.split(_AUTO_FLAGS if choice.lower() == "auto" else choice)
    except ValueError as err:
        _log.warning("%s=%r cannot be read as flags (%s); none added", JIT_FLAGS_ENV, choice, err)
        _active = CpuJitInfo(flags="", reason=f"{JIT_FLAGS_ENV}={choice!r} is not shell words")
        return _active
    flags = [word for word in words if word]
    if not flags:
        _active = CpuJitInfo(flags="", reason=f"{JIT_FLAGS_ENV} names no flags")
        return _active
    compiler = _real_compiler()
    if compiler is None:
        _active = CpuJitInfo(flags="", reason="no g++ on PATH (MLX cannot compile kernels)")
        return _active
    if not _accepts(compiler, flags):
        _log.warning("%s refuses %s; MLX's kernels are built without them", compiler, flags)
        _active = CpuJitInfo(flags="", reason=f"{compiler} refuses {shlex.join(flags)}")
        return _active
    try:
        directory = _install(compiler, flags)
    except OSError as err:
        _log.warning("cannot write the compiler wrapper (%s); no flags added", err)
        _active = CpuJitInfo(flags="", reason=f"cannot write the compiler wrapper: {err}")
        return _active
    os.environ["PATH"] = os.pathsep.join([str(directory), os.environ.get("PATH", "")])
    how = "auto" if choice.lower() == "auto" else JIT_FLAGS_ENV
    _active = CpuJitInfo(flags=shlex.join(flags), reason=f"{how}; {compiler} on PATH wrapped")
    return _active


def active_cpu_jit() -> CpuJitInfo:
    """What :func:`configure_cpu_jit` did in this process (it configures nothing itself)."""
    if _active is not None:
        return _active
    return CpuJitInfo(flags="", reason="kv_serve.configure_cpu_jit() has not run")
