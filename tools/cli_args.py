"""Typed command-line values shared by every entry point in ``tools/``.

One mechanism for every option: each option's ``type=`` is a function from this module, which
refuses a bad value while argparse parses (so before any model is built or anything runs), and
:class:`ArgumentParser` reports any parse error as exactly one ``error: ...`` line on stderr
with exit status 2, never a traceback. Ranges are checked by ``kv_protocol.check_int`` and
``kv_protocol.check_number``, the rule every kv-* entry point uses.

The benchmarks build their parsers from the same option groups (``add_model_options``,
``add_workload_options``, ``add_engine_options``, ``add_trained_model_options``,
``add_run_options``), so an option means and checks the same in every one of them.
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
    "Shown",
    "add_engine_options",
    "add_model_options",
    "add_run_options",
    "add_trained_model_options",
    "add_workload_options",
    "budget_mib",
    "existing_directory",
    "finite_float",
    "int_in_range",
    "int_list",
    "layer_count",
    "markdown_file",
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
    if Path(text).suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{text}: the picture is written as PNG; name a .png file")
    return _writable_file(text)


def markdown_file(text: str) -> str:
    """An argparse ``type=``: a ``.md`` path that can be written now (checked by a probe)."""
    if Path(text).suffix.lower() != ".md":
        raise argparse.ArgumentTypeError(
            f"{text}: the results are written as Markdown; name a .md file"
        )
    return _writable_file(text)


def _writable_file(text: str) -> str:
    """``text`` if a file can be written there now: its directory exists and takes a file."""
    path = Path(text)
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
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".kv-probe-", suffix=path.suffix):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise argparse.ArgumentTypeError(
            f"{text}: directory {parent} is not writable ({reason})"
        ) from None
    return text


# ------------------------------------------------------------------ option groups of the benchmarks

#: ``type=`` of ``--layers``: the generated models alternate sliding and full layers.
layer_count = int_in_range(
    2, MAX_LAYERS, why="; layers alternate sliding/full, so 2 is the fewest with a full one"
)

#: A default an option group shows: an int (the default), a text (``None`` until the
#: benchmark fills it in; the text says what it becomes), or ``None`` (no such option).
Shown = int | str | None


def _default(value: int | str) -> tuple[int | None, str]:
    return (value, str(value)) if isinstance(value, int) else (None, value)


def add_model_options(
    parser: argparse.ArgumentParser, *, layers: int = 4, window: int = 128, sizes: bool = False
) -> argparse._ArgumentGroup:
    """``--layers`` and ``--window`` of the random-weight model (``tools.harness.build_model``).

    With ``sizes``, also its ``--hidden`` size and ``--experts``.
    """
    group = parser.add_argument_group("random-weight model")
    group.add_argument(
        "--layers",
        type=layer_count,
        default=layers,
        help=f"model layers, alternating sliding/full, 2..{MAX_LAYERS} (default {layers})",
    )
    group.add_argument(
        "--window",
        type=positive_int(MAX_TOKENS),
        default=window,
        help=f"sliding window (default {window})",
    )
    if sizes:
        group.add_argument(
            "--hidden",
            type=positive_int(4096),
            default=64,
            help="hidden size of the random-weight model (default 64)",
        )
        group.add_argument(
            "--experts",
            type=positive_int(256),
            default=2,
            help="experts of the random-weight model, half of them routed per token (default 2)",
        )
    return group


def add_trained_model_options(
    parser: argparse.ArgumentParser, *, default: str | None, help: str, dtype: bool = False
) -> argparse._ArgumentGroup:
    """``--model`` (a trained model: ``gemma3-270m``, a ``.gguf``, a directory), ``--dtype``."""
    group = parser.add_argument_group("trained model")
    group.add_argument(
        "--model", type=model_source, default=default, metavar="NAME_OR_PATH", help=help
    )
    if dtype:
        group.add_argument(
            "--dtype",
            choices=("float32", "bfloat16", "float16"),
            default="float32",
            help="weights of --model (default float32)",
        )
    return group


def add_workload_options(
    parser: argparse.ArgumentParser,
    *,
    requests: Shown = None,
    min_prompt: Shown = None,
    max_prompt: Shown = None,
    min_out: Shown = None,
    max_out: Shown = None,
    seed: bool = True,
) -> argparse._ArgumentGroup:
    """The random workload's sizes (each option only where a default is given) and ``--seed``."""
    group = parser.add_argument_group("workload")
    options = (
        ("--requests", requests, MAX_REQUESTS, "number of requests"),
        ("--min-prompt", min_prompt, MAX_TOKENS, "shortest prompt in tokens"),
        ("--max-prompt", max_prompt, MAX_TOKENS, "longest prompt in tokens"),
        ("--min-out", min_out, MAX_TOKENS, "fewest output tokens of a request"),
        ("--max-out", max_out, MAX_TOKENS, "most output tokens of a request"),
    )
    for flag, shown, maximum, what in options:
        if shown is None:
            continue
        value, text = _default(shown)
        group.add_argument(
            flag,
            type=positive_int(maximum),
            default=value,
            help=f"{what}, 1..{maximum} (default {text})",
        )
    if seed:
        group.add_argument(
            "--seed", type=random_seed, default=0, help="workload seed, 0..2**32-1 (default 0)"
        )
    return group


def add_engine_options(
    parser: argparse.ArgumentParser,
    *,
    running: int | None = 16,
    page_size: int | None = 16,
    chunk: int = 512,
    stall: list[float] | bool | None = False,
) -> argparse._ArgumentGroup:
    """The engine and its pool: ``--running``, ``--page-size``, ``--chunk``, ``--stall``.

    ``running`` or ``page_size`` ``None``: no such option. ``stall``: ``False`` adds no
    ``--stall``; ``None`` one value (default: none); a list of values one engine run per
    value (``nargs="+"``) with that default.
    """
    group = parser.add_argument_group("engine and pool")
    if running is not None:
        group.add_argument(
            "--running",
            type=positive_int(MAX_REQUESTS),
            default=running,
            help=f"most requests decoding at once (default {running})",
        )
    if page_size is not None:
        group.add_argument(
            "--page-size",
            type=positive_int(MAX_PAGE_SIZE),
            default=page_size,
            help=f"pool page size, 1..{MAX_PAGE_SIZE} (default {page_size})",
        )
    group.add_argument(
        "--chunk",
        type=positive_int(MAX_TOKENS),
        default=chunk,
        help=f"prefill chunk in tokens (default {chunk})",
    )
    stall_type = finite_float(0.0, 1000.0, min_inclusive=False)
    if isinstance(stall, list):
        group.add_argument(
            "--stall",
            type=stall_type,
            nargs="+",
            default=stall,
            help="the engine's prefill_stall, one engine run per value (default "
            f"{' '.join(f'{s:g}' for s in stall)})",
        )
    elif stall is None:
        group.add_argument(
            "--stall",
            type=stall_type,
            default=None,
            help="the engine's prefill_stall (default: none, --chunk tokens a step)",
        )
    return group


def add_run_options(
    parser: argparse.ArgumentParser, *, quick: str | None, rounds: int | None = None
) -> argparse._ArgumentGroup:
    """``--quick`` (``quick`` says what it runs), ``--rounds`` and ``--markdown [FILE]``.

    ``--markdown`` alone prints the results as Markdown too; ``--markdown FILE.md`` writes
    them there (with the command, the machine and the date), e.g. into ``docs/results/``.
    """
    group = parser.add_argument_group("run")
    if quick is not None:
        group.add_argument("--quick", action="store_true", help=quick)
    if rounds is not None:
        group.add_argument(
            "--rounds",
            type=positive_int(16),
            default=rounds,
            help=f"rounds of every system in alternating order, 1..16 (default {rounds})",
        )
    group.add_argument(
        "--markdown",
        type=markdown_file,
        nargs="?",
        const="-",
        default=None,
        metavar="FILE.md",
        help="also print the results as Markdown, or write them to FILE.md (with the command, "
        "the machine and the date), e.g. docs/results/NAME.md",
    )
    return group
