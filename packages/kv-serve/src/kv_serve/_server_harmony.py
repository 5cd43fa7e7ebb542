"""gpt-oss's harmony output: channels split into content, reasoning and tool calls.

A harmony model answers in messages, each ``<|channel|>NAME [to=RECIPIENT] [<|constrain|>
json]<|message|>TEXT`` ended by ``<|end|>`` (another message follows after ``<|start|>
assistant``), ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool is called). The
``final`` channel is the answer (``content``), ``analysis`` the model's reasoning
(``reasoning_content``, as vLLM and SGLang return it), and a ``commentary`` message addressed
``to=functions.NAME`` a call of ``NAME`` whose text is its JSON arguments. mlx-lm has no parser
for it; :class:`HarmonyText` is this server's, streamed or at once, with the interface of
:class:`~kv_serve._server_tools.ToolCallText`. Pure Python.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ._server_tools import ToolCall, _partial_suffix

__all__ = ["HARMONY_MARKERS", "HarmonyText", "harmony_call_grammar", "is_harmony"]

#: The special tokens a harmony tokenizer has (and its chat template writes).
HARMONY_MARKERS = ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|call|>")
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_FUNCTIONS = "functions."
#: A header longer than this without ``<|message|>`` is not one: it is shown as text.
_LONGEST_HEADER = 256


def is_harmony(tokenizer: Any) -> bool:
    """Whether a tokenizer speaks harmony: its markers are tokens and its template writes them."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "<|channel|>" not in template:
        return False
    vocab = tokenizer.get_vocab()
    return all(marker in vocab for marker in HARMONY_MARKERS)


def harmony_call_grammar(tools: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """A Lark grammar (llguidance's dialect) of one harmony call of one of ``tools``.

    ``tools`` are ``(name, parameters schema)`` pairs; the markers are matched as the special
    tokens they are (``<|channel|>``), never as their spelling in ordinary tokens.
    """
    options = []
    rules = []
    for i, (name, parameters) in enumerate(tools):
        options.append(f"call{i}")
        rules.append(
            f'call{i}: {json.dumps(name)} " " <|constrain|> "json" <|message|> args{i} <|call|>'
        )
        rules.append(f"args{i}: %json {json.dumps(dict(parameters))}")
    head = f'start: <|channel|> "commentary to={_FUNCTIONS}" ({" | ".join(options)})'
    return "\n".join([head, *rules]) + "\n"


class HarmonyText:
    """Splits a harmony model's output into content, reasoning and tool calls, as it streams.

    :meth:`push` takes the next piece of text and returns the content that can be shown now
    and the calls it completed; reasoning (the ``analysis`` channel) collects in
    :attr:`reasoning` (:meth:`take_reasoning` returns what is new). Text that may be a marker
    is held until it is known. ``parse`` false (``tool_choice: none``) or a call whose text is
    not JSON leaves the call's text as content; with ``single`` only the first call is kept.
    Output that is not harmony at all (no header) is content.
    """

    def __init__(self, *, parse: bool = True, single: bool = False) -> None:
        self._parse = parse
        self._single = single
        self._held = ""
        # The model starts right after "<|start|>assistant": in a header, or in plain text.
        self._mode = "start"
        self._channel = ""
        self._recipient = ""
        self._body = ""
        self._taken = 0
        self.calls: list[ToolCall] = []
        self.content = ""
        self.reasoning = ""

    def take_reasoning(self) -> str:
        """The reasoning text added since the last call."""
        out = self.reasoning[self._taken :]
        self._taken = len(self.reasoning)
        return out

    def push(self, piece: str) -> tuple[str, list[ToolCall]]:
        """The content to send now and the calls that ``piece`` completed."""
        self._held += piece
        shown = ""
        done: list[ToolCall] = []
        while self._held:
            if self._mode == "start":
                if not self._decide_start():
                    break
                continue
            if self._mode == "header":
                if not self._read_header():
                    break
                continue
            step_shown, call, ended = self._read_body(final=False)
            shown += step_shown
            if call is not None:
                done.append(call)
            if not ended:
                break
        self.content += shown
        return shown, done

    def finish(self) -> str:
        """The content still held: an open message's text, or a header that never closed.

        A call whose text runs to the end of the output (``<|call|>`` is an end-of-sequence
        token, so it is not in the text) completes here: it is appended to :attr:`calls`.
        """
        shown = ""
        if self._mode in ("start", "header"):
            shown = self._held
            self._held = ""
        elif self._mode == "body":
            # A call's text ends with the output when <|call|> is an end-of-sequence token.
            shown = self._read_body(final=True)[0]
        self._mode = "start"
        self.content += shown
        return shown

    def _decide_start(self) -> bool:
        """At a message's start: a header follows, or plain text does. False: wait for more."""
        text = self._held
        for marker in ("<|start|>", "<|channel|>"):
            if text.startswith(marker):
                self._mode = "header"
                return True
            if marker.startswith(text):
                return False
        self._mode = "body"
        self._channel, self._recipient = "final", ""
        return True

    def _read_header(self) -> bool:
        at = self._held.find("<|message|>")
        if at < 0:
            if len(self._held) > _LONGEST_HEADER:
                self._mode, self._channel, self._recipient = "body", "final", ""
                return True
            return False
        header, self._held = self._held[:at], self._held[at + len("<|message|>") :]
        header = header.replace("<|start|>", " ").replace("<|constrain|>", " ")
        words = header.replace("<|channel|>", " <|channel|> ").split()
        channel = ""
        recipient = ""
        for i, word in enumerate(words):
            if word == "<|channel|>" and i + 1 < len(words):
                channel = words[i + 1]
            elif word.startswith("to="):
                recipient = word[3:]
        self._channel, self._recipient, self._body = channel or "final", recipient, ""
        self._mode = "body"
        return True

    def _is_call(self) -> bool:
        return self._parse and self._recipient.startswith(_FUNCTIONS)

    def _read_body(self, *, final: bool) -> tuple[str, ToolCall | None, bool]:
        """Text of the open message: (content shown, a completed call, whether it ended)."""
        ends = [(self._held.find(e), e) for e in _ENDS if e in self._held]
        if ends:
            at, marker = min(ends)
            text, self._held = self._held[:at], self._held[at + len(marker) :]
            ended = True
        elif final:
            text, self._held, ended = self._held, "", True
        else:
            keep = max(_partial_suffix(self._held, e) for e in _ENDS)
            text = self._held[: len(self._held) - keep]
            self._held = self._held[len(self._held) - keep :]
            ended = False
        if ended:
            self._mode = "start"
        if self._is_call():
            self._body += text
            if not ended:
                return "", None, False
            if self._single and self.calls:  # one call wanted: later ones are dropped
                return "", None, True
            call = self._call(self._body)
            if call is None:
                return self._body, None, True
            return "", call, True
        if self._recipient.startswith(_FUNCTIONS):  # a call, not parsed: shown as written
            self._body += text
            if not ended:
                return "", None, False
            return f"to={self._recipient} {self._body}", None, True
        if self._channel == "analysis":
            self.reasoning += text
            return "", None, ended
        return text, None, ended

    def _call(self, body: str) -> ToolCall | None:
        try:
            arguments = json.loads(body)
        except json.JSONDecodeError:
            return None
        call = ToolCall(
            f"call_{uuid.uuid4().hex[:24]}",
            self._recipient[len(_FUNCTIONS) :],
            json.dumps(arguments),
        )
        self.calls.append(call)
        return call
