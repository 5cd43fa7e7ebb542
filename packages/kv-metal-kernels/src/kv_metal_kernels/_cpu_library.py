"""Native CPU kernels: C sources built once with the system compiler and loaded with ctypes.

MLX has no user kernels on its CPU backend (``mx.fast.metal_kernel`` and ``cuda_kernel``
are GPU only), so a CPU kernel of this package is a C translation unit compiled here with
``cc`` (``gcc``, ``clang``: whichever is first on ``PATH``; ``$CC`` wins) at ``-O3
-march=native`` and OpenMP, and called on the buffers of evaluated MLX arrays. Where
MKL's OpenMP runtime (``libiomp5``) is already loaded the library is linked against it, so
its parallel loops run on the threads MKL's products use (two runtimes would each keep a
spinning thread per core); otherwise the compiler's own runtime, else none.

A built library is cached under ``$XDG_CACHE_HOME/kv-metal-kernels`` (else
``~/.cache/kv-metal-kernels``), keyed by the source, the compiler and the whole command, in
a directory only this user may write to (what is there is code this process runs); where
that directory is not private, a fresh temporary one is used. ``KV_CPU_KERNELS=off`` turns
the native CPU kernels off (the callers keep MLX's own operations).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CPU_KERNELS_ENV", "CpuLibrary", "build_cpu_library", "build_mlx_library"]

_log = logging.getLogger("kv_metal_kernels")

#: The environment variable that turns the native CPU kernels off (``off``) or on (``auto``).
CPU_KERNELS_ENV = "KV_CPU_KERNELS"
_COMPILERS = ("cc", "gcc", "clang")


@dataclass(frozen=True, kw_only=True)
class CpuLibrary:
    """A built C library (``handle``, ``None`` where it could not be built) and how."""

    handle: ctypes.CDLL | None
    path: str
    openmp: str
    reason: str

    def describe(self) -> str:
        """One line for logs: what was built, or why nothing was."""
        if self.handle is None:
            return f"not built: {self.reason}"
        return f"{self.path} ({self.reason}; OpenMP: {self.openmp})"


_built: dict[str, CpuLibrary] = {}
_lock = threading.Lock()


def _compiler() -> str | None:
    chosen = os.environ.get("CC", "").strip()
    if chosen:
        return shutil.which(chosen)
    for name in _COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def _loaded_iomp() -> str | None:
    """MKL's OpenMP runtime (``libiomp5``): loaded in this process, or beside a loaded MKL.

    ``libmkl_rt`` loads it on its first threaded product, which may come later than this
    build.
    """
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {Path(line.split()[-1]) for line in maps.splitlines() if len(line.split()) >= 6}
    for path in sorted(paths):
        if path.name.startswith("libiomp5") and path.is_file():
            return str(path)
    for path in sorted(paths):
        beside = path.parent / "libiomp5.so"
        if path.name.startswith("libmkl_rt") and beside.is_file():
            return str(beside)
    return None


def _machine() -> str:
    """The CPU's identity for the cache key (a ``-march=native`` library runs only here)."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                flags += line
                if line.startswith(("flags", "Features")):
                    break
    return f"{platform.machine()} {flags}"


def _private(path: Path) -> bool:
    """A real directory of this user that nobody else may write to (not a symlink)."""
    info = os.lstat(path)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    root = Path(base) if base else Path.home() / ".cache"
    directory = root / "kv-metal-kernels"
    with contextlib.suppress(OSError):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if _private(directory):
            return directory
    return Path(tempfile.mkdtemp(prefix="kv-metal-kernels-"))


def _run(command: list[str]) -> str | None:
    """``None`` when ``command`` succeeds, else the tail of what it printed."""
    try:
        done = subprocess.run(command, capture_output=True, timeout=300, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        return str(err)
    if done.returncode == 0:
        return None
    return (done.stderr or done.stdout).decode(errors="replace").strip()[-400:]


def _plans(compiler: str, source: Path, out: Path) -> list[tuple[str, list[list[str]]]]:
    """Build commands, best first: ``(openmp, [commands])``."""
    base = [compiler, "-O3", "-fPIC", "-x", "c"]
    plans: list[tuple[str, list[list[str]]]] = []
    iomp = _loaded_iomp()
    for arch in (["-march=native"], []):
        if iomp is not None:
            obj = out.with_suffix(".o")
            compile_ = [*base, *arch, "-fopenmp", "-c", "-o", str(obj), str(source)]
            link = [compiler, "-shared", "-o", str(out), str(obj), iomp]
            link.append(f"-Wl,-rpath,{Path(iomp).parent}")
            plans.append(("libiomp5 (MKL's threads)", [compile_, link]))
        plans.append(
            ("the compiler's", [[*base, *arch, "-fopenmp", "-shared", "-o", str(out), str(source)]])
        )
        plans.append(
            ("none (one thread)", [[*base, *arch, "-shared", "-o", str(out), str(source)]])
        )
    return plans


def build_cpu_library(name: str, source: str) -> CpuLibrary:
    """Build (once per process and cache entry) and load the C ``source`` as ``name``.

    Never raises: a library that cannot be built (no compiler, a refused command,
    ``KV_CPU_KERNELS=off``, not Linux or macOS) comes back with ``handle=None`` and the
    reason, and is logged once.
    """
    return _memoized(name, lambda: _build(name, source))


def _memoized(name: str, build: Callable[[], CpuLibrary]) -> CpuLibrary:
    """The library built under ``name`` in this process, else ``build()``'s (logged if none)."""
    with _lock:
        if name in _built:
            return _built[name]
        library = build()
        if library.handle is None:
            _log.info("native CPU kernel %s %s", name, library.describe())
        _built[name] = library
        return library


def _build(name: str, source: str) -> CpuLibrary:
    refused = _refusal()
    if refused is not None:
        return refused
    compiler = _compiler()
    if compiler is None:
        return CpuLibrary(handle=None, path="", openmp="", reason="no C compiler on PATH")
    return _build_cached(
        name,
        source,
        compiler,
        _machine(),
        lambda src, out: _plans(compiler, src, out),
        ctypes.CDLL,
        suffix=".c",
    )


def build_mlx_library(name: str, source: str) -> CpuLibrary:
    """Build (once per process and cache entry) and load the C++ ``source`` against MLX.

    The translation unit is compiled with ``c++`` (``$CXX`` wins) at ``-O2 -std=c++20``
    against the headers and ``libmlx`` of the ``mlx`` package this process imported, and
    loaded with :class:`ctypes.PyDLL` (its functions run holding the GIL); with this
    Python's headers where they are installed (``-DKV_WITH_PYTHON``), else without. The
    cache key includes MLX's version and its library's size and time and Python's version,
    since the code depends on both ABIs. Never raises, like :func:`build_cpu_library`.
    """
    return _memoized(name, lambda: _build_mlx(name, source))


def _build_mlx(name: str, source: str) -> CpuLibrary:
    refused = _refusal()
    if refused is not None:
        return refused
    compiler = _cxx_compiler()
    if compiler is None:
        return CpuLibrary(handle=None, path="", openmp="", reason="no C++ compiler on PATH")
    import mlx.core as mx

    package = Path(mx.__file__).resolve().parent  # mlx/core.*.so: the mlx package
    if not (package / "include" / "mlx" / "array.h").is_file():
        return CpuLibrary(
            handle=None, path="", openmp="", reason="the mlx package ships no C++ headers"
        )
    libraries = sorted((package / "lib").glob("libmlx.*"))
    if not libraries:
        return CpuLibrary(handle=None, path="", openmp="", reason="the mlx package has no libmlx")
    info = libraries[0].stat()
    version = getattr(mx, "__version__", "")
    identity = f"mlx {version} {libraries[0]} {info.st_size} {info.st_mtime_ns}"

    python = Path(sysconfig.get_paths()["include"])
    identity += f" python {sys.version}"

    def plans(src: Path, out: Path) -> list[tuple[str, list[list[str]]]]:
        command = [compiler, "-O2", "-std=c++20", "-fPIC", "-shared", "-x", "c++"]
        command += [f"-I{package / 'include'}", "-o", str(out), str(src)]
        command += [f"-L{package / 'lib'}", "-lmlx", f"-Wl,-rpath,{package / 'lib'}"]
        found = []
        if (python / "Python.h").is_file():
            with_python = [*command, f"-I{python}", "-DKV_WITH_PYTHON"]
            found.append(("none (MLX's stream thread; a CPython entry point)", [with_python]))
        return [*found, ("none (MLX's stream thread; ctypes entry points)", [command])]

    return _build_cached(name, source, compiler, identity, plans, ctypes.PyDLL, suffix=".cpp")


def _refusal() -> CpuLibrary | None:
    """Why no native library may be built here (``KV_CPU_KERNELS``, the platform), else ``None``."""
    choice = os.environ.get(CPU_KERNELS_ENV, "auto").strip().lower() or "auto"
    if choice == "off":
        return CpuLibrary(handle=None, path="", openmp="", reason=f"{CPU_KERNELS_ENV}=off")
    if choice != "auto":
        return CpuLibrary(
            handle=None,
            path="",
            openmp="",
            reason=f"{CPU_KERNELS_ENV}={choice!r} is neither 'auto' nor 'off'",
        )
    if not sys.platform.startswith(("linux", "darwin")):
        return CpuLibrary(
            handle=None, path="", openmp="", reason=f"{sys.platform} is not supported"
        )
    return None


def _cxx_compiler() -> str | None:
    chosen = os.environ.get("CXX", "").strip()
    if chosen:
        return shutil.which(chosen)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _build_cached(
    name: str,
    source: str,
    compiler: str,
    identity: str,
    plans: Callable[[Path, Path], list[tuple[str, list[list[str]]]]],
    loader: Callable[[str], ctypes.CDLL],
    *,
    suffix: str,
) -> CpuLibrary:
    """The first plan that builds (or is cached) and loads; the cache key covers ``identity``."""
    directory = _cache_dir()
    failures: list[str] = []
    placeholders = plans(Path("SOURCE" + suffix), Path("OUT.so"))
    for index, (openmp, commands) in enumerate(placeholders):
        key = hashlib.sha256(
            "\n".join([source, identity, openmp, *(" ".join(c) for c in commands)]).encode()
        ).hexdigest()[:20]
        target = directory / f"{name}-{key}.so"
        if not target.is_file():
            work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=directory))
            try:
                src, out = work / ("source" + suffix), work / "library.so"
                src.write_text(source)
                _, real = plans(src, out)[index]
                error = next((e for e in map(_run, real) if e is not None), None)
                if error is not None:
                    failures.append(f"{openmp}: {error}")
                    continue
                out.replace(target)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        try:
            handle = loader(str(target))
        except OSError as err:
            failures.append(f"{openmp}: {err}")
            continue
        flags = " ".join(f for f in commands[0] if f in ("-O3", "-O2", "-march=native"))
        return CpuLibrary(
            handle=handle, path=str(target), openmp=openmp, reason=f"{compiler} {flags}"
        )
    return CpuLibrary(
        handle=None,
        path="",
        openmp="",
        reason=f"{compiler} could not build it: {failures[-1] if failures else 'no plan'}",
    )
