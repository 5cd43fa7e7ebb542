"""The OpenAI endpoints' field table: every field a body may hold, and what is done with it.

:data:`REQUEST_FIELDS` names each field of ``/v1/completions`` and ``/v1/chat/completions``
with its treatment (the kv-serve README's table is checked against it);
:func:`check_fields` applies it to a body: refused fields are a 400 naming them, ignored and
unknown ones come back to be reported (:mod:`._server_warnings`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ._server_errors import OpenAIError
from ._server_warnings import IgnoredField

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_SEQUENCES",
    "MAX_STOP_STRINGS",
    "MAX_TOKENS_LIMIT",
    "REQUEST_FIELDS",
    "Endpoint",
    "FieldRule",
    "check_fields",
]

#: The most stop strings one request may give (OpenAI's limit).
MAX_STOP_STRINGS = 4
#: The most alternatives per token: completions' ``logprobs`` (OpenAI allows 5) and chat's
#: ``top_logprobs`` (OpenAI allows 20); the engine's limit.
MAX_LOGPROBS = 20
#: The most prompts one ``/v1/completions`` request may hold.
MAX_PROMPTS = 64
#: The largest ``n`` and ``best_of`` (OpenAI's limit for ``n``).
MAX_N = 128
#: The most sequences one request may generate: prompts times ``best_of`` (or ``n``).
MAX_SEQUENCES = 256
#: No request may ask for more tokens than this, whatever the context (a sanity bound).
MAX_TOKENS_LIMIT = 2**31 - 1

Endpoint = Literal["completions", "chat", "responses"]
Treatment = Literal["honoured", "extension", "accepted", "ignored", "refused"]


@dataclass(frozen=True)
class FieldRule:
    """What the server does with one request field of one or both endpoints.

    ``treatment``: ``honoured`` (an OpenAI field the server implements), ``extension`` (not
    OpenAI's; the common vLLM / SGLang fields and ``return_token_ids``), ``accepted`` (an
    OpenAI field that means nothing to a local server: type-checked, then without effect),
    ``ignored`` (a field the server cannot act on but whose absence leaves the answer a
    valid one: accepted, and reported in the answer's headers), or ``refused`` (a 400
    naming the field whenever it is given a value other than null or the default that
    ``note`` names: acting without it would change the answer).
    """

    name: str
    endpoints: tuple[Endpoint, ...]
    treatment: Treatment
    note: str


_BOTH: tuple[Endpoint, ...] = ("completions", "chat")
_CMPL: tuple[Endpoint, ...] = ("completions",)
_CHAT: tuple[Endpoint, ...] = ("chat",)

#: Every request field either endpoint knows, in the order of the README's table.
REQUEST_FIELDS: tuple[FieldRule, ...] = (
    FieldRule("model", _BOTH, "honoured", "the served model's id; another is a 404"),
    FieldRule(
        "prompt",
        _CMPL,
        "honoured",
        f"a string, a list of token ids, or a batch of up to {MAX_PROMPTS} of either",
    ),
    FieldRule("messages", _CHAT, "honoured", "through the tokenizer's chat template; text only"),
    FieldRule("max_tokens", _BOTH, "honoured", "completions: default 16, 0 only with echo"),
    FieldRule("max_completion_tokens", _CHAT, "honoured", "wins over max_tokens"),
    FieldRule("temperature", _BOTH, "honoured", "0..2; 0 is greedy"),
    FieldRule("top_p", _BOTH, "honoured", "(0, 1]"),
    FieldRule("n", _BOTH, "honoured", f"1..{MAX_N}; the prompt is prefilled once"),
    FieldRule(
        "best_of",
        _CMPL,
        "honoured",
        f"n..{MAX_N}; the n with the highest mean token logprob; not with stream",
    ),
    FieldRule("stop", _BOTH, "honoured", f"up to {MAX_STOP_STRINGS} strings, cut from the text"),
    FieldRule("seed", _BOTH, "honoured", "each sequence i of n draws from seed + i"),
    FieldRule("presence_penalty", _BOTH, "honoured", "-2..2, over the generated tokens"),
    FieldRule("frequency_penalty", _BOTH, "honoured", "-2..2, over the generated tokens"),
    FieldRule("logit_bias", _BOTH, "honoured", "token id -> -100..100, added to the logits"),
    FieldRule(
        "logprobs",
        _BOTH,
        "honoured",
        f"completions: 0..{MAX_LOGPROBS} (OpenAI: 0..5); chat: true or false",
    ),
    FieldRule("top_logprobs", _CHAT, "honoured", f"0..{MAX_LOGPROBS}; needs logprobs: true"),
    FieldRule("echo", _CMPL, "honoured", "the prompt before the completion (and its logprobs)"),
    FieldRule("stream", _BOTH, "honoured", "server-sent events ending in data: [DONE]"),
    FieldRule("stream_options", _BOTH, "honoured", "include_usage; only with stream: true"),
    FieldRule("modalities", _CHAT, "honoured", 'only ["text"] (the default); "audio" is a 400'),
    FieldRule("tools", _CHAT, "honoured", "function tools, rendered by the chat template"),
    FieldRule(
        "tool_choice",
        _CHAT,
        "honoured",
        "none, auto, required or a named function; required and named are enforced",
    ),
    FieldRule("parallel_tool_calls", _CHAT, "honoured", "false: at most one call"),
    FieldRule(
        "response_format",
        _BOTH,
        "honoured",
        "text, json_object or json_schema: decoded under the schema's grammar in the batch",
    ),
    FieldRule("top_k", _BOTH, "extension", "-1 or 0: off; else the k most likely tokens"),
    FieldRule("min_p", _BOTH, "extension", "0..1 of the most likely token's probability"),
    FieldRule(
        "repetition_penalty",
        _BOTH,
        "extension",
        "> 0, multiplicative over prompt and generated tokens",
    ),
    FieldRule("ignore_eos", _BOTH, "extension", "the model's end-of-sequence ids do not stop"),
    FieldRule("min_tokens", _BOTH, "extension", "no stop token or string before this many"),
    FieldRule("stop_token_ids", _BOTH, "extension", "more token ids that end a sequence"),
    FieldRule("return_token_ids", _BOTH, "extension", "adds each choice's token_ids"),
    FieldRule(
        "chat_template_kwargs",
        _CHAT,
        "extension",
        "an object handed to the chat template (enable_thinking, ...); keys it never reads "
        "are ignored with a warning",
    ),
    FieldRule("user", _BOTH, "accepted", "a string; nothing is tracked"),
    FieldRule("metadata", _CHAT, "accepted", "an object of strings; nothing is stored"),
    FieldRule("store", _CHAT, "accepted", "a boolean; nothing is stored"),
    FieldRule("service_tier", _CHAT, "accepted", "a string; one tier"),
    FieldRule("safety_identifier", _CHAT, "accepted", "a string; nothing is tracked"),
    FieldRule("prompt_cache_key", _CHAT, "accepted", "a string; prefix caching is automatic"),
    FieldRule("prompt_cache_retention", _CHAT, "accepted", "a string; prefix caching is automatic"),
    FieldRule("prompt_cache_options", _CHAT, "accepted", "an object; prefix caching is automatic"),
    FieldRule("suffix", _CMPL, "refused", 'insertion is not supported (null or "" pass)'),
    FieldRule("functions", _CHAT, "refused", "function calling is not supported"),
    FieldRule("function_call", _CHAT, "refused", "function calling is not supported"),
    FieldRule("audio", _CHAT, "refused", "audio output is not supported"),
    FieldRule("reasoning_effort", _CHAT, "honoured", "handed to the chat template"),
    FieldRule("prediction", _CHAT, "ignored", "predicted outputs only save time"),
    FieldRule("verbosity", _CHAT, "ignored", "the model takes no verbosity"),
    FieldRule("web_search_options", _CHAT, "ignored", "no web search here"),
    FieldRule("moderation", _CHAT, "ignored", "no moderation model here"),
)

_KNOWN: dict[Endpoint, frozenset[str]] = {
    endpoint: frozenset(r.name for r in REQUEST_FIELDS if endpoint in r.endpoints)
    for endpoint in ("completions", "chat")
}
_REFUSED: dict[str, FieldRule] = {r.name: r for r in REQUEST_FIELDS if r.treatment == "refused"}
_IGNORED: dict[str, FieldRule] = {r.name: r for r in REQUEST_FIELDS if r.treatment == "ignored"}


def check_fields(body: Mapping[str, Any], endpoint: Endpoint) -> list[IgnoredField]:
    """Refuse the refused fields; the fields accepted without effect (given, not null)."""
    known = _KNOWN[endpoint]
    ignored: list[IgnoredField] = []
    other: Endpoint = "chat" if endpoint == "completions" else "completions"
    path = "/v1/chat/completions" if other == "chat" else "/v1/completions"
    for name, value in body.items():
        if value is None:
            continue
        if name not in known:
            where = f"only on {path}" if name in _KNOWN[other] else "not a field this server knows"
            ignored.append(IgnoredField(name=name, reason=where))
        elif name in _IGNORED:
            ignored.append(IgnoredField(name=name, reason=_IGNORED[name].note))
    for name, rule in _REFUSED.items():
        value = body.get(name)
        if value is None or name not in known:
            continue
        if name == "suffix" and value == "":
            continue
        raise OpenAIError(
            400,
            f"{name} is not supported by this server ({rule.note}), got {value!r}",
            param=name,
            code="unsupported_parameter",
        )
    return ignored
