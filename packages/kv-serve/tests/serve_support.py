"""Helpers shared by kv-serve's HTTP tests.

Official clients bound to a running server, the ``serve`` fixture's type, and the wait for a
server to go idle with every page given back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Protocol

import anthropic
import openai

from kv_serve import KVServer, RunningServer

__all__ = [
    "Serve",
    "anthropic_client",
    "openai_client",
    "pages_used",
    "serving",
    "wait_idle",
]


class Serve(Protocol):
    """The ``serve`` fixture: start a ``KVServer`` on a free port (arguments as its own)."""

    def __call__(self, model: Any, tokenizer: Any, /, **settings: Any) -> RunningServer: ...


def serving() -> Iterator[Serve]:
    """The ``serve`` fixture (a module's): each server it starts stops when the module ends."""
    with contextlib.ExitStack() as started:

        def start(model: Any, tokenizer: Any, /, **settings: Any) -> RunningServer:
            return started.enter_context(KVServer(model, tokenizer, **settings).running())

        yield start


def openai_client(running: RunningServer) -> openai.OpenAI:
    """The official OpenAI client on ``running``'s ``/v1``, with no retries."""
    return openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)


def anthropic_client(running: RunningServer) -> anthropic.Anthropic:
    """The official Anthropic client on ``running``, with no retries."""
    return anthropic.Anthropic(base_url=running.url, api_key="none", max_retries=0, timeout=60)


def pages_used(running: RunningServer) -> dict[str, int]:
    """The pages each sub-pool of the server's engine holds now."""
    return dict(running.server.worker.snapshot().pages_used)


def wait_idle(running: RunningServer, timeout: float = 10.0) -> None:
    """Wait until no request is active or running and every page is free; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = running.server.worker.snapshot()
        if snap.active == 0 and snap.running == 0 and not any(snap.pages_used.values()):
            return
        time.sleep(0.01)
    raise AssertionError(
        f"requests or pages left on the server: {running.server.worker.snapshot()}"
    )
