"""OpenAI's Responses API, the answer side: output items, the response object, its events.

Pure Python (no MLX). A generated sequence becomes output items: a ``reasoning`` item (the
model's reasoning, where its format has one), a ``message`` item with one ``output_text``
part, and a ``function_call`` (or ``custom_tool_call``) item per call. :class:`ResponseEvents`
streams them in the order the official ``openai`` client's stream helper and Codex expect:
``response.created`` and ``response.in_progress``; per item ``response.output_item.added``,
its content part, its deltas, their ``done`` events and ``response.output_item.done``; then
``response.completed`` (``response.incomplete`` when cut at ``max_output_tokens``,
``response.failed`` when the engine failed). Every event carries a ``sequence_number``.

:class:`ResponseStore` keeps finished responses (``store: true``, the default) in memory,
bounded, for ``previous_response_id`` and ``GET /v1/responses/{id}``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._server_errors import OpenAIError
from ._server_responses import CUSTOM_TOOL_INPUT, ResponsesRequest
from ._server_tools import ToolCall

__all__ = [
    "ResponseEvents",
    "ResponseStore",
    "ResponseUsage",
    "assistant_message",
    "new_response_id",
    "output_items",
    "response_object",
]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_response_id() -> str:
    """A fresh response id (``resp_...``)."""
    return _id("resp")


@dataclass(frozen=True, kw_only=True)
class ResponseUsage:
    """A response's token counts: the prompt (and the part the prefix cache served), output."""

    input_tokens: int
    cached_tokens: int
    output_tokens: int

    def body(self) -> dict[str, Any]:
        """The ``usage`` object."""
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


def _reasoning_item(ident: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": ident, "type": "reasoning", "summary": [], "content": content, "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(ident: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _custom_input(call: ToolCall) -> str:
    """A custom tool's input text: its one ``input`` argument (the raw text if unreadable)."""
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments
    value = arguments.get(CUSTOM_TOOL_INPUT) if isinstance(arguments, dict) else None
    return value if isinstance(value, str) else call.arguments


def _call_item(call: ToolCall, custom: frozenset[str], status: str, whole: bool) -> dict[str, Any]:
    """A call's item (its arguments or input left empty until ``whole``)."""
    if call.name in custom:
        return {
            "id": _id("ctc"),
            "type": "custom_tool_call",
            "call_id": call.id,
            "name": call.name,
            "input": _custom_input(call) if whole else "",
            "status": status,
        }
    return {
        "id": _id("fc"),
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if whole else "",
        "status": status,
    }


def output_items(
    reasoning: str, text: str, calls: Sequence[ToolCall], custom: frozenset[str]
) -> list[dict[str, Any]]:
    """A finished sequence's output items: reasoning, the message, the calls (each if any)."""
    items = []
    if reasoning:
        items.append(_reasoning_item(_id("rs"), reasoning, "completed"))
    if text or not calls:
        items.append(_message_item(_id("msg"), text, "completed"))
    items.extend(_call_item(call, custom, "completed", True) for call in calls)
    return items


def assistant_message(reasoning: str, text: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The chat message a stored response adds to its conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [call.openai() for call in calls]
    return message


def _status(finish: str | None) -> tuple[str, dict[str, Any] | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish == "error":
        return "failed", None
    return "completed", None


def response_object(
    request: ResponsesRequest,
    *,
    ident: str,
    created_at: int,
    model: str,
    output: list[dict[str, Any]],
    finish: str | None,
    usage: ResponseUsage | None,
    error: OpenAIError | None = None,
) -> dict[str, Any]:
    """The ``response`` object (``finish`` ``None``: still in progress)."""
    status, incomplete = _status(finish) if finish is not None else ("in_progress", None)
    if error is not None:
        status, incomplete = "failed", None
    echo = request.echo
    body: dict[str, Any] = {
        "id": ident,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None
        if error is None
        else {"code": error.code or "server_error", "message": error.message},
        "incomplete_details": incomplete,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"),
        "metadata": echo.get("metadata") or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "previous_response_id": echo.get("previous_response_id"),
        "reasoning": echo.get("reasoning") or {"effort": None, "summary": None},
        "store": request.store,
        "temperature": 1.0 if echo.get("temperature") is None else echo["temperature"],
        "text": echo.get("text") or {"format": {"type": "text"}},
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": echo.get("tools") or [],
        "top_p": 1.0 if echo.get("top_p") is None else echo["top_p"],
        "truncation": echo.get("truncation") or "disabled",
        "usage": None if usage is None else usage.body(),
        "user": echo.get("user"),
    }
    if finish is not None and error is None:
        body["completed_at"] = int(time.time())
    return body


class ResponseEvents:
    """The Responses event stream of one response, as its reasoning, text and calls arrive.

    :meth:`start` opens it; :meth:`reasoning`, :meth:`text` and :meth:`call` each return the
    events for what arrived (an item is opened when its first piece comes and closed when
    another kind of output follows); :meth:`finish` or :meth:`fail` close it. The finished
    items are kept (:attr:`items`) for the final response object.
    """

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.request = request
        self.model = model
        self.id = new_response_id()
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []
        self._sequence = 0
        # The item being streamed (reasoning or message), its text so far.
        self._open: dict[str, Any] | None = None
        self._open_text = ""

    def _event(self, kind: str, payload: Mapping[str, Any]) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _response(
        self,
        finish: str | None,
        usage: ResponseUsage | None = None,
        error: OpenAIError | None = None,
    ) -> dict[str, Any]:
        return response_object(
            self.request,
            ident=self.id,
            created_at=self.created_at,
            model=self.model,
            output=list(self.items) if finish is not None else [],
            finish=finish,
            usage=usage,
            error=error,
        )

    def start(self) -> list[str]:
        """``response.created`` and ``response.in_progress``."""
        snapshot = {"response": self._response(None)}
        return [
            self._event("response.created", snapshot),
            self._event("response.in_progress", snapshot),
        ]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def _open_item(self, item: dict[str, Any], part: dict[str, Any]) -> str:
        self._open = item
        self._open_text = ""
        out = self._event(
            "response.output_item.added", {"output_index": len(self.items), "item": item}
        )
        return out + self._event(
            "response.content_part.added", {**self._where(), "content_index": 0, "part": part}
        )

    def _close(self) -> str:
        item = self._open
        if item is None:
            return ""
        text = self._open_text
        if item["type"] == "reasoning":
            done = _reasoning_item(item["id"], text, "completed")
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            out = self._event(
                "response.reasoning_text.done", {**self._where(), "content_index": 0, "text": text}
            )
        else:
            done = _message_item(item["id"], text, "completed")
            part = _text_part(text)
            out = self._event(
                "response.output_text.done",
                {**self._where(), "content_index": 0, "text": text, "logprobs": []},
            )
        out += self._event(
            "response.content_part.done", {**self._where(), "content_index": 0, "part": part}
        )
        out += self._event(
            "response.output_item.done", {"output_index": len(self.items), "item": done}
        )
        self.items.append(done)
        self._open = None
        return out

    def reasoning(self, piece: str) -> str:
        """Events for a piece of reasoning."""
        if not piece:
            return ""
        out = ""
        if self._open is not None and self._open["type"] != "reasoning":
            out += self._close()
        if self._open is None:
            item = _reasoning_item(_id("rs"), "", "in_progress")
            out += self._open_item(item, {"type": "reasoning_text", "text": ""})
        self._open_text += piece
        delta = {**self._where(), "content_index": 0, "delta": piece}
        return out + self._event("response.reasoning_text.delta", delta)

    def text(self, piece: str) -> str:
        """Events for a piece of the answer's text."""
        if not piece:
            return ""
        out = ""
        if self._open is not None and self._open["type"] != "message":
            out += self._close()
        if self._open is None:
            out += self._open_item(_message_item(_id("msg"), None, "in_progress"), _text_part(""))
        self._open_text += piece
        delta = {**self._where(), "content_index": 0, "delta": piece, "logprobs": []}
        return out + self._event("response.output_text.delta", delta)

    def call(self, call: ToolCall) -> str:
        """The events of one whole call (an item of its own)."""
        out = self._close()
        custom = self.request.custom_tools
        opened = _call_item(call, custom, "in_progress", False)
        done = {**_call_item(call, custom, "completed", True), "id": opened["id"]}
        index = len(self.items)
        where = {"item_id": opened["id"], "output_index": index}
        out += self._event("response.output_item.added", {"output_index": index, "item": opened})
        if done["type"] == "custom_tool_call":
            out += self._event(
                "response.custom_tool_call_input.delta", {**where, "delta": done["input"]}
            )
            out += self._event(
                "response.custom_tool_call_input.done", {**where, "input": done["input"]}
            )
        else:
            arguments = done["arguments"]
            out += self._event(
                "response.function_call_arguments.delta", {**where, "delta": arguments}
            )
            out += self._event(
                "response.function_call_arguments.done",
                {**where, "name": call.name, "arguments": arguments},
            )
        out += self._event("response.output_item.done", {"output_index": index, "item": done})
        self.items.append(done)
        return out

    def finish(self, finish: str | None, usage: ResponseUsage) -> tuple[str, dict[str, Any]]:
        """The closing events (``completed`` or ``incomplete``) and the final response."""
        out = self._close()
        if not self.items:  # an empty answer is still one message, as OpenAI's
            out += self._open_item(_message_item(_id("msg"), None, "in_progress"), _text_part(""))
            out += self._close()
        response = self._response(finish or "stop", usage)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, {"response": response}), response

    def fail(self, error: OpenAIError) -> str:
        """``response.failed``: the engine failed after the stream began."""
        out = self._close()
        return out + self._event(
            "response.failed", {"response": self._response("error", error=error)}
        )


@dataclass(frozen=True)
class _Stored:
    body: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    chars: int


class ResponseStore:
    """Finished responses kept in memory for ``previous_response_id`` and ``GET``.

    At most ``max_responses`` responses and about ``max_chars`` characters of their
    conversations are kept; the least recently used go first.
    """

    def __init__(self, max_responses: int = 256, max_chars: int = 64 << 20) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._kept: OrderedDict[str, _Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, body: dict[str, Any], conversation: Sequence[dict[str, Any]]) -> None:
        """Keep ``body`` (a finished response) and the conversation it ended."""
        chars = len(json.dumps(list(conversation))) + len(json.dumps(body))
        if chars > self.max_chars or self.max_responses < 1:
            return
        with self._lock:
            self._drop(body["id"])
            self._kept[body["id"]] = _Stored(body, tuple(conversation), chars)
            self._chars += chars
            while len(self._kept) > self.max_responses or self._chars > self.max_chars:
                self._drop(next(iter(self._kept)))

    def _drop(self, ident: str) -> bool:
        stored = self._kept.pop(ident, None)
        if stored is None:
            return False
        self._chars -= stored.chars
        return True

    def conversation(self, ident: str) -> list[dict[str, Any]] | None:
        """The conversation response ``ident`` ended (``None``: not kept)."""
        with self._lock:
            stored = self._kept.get(ident)
            if stored is None:
                return None
            self._kept.move_to_end(ident)
            return list(stored.conversation)

    def get(self, ident: str) -> dict[str, Any] | None:
        """Response ``ident``'s object (``None``: not kept)."""
        with self._lock:
            stored = self._kept.get(ident)
            return None if stored is None else stored.body

    def delete(self, ident: str) -> bool:
        """Forget response ``ident``; whether it was kept."""
        with self._lock:
            return self._drop(ident)
