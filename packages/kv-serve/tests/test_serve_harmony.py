"""gpt-oss's harmony format: the output splitter, and tool calls through the server.

The splitter is checked on harmony text written out by hand (content from the ``final``
channel, reasoning from ``analysis``, calls from ``commentary to=functions.NAME``), streamed
in arbitrary pieces (hypothesis) against the whole text at once. Through the server, a tiny
random-weight gpt-oss model with a harmony chat template (``kv_testing``'s) calls the tool
``tool_choice`` requires (the grammar writes the markers as the special tokens they are), and
the next turn's prompt is the template's rendering of the call and its result.
"""

from __future__ import annotations

import itertools
import json
from functools import cache
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from serve_support import Serve

from kv_serve._server import RunningServer
from kv_serve._server_harmony import HarmonyText, is_harmony
from kv_serve._server_tools import split_piece
from kv_testing import build_tiny_model, build_tiny_tokenizer

MODEL = "tiny-harmony"
THINK = "<|channel|>analysis<|message|>The user wants weather.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is 3 C in Oslo.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}'
)


def split(text: str, cuts: list[int] | None = None, **kwargs: Any) -> tuple[HarmonyText, str]:
    """The splitter after ``text`` (in pieces cut at ``cuts``) and the content it showed."""
    splitter = HarmonyText(**kwargs)
    bounds = [0, *sorted(set(cuts or [])), len(text)]
    shown = ""
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        shown += split_piece(splitter, text[a:b], last=i == len(bounds) - 2)[0]
    return splitter, shown


def test_channels_become_reasoning_content_and_calls() -> None:
    splitter, shown = split(THINK + ANSWER)
    assert shown == splitter.content == "It is 3 C in Oslo."
    assert splitter.reasoning == "The user wants weather." and not splitter.calls
    # <|call|> ends the output as an end-of-sequence token: the call completes at the end.
    splitter, shown = split(THINK + CALL)
    assert shown == "" and splitter.reasoning == "The user wants weather."
    assert [(c.name, json.loads(c.arguments)) for c in splitter.calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    # The recipient may come before the channel, and <|call|> may be in the text.
    other = "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>"
    assert [c.name for c in split(other)[0].calls] == ["f"]


def test_what_is_not_a_parsed_call_is_content() -> None:
    assert split("just text, no harmony")[1] == "just text, no harmony"
    unparsed = split(CALL, parse=False)[0]
    assert not unparsed.calls and '{"city": "Oslo"}' in unparsed.content
    broken = split(CALL.replace('{"city": "Oslo"}', "{not json"))[0]
    assert not broken.calls and broken.content == "{not json"
    unclosed = "<|channel|>final" + "x" * 300
    assert split(unclosed)[0].content == unclosed  # a header never closed is text
    single = split(CALL + "<|call|>" + CALL, single=True)[0]
    assert len(single.calls) == 1 and single.content == ""


@given(st.lists(st.integers(0, len(THINK + ANSWER + CALL)), max_size=12))
def test_any_streaming_equals_the_whole(cuts: list[int]) -> None:
    text = THINK + ANSWER + CALL
    whole, whole_shown = split(text)
    streamed, streamed_shown = split(text, cuts)
    assert streamed_shown == whole_shown == whole.content == streamed.content
    assert streamed.reasoning == whole.reasoning
    assert [(c.name, c.arguments) for c in streamed.calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
ASK: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]


@cache
def tokenizer() -> Any:
    return build_tiny_tokenizer(harmony=True)


@pytest.fixture(scope="module")
def served(serve: Serve) -> RunningServer:
    model = build_tiny_model("gpt_oss", window=8, num_layers=4, vocab_size=len(tokenizer()))
    return serve(model, tokenizer(), model_name=MODEL, max_running=4, max_context=2048)


def test_the_tiny_tokenizer_is_harmony() -> None:
    assert is_harmony(tokenizer())
    assert not is_harmony(build_tiny_tokenizer(tools=True))


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_round_trip(served: RunningServer, stream: bool) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        calls: list[Any] = []
        reasons = []
        for chunk in client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200, stream=True
        ):
            for c in chunk.choices:
                calls += c.delta.tool_calls or []
                reasons.append(c.finish_reason)
        assert reasons[-1] == "tool_calls" and len(calls) == 1
        name, arguments, ident = calls[0].function.name, calls[0].function.arguments, calls[0].id
    else:
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = list[Any](choice.message.tool_calls or [])
        name, arguments, ident = call.function.name, call.function.arguments, call.id
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)
    call_message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": ident, "type": "function", "function": {"name": name, "arguments": arguments}}
        ],
    }
    turn: list[Any] = [
        *ASK,
        call_message,
        {"role": "tool", "tool_call_id": ident, "content": "3 C"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=6
    )
    rendered = [
        *ASK,
        {
            **call_message,
            "tool_calls": [
                {
                    "id": ident,
                    "type": "function",
                    "function": {"name": name, "arguments": json.loads(arguments)},
                }
            ],
        },
        turn[2],
    ]
    expected = tokenizer().apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(expected)


def test_required_with_any_tool_calls_one_of_them(served: RunningServer) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        seed=3,
        temperature=1.0,
    )
    (call,) = list[Any](out.choices[0].message.tool_calls or [])
    assert call.function.name in ("get_weather", "get_time")
    parameters = WEATHER if call.function.name == "get_weather" else {"type": "object"}
    jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_streamed_content_and_reasoning_equal_the_whole_answer(served: RunningServer) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    for seed in range(3):
        sampled: Any = {"temperature": 1.0, "seed": seed, "max_tokens": 40}
        whole = client.chat.completions.create(model=MODEL, messages=ASK, **sampled)
        message = whole.choices[0].message
        content, reasoning = "", ""
        for chunk in client.chat.completions.create(
            model=MODEL, messages=ASK, stream=True, **sampled
        ):
            for c in chunk.choices:
                content += c.delta.content or ""
                reasoning += (c.delta.model_extra or {}).get("reasoning_content", "")
        assert content == (message.content or "")
        assert reasoning == (message.model_extra or {}).get("reasoning_content", "")
