"""Tool calling on the OpenAI side: checked ``tools`` / ``tool_choice``, and finding the calls.

Pure Python (no MLX, no grammar library). :func:`parse_tools` checks a chat body's ``tools``,
``tool_choice`` and ``parallel_tool_calls``; :func:`check_tool_messages` checks that every
``role: tool`` message answers a call an earlier assistant message made. :class:`ToolCallText`
splits a model's output into content and tool calls, streamed or at once, with the model
family's own parser (mlx-lm's: the tokenizer's ``tool_call_start`` / ``tool_call_end``
markers and ``tool_parser``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

__all__ = [
    "Tool",
    "ToolCall",
    "OutputSplitter",
    "ToolCallText",
    "ToolChoice",
    "ToolError",
    "ToolFormat",
    "ToolRequest",
    "check_tool_messages",
    "parse_tools",
    "split_piece",
    "tool_calls_of_message",
]

ToolChoice = Literal["none", "auto", "required", "function"]
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


class ToolError(ValueError):
    """A bad ``tools`` / ``tool_choice`` / tool message: ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description and JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})

    def template_form(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's / Hugging Face's shape)."""
        function: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's checked tools: which may be called, and how the choice is made.

    ``choice`` is ``none`` (no call: the output is text), ``auto`` (the model decides; its
    calls are parsed), ``required`` (at least one call, enforced by a grammar) or
    ``function`` (a call of ``name``, enforced); ``parallel`` false allows one call.
    """

    tools: tuple[Tool, ...]
    choice: ToolChoice = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def enforced(self) -> tuple[Tool, ...]:
        """The tools a grammar must make the output call (none unless required or named)."""
        if self.choice == "required":
            return self.tools
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.name)
        return ()

    @property
    def parses(self) -> bool:
        """Whether the output is searched for tool calls."""
        return self.choice != "none"


def _tool(value: object, i: int) -> Tool:
    param = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type") != "function":
        raise ToolError(f'{param} must be an object with "type": "function"', param)
    unknown = [k for k in value if k not in _TOOL_KEYS]
    if unknown:
        raise ToolError(f"{param}.{unknown[0]} is not a tool field", f"{param}.{unknown[0]}")
    function = value.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{param}.function must be an object", f"{param}.function")
    unknown = [k for k in function if k not in _FUNCTION_KEYS]
    if unknown:
        raise ToolError(
            f"{param}.function.{unknown[0]} is not a function field (name, description, "
            "parameters, strict)",
            f"{param}.function.{unknown[0]}",
        )
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(
            f"{param}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
            f"{param}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(
            f"{param}.function.description must be a string", f"{param}.function.description"
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{param}.function.strict must be a boolean", f"{param}.function.strict")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolError(
            f"{param}.function.parameters must be a JSON schema object",
            f"{param}.function.parameters",
        )
    return Tool(name, description, parameters)


def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """The checked ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body.

    ``None`` when no tools are given (then ``tool_choice`` may only be ``none`` or ``auto``,
    and ``parallel_tool_calls`` only null). Raises :class:`ToolError` naming the field.
    """
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(
            f"parallel_tool_calls must be a boolean, got {parallel!r}", "parallel_tool_calls"
        )
    if raw is None:
        if choice not in (None, "none", "auto"):
            raise ToolError(f"tool_choice {choice!r} needs tools", "tool_choice")
        if parallel is not None:
            raise ToolError("parallel_tool_calls needs tools", "parallel_tool_calls")
        return None
    if not isinstance(raw, list) or not raw:
        raise ToolError("tools must be a non-empty list of function tools", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolError(f"tools name {twice[0]!r} more than once", "tools")
    kind: ToolChoice
    name = None
    if choice is None or choice == "auto":
        kind = "auto"
    elif choice in ("none", "required"):
        kind = choice
    elif isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict):
            raise ToolError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", '
                '"function": {"name": ...}}',
                "tool_choice",
            )
        name = function.get("name")
        if name not in names:
            raise ToolError(
                f"tool_choice names function {name!r}, which is not among the tools "
                f"({', '.join(names)})",
                "tool_choice.function.name",
            )
        kind = "function"
    else:
        raise ToolError(
            f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
            "tool_choice",
        )
    return ToolRequest(tools, kind, name, True if parallel is None else parallel)


def check_tool_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Every ``tool`` message must answer a call an earlier assistant message made."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or ():
            called.add(call["id"])
        if message.get("role") != "tool":
            continue
        ident = message.get("tool_call_id")
        if not isinstance(ident, str):
            raise ToolError(
                f"messages[{i}] (role tool) needs a tool_call_id", f"messages[{i}].tool_call_id"
            )
        if ident not in called:
            raise ToolError(
                f"messages[{i}].tool_call_id {ident!r} answers no tool call of an earlier "
                "assistant message",
                f"messages[{i}].tool_call_id",
            )


def tool_calls_of_message(value: object, i: int) -> list[dict[str, Any]]:
    """An assistant message's checked ``tool_calls``, arguments as objects (for templates).

    Returns the calls in the shape chat templates take (``function.arguments`` a dict, as
    Hugging Face's templates expect), each with its ``id``.
    """
    param = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise ToolError(f"{param} must be a list", param)
    calls = []
    for j, call in enumerate(value):
        where = f"{param}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ToolError(f'{where} must be a {{"type": "function"}} call', where)
        ident = call.get("id")
        function = call.get("function")
        if not isinstance(ident, str) or not isinstance(function, dict):
            raise ToolError(f"{where} needs a string id and a function object", where)
        name = function.get("name")
        arguments = function.get("arguments")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise ToolError(
                f"{where}.function needs a string name and arguments (a JSON string)",
                f"{where}.function",
            )
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ToolError(
                f"{where}.function.arguments is not JSON: {err}", f"{where}.function.arguments"
            ) from None
        calls.append(
            {"id": ident, "type": "function", "function": {"name": name, "arguments": parsed}}
        )
    return calls


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a tool call: the markers around one, and the text's parser.

    ``parse(text, tools)`` turns the text between the markers into ``{"name": ...,
    "arguments": ...}`` (mlx-lm's tool parsers). ``json`` says a call's text is one JSON
    object ``{"name", "arguments"}`` (Hermes / Qwen style), the form a grammar can enforce.
    """

    start: str
    end: str
    parse: Callable[[str, Any], Any]
    json: bool = False


@dataclass(frozen=True)
class ToolCall:
    """One parsed call, in OpenAI's shape once :meth:`openai` is called."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as ``tool_calls[]`` holds it (with ``index`` in a streamed delta)."""
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out = {"index": index, **out}
        return out


class ToolCallText:
    """Splits generated text into content and tool calls, as it streams.

    :meth:`push` takes the next piece of text and returns the content that can be shown now
    and the calls completed by it; text that may be the start of a call is held back until
    it is known. :meth:`finish` returns what is left: an unfinished call stays content, and so
    does a call the model's parser cannot read.
    With ``single``, only the first call is kept and the rest of the output is dropped.
    """

    def __init__(self, fmt: ToolFormat, tools: Sequence[Tool], *, single: bool = False) -> None:
        self._fmt = fmt
        self._tools = [t.template_form() for t in tools]
        self._single = single
        self._held = ""
        self._inside = False
        # Whitespace after a call, shown only if more text follows.
        self._space = ""
        self.calls: list[ToolCall] = []
        self.content = ""
        #: Always empty: these formats carry no separate reasoning.
        self.reasoning = ""

    def take_reasoning(self) -> str:
        """The reasoning added since the last call: none in these formats."""
        return ""

    def push(self, piece: str) -> tuple[str, list[ToolCall]]:
        """The content to send now and the calls that ``piece`` completed."""
        self._held += piece
        shown = ""
        done: list[ToolCall] = []
        while True:
            if self._single and self.calls:
                self._held = ""
                break
            if self._inside:
                end = self._held.find(self._fmt.end)
                if end < 0:
                    break
                body, self._held = self._held[:end], self._held[end + len(self._fmt.end) :]
                self._inside = False
                call = self._call(body)
                if call is None:  # its parser cannot read it: it stays text
                    shown += self._outside(self._fmt.start + body + self._fmt.end)
                    continue
                self.calls.append(call)
                done.append(call)
                continue
            start = self._held.find(self._fmt.start)
            if start >= 0:
                shown += self._outside(self._held[:start])
                self._held = self._held[start + len(self._fmt.start) :]
                self._inside = True
                continue
            keep = _partial_suffix(self._held, self._fmt.start)
            shown += self._outside(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            break
        self.content += shown
        return shown, done

    def _outside(self, text: str) -> str:
        """Text outside the calls, less whitespace that only separates calls."""
        if not self.calls:
            return text
        self._space += text
        if not self._space.strip():
            return ""
        out, self._space = self._space, ""
        return out

    def finish(self) -> str:
        """The content still held (an unfinished call is given back as text)."""
        rest = (self._fmt.start + self._held) if self._inside else self._held
        self._held = ""
        self._inside = False
        if self._single and self.calls:
            return ""
        rest = self._outside(rest)
        self._space = ""
        self.content += rest
        return rest

    def _call(self, body: str) -> ToolCall | None:
        """The call ``body`` writes, or ``None`` where the model's parser cannot read it."""
        try:
            parsed = self._fmt.parse(body, self._tools)
        except Exception:  # the model wrote something its parser cannot read
            return None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return None
        arguments = parsed.get("arguments", {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", parsed["name"], text)


class OutputSplitter(Protocol):
    """Splits a chat sequence's text into content, reasoning and tool calls as it streams.

    :class:`ToolCallText` (calls between markers) and the harmony splitter implement it.
    """

    calls: list[ToolCall]
    content: str
    reasoning: str

    def push(self, piece: str) -> tuple[str, list[ToolCall]]:
        """The content to show now and the calls ``piece`` completed."""
        ...

    def finish(self) -> str:
        """The content still held, at the end of the output."""
        ...

    def take_reasoning(self) -> str:
        """The reasoning text added since the last call."""
        ...


def split_piece(splitter: OutputSplitter, piece: str, *, last: bool) -> tuple[str, list[ToolCall]]:
    """Feed ``piece`` (the output's last with ``last``): the content to show and new calls.

    The calls include any that only the end of the output completes.
    """
    before = len(splitter.calls)
    shown, _ = splitter.push(piece)
    if last:
        shown += splitter.finish()
    return shown, splitter.calls[before:]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
