"""The OpenAI request side: errors in OpenAI's JSON shape and checked request fields.

Pure Python (no MLX): request bodies are checked here before anything reaches the engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CompletionRequest",
    "OpenAIError",
    "parse_chat_request",
    "parse_completion_request",
    "parse_json_body",
]

#: The most stop strings one request may give (OpenAI's limit).
MAX_STOP_STRINGS = 4
_ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(Exception):
    """An HTTP error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """A checked request of either endpoint (``prompt`` xor ``messages`` is set)."""

    model: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad(f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(
            f"the request body must be a JSON object, got {type(body).__name__}",
            code="invalid_json",
        )
    return body


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _int(body: Mapping[str, Any], name: str, *, minimum: int, maximum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _bad(f"{name} must be an integer, got {_type_name(value)} {value!r}", name)
    if not minimum <= value <= maximum:
        raise _bad(f"{name} must be in {minimum}..{maximum}, got {value}", name)
    return int(value)


def _number(
    body: Mapping[str, Any],
    name: str,
    default: float,
    *,
    minimum: float,
    maximum: float,
    min_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{name} must be a number, got {_type_name(value)} {value!r}", name)
    number = float(value)
    low_ok = number > minimum if min_open else number >= minimum
    if not math.isfinite(number) or not low_ok or number > maximum:
        bracket = "(" if min_open else "["
        raise _bad(f"{name} must be in {bracket}{minimum}, {maximum}], got {value!r}", name)
    return number


def _bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean, got {_type_name(value)} {value!r}", name)
    return value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad(f"stop must be a string or a list of strings, got {value!r}", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise _bad(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(items)}", "stop")
    if any(not s for s in items):
        raise _bad("stop strings must not be empty", "stop")
    return tuple(items)


def _unsupported(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad(f"only n=1 is supported, got n={n!r}", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise _bad(f"only best_of=1 is supported, got {best_of!r}", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and value != 0:
            raise _bad(f"{name} is not supported (only 0), got {value!r}", name)
    if body.get("echo"):
        raise _bad("echo is not supported", "echo")
    if body.get("suffix"):
        raise _bad("suffix is not supported", "suffix")
    if body.get("logprobs") not in (None, False, 0):
        raise _bad("logprobs are not supported", "logprobs")
    if body.get("tools") or body.get("functions"):
        raise _bad("tool and function calling are not supported", "tools")


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    model = body.get("model")
    if model is None:
        raise _bad("you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise _bad(f"model must be a string, got {_type_name(model)} {model!r}", "model")
    _unsupported(body)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options must be an object", "stream_options")
        include_usage = _bool(options, "include_usage")
    return {
        "model": model,
        "temperature": _number(body, "temperature", 1.0, minimum=0.0, maximum=2.0),
        "top_p": _number(body, "top_p", 1.0, minimum=0.0, maximum=1.0, min_open=True),
        "seed": _int(body, "seed", minimum=-(2**63), maximum=2**64 - 1),
        "stop": _stop(body),
        "stream": _bool(body, "stream"),
        "include_usage": include_usage,
        "return_token_ids": _bool(body, "return_token_ids"),
    }


#: No request may ask for more tokens than this, whatever the context (a sanity bound).
MAX_TOKENS_LIMIT = 2**31 - 1


def parse_completion_request(body: Mapping[str, Any]) -> CompletionRequest:
    """Check a ``/v1/completions`` body."""
    common = _common(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("you must provide a prompt", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise _bad("prompt must not be empty", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise _bad(
                "prompt must be a string, a list of token ids, or a list of one of those "
                "(one prompt per request)",
                "prompt",
            )
    elif not isinstance(prompt, str):
        raise _bad(
            f"prompt must be a string or a list of token ids, got {_type_name(prompt)}", "prompt"
        )
    max_tokens = _int(body, "max_tokens", minimum=1, maximum=MAX_TOKENS_LIMIT)
    return CompletionRequest(
        prompt=prompt, max_tokens=16 if max_tokens is None else max_tokens, **common
    )


def _content(message: Mapping[str, Any], index: int) -> str:
    content = message.get("content")
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad(f"{param}: only text parts are supported", param)
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"{param}: a text part needs a string 'text'", param)
            parts.append(text)
        return "".join(parts)
    raise _bad(f"{param} must be a string or a list of text parts", param)


def parse_chat_request(body: Mapping[str, Any]) -> CompletionRequest:
    """Check a ``/v1/chat/completions`` body."""
    common = _common(body)
    messages = body.get("messages")
    if messages is None:
        raise _bad("you must provide messages", "messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    checked: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in _ROLES:
            raise _bad(
                f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                f"messages[{i}].role",
            )
        checked.append({"role": str(role), "content": _content(message, i)})
    max_tokens = _int(body, "max_completion_tokens", minimum=1, maximum=MAX_TOKENS_LIMIT)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", minimum=1, maximum=MAX_TOKENS_LIMIT)
    return CompletionRequest(messages=checked, max_tokens=max_tokens, **common)
