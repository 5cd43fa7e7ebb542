"""Typed command-line values shared by every entry point in ``tools/``.

One mechanism for every option: each option's ``type=`` is a function from this module, which
refuses a bad value while argparse parses (so before any model is built or anything runs), and
:class:`ArgumentParser` reports any parse error as exactly one ``error: ...`` line on stderr
with exit status 2, never a traceback. Ranges are checked by ``kv_protocol.check_int`` and
``kv_protocol.check_number``, the rule every kv-* entry point uses.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from kv_protocol import KVCacheError, check_int, check_number

__all__ = [
    "MAX_LAYERS",
    "MAX_PAGE_SIZE",
    "MAX_REQUESTS",
    "MAX_SEED",
    "MAX_TOKENS",
    "MAX_WORKLOAD_TOKENS",
    "ArgumentParser",
    "budget_mib",
    "existing_directory",
    "finite_float",
    "int_in_range",
    "int_list",
    "memory_limit_bytes",
    "png_file",
    "positive_int",
    "random_seed",
]

#: Requests in one workload: more is not a demo or a benchmark any more.
MAX_REQUESTS = 10_000
#: Tokens in one prompt, one output, one window or one prefill chunk (2**20).
MAX_TOKENS = 1 << 20
#: Prompt plus output tokens of a whole workload, at the longest lengths asked for (2**24).
MAX_WORKLOAD_TOKENS = 1 << 24
#: Tokens per pool page.
MAX_PAGE_SIZE = 1 << 16
#: Layers of a generated model.
MAX_LAYERS = 256
#: Seeds feed ``random.Random`` and ``mx.random.seed``: an unsigned 32-bit value.
MAX_SEED = 2**32 - 1
#: Used when the machine's memory cannot be read (1 TiB).
FALLBACK_MEMORY_BYTES = 1 << 40


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose errors are one ``error: ...`` line and exit 2.

    Sub-parsers made with ``add_subparsers().add_parser`` are of the same class, so they
    report the same way.
    """

    def error(self, message: str) -> NoReturn:
        """Print ``error: message`` on stderr and exit with status 2."""
        self.exit(2, f"error: {' '.join(message.split())}\n")


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"value must be an int, got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"value must be a number, got {text!r}") from None


def int_in_range(minimum: int, maximum: int, *, why: str = "") -> Callable[[str], int]:
    """An argparse ``type=``: an int in ``minimum..maximum`` (``why`` explains the range)."""

    def parse(text: str) -> int:
        try:
            return check_int(_parse_int(text), "value", minimum=minimum, maximum=maximum)
        except KVCacheError as exc:
            raise argparse.ArgumentTypeError(f"{exc}{why}") from None

    parse.__name__ = f"int in {minimum}..{maximum}"
    return parse


def positive_int(maximum: int) -> Callable[[str], int]:
    """An argparse ``type=``: an int in ``1..maximum``."""
    return int_in_range(1, maximum)


#: An argparse ``type=`` for a seed: ``0..2**32 - 1``.
random_seed = int_in_range(0, MAX_SEED)


def finite_float(
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    min_inclusive: bool = True,
    why: str = "",
) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number within the bounds (never nan or inf)."""

    def parse(text: str) -> float:
        try:
            return check_number(
                _parse_float(text),
                "value",
                minimum=minimum,
                maximum=maximum,
                min_inclusive=min_inclusive,
            )
        except KVCacheError as exc:
            raise argparse.ArgumentTypeError(f"{exc}{why}") from None

    parse.__name__ = "finite number"
    return parse


def int_list(
    minimum: int, maximum: int, *, length: int | None = None
) -> Callable[[str], list[int]]:
    """An argparse ``type=``: comma-separated ints in ``minimum..maximum`` (``1,8,32``)."""
    item = int_in_range(minimum, maximum)

    def parse(text: str) -> list[int]:
        parts = [part.strip() for part in text.split(",")]
        if length is not None and len(parts) != length:
            raise argparse.ArgumentTypeError(
                f"value must be {length} comma-separated ints, got {text!r}"
            )
        values = []
        for index, part in enumerate(parts):
            try:
                values.append(item(part))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"item {index + 1} of {text!r}: {exc}") from None
        return values

    parse.__name__ = "comma-separated ints"
    return parse


@functools.cache
def memory_limit_bytes() -> int:
    """The memory a KV pool can use on this machine: the smaller of RAM and device memory.

    RAM is read with ``os.sysconf``; a GPU reports its own memory through
    ``mx.device_info()``. Falls back to 1 TiB where neither can be read.
    """
    limits = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    with contextlib.suppress(AttributeError, RuntimeError):
        import mlx.core as mx

        device = mx.device_info().get("memory_size")
        if isinstance(device, int) and device > 0:
            limits.append(device)
    positive = [limit for limit in limits if limit > 0]
    return min(positive) if positive else FALLBACK_MEMORY_BYTES


def budget_mib(text: str) -> float:
    """An argparse ``type=``: a KV pool budget in MiB, > 0 and at most this machine's memory."""
    limit = memory_limit_bytes() / 2**20
    parse = finite_float(
        0.0,
        float(f"{limit:.1f}"),
        min_inclusive=False,
        why=f"; the limit is this machine's memory ({limit / 1024:.1f} GiB)",
    )
    return parse(text)


def existing_directory(text: str) -> str:
    """An argparse ``type=``: a path that is an existing directory."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a directory")
    return text


def model_source(text: str) -> str:
    """An argparse ``type=``: ``gemma3-270m``, an existing ``.gguf`` file or a directory."""
    if text == "gemma3-270m":
        return text
    path = Path(text)
    if path.is_dir():
        return text
    if path.is_file():
        if path.suffix != ".gguf":
            raise argparse.ArgumentTypeError(
                f"{text}: a file but not a .gguf file; expected an mlx-lm model directory, "
                "a Gemma 3 .gguf file or gemma3-270m"
            )
        return text
    raise argparse.ArgumentTypeError(
        f"{text}: no such directory or .gguf file, and not the packaged model gemma3-270m"
    )


def png_file(text: str) -> str:
    """An argparse ``type=``: a ``.png`` path that can be written now (checked by a probe)."""
    path = Path(text)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{text}: the picture is written as PNG; name a .png file")
    parent = path.parent
    if not parent.exists():
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not a directory")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: the file is not writable")
    try:
        # A real write, not os.access: a privileged user passes os.access everywhere, and a
        # read-only file system refuses writes whatever the permission bits say.
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".kv-plot-", suffix=".png"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise argparse.ArgumentTypeError(
            f"{text}: directory {parent} is not writable ({reason})"
        ) from None
    return text
