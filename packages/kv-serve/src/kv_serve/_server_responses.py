"""OpenAI's Responses API on top of the chat pipeline: a ``/v1/responses`` body as a chat body.

Pure Python (no MLX). :func:`responses_to_chat` checks a Responses body field by field, naming
the Responses field in its errors, and maps it onto the OpenAI chat body the server already
serves: ``instructions`` becomes the first system message, ``input`` items become messages
(a ``developer`` message a system one, ``function_call`` items an assistant message's
``tool_calls``, ``function_call_output`` items ``tool`` messages, ``reasoning`` items the next
assistant message's ``reasoning_content``), ``max_output_tokens`` ``max_tokens``,
``text.format`` ``response_format``, ``reasoning.effort`` ``reasoning_effort``. A ``custom``
(free-form) tool is offered to the model as a function taking one string, ``input``.

What a local server cannot act on and whose absence leaves the answer a valid one (a hosted
tool such as ``web_search``, ``namespace`` tools, a reasoning summary, an unknown field) is
accepted and reported (:mod:`._server_warnings`); what would change the answer and cannot
be done (``background``, stored ``prompt`` templates, ``conversation``, an ``item_reference``,
images) is a 400 naming the field. ``previous_response_id`` continues a response this server
stored (:class:`~kv_serve._server_response_output.ResponseStore`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._server_errors import OpenAIError
from ._server_fields import MAX_TOKENS_LIMIT, Endpoint, FieldRule
from ._server_warnings import IgnoredField

__all__ = [
    "CUSTOM_TOOL_INPUT",
    "RESPONSES_FIELDS",
    "ResponsesRequest",
    "responses_to_chat",
]

#: The one argument a custom (free-form) tool's function form takes: the tool's input text.
CUSTOM_TOOL_INPUT = "input"

_R: tuple[Endpoint, ...] = ("responses",)

#: Every field of a Responses body and what the server does with it (the README's table).
RESPONSES_FIELDS: tuple[FieldRule, ...] = (
    FieldRule("model", _R, "honoured", "the served model's id; another is a 404"),
    FieldRule(
        "input",
        _R,
        "honoured",
        "a string or a list of items (messages, function calls and outputs, reasoning)",
    ),
    FieldRule("instructions", _R, "honoured", "the first system message"),
    FieldRule("max_output_tokens", _R, "honoured", "as chat's max_tokens"),
    FieldRule("temperature", _R, "honoured", "0..2; 0 is greedy"),
    FieldRule("top_p", _R, "honoured", "(0, 1]"),
    FieldRule("stream", _R, "honoured", "the Responses event stream"),
    FieldRule("stream_options", _R, "accepted", "include_obfuscation: nothing is padded"),
    FieldRule(
        "tools",
        _R,
        "honoured",
        "function and custom tools; hosted and namespace tools are ignored with a warning",
    ),
    FieldRule(
        "tool_choice",
        _R,
        "honoured",
        "none, auto, required, a named function or custom tool, allowed_tools",
    ),
    FieldRule("parallel_tool_calls", _R, "honoured", "false: at most one call"),
    FieldRule(
        "text",
        _R,
        "honoured",
        "format: text, json_object or json_schema (grammar-decoded); verbosity is ignored",
    ),
    FieldRule(
        "reasoning", _R, "honoured", "effort is handed to the chat template; summary is ignored"
    ),
    FieldRule(
        "store",
        _R,
        "honoured",
        "default true: kept in memory (bounded) for previous_response_id and GET",
    ),
    FieldRule(
        "previous_response_id",
        _R,
        "honoured",
        "a response this server stored; its conversation goes first",
    ),
    FieldRule(
        "include", _R, "accepted", "reasoning comes back as reasoning items; nothing is encrypted"
    ),
    FieldRule("metadata", _R, "honoured", "echoed in the response"),
    FieldRule("user", _R, "accepted", "a string; nothing is tracked"),
    FieldRule("safety_identifier", _R, "accepted", "a string; nothing is tracked"),
    FieldRule("prompt_cache_key", _R, "accepted", "a string; prefix caching is automatic"),
    FieldRule("prompt_cache_retention", _R, "accepted", "prefix caching is automatic"),
    FieldRule("prompt_cache_options", _R, "accepted", "prefix caching is automatic"),
    FieldRule("service_tier", _R, "accepted", "one tier"),
    FieldRule(
        "truncation",
        _R,
        "honoured",
        "disabled: a prompt past the context is a 400; auto is ignored with a warning",
    ),
    FieldRule("top_logprobs", _R, "ignored", "no logprobs in Responses output here"),
    FieldRule("max_tool_calls", _R, "ignored", "no hosted tools run here"),
    FieldRule("context_management", _R, "ignored", "no server-side compaction here"),
    FieldRule("moderation", _R, "ignored", "no moderation model here"),
    FieldRule("image", _R, "ignored", "no image generation here"),
    FieldRule("access_programs", _R, "ignored", "no access programs here"),
    FieldRule("background_options", _R, "ignored", "no background responses here"),
    FieldRule("background", _R, "refused", "true: background responses are not supported"),
    FieldRule("prompt", _R, "refused", "stored prompt templates are not supported"),
    FieldRule(
        "conversation", _R, "refused", "conversations are not stored; use previous_response_id"
    ),
)

#: Chat fields a Responses body may also carry (the common extensions and sampling fields).
_CHAT_PASSED = frozenset(
    {
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "min_tokens",
        "stop_token_ids",
        "chat_template_kwargs",
    }
)
_KNOWN = frozenset(r.name for r in RESPONSES_FIELDS)
_IGNORED = {r.name: r.note for r in RESPONSES_FIELDS if r.treatment == "ignored"}
#: Tool types run on OpenAI's servers, or by a client only for OpenAI's own models.
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True, kw_only=True)
class ResponsesRequest:
    """A checked Responses body: the chat body it maps onto and what the answer echoes."""

    chat: dict[str, Any]
    stream: bool = False
    store: bool = True
    #: The fields accepted without effect.
    ignored: tuple[IgnoredField, ...] = ()
    #: Where each chat message came from in the Responses body (``instructions``,
    #: ``input``, ``input[i]``, ``previous_response_id``).
    origins: tuple[str, ...] = ()
    #: The names of the custom (free-form) tools among ``chat["tools"]``.
    custom_tools: frozenset[str] = frozenset()
    #: The request's fields the response object repeats (tools, tool_choice, ...).
    echo: dict[str, Any] = field(default_factory=dict)
    #: The conversation the next response may continue: the chat messages less the
    #: instructions (OpenAI does not carry instructions over).
    history: tuple[dict[str, Any], ...] = ()

    def named(self, ignored: Sequence[IgnoredField]) -> list[IgnoredField]:
        """``ignored`` fields of the chat body renamed after the Responses body's."""
        out = []
        for item in ignored:
            if item.name == "max_tokens":
                item = IgnoredField(name="max_output_tokens", reason=item.reason)
            head, dot, rest = item.name.partition("].")
            if dot and head.startswith("messages["):
                index = int(head.removeprefix("messages["))
                if index < len(self.origins):
                    item = IgnoredField(name=f"{self.origins[index]}.{rest}", reason=item.reason)
            out.append(item)
        return out


def _text(value: object, param: str, kinds: tuple[str, ...]) -> str:
    """A content string, or the text of a list of text parts of ``kinds``."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad("must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(value):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad("must be an object", where)
        kind = part.get("type")
        if kind not in kinds:
            what = (
                "images and files cannot be read by this text-only server"
                if kind
                in (
                    "input_image",
                    "input_file",
                    "input_audio",
                )
                else f"expected one of {', '.join(kinds)}"
            )
            raise _bad(f"content type {kind!r} is not supported: {what}", f"{where}.type")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise _bad("needs a string text", where)
        texts.append(text)
    return "".join(texts)


def _arguments(value: object, param: str) -> str:
    """A function call's ``arguments``: a JSON string (an object)."""
    if not isinstance(value, str):
        raise _bad("must be a JSON string", param)
    try:
        json.loads(value)
    except json.JSONDecodeError as err:
        raise _bad(f"is not JSON: {err}", param) from None
    return value


class _Conversation:
    """The chat messages ``input`` items add up to, with where each came from."""

    def __init__(self, ignored: list[IgnoredField]) -> None:
        self.messages: list[dict[str, Any]] = []
        self.origins: list[str] = []
        self.ignored = ignored
        self._thought: list[str] = []

    def add(self, message: dict[str, Any], origin: str) -> None:
        if self._thought and message["role"] != "assistant":
            self.dropped_thought(origin)
        self.messages.append(message)
        self.origins.append(origin)

    def assistant(self, origin: str) -> dict[str, Any]:
        """The assistant message to extend: the last one, unless a user or tool spoke since."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.add(last, origin)
        if self._thought:
            last["reasoning_content"] = last.get("reasoning_content", "") + "".join(self._thought)
            self._thought = []
        return last

    def dropped_thought(self, origin: str) -> None:
        """Reasoning no assistant output follows cannot go into the conversation."""
        self._thought = []
        reason = "reasoning with no assistant output after it"
        self.ignored.append(IgnoredField(name=f"reasoning before {origin}", reason=reason))

    def finish(self) -> None:
        """The end of the items: reasoning still waiting for its output is dropped."""
        if self._thought:
            self.dropped_thought("the end of input")

    def call(self, ident: str, name: str, arguments: str, origin: str) -> None:
        message = self.assistant(origin)
        message.setdefault("tool_calls", []).append(
            {"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}}
        )

    def item(self, item: object, i: int) -> None:
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad("must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(
                    f"role must be user, system, developer or assistant, got {role!r}",
                    f"{where}.role",
                )
            if role == "assistant":
                kinds: tuple[str, ...] = ("output_text", "input_text", "refusal")
                text = _text(item.get("content"), f"{where}.content", kinds)
                message = self.assistant(where)
                message["content"] = message["content"] + text
                return
            text = _text(item.get("content"), f"{where}.content", ("input_text",))
            self.add({"role": _ROLES[role], "content": text}, where)
        elif kind in ("function_call", "custom_tool_call"):
            ident, name = item.get("call_id"), item.get("name")
            if not isinstance(ident, str) or not ident or not isinstance(name, str):
                raise _bad("needs a string call_id and name", where)
            if kind == "function_call":
                arguments = _arguments(item.get("arguments"), f"{where}.arguments")
            else:
                given = item.get("input")
                if not isinstance(given, str):
                    raise _bad("input must be a string", f"{where}.input")
                arguments = json.dumps({CUSTOM_TOOL_INPUT: given})
            self.call(ident, name, arguments, where)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            ident = item.get("call_id")
            if not isinstance(ident, str) or not ident:
                raise _bad("needs a string call_id", where)
            output = _text(item.get("output"), f"{where}.output", ("input_text", "output_text"))
            self.add({"role": "tool", "tool_call_id": ident, "content": output}, where)
        elif kind == "reasoning":
            # The reasoning text itself where the item has it, else its summary.
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise _bad("content and summary must be lists of text parts", where)
            texts = [p.get("text") if isinstance(p, dict) else None for p in parts]
            if not all(isinstance(t, str) for t in texts):
                raise _bad("reasoning parts need a string text", where)
            if texts:
                self._thought.extend(str(t) for t in texts)
            elif item.get("encrypted_content") is not None:
                self.ignored.append(
                    IgnoredField(name=where, reason="encrypted reasoning cannot be read here")
                )
        elif kind == "item_reference":
            raise _bad(
                "an item_reference needs stored conversation items; send the item itself", where
            )
        else:
            if not isinstance(kind, str):
                raise _bad(f"type must be a string, got {kind!r}", f"{where}.type")
            reason = f"{kind} items come from tools that do not run here"
            self.ignored.append(IgnoredField(name=where, reason=reason))


def _tools(
    value: object, ignored: list[IgnoredField]
) -> tuple[list[dict[str, Any]], frozenset[str]]:
    """Function and custom tools as chat function tools; the others are ignored."""
    if not isinstance(value, list):
        raise _bad("must be a list of tools", "tools")
    tools: list[dict[str, Any]] = []
    custom: set[str] = set()
    for k, tool in enumerate(value):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise _bad("must be an object", where)
        kind = tool.get("type")
        name = tool.get("name")
        if kind in ("function", "custom"):
            if not isinstance(name, str) or not name:
                raise _bad("needs a string name", f"{where}.name")
            function: dict[str, Any] = {"name": name}
            description = tool.get("description")
            if description is not None:
                if not isinstance(description, str):
                    raise _bad("must be a string", f"{where}.description")
                function["description"] = description
            if kind == "function":
                parameters = tool.get("parameters")
                if parameters is not None:
                    if not isinstance(parameters, dict):
                        raise _bad("must be a JSON schema object", f"{where}.parameters")
                    function["parameters"] = parameters
            else:
                custom.add(name)
                if tool.get("format") not in (None, {"type": "text"}):
                    reason = "a custom tool's grammar is not enforced; its input is free text"
                    ignored.append(IgnoredField(name=f"{where}.format", reason=reason))
                function["parameters"] = {
                    "type": "object",
                    "properties": {CUSTOM_TOOL_INPUT: {"type": "string"}},
                    "required": [CUSTOM_TOOL_INPUT],
                }
            tools.append({"type": "function", "function": function})
            continue
        if not isinstance(kind, str):
            raise _bad(f"type must be a string, got {kind!r}", f"{where}.type")
        reason = (
            "namespaced tools are not offered to the model here"
            if kind == "namespace"
            else f"{kind} tools run on OpenAI's servers or only for OpenAI's models"
        )
        ignored.append(IgnoredField(name=where, reason=reason))
    return tools, frozenset(custom)


def _tool_choice(value: object, tools: list[dict[str, Any]]) -> tuple[object, list[dict[str, Any]]]:
    """Chat's ``tool_choice`` for the Responses one, and the tools it leaves offered."""
    if value in ("none", "auto", "required"):
        return value, tools
    if not isinstance(value, dict):
        raise _bad('must be "none", "auto", "required" or an object with a type', "tool_choice")
    kind = value.get("type")
    names = [t["function"]["name"] for t in tools]
    if kind in ("function", "custom"):
        name = value.get("name")
        if name not in names:
            raise _bad(
                f"names tool {name!r}, which is not among the tools ({', '.join(names)})",
                "tool_choice.name",
            )
        return {"type": "function", "function": {"name": name}}, tools
    if kind == "allowed_tools":
        mode = value.get("mode", "auto")
        allowed = value.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise _bad(
                "allowed_tools needs mode auto or required and a list of tools", "tool_choice"
            )
        wanted = {t.get("name") for t in allowed if isinstance(t, dict)}
        kept = [t for t in tools if t["function"]["name"] in wanted]
        if not kept:
            raise _bad("allows none of the tools given", "tool_choice.tools")
        return mode, kept
    raise _bad(
        f"type {kind!r} names a tool that does not run here (function, custom or allowed_tools)",
        "tool_choice.type",
    )


def _text_format(value: object, ignored: list[IgnoredField]) -> dict[str, Any] | None:
    """Chat's ``response_format`` for ``text`` (its ``format``); ``verbosity`` is ignored."""
    if not isinstance(value, dict):
        raise _bad("must be an object", "text")
    for key in value:
        if key not in ("format", "verbosity"):
            ignored.append(IgnoredField(name=f"text.{key}", reason="not a text field"))
    if value.get("verbosity") is not None:
        ignored.append(IgnoredField(name="text.verbosity", reason="the model takes no verbosity"))
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("must be an object with a type", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise _bad(f"type must be text, json_object or json_schema, got {kind!r}", "text.format.type")


def _reasoning(value: object, chat: dict[str, Any], ignored: list[IgnoredField]) -> None:
    if not isinstance(value, dict):
        raise _bad("must be an object", "reasoning")
    effort = value.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise _bad("must be a string", "reasoning.effort")
        chat["reasoning_effort"] = effort
    for key in value:
        if key != "effort" and value[key] is not None:
            reason = "reasoning comes back whole, not summarised"
            ignored.append(IgnoredField(name=f"reasoning.{key}", reason=reason))


def responses_to_chat(
    body: Mapping[str, Any],
    previous: Callable[[str], Sequence[dict[str, Any]] | None] | None = None,
) -> ResponsesRequest:
    """Check a Responses body and map it onto an OpenAI chat body (see the module's doc).

    ``previous(id)`` gives the conversation a stored response ended with (``None``: not
    stored). Raises :class:`OpenAIError` (400, or 404 for an unknown previous response)
    naming the Responses field that is wrong.
    """
    ignored: list[IgnoredField] = []
    chat: dict[str, Any] = {}
    for name, value in body.items():
        if value is None:
            continue
        if name in _CHAT_PASSED:
            chat[name] = value
        elif name in _IGNORED:
            ignored.append(IgnoredField(name=name, reason=_IGNORED[name]))
        elif name not in _KNOWN:
            ignored.append(IgnoredField(name=name, reason="not a field this server knows"))
    if body.get("background"):
        raise OpenAIError(
            400,
            "background: background responses are not supported by this server; leave it "
            "false and stream instead",
            param="background",
            code="unsupported_parameter",
        )
    for name in ("prompt", "conversation"):
        if body.get(name) is not None:
            note = next(r.note for r in RESPONSES_FIELDS if r.name == name)
            raise OpenAIError(
                400,
                f"{name} is not supported by this server ({note})",
                param=name,
                code="unsupported_parameter",
            )
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("the model is required (a string)", "model")
    chat["model"] = model
    conversation = _Conversation(ignored)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("must be a string", "instructions")
        if instructions:
            conversation.add({"role": "system", "content": instructions}, "instructions")
    first = len(conversation.messages)
    previous_id = body.get("previous_response_id")
    if previous_id is not None:
        if not isinstance(previous_id, str):
            raise _bad("must be a string", "previous_response_id")
        earlier = previous(previous_id) if previous is not None else None
        if earlier is None:
            raise OpenAIError(
                404,
                f"previous_response_id: no stored response {previous_id!r} (this server keeps "
                "responses made with store: true, in memory, until it restarts or they are "
                "evicted)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        for message in earlier:
            conversation.add(json.loads(json.dumps(message)), "previous_response_id")
    given = body.get("input")
    if given is None:
        raise _bad("input is required (a string or a list of items)", "input")
    if isinstance(given, str):
        conversation.add({"role": "user", "content": given}, "input")
    elif isinstance(given, list):
        for i, item in enumerate(given):
            conversation.item(item, i)
    else:
        raise _bad("must be a string or a list of items", "input")
    conversation.finish()
    if not conversation.messages:
        raise _bad("holds no message the model can read", "input")
    chat["messages"] = conversation.messages
    history = tuple(conversation.messages[first:])
    tools: list[dict[str, Any]] = []
    custom: frozenset[str] = frozenset()
    if body.get("tools") is not None:
        tools, custom = _tools(body["tools"], ignored)
    choice = body.get("tool_choice")
    if choice is not None and (tools or choice not in ("none", "auto")):
        choice, tools = _tool_choice(choice, tools)
        chat["tool_choice"] = choice
    if tools:
        chat["tools"] = tools
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if (
            isinstance(limit, bool)
            or not isinstance(limit, int)
            or not 1 <= limit <= MAX_TOKENS_LIMIT
        ):
            raise _bad(f"must be an integer >= 1, got {limit!r}", "max_output_tokens")
        chat["max_tokens"] = limit
    for name in ("temperature", "top_p", "user", "metadata"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("text") is not None:
        fmt = _text_format(body["text"], ignored)
        if fmt is not None:
            chat["response_format"] = fmt
    if body.get("reasoning") is not None:
        _reasoning(body["reasoning"], chat, ignored)
    truncation = body.get("truncation")
    if truncation not in (None, "disabled", "auto"):
        raise _bad(f"must be auto or disabled, got {truncation!r}", "truncation")
    if truncation == "auto":
        reason = "nothing is dropped: a prompt past the context is a 400"
        ignored.append(IgnoredField(name="truncation", reason=reason))
    include = body.get("include")
    if include is not None and (
        not isinstance(include, list) or not all(isinstance(v, str) for v in include)
    ):
        raise _bad("must be a list of strings", "include")
    stream = body.get("stream")
    store = body.get("store")
    for name, flag in (("stream", stream), ("store", store)):
        if flag is not None and not isinstance(flag, bool):
            raise _bad("must be a boolean", name)
    echo = {
        name: body.get(name)
        for name in (
            "instructions",
            "max_output_tokens",
            "metadata",
            "previous_response_id",
            "temperature",
            "top_p",
            "user",
            "truncation",
        )
    }
    echo["tools"] = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    echo["tool_choice"] = body.get("tool_choice") or "auto"
    echo["parallel_tool_calls"] = body.get("parallel_tool_calls") is not False
    echo["text"] = body.get("text") or {"format": {"type": "text"}}
    echo["reasoning"] = body.get("reasoning")
    return ResponsesRequest(
        chat=chat,
        stream=bool(stream),
        store=store is not False,
        ignored=tuple(ignored),
        origins=tuple(conversation.origins),
        custom_tools=custom,
        echo=echo,
        history=history,
    )
