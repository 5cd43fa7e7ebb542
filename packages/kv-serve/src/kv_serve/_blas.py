"""A fast BLAS for MLX's Linux CPU backend, loaded before ``mlx`` is first imported.

MLX's Linux CPU wheel links a reference BLAS: correct, but a fp32 matmul runs at a few
GFLOP/s, and prefill of a real model is dominated by it. ``libmlx`` calls the standard
``cblas_*`` and LAPACK (``sgeev_``, ...) symbols, which the dynamic loader resolves in the
process's global scope before the library's own dependencies. So a BLAS loaded with
``RTLD_GLOBAL`` before ``mlx`` is imported takes the place of the reference one, with no
change to MLX.

Where one comes from (``KV_SERVE_BLAS``, default ``auto``):

* ``auto``: a system OpenBLAS (Debian's ``libopenblas0-pthread``) if the loader finds one,
  else Intel MKL installed into this environment (the ``fast-cpu`` extra of kv-serve, which
  ``uv sync`` installs in this workspace), else MLX's own reference BLAS;
* ``openblas`` or ``mkl``: that one, or an error saying how to install it;
* ``off``: MLX's own;
* a path to a shared library that exports ``cblas_sgemm``.

Nothing is loaded on import: an entry point calls :func:`load_fast_blas` before anything
imports ``mlx`` (the ``kv-serve`` command, ``tools/`` and the test session do), which is why
importing :mod:`kv_serve` imports no ``mlx``. macOS is left alone (MLX uses Accelerate there
and the GPU for models).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ._cpu_jit import configure_cpu_jit

__all__ = [
    "BLAS_ENV",
    "BlasError",
    "BlasInfo",
    "active_blas",
    "load_fast_blas",
]

_log = logging.getLogger("kv_serve.blas")

#: The environment variable that picks the BLAS (see the module docstring).
BLAS_ENV = "KV_SERVE_BLAS"
_CHOICES = ("auto", "off", "openblas", "mkl")
#: The symbol every candidate must export: the fp32 matmul MLX's CPU backend calls.
_PROBE_SYMBOL = "cblas_sgemm"


class BlasError(OSError):
    """The BLAS that was asked for cannot be loaded (missing, or not a CBLAS library)."""


@dataclass(frozen=True, kw_only=True)
class BlasInfo:
    """Which BLAS MLX's CPU backend uses in this process, and why.

    ``name`` is ``openblas``, ``mkl``, ``custom`` (a library named by path), ``reference``
    (the one MLX's wheel links) or ``platform`` (not Linux: left to MLX); ``path`` is the
    library loaded, if any.
    """

    name: str
    path: str | None
    reason: str

    @property
    def fast(self) -> bool:
        """Whether a BLAS other than MLX's reference one was loaded."""
        return self.path is not None

    def describe(self) -> str:
        """One line for logs: the name, the library and why."""
        where = f" ({self.path})" if self.path else ""
        return f"{self.name}{where}: {self.reason}"


_active: BlasInfo | None = None


def _system_openblas() -> str | None:
    for name in ("openblas", "openblasp", "openblaso"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def _environment_mkl() -> str | None:
    """``libmkl_rt`` of the ``mkl`` wheel installed into this environment, if any."""
    try:
        files = metadata.files("mkl") or []
    except metadata.PackageNotFoundError:
        return None
    candidates = sorted(
        str(Path(str(file.locate())).resolve())
        for file in files
        if Path(str(file)).name.startswith("libmkl_rt.so")
    )
    existing = [path for path in candidates if Path(path).is_file()]
    return existing[-1] if existing else None


def _load(name: str, path: str, reason: str) -> BlasInfo:
    try:
        library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise BlasError(f"{BLAS_ENV}: cannot load {path}: {err}") from err
    if not hasattr(library, _PROBE_SYMBOL):
        raise BlasError(
            f"{BLAS_ENV}: {path} does not export {_PROBE_SYMBOL}; expected a CBLAS library "
            "with unprefixed symbols (OpenBLAS, MKL's libmkl_rt)"
        )
    return BlasInfo(name=name, path=path, reason=reason)


def _choose(choice: str) -> BlasInfo:
    if choice == "off":
        return BlasInfo(name="reference", path=None, reason=f"{BLAS_ENV}=off")
    if choice not in _CHOICES:
        if os.sep in choice or choice.endswith(".so") or ".so." in choice:
            return _load("custom", choice, f"{BLAS_ENV}={choice}")
        raise BlasError(
            f"{BLAS_ENV}={choice!r}: expected one of {', '.join(_CHOICES)} or the path of a "
            "CBLAS shared library"
        )
    openblas = _system_openblas() if choice in ("auto", "openblas") else None
    if openblas is not None:
        return _load("openblas", openblas, "found by the system's loader")
    mkl = _environment_mkl() if choice in ("auto", "mkl") else None
    if mkl is not None:
        return _load("mkl", mkl, "the mkl package of this environment")
    if choice == "openblas":
        raise BlasError(
            f"{BLAS_ENV}=openblas: no OpenBLAS found by the loader; install one "
            "(Debian/Ubuntu: apt-get install libopenblas0-pthread)"
        )
    if choice == "mkl":
        raise BlasError(
            f"{BLAS_ENV}=mkl: the mkl package is not installed; install kv-serve's "
            "fast-cpu extra (uv sync installs it in this workspace; "
            "pip install 'kv-serve[fast-cpu]')"
        )
    return BlasInfo(
        name="reference",
        path=None,
        reason="no OpenBLAS or MKL found; uv sync installs MKL (kv-serve's fast-cpu extra), "
        "or apt-get install libopenblas0-pthread",
    )


def load_fast_blas(choice: str | None = None, *, strict: bool = False) -> BlasInfo:
    """Load the BLAS ``choice`` (default: ``$KV_SERVE_BLAS``, else ``auto``) for MLX.

    Call it before ``mlx`` is first imported; after that it loads nothing and reports the
    reference BLAS. Idempotent: the first call decides and later calls return what it did.
    A BLAS asked for by name or path that cannot be loaded is logged as a warning and
    recorded as the reason MLX keeps its reference BLAS (so a bad ``KV_SERVE_BLAS`` never
    stops an entry point; the command line reports it), or, with ``strict``, raises
    :class:`BlasError` and records nothing. ``auto`` never fails for a missing one.

    It also gives MLX's CPU kernel compiler its target flags
    (:func:`kv_serve.configure_cpu_jit`), the other half of a fast Linux CPU backend.
    """
    global _active
    if _active is not None:
        return _active
    configure_cpu_jit()
    if choice is None:
        choice = os.environ.get(BLAS_ENV, "auto").strip() or "auto"
    if not sys.platform.startswith("linux"):
        info = BlasInfo(name="platform", path=None, reason=f"{sys.platform}: left to MLX")
    elif "mlx.core" in sys.modules:
        info = BlasInfo(
            name="reference",
            path=None,
            reason="mlx was imported before kv_serve.load_fast_blas() ran, so its own BLAS "
            "is bound",
        )
    else:
        try:
            info = _choose(choice.lower() if choice.lower() in _CHOICES else choice)
        except BlasError as err:
            if strict:
                raise
            _log.warning("%s; MLX keeps its reference BLAS", err)
            info = BlasInfo(name="reference", path=None, reason=str(err))
    _active = info
    return info


def active_blas() -> BlasInfo:
    """What :func:`load_fast_blas` did in this process; it loads nothing itself.

    Before :func:`load_fast_blas` has run it reports MLX's own BLAS (on Linux, the reference
    one) and leaves the decision to a later :func:`load_fast_blas` call.
    """
    if _active is not None:
        return _active
    if not sys.platform.startswith("linux"):
        return BlasInfo(name="platform", path=None, reason=f"{sys.platform}: left to MLX")
    return BlasInfo(
        name="reference", path=None, reason="kv_serve.load_fast_blas() has not run in this process"
    )
