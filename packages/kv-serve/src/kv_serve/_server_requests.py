"""A request body checked and turned into engine work: its prompts, sampling and limits.

Everything a request can be refused for before anything is queued is refused here: the
wrong model, a chat without a chat template, a prompt that encodes to nothing, a prompt plus
``max_tokens`` beyond the context or beyond what the KV pool could ever hold, sampling values
the engine refuses, output constraints the model cannot follow (:mod:`._server_policy`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kv_batching import SamplingParams
from kv_pool import pages_per_request
from kv_protocol import RequestStateError

from ._server_harmony import HarmonyText
from ._server_policy import OutputPolicy
from ._server_protocol import (
    MESSAGE_KEYS,
    CompletionRequest,
    OpenAIError,
    parse_chat_request,
    parse_completion_request,
)
from ._server_text import IncrementalDecoder
from ._server_tools import OutputSplitter, ToolCallText, ToolFormat
from ._server_warnings import IgnoredField, IgnoredFieldLog
from ._server_worker import EngineWorker, RequestParams

__all__ = ["PreparedRequest", "Prompt", "RequestPreparer", "model_not_found"]


def model_not_found(name: str, served: str) -> OpenAIError:
    """The 404 for a request naming model ``name`` of a server that serves ``served``."""
    return OpenAIError(
        404,
        f"The model {name!r} does not exist; this server serves {served!r}",
        param="model",
        code="model_not_found",
    )


@dataclass
class Prompt:
    """One prompt of a request: its tokens, the text ``echo`` gives back, its engine params.

    ``skip_special``: the prompt was text, so its special tokens (BOS) are no part of the
    echoed text. ``skip_first``: a token-id prompt starting with the BOS that encoding a text
    adds; it is not echoed either, so a text and its token ids echo the same.
    """

    tokens: list[int]
    echo_text: str
    skip_special: bool
    skip_first: bool
    params: RequestParams
    _pieces: tuple[list[str], list[int]] | None = None

    def pieces(self, tokenizer: Any) -> tuple[list[str], list[int]]:
        """Each prompt token's text and where it starts in the echoed text."""
        if self._pieces is None:
            decoder = IncrementalDecoder(tokenizer, skip_special_tokens=self.skip_special)
            skipped = 1 if self.skip_first else 0
            pieces: list[str] = [""] * skipped
            offsets: list[int] = [0] * skipped
            at = 0
            for token in self.tokens[skipped:]:
                offsets.append(at)
                pieces.append(decoder.push(token))
                at += len(pieces[-1])
            pieces[-1] += decoder.flush()
            self._pieces = pieces, offsets
        return self._pieces


@dataclass
class PreparedRequest:
    """A checked request: its prompts with their engine parameters."""

    request: CompletionRequest
    prompts: list[Prompt]
    chat: bool
    #: Token ids that end a sequence without text: end-of-sequence and stop_token_ids.
    hidden: frozenset[int]
    #: How the model writes tool calls, when the request's output is searched for them.
    tool_format: ToolFormat | None = None
    #: The model answers in harmony channels (gpt-oss): every chat output is split.
    harmony: bool = False
    #: The request's fields accepted without effect (its own, and what the template ignored).
    ignored: tuple[IgnoredField, ...] = ()

    def tool_text(self) -> OutputSplitter | None:
        """A splitter of one sequence's output into content and tool calls (or ``None``)."""
        tools = self.request.tools
        if self.harmony and self.chat:
            parse = tools is not None and tools.parses
            return HarmonyText(parse=parse, single=tools is not None and not tools.parallel)
        if self.tool_format is None or tools is None:
            return None
        return ToolCallText(self.tool_format, tools.tools, single=not tools.parallel)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the request (each prompt once, whatever ``n``)."""
        return sum(len(p.tokens) for p in self.prompts)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt alone is answered (one token is run)."""
        return self.request.echo and self.request.max_tokens == 0


@dataclass
class RequestPreparer:
    """Checks request bodies against the served model and prepares them for the engine."""

    tokenizer: Any
    model_name: str
    max_context: int
    worker: EngineWorker
    policy: OutputPolicy
    #: The most tokens a request without ``max_tokens`` generates (``None``: the context left).
    max_tokens_default: int | None = None
    #: Logs the first ignoring of each field name on each API.
    ignored_log: IgnoredFieldLog = field(default_factory=IgnoredFieldLog)

    def check_model(self, request: CompletionRequest) -> None:
        """Refuse (404) a request for a model other than the served one."""
        if request.model != self.model_name:
            raise model_not_found(request.model, self.model_name)

    def parse_chat(self, body: dict[str, Any]) -> CompletionRequest:
        """A chat body checked against the served model and its vocabulary."""
        request = parse_chat_request(body, vocab_size=self.worker.vocab_size or None)
        self.check_model(request)
        return request

    def template_ignores(self, request: CompletionRequest) -> list[IgnoredField]:
        """What a chat request hands the template that the template never reads.

        The template's arguments (``reasoning_effort``, ``chat_template_kwargs``) and the
        messages' fields OpenAI does not define, by name: a name the template's source never
        mentions has no effect on the prompt.
        """
        source = _template_source(getattr(self.tokenizer, "chat_template", None))
        names = [
            name if name == "reasoning_effort" else f"chat_template_kwargs.{name}"
            for name in request.template_kwargs
            if not _mentions(source, name)
        ]
        names += [
            f"messages[{i}].{key}"
            for i, message in enumerate(request.messages or [])
            for key in message
            if key not in MESSAGE_KEYS and not _mentions(source, key)
        ]
        return [IgnoredField(name=n, reason="the chat template never reads it") for n in names]

    def chat_tokens(self, request: CompletionRequest) -> list[int]:
        """A chat request's messages (and tools) rendered by the chat template, as tokens."""
        return self.render_chat(request)[0]

    def render_chat(self, request: CompletionRequest) -> tuple[list[int], list[IgnoredField]]:
        """The chat request's prompt tokens, and what the given_up had to give up.

        A template that refuses the messages (roles out of order, ...) is a 400 naming its
        complaint, unless it takes them reshaped the way agents need: two system or user
        turns in a row (a system prompt in parts, context then the question) joined into
        one (text parted by a blank line), else every system turn joined into the first
        (Claude Code sends system turns among the messages). Then the answer says so
        (``messages``, ignored as given).
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(
                400,
                f"this model's tokenizer has no chat template: {self.model_name!r} cannot serve "
                "/v1/chat/completions; use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        extra: dict[str, Any] = dict(request.template_kwargs)
        if request.tools is not None:
            extra["tools"] = [t.template_form() for t in request.tools.tools]
        messages = list(request.messages or [])
        try:
            return self._apply_template(messages, extra), []
        except OpenAIError as refused:
            error = refused
        for reshaped, reason in (
            (join_repeated_turns(messages), "repeated turns were joined"),
            (fold_system_turns(messages), "system turns were joined into the first"),
        ):
            if len(reshaped) == len(messages):
                continue
            try:
                tokens = self._apply_template(reshaped, extra)
            except OpenAIError:
                continue
            reason = f"the chat template refused them as given: {reason}"
            return tokens, [IgnoredField(name="messages", reason=reason)]
        raise error

    def _apply_template(self, messages: list[dict[str, Any]], extra: dict[str, Any]) -> list[int]:
        try:
            ids: Any = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, **extra
            )
        except Exception as err:  # a template's raise_exception (roles out of order, ...)
            raise OpenAIError(
                400, f"the chat template refused the messages: {err}", param="messages"
            ) from None
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def prepare(
        self, body: dict[str, Any], *, chat: bool, fit_max_tokens: bool = False
    ) -> PreparedRequest:
        """Check a chat or completions body and turn its prompts into engine work.

        With ``fit_max_tokens`` (the Messages and Responses APIs, whose agents send a
        ``max_tokens`` as large as the model's output limit whatever their prompt), a
        ``max_tokens`` past the context the prompt leaves is cut to that context and the
        answer says so (``max_tokens``, ignored as given); else it is a 400.
        """
        if chat:
            request = self.parse_chat(body)
        else:
            request = parse_completion_request(body, vocab_size=self.worker.vocab_size or None)
            self.check_model(request)
        eos = self.policy.eos
        fields = request.sampling
        extra = frozenset(fields.stop_token_ids)
        stops = extra if fields.ignore_eos else eos | extra
        hidden = eos | extra
        sampling = self._sampling(request)
        sources: list[tuple[list[int], str, bool, bool]] = []
        given_up: list[IgnoredField] = []
        if chat:
            tokens, given_up = self.render_chat(request)
            sources.append((tokens, "", False, False))
        bos = getattr(self.tokenizer, "bos_token_id", None)
        for prompt in request.prompts:
            if isinstance(prompt, str):
                tokens = [int(i) for i in self.tokenizer.encode(prompt)]
                sources.append((tokens, prompt, True, False))
            else:
                skip = bos is not None and prompt[0] == bos
                echo = str(self.tokenizer.decode(list(prompt[1:] if skip else prompt)))
                sources.append((list(prompt), echo, False, skip))
        prompts: list[Prompt] = []
        for i, (tokens, echo_text, skip_special, skip_first) in enumerate(sources):
            where = f" {i}" if len(sources) > 1 else ""
            if not tokens:
                raise OpenAIError(400, f"the prompt{where} encodes to no tokens", param="prompt")
            max_tokens = request.max_tokens
            if max_tokens is None:
                max_tokens = max(1, self.max_context - len(tokens))
                if self.max_tokens_default is not None:
                    max_tokens = min(max_tokens, self.max_tokens_default)
            max_tokens = max(1, max_tokens)  # echo with max_tokens 0 runs one, unseen
            left = self.max_context - len(tokens)
            if fit_max_tokens and max_tokens > left >= 1:
                max_tokens = left
                reason = f"more than the context leaves: at most {left} tokens are generated"
                given_up.append(IgnoredField(name="max_tokens", reason=reason))
            self._fit(len(tokens), max_tokens, where)
            params = RequestParams(max_tokens=max_tokens, sampling=sampling, stop_tokens=stops)
            prompts.append(Prompt(tokens, echo_text, skip_special, skip_first, params))
        tool_format = self.policy.tool_format(request.tools)
        ignored = (
            *request.ignored,
            *(self.template_ignores(request) if chat else ()),
            *given_up,
        )
        return PreparedRequest(
            request, prompts, chat, hidden, tool_format, self.policy.harmony, ignored
        )

    def _fit(self, prompt_tokens: int, max_tokens: int, where: str = "") -> None:
        total = prompt_tokens + max_tokens
        if total > self.max_context:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, "
                f"you requested {total} tokens ({prompt_tokens} in the prompt{where}, "
                f"{max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        layout = self.worker.layout
        limits = self.worker.pool_limits
        if layout is None or not limits:
            return
        # A request alone needs at least this many pages (prefilled a token at a time).
        needs = pages_per_request(
            layout,
            max_context=total,
            page_size={s.name: s.page_size for s in limits},
            prefill_chunk=1,
        )
        for sub in limits:
            usable = sub.num_pages - 1
            if needs.get(sub.name, 0) > usable:
                raise OpenAIError(
                    400,
                    f"the request can never fit the KV pool: {prompt_tokens} prompt{where} + "
                    f"{max_tokens} completion tokens need {needs[sub.name]} pages of sub-pool "
                    f"{sub.name!r}, which has {usable}; reduce the prompt or max_tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )

    def _sampling(self, request: CompletionRequest) -> SamplingParams:
        fields = request.sampling
        vocab = self.worker.vocab_size
        k = request.logprobs
        if k is None and request.best_of > request.n:
            k = 0  # best_of ranks the sequences by their tokens' logprobs
        try:
            return SamplingParams(
                temperature=fields.temperature,
                top_p=fields.top_p,
                top_k=fields.top_k if 0 < fields.top_k < vocab else 0,
                min_p=fields.min_p,
                presence_penalty=fields.presence_penalty,
                frequency_penalty=fields.frequency_penalty,
                repetition_penalty=fields.repetition_penalty,
                logit_bias=fields.logit_bias,
                min_tokens=fields.min_tokens,
                seed=fields.seed,
                logprobs=k,
                prompt_logprobs=request.logprobs if request.echo else None,
                constraint=self.policy.constraint(request),
            )
        except RequestStateError as err:
            raise OpenAIError(400, str(err)) from None


def join_repeated_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each run of plain system or user turns of one role joined into one.

    A plain turn holds only its role and text content; the texts are parted by a blank line.
    """
    joined: list[dict[str, Any]] = []
    for message in messages:
        last = joined[-1] if joined else None
        if (
            last is not None
            and _plain_turn(last)
            and _plain_turn(message)
            and last["role"] == message["role"]
        ):
            joined[-1] = {**last, "content": f"{last['content']}\n\n{message['content']}"}
        else:
            joined.append(message)
    return joined


def fold_system_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every plain system turn joined into one first system turn.

    The texts keep their order, parted by a blank line; user turns brought together by the
    system turns' leaving are joined too (:func:`join_repeated_turns`).
    """
    systems = [m for m in messages if _plain_turn(m) and m["role"] == "system"]
    if not systems:
        return messages
    rest = [m for m in messages if not (_plain_turn(m) and m["role"] == "system")]
    first = {"role": "system", "content": "\n\n".join(m["content"] for m in systems)}
    return join_repeated_turns([first, *rest])


def _plain_turn(message: Mapping[str, Any]) -> bool:
    return (
        message.get("role") in ("system", "user")
        and isinstance(message.get("content"), str)
        and set(message) <= {"role", "content"}
    )


def _template_source(template: object) -> str:
    """A chat template's source text (a tokenizer may hold several, by name)."""
    if isinstance(template, str):
        return template
    return json.dumps(template, default=str) if template else ""


def _mentions(source: str, name: str) -> bool:
    """Whether template ``source`` names ``name`` as a whole word."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", source) is not None
