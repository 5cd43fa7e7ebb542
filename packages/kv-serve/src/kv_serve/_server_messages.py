"""Anthropic's Messages API on top of the chat pipeline: requests in, events and bodies out.

Pure Python (no MLX). :func:`messages_to_chat` checks a ``/v1/messages`` (or
``/v1/messages/count_tokens``) body field by field, naming Anthropic's fields in its errors,
and turns it into the OpenAI chat body the server already serves: ``system`` becomes a system
message, ``tool_use`` blocks an assistant message's ``tool_calls``, ``tool_result`` blocks
``tool`` messages, ``stop_sequences`` the stop strings, ``tool_choice`` ``any`` OpenAI's
``required``. A field the server cannot act on and whose absence leaves the answer a valid
one (``thinking`` on a model whose reasoning is not parsed, a server tool, an unknown field)
is accepted and reported (:mod:`._server_warnings`); ``cache_control`` is accepted without a
report (prefix caching is automatic). :func:`message_body` and :class:`MessageEvents` give
the answer back in Anthropic's shapes; :func:`anthropic_error` turns an error into
Anthropic's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._server_protocol import MAX_STOP_STRINGS, OpenAIError
from ._server_tools import ToolCall
from ._server_warnings import IgnoredField

__all__ = [
    "MessageEvents",
    "MessagesRequest",
    "anthropic_error",
    "message_body",
    "messages_to_chat",
    "stop_reason",
]

#: Every field of a Messages body: taken (mapped onto the chat pipeline), accepted without
#: effect on a local server, or ignored with a report (any other field is too).
_TAKEN = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
    }
)
_ACCEPTED = frozenset({"metadata", "service_tier"})
_IGNORED = {
    "thinking": "no thinking blocks: this server does not parse the model's reasoning",
    "container": "no code-execution container here",
    "mcp_servers": "no MCP servers here",
    "context_management": "no context management here",
}
_THINKING_TYPES = ("enabled", "disabled", "adaptive")
#: What count_tokens takes (no generation fields).
_COUNT = frozenset({"model", "messages", "system", "tools", "tool_choice"})
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class MessagesRequest:
    """A checked Messages body: the chat body it maps onto, and whether it streams."""

    chat: dict[str, Any]
    stream: bool = False
    #: The fields accepted without effect.
    ignored: tuple[IgnoredField, ...] = ()
    #: Where each chat message came from in the Messages body (``system``, ``messages[i]``).
    origins: tuple[str, ...] = ()

    def named(self, ignored: Sequence[IgnoredField]) -> list[IgnoredField]:
        """``ignored`` fields of the chat body renamed after the Messages body's."""
        out = []
        for item in ignored:
            head, dot, rest = item.name.partition("].")
            if dot and head.startswith("messages["):
                index = int(head.removeprefix("messages["))
                if index < len(self.origins):
                    item = IgnoredField(name=f"{self.origins[index]}.{rest}", reason=item.reason)
            out.append(item)
        return out


def _text_of(blocks: object, param: str) -> str:
    """The text of a string or a list of text blocks (a system prompt, a tool result)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad("must be a string or a list of text blocks", param)
    parts = []
    for j, block in enumerate(blocks):
        where = f"{param}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(f"only text blocks are supported here, got {kind!r}", where)
        text = block.get("text")
        if not isinstance(text, str):
            raise _bad("a text block needs a string text", where)
        parts.append(text)
    return "".join(parts)


def _user_turn(content: object, i: int) -> list[dict[str, Any]]:
    """A user message: ``tool`` messages for its tool results, then its text (if any)."""
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad("must be a string or a list of content blocks", param)
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        where = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_of([block], param))
        elif kind == "tool_result":
            ident = block.get("tool_use_id")
            if not isinstance(ident, str):
                raise _bad("a tool_result block needs a string tool_use_id", where)
            body = block.get("content", "")
            text = _text_of(body, f"{where}.content")
            is_error = block.get("is_error")
            if is_error is not None and not isinstance(is_error, bool):
                raise _bad("is_error must be a boolean", f"{where}.is_error")
            if is_error:
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": ident, "content": text})
        else:
            raise _bad(
                f"block type {kind!r} is not supported in a user message (text, tool_result)",
                f"{where}.type",
            )
    out = results
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    if not out:
        raise _bad("a user message needs at least one block", param)
    return out


def _assistant_turn(content: object, i: int, ignored: list[IgnoredField]) -> dict[str, Any]:
    """An assistant message: its text, ``tool_use`` blocks as ``tool_calls``, its thinking.

    ``thinking`` blocks go to the template as the message's ``reasoning_content`` (the name
    reasoning templates read); ``redacted_thinking`` blocks are ignored (``ignored``).
    """
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad("must be a string or a list of content blocks", param)
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_of([block], param))
        elif kind == "tool_use":
            ident, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(ident, str) or not isinstance(name, str):
                raise _bad("a tool_use block needs a string id and name", where)
            if not isinstance(arguments, dict):
                raise _bad("a tool_use block's input must be an object", f"{where}.input")
            calls.append(
                {
                    "id": ident,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
            )
        elif kind == "thinking":
            thought = block.get("thinking")
            if not isinstance(thought, str):
                raise _bad("a thinking block needs a string thinking", where)
            thoughts.append(thought)
        elif kind == "redacted_thinking":
            ignored.append(IgnoredField(name=where, reason="redacted thinking cannot be read"))
        else:
            raise _bad(
                f"block type {kind!r} is not supported in an assistant message (text, "
                "tool_use, thinking, redacted_thinking)",
                f"{where}.type",
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


_TOOL_KEYS = ("type", "name", "description", "input_schema", "cache_control")


def _tools(value: object, ignored: list[IgnoredField]) -> list[dict[str, Any]]:
    """The custom tools as OpenAI function tools; server tools are ignored (``ignored``)."""
    if not isinstance(value, list) or not value:
        raise _bad("must be a non-empty list of tools", "tools")
    tools = []
    for k, tool in enumerate(value):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise _bad("must be an object", where)
        kind = tool.get("type") or "custom"
        if kind != "custom":
            if not isinstance(kind, str):
                raise _bad(f"type must be a string, got {kind!r}", f"{where}.type")
            reason = f"tool type {kind} runs on Anthropic's servers or has no schema here"
            ignored.append(IgnoredField(name=where, reason=reason))
            continue
        for key in tool:
            if key not in _TOOL_KEYS:
                ignored.append(IgnoredField(name=f"{where}.{key}", reason="not a tool field"))
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad("input_schema must be a JSON schema object", f"{where}.input_schema")
        function: dict[str, Any] = {"name": tool.get("name"), "parameters": schema}
        if "description" in tool:
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: object) -> tuple[object, bool | None]:
    """OpenAI's ``tool_choice`` and ``parallel_tool_calls`` for Anthropic's ``tool_choice``."""
    if not isinstance(value, dict):
        raise _bad("must be an object with a type", "tool_choice")
    kind = value.get("type")
    keys = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    unknown = [k for k in value if k not in keys]
    if unknown:
        raise _bad(f"{unknown[0]!r} is not a field of this tool_choice", "tool_choice")
    disable = value.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise _bad("disable_parallel_tool_use must be a boolean", "tool_choice")
    parallel = None if disable is None else not disable
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": value.get("name")}}, parallel
    raise _bad(f"type must be auto, any, tool or none, got {kind!r}", "tool_choice.type")


def messages_to_chat(body: Mapping[str, Any], *, count_only: bool = False) -> MessagesRequest:
    """Check a Messages body and map it onto an OpenAI chat body (see the module's doc).

    With ``count_only`` the body is a ``count_tokens`` one (no generation fields). Raises
    :class:`OpenAIError` (400) naming the Anthropic field that is wrong.
    """
    allowed = _COUNT if count_only else _TAKEN | _ACCEPTED
    ignored: list[IgnoredField] = []
    for name, value in body.items():
        if name in _IGNORED:
            if name == "thinking":
                _check_thinking(value)
                if value is None or value.get("type") == "disabled":
                    continue
            if value is not None:
                ignored.append(IgnoredField(name=name, reason=_IGNORED[name]))
        elif name not in allowed and value is not None:
            why = "not a count_tokens field" if name in _TAKEN else "not a field this server knows"
            ignored.append(IgnoredField(name=name, reason=why))
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("the model is required (a string)", "model")
    chat: dict[str, Any] = {"model": model}
    if not count_only:
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _bad(f"max_tokens is required, an integer >= 1, got {max_tokens!r}", "max_tokens")
        chat["max_tokens"] = max_tokens
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
        origins.append("system")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise _bad("must be an object", f"messages[{i}]")
        for key in message:
            if key not in ("role", "content"):
                reason = "not a message field"
                ignored.append(IgnoredField(name=f"messages[{i}].{key}", reason=reason))
        role = message.get("role")
        if role == "user":
            turn = _user_turn(message.get("content"), i)
            messages.extend(turn)
            origins.extend([f"messages[{i}]"] * len(turn))
        elif role == "assistant":
            messages.append(_assistant_turn(message.get("content"), i, ignored))
            origins.append(f"messages[{i}]")
        elif role == "system":  # Claude Code sends system turns among the messages
            content = _text_of(message.get("content"), f"messages[{i}].content")
            messages.append({"role": "system", "content": content})
            origins.append(f"messages[{i}]")
        else:
            raise _bad(
                f"role must be user, assistant or system, got {role!r}", f"messages[{i}].role"
            )
    chat["messages"] = messages
    if body.get("tools") is not None:
        tools = _tools(body["tools"], ignored)
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        choice, parallel = _tool_choice(body["tool_choice"])
        chat["tool_choice"] = choice
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    if count_only:
        return MessagesRequest(chat, ignored=tuple(ignored), origins=tuple(origins))
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("must be a list of non-empty strings", "stop_sequences")
        if len(stops) > MAX_STOP_STRINGS:
            raise _bad(
                f"at most {MAX_STOP_STRINGS} stop sequences, got {len(stops)}", "stop_sequences"
            )
        if stops:
            chat["stop"] = stops
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, int | float):
            raise _bad("must be a number in 0..1", "temperature")
        if not 0 <= temperature <= 1:
            raise _bad(f"must be in 0..1, got {temperature}", "temperature")
    chat["temperature"] = 1.0 if temperature is None else float(temperature)
    for name in ("top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("top_k") is not None and (
        isinstance(body["top_k"], bool) or not isinstance(body["top_k"], int) or body["top_k"] < 1
    ):
        raise _bad("must be an integer >= 1", "top_k")
    metadata = body.get("metadata")
    if metadata is not None:
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
        if (
            not isinstance(metadata, dict)
            or set(metadata) - {"user_id"}
            or (user is not None and not isinstance(user, str))
        ):
            raise _bad("must be an object with an optional string user_id", "metadata")
    tier = body.get("service_tier")
    if tier is not None and tier not in ("auto", "standard_only"):
        raise _bad("must be auto or standard_only", "service_tier")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("must be a boolean", "stream")
    return MessagesRequest(chat, bool(stream), tuple(ignored), tuple(origins))


def _check_thinking(value: object) -> None:
    """Refuse a malformed ``thinking`` (its budget must be an integer >= 1024, as Anthropic's)."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") not in _THINKING_TYPES:
        raise _bad(f"must be an object whose type is {', '.join(_THINKING_TYPES)}", "thinking")
    budget = value.get("budget_tokens")
    if value.get("type") == "enabled" and (
        isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024
    ):
        raise _bad(
            f"budget_tokens must be an integer >= 1024, got {budget!r}", "thinking.budget_tokens"
        )


def anthropic_error(error: OpenAIError) -> dict[str, Any]:
    """The body of ``error`` in Anthropic's shape: ``{"type": "error", "error": {...}}``."""
    kind = _ERROR_TYPES.get(
        error.status, "api_error" if error.status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = {"arguments": call.arguments}
    if not isinstance(arguments, dict):
        arguments = {"value": arguments}
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": arguments,
    }


def stop_reason(finish: str | None, calls: Sequence[ToolCall], stop_string: str | None) -> str:
    """Anthropic's ``stop_reason`` for a sequence's end."""
    if calls and finish == "stop":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    if stop_string is not None:
        return "stop_sequence"
    return "end_turn"


def message_body(
    *,
    model: str,
    text: str,
    calls: Sequence[ToolCall],
    finish: str | None,
    stop_string: str | None,
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """A whole Messages response.

    ``input_tokens`` counts the whole prompt, ``cached_tokens`` the part the prefix cache
    served (Anthropic's usage reports them apart).
    """
    content: list[dict[str, Any]] = []
    if text:
        content.append({"type": "text", "text": text})
    content.extend(_tool_use(call) for call in calls)
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(finish, calls, stop_string),
        "stop_sequence": stop_string,
        "usage": {**input_usage(input_tokens, cached_tokens), "output_tokens": output_tokens},
    }


def input_usage(prompt_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's input usage: tokens read from the cache apart from the others."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def _event(kind: str, payload: Mapping[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"


class MessageEvents:
    """Anthropic's stream events for one message, as its text and calls arrive.

    ``message_start``; per content block ``content_block_start``, its deltas
    (``text_delta``, or one ``input_json_delta`` with a call's whole input) and
    ``content_block_stop``; then ``message_delta`` (stop reason, output tokens) and
    ``message_stop``.
    """

    def __init__(self, model: str, input_tokens: int) -> None:
        self._model = model
        self._input = input_tokens
        self._index = 0
        self._text_open = False

    def start(self) -> str:
        """The ``message_start`` event."""
        message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**input_usage(self._input, 0), "output_tokens": 0},
        }
        return _event("message_start", {"message": message})

    def text(self, piece: str) -> str:
        """Events for a piece of text (a text block is opened first when none is open)."""
        if not piece:
            return ""
        out = ""
        if not self._text_open:
            out += _event(
                "content_block_start",
                {"index": self._index, "content_block": {"type": "text", "text": ""}},
            )
            self._text_open = True
        delta = {"type": "text_delta", "text": piece}
        return out + _event("content_block_delta", {"index": self._index, "delta": delta})

    def _close_text(self) -> str:
        if not self._text_open:
            return ""
        self._text_open = False
        self._index += 1
        return _event("content_block_stop", {"index": self._index - 1})

    def tool_use(self, call: ToolCall) -> str:
        """The events of one whole tool call (a block of its own)."""
        block = _tool_use(call)
        out = self._close_text()
        index = self._index
        self._index += 1
        start = {**block, "input": {}}
        out += _event("content_block_start", {"index": index, "content_block": start})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        out += _event("content_block_delta", {"index": index, "delta": delta})
        return out + _event("content_block_stop", {"index": index})

    def stop(
        self, reason: str, stop_string: str | None, output_tokens: int, cached_tokens: int = 0
    ) -> str:
        """The closing events: the open block's stop, ``message_delta``, ``message_stop``.

        ``message_delta``'s usage is the whole message's: the input as the prefix cache
        served it (unknown at ``message_start``) and the output.
        """
        out = self._close_text()
        delta = {"stop_reason": reason, "stop_sequence": stop_string}
        usage = {**input_usage(self._input, cached_tokens), "output_tokens": output_tokens}
        out += _event("message_delta", {"delta": delta, "usage": usage})
        return out + _event("message_stop", {})

    @staticmethod
    def error(error: OpenAIError) -> str:
        """An ``error`` event (a failure after the stream began)."""
        return f"event: error\ndata: {json.dumps(anthropic_error(error))}\n\n"
