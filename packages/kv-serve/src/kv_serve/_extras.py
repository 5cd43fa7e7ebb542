"""kv-serve's optional extras: which modules each needs, and the error when one is missing."""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRA_MODULES", "MissingExtraError", "require_extra"]

#: The top-level modules each optional extra of kv-serve installs and its code imports.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "server": ("fastapi", "starlette", "uvicorn"),
    "gguf": ("gguf", "transformers"),
}

_WHAT = {"server": "the HTTP server", "gguf": "loading GGUF files"}


class MissingExtraError(ImportError):
    """A part of kv-serve was used without the optional extra that installs its dependencies."""


def require_extra(extra: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` if any module it installs is absent.

    It only looks the modules up (nothing is imported), so it costs no import time.
    """
    missing = [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(
            f"{_WHAT[extra]} needs kv-serve's {extra!r} extra ({', '.join(missing)} not "
            f"installed): pip install 'kv-serve[{extra}]'",
            name=missing[0],
        )
