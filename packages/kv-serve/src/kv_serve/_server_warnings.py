"""Request fields the server accepts without acting on them, and how a client is told.

A real client sends fields a local server cannot act on (a hosted tool, a thinking budget
on a model without a reasoning format, a field of a newer API version). Refusing them turns
the client away; ignoring them silently hides that the answer was made without them. So
such a field is accepted with a visible warning: every answer to the request carries an
``X-KV-Serve-Ignored`` header listing the ignored fields' names and a ``Warning`` header
(code 299) saying why for each, and the server logs one line the first time it ignores a
field of that name for an API. What would change the answer and cannot be done is still
refused by name (a 400), before anything is queued.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "IGNORED_HEADER",
    "MAX_HEADER_CHARS",
    "IgnoredField",
    "IgnoredFieldLog",
    "ignored_headers",
]

#: The response header that lists the names of the request fields the server ignored.
IGNORED_HEADER = "X-KV-Serve-Ignored"
#: The longest value either header gets (clients and proxies bound a header's size).
MAX_HEADER_CHARS = 2048

_log = logging.getLogger("kv_serve")
_UNSAFE = re.compile(r'[^\x20-\x7e]|["\\]')


@dataclass(frozen=True, kw_only=True)
class IgnoredField:
    """One request field accepted without effect: its path in the body and why."""

    #: The field's path in the request body (``thinking``, ``tools[2]``, ``messages[0].x``).
    name: str
    #: Why it has no effect here, one short clause.
    reason: str


def _header_text(text: str) -> str:
    """``text`` as printable ASCII without quotes or backslashes (a header's quoted string)."""
    return _UNSAFE.sub("?", text)


def ignored_headers(ignored: Iterable[IgnoredField]) -> dict[str, str]:
    """The response headers that report ``ignored`` (none when nothing was ignored)."""
    fields = list(ignored)
    if not fields:
        return {}
    names = _bounded(", ".join(_header_text(f.name) for f in fields))
    reasons = _bounded(_header_text("; ".join(f"{f.name}: {f.reason}" for f in fields)))
    return {IGNORED_HEADER: names, "Warning": f'299 kv-serve "ignored {reasons}"'}


def _bounded(text: str) -> str:
    """``text`` cut to :data:`MAX_HEADER_CHARS` (``...`` at the end where cut)."""
    return text if len(text) <= MAX_HEADER_CHARS else text[: MAX_HEADER_CHARS - 3] + "..."


class IgnoredFieldLog:
    """Logs the first time a field of each name is ignored on each API (a warning line)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def note(self, api: str, ignored: Iterable[IgnoredField]) -> None:
        """Log the fields of ``ignored`` not yet logged for ``api`` (by name, indices dropped)."""
        for item in ignored:
            key = (api, re.sub(r"\[\d+\]", "[]", item.name))
            with self._lock:
                if key in self._seen:
                    continue
                self._seen.add(key)
            _log.warning(
                "%s: ignored request field %s (%s); further requests with it are answered "
                "with the %s header only",
                api,
                key[1],
                item.reason,
                IGNORED_HEADER,
            )
