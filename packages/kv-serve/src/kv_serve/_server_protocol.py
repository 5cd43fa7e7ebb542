"""The OpenAI request side: errors in OpenAI's JSON shape and checked request fields.

Pure Python (no MLX): request bodies are checked here before anything reaches the engine.
Every field a body may hold is in the table of :mod:`._server_fields`, with what the server
does with it (honoured, an extension, accepted but meaningless to a local server, ignored
with a warning, or refused). A field not listed there is ignored with a warning too
(:mod:`._server_warnings`): the request is answered, and says which fields had no effect.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

from ._server_errors import OpenAIError
from ._server_fields import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS,
    MAX_SEQUENCES,
    MAX_STOP_STRINGS,
    MAX_TOKENS_LIMIT,
    REQUEST_FIELDS,
    Endpoint,
    FieldRule,
    check_fields,
)
from ._server_tools import (
    ToolError,
    ToolRequest,
    check_tool_messages,
    parse_tools,
    tool_calls_of_message,
)
from ._server_warnings import IgnoredField

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_SEQUENCES",
    "MAX_STOP_STRINGS",
    "MESSAGE_KEYS",
    "REQUEST_FIELDS",
    "CompletionRequest",
    "FieldRule",
    "OpenAIError",
    "ResponseFormat",
    "SamplingFields",
    "parse_chat_request",
    "parse_completion_request",
    "parse_json_body",
]

#: The message fields OpenAI defines; a message's other fields are handed to the template.
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls", "refusal"})

_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation", "continuous_usage_stats"})


def _bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


@dataclass(frozen=True, kw_only=True)
class SamplingFields:
    """The checked sampling fields of a request (what the engine's sampler is asked for).

    ``top_k`` 0 is off (the request's -1 is stored as 0); ``logit_bias`` maps token ids to
    biases; ``stop_token_ids`` end a sequence besides the model's end-of-sequence ids (which
    ``ignore_eos`` leaves out).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ResponseFormat:
    """A checked structured-output ``response_format`` (``{"type": "text"}`` is ``None``).

    ``type`` is ``json_object`` (any JSON object) or ``json_schema`` (a value valid under
    ``schema``, the request's ``json_schema.schema``; ``name`` is its ``json_schema.name``).
    The schema is enforced whether ``strict`` is true or not. It is compiled by the server
    (a schema it cannot compile is a 400 there), not here.
    """

    type: Literal["json_object", "json_schema"]
    schema: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""
    strict: bool | None = None


@dataclass(frozen=True, kw_only=True)
class CompletionRequest:
    """A checked request of either endpoint (``prompts`` xor ``messages`` is set).

    ``prompts`` holds each prompt of a completions request (a string or token ids);
    ``logprobs`` is the number of alternatives per token (completions' ``logprobs``, chat's
    ``top_logprobs`` when ``logprobs`` is true), ``None`` when none are asked for.
    ``best_of`` is at least ``n`` (equal when not given). ``max_tokens`` ``None`` means up
    to the context. ``response_format`` is the checked structured output (``None``: text);
    ``tools`` the checked tools of a chat request (``None``: none given).
    ``template_kwargs`` go to the chat template (``reasoning_effort`` and
    ``chat_template_kwargs``); ``ignored`` are the fields accepted without effect.
    """

    model: str
    prompts: tuple[str | tuple[int, ...], ...] = ()
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    n: int = 1
    best_of: int = 1
    echo: bool = False
    logprobs: int | None = None
    sampling: SamplingFields = field(default_factory=SamplingFields)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    tools: ToolRequest | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    ignored: tuple[IgnoredField, ...] = ()

    @property
    def prompt(self) -> str | tuple[int, ...] | None:
        """The first prompt (``None`` for a chat request)."""
        return self.prompts[0] if self.prompts else None


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


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(
    body: Mapping[str, Any], name: str, *, minimum: int, maximum: int, param: str | None = None
) -> int | None:
    value = body.get(name)
    param = param or name
    if value is None:
        return None
    if not _is_int(value):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _bad(f"{param} must be an integer, got {_type_name(value)} {value!r}", param)
    if not minimum <= value <= maximum:
        raise _bad(f"{param} must be in {minimum}..{maximum}, got {value}", param)
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


def _bool(body: Mapping[str, Any], name: str, default: bool = False, param: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        param = param or name
        raise _bad(f"{param} must be a boolean, got {_type_name(value)} {value!r}", param)
    return value


def _string(body: Mapping[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _bad(f"{name} must be a string, got {_type_name(value)} {value!r}", name)


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


def _token_id(value: object, param: str, vocab_size: int | None) -> int:
    if _is_int(value) and value >= 0 and (vocab_size is None or value < vocab_size):
        return value
    top = "0 or more" if vocab_size is None else f"0..{vocab_size - 1}"
    raise _bad(f"{param} must hold token ids in {top}, got {value!r}", param)


def _logit_bias(body: Mapping[str, Any], vocab_size: int | None) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(
            f"logit_bias must be an object of token id -> bias, got {_type_name(value)}",
            "logit_bias",
        )
    bias: dict[int, float] = {}
    for key, amount in value.items():
        text = str(key)
        if not re.fullmatch(r"-?[0-9]+", text):
            raise _bad(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        token = _token_id(int(text), "logit_bias", vocab_size)
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise _bad(
                f"logit_bias[{text}] must be a number in -100..100, got {amount!r}", "logit_bias"
            )
        if not math.isfinite(amount) or not -100 <= amount <= 100:
            raise _bad(f"logit_bias[{text}] must be in -100..100, got {amount!r}", "logit_bias")
        bias[token] = float(amount)
    return bias


def _stop_token_ids(body: Mapping[str, Any], vocab_size: int | None) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad(
            f"stop_token_ids must be a list of token ids, got {_type_name(value)}",
            "stop_token_ids",
        )
    return tuple(_token_id(v, "stop_token_ids", vocab_size) for v in value)


def _accepted(body: Mapping[str, Any]) -> None:
    for name in ("user", "service_tier", "safety_identifier", "prompt_cache_key"):
        _string(body, name)
    _string(body, "prompt_cache_retention")
    _bool(body, "store")
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise _bad("metadata must be an object of string values", "metadata")
    options = body.get("prompt_cache_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("prompt_cache_options must be an object", "prompt_cache_options")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _bad(
            f'modalities must be ["text"]: this server generates text only, got {modalities!r}',
            "modalities",
            code="unsupported_parameter",
        )


def _stream_options(body: Mapping[str, Any], stream: bool) -> tuple[bool, bool]:
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise _bad("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict):
        raise _bad(f"stream_options must be an object, got {_type_name(options)}", "stream_options")
    unknown = [k for k in options if k not in _STREAM_OPTIONS]
    if unknown:
        raise _bad(
            f"unrecognized stream option {unknown[0]!r}; known: "
            f"{', '.join(sorted(_STREAM_OPTIONS))}",
            f"stream_options.{unknown[0]}",
            code="unsupported_parameter",
        )
    include = _bool(options, "include_usage", param="stream_options.include_usage")
    _bool(options, "include_obfuscation", param="stream_options.include_obfuscation")
    continuous = _bool(
        options, "continuous_usage_stats", param="stream_options.continuous_usage_stats"
    )
    return include, continuous and include


def _sampling(body: Mapping[str, Any], vocab_size: int | None) -> SamplingFields:
    top_k = _int(body, "top_k", minimum=-(2**31), maximum=2**31 - 1)
    if top_k is not None and top_k < -1:
        raise _bad(f"top_k must be -1 or 0 (off) or at least 1, got {top_k}", "top_k")
    repetition = body.get("repetition_penalty")
    if repetition is not None and (
        isinstance(repetition, bool)
        or not isinstance(repetition, int | float)
        or not math.isfinite(repetition)
        or repetition <= 0
    ):
        raise _bad(
            f"repetition_penalty must be a finite number > 0, got {repetition!r}",
            "repetition_penalty",
        )
    seed = _int(body, "seed", minimum=-(2**63), maximum=2**63 - 1)  # OpenAI's: an int64
    return SamplingFields(
        temperature=_number(body, "temperature", 1.0, minimum=0.0, maximum=2.0),
        top_p=_number(body, "top_p", 1.0, minimum=0.0, maximum=1.0, min_open=True),
        top_k=max(0, top_k or 0),
        min_p=_number(body, "min_p", 0.0, minimum=0.0, maximum=1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, minimum=-2.0, maximum=2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, minimum=-2.0, maximum=2.0),
        repetition_penalty=1.0 if repetition is None else float(repetition),
        logit_bias=_logit_bias(body, vocab_size),
        # OpenAI's seed may be negative; the engine's stream takes 0 .. 2**64 - 1.
        seed=None if seed is None else seed % 2**64,
        min_tokens=_int(body, "min_tokens", minimum=0, maximum=MAX_TOKENS_LIMIT) or 0,
        ignore_eos=_bool(body, "ignore_eos"),
        stop_token_ids=_stop_token_ids(body, vocab_size),
    )


_RESPONSE_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _response_format(body: Mapping[str, Any]) -> ResponseFormat | None:
    value = body.get("response_format")
    if value is None:
        return None
    param = "response_format"
    if not isinstance(value, dict):
        raise _bad(f"response_format must be an object, got {_type_name(value)} {value!r}", param)
    kind = value.get("type")
    if kind not in _RESPONSE_TYPES:
        raise _bad(
            f"response_format.type must be one of {', '.join(_RESPONSE_TYPES)}, got {kind!r}",
            "response_format.type",
        )
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise _bad(
            f"response_format of type {kind} takes no {unknown[0]!r}",
            f"response_format.{unknown[0]}",
            code="unsupported_parameter",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", {"type": "object"})
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise _bad(f"{param} must be an object with name and schema, got {_type_name(spec)}", param)
    unknown = [k for k in spec if k not in _JSON_SCHEMA_KEYS]
    if unknown:
        raise _bad(
            f"{param}.{unknown[0]} is not a json_schema field (name, description, schema, strict)",
            f"{param}.{unknown[0]}",
            code="unsupported_parameter",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise _bad(
            f"{param}.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
            f"{param}.name",
        )
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{param}.description must be a string", f"{param}.description")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{param}.strict must be a boolean, got {strict!r}", f"{param}.strict")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _bad(
            f"{param}.schema must be a JSON schema object, got {_type_name(schema)}",
            f"{param}.schema",
        )
    return ResponseFormat("json_schema", schema, name, strict)


def _common(body: Mapping[str, Any], endpoint: Endpoint, vocab_size: int | None) -> dict[str, Any]:
    model = body.get("model")
    if model is None:
        raise _bad("you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise _bad(f"model must be a string, got {_type_name(model)} {model!r}", "model")
    ignored = check_fields(body, endpoint)
    _accepted(body)
    stream = _bool(body, "stream")
    include_usage, continuous = _stream_options(body, stream)
    n = _int(body, "n", minimum=1, maximum=MAX_N) or 1
    response_format = _response_format(body)
    sampling = _sampling(body, vocab_size)
    if response_format is not None and sampling.min_tokens:
        raise _bad(
            "min_tokens cannot be combined with a JSON response_format: the schema's grammar "
            "decides where the output ends",
            "min_tokens",
        )
    return {
        "model": model,
        "response_format": response_format,
        "n": n,
        "sampling": sampling,
        "stop": _stop(body),
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous,
        "return_token_ids": _bool(body, "return_token_ids"),
        "ignored": tuple(ignored),
    }


def _check_min_tokens(common: Mapping[str, Any], max_tokens: int | None) -> None:
    minimum = common["sampling"].min_tokens
    if max_tokens is not None and minimum > max_tokens:
        raise _bad(
            f"min_tokens ({minimum}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )


def _prompts(body: Mapping[str, Any], vocab_size: int | None) -> tuple[str | tuple[int, ...], ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("you must provide a prompt", "prompt")
    if isinstance(prompt, str):
        return (prompt,)
    shape = (
        "prompt must be a string, a list of token ids, or a list of strings or of token-id lists"
    )
    if not isinstance(prompt, list):
        raise _bad(f"{shape}, got {_type_name(prompt)}", "prompt")
    if not prompt:
        raise _bad("prompt must not be an empty list", "prompt")
    if all(_is_int(t) for t in prompt):
        return (tuple(_token_id(t, "prompt", vocab_size) for t in prompt),)
    if len(prompt) > MAX_PROMPTS:
        raise _bad(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt")
    out: list[str | tuple[int, ...]] = []
    for item in prompt:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            out.append(tuple(_token_id(t, "prompt", vocab_size) for t in item))
        else:
            raise _bad(f"{shape}; a batch item was {item!r}", "prompt")
    return tuple(out)


def parse_completion_request(
    body: Mapping[str, Any], *, vocab_size: int | None = None
) -> CompletionRequest:
    """Check a ``/v1/completions`` body (token ids against ``vocab_size`` when given)."""
    common = _common(body, "completions", vocab_size)
    prompts = _prompts(body, vocab_size)
    echo = _bool(body, "echo")
    logprobs = body.get("logprobs")
    if isinstance(logprobs, bool):
        raise _bad(
            f"logprobs must be an integer in 0..{MAX_LOGPROBS} on /v1/completions (the number "
            f"of alternatives per token), got {logprobs!r}",
            "logprobs",
        )
    k = _int(body, "logprobs", minimum=0, maximum=MAX_LOGPROBS)
    max_tokens = _int(body, "max_tokens", minimum=0 if echo else 1, maximum=MAX_TOKENS_LIMIT)
    max_tokens = 16 if max_tokens is None else max_tokens
    _check_min_tokens(common, max_tokens)
    n = common["n"]
    best_of = _int(body, "best_of", minimum=1, maximum=MAX_N)
    if best_of is None:
        best_of = n
    if best_of < n:
        raise _bad(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if best_of > n and common["stream"]:
        raise _bad("best_of greater than n cannot be streamed", "best_of")
    if len(prompts) * best_of > MAX_SEQUENCES:
        raise _bad(
            f"a request may generate at most {MAX_SEQUENCES} sequences; {len(prompts)} prompts "
            f"x {'best_of' if best_of > n else 'n'} {best_of} = {len(prompts) * best_of}",
            "best_of" if best_of > n else "n",
        )
    return CompletionRequest(
        prompts=prompts, max_tokens=max_tokens, best_of=best_of, echo=echo, logprobs=k, **common
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


def _message(message: object, i: int) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise _bad(
            f"messages[{i}].role must be a string (system, developer, user, assistant, tool, "
            f"or a role the chat template renders), got {role!r}",
            f"messages[{i}].role",
        )
    checked: dict[str, Any] = {"role": role, "content": _content(message, i)}
    # Fields OpenAI does not define go to the template as they are (reasoning_content, ...).
    checked.update({k: v for k, v in message.items() if k not in MESSAGE_KEYS and v is not None})
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise _bad(
                f"messages[{i}].tool_calls: only assistant messages make tool calls",
                f"messages[{i}].tool_calls",
            )
        try:
            checked["tool_calls"] = tool_calls_of_message(calls, i)
        except ToolError as err:
            raise _bad(str(err), err.param) from None
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise _bad(f"messages[{i}].{key} must be a string", f"messages[{i}].{key}")
            checked[key] = value
    return checked


#: Arguments of ``apply_chat_template`` the server sets itself (not a request's to give).
_TEMPLATE_RESERVED = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "return_dict"}
)


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """``reasoning_effort`` and ``chat_template_kwargs``: what the chat template is handed."""
    kwargs: dict[str, Any] = {}
    given = body.get("chat_template_kwargs")
    if given is not None:
        if not isinstance(given, dict):
            raise _bad(
                f"chat_template_kwargs must be an object, got {_type_name(given)}",
                "chat_template_kwargs",
            )
        reserved = sorted(k for k in given if k in _TEMPLATE_RESERVED)
        if reserved:
            raise _bad(
                f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets it "
                "from the request",
                f"chat_template_kwargs.{reserved[0]}",
            )
        kwargs.update(given)
    _string(body, "reasoning_effort")
    effort = body.get("reasoning_effort")
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    return kwargs


def parse_chat_request(
    body: Mapping[str, Any], *, vocab_size: int | None = None
) -> CompletionRequest:
    """Check a ``/v1/chat/completions`` body (token ids against ``vocab_size`` when given)."""
    common = _common(body, "chat", vocab_size)
    messages = body.get("messages")
    if messages is None:
        raise _bad("you must provide messages", "messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    checked = [_message(message, i) for i, message in enumerate(messages)]
    try:
        tools = parse_tools(body)
        check_tool_messages(checked)
    except ToolError as err:
        raise _bad(str(err), err.param) from None
    if tools is not None and tools.choice != "none" and common["response_format"] is not None:
        raise _bad(
            "response_format cannot be combined with tools the model may call: the output "
            'follows the schema or calls a tool; give tool_choice "none" or drop one',
            "response_format",
        )
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    if top and not want:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = _int(body, "max_completion_tokens", minimum=1, maximum=MAX_TOKENS_LIMIT)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", minimum=1, maximum=MAX_TOKENS_LIMIT)
    _check_min_tokens(common, max_tokens)
    return CompletionRequest(
        messages=checked,
        tools=tools,
        template_kwargs=_template_kwargs(body),
        max_tokens=max_tokens,
        best_of=common["n"],
        logprobs=(top or 0) if want else None,
        **common,
    )
