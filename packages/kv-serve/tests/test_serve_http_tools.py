"""Tool calling through the official ``openai`` client against the real HTTP server.

A tiny random-weight model with a Hermes / Qwen style tool template (``TINY_TOOL_CHAT_TEMPLATE``,
which mlx-lm reads as its ``json_tools`` format). A random model does not choose to call a
tool, so ``tool_choice`` ``required`` and a named function are what make it call one: they
are enforced by a grammar, and every call's arguments validate (``jsonschema``) against the
function's parameters. A full round trip (tools -> tool_calls -> a tool message -> an answer),
streamed and not. The splitting of text into content and calls is checked on its own against
hand-written outputs. Bad tools, choices and tool messages are 400s naming the field, and
queue nothing.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any, cast

import httpx
import jsonschema
import pytest
from mlx_lm.tool_parsers import json_tools
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)
from serve_support import Serve, wait_idle
from serve_support import openai_client as client

from kv_serve._server import KVServer, RunningServer
from kv_serve._server_tools import Tool, ToolCallText, ToolFormat
from kv_testing import build_tiny_model, build_tiny_tokenizer

MODEL = "tiny-tools"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Weather in Oslo?"}]


@cache
def tokenizer() -> Any:
    return build_tiny_tokenizer(tools=True)


@pytest.fixture(scope="module")
def served(serve: Serve) -> RunningServer:
    model = build_tiny_model("gpt_oss", window=8, num_layers=4, vocab_size=len(tokenizer()))
    return serve(
        model, tokenizer(), model_name=MODEL, max_running=8, max_context=2048, page_size=16
    )


def function_calls(calls: Any) -> list[ChatCompletionMessageFunctionToolCall]:
    """The message's tool calls, each a function call (the only kind the server makes)."""
    out = list(calls or [])
    assert all(isinstance(c, ChatCompletionMessageFunctionToolCall) for c in out)
    return out


def valid_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return cast(dict[str, Any], arguments)


# ---------------------------------------------------------------------- enforced calls


def test_required_makes_valid_calls_of_the_given_tools(served: RunningServer) -> None:
    out = client(served).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=300,
        temperature=1.0,
        seed=4,
        n=3,
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert calls
        for call in calls:
            valid_call(call)


def test_a_named_function_and_no_parallel_calls_make_one_call_of_it(
    served: RunningServer,
) -> None:
    out = client(served).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = function_calls(choice.message.tool_calls)
    assert [c.function.name for c in calls] == ["get_time"]
    assert -12 <= valid_call(calls[0])["zone"] <= 14


def test_streamed_tool_calls_come_in_openai_s_delta_shape(served: RunningServer) -> None:
    stream = client(served).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=300,
        temperature=0.8,
        seed=2,
        stream=True,
    )
    calls: dict[int, dict[str, Any]] = {}
    reason = None
    content = ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"arguments": ""})
                if delta.id:
                    entry["id"] = delta.id
                if delta.function and delta.function.name:
                    entry["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    entry["arguments"] += delta.function.arguments
            reason = choice.finish_reason or reason
    assert reason == "tool_calls" and content == ""
    assert calls and all(c["name"] == "get_weather" for c in calls.values())
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), WEATHER)


# ---------------------------------------------------------------------- a round trip


@pytest.mark.parametrize("stream", [False, True])
def test_a_round_trip_tools_call_tool_message_answer(served: RunningServer, stream: bool) -> None:
    c = client(served)
    first = c.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300
    )
    calls = function_calls(first.choices[0].message.tool_calls)
    assert calls
    turn: list[ChatCompletionMessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in calls
            ],
        },
        *(
            cast(
                ChatCompletionMessageParam,
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
            )
            for call in calls
        ),
    ]
    if stream:
        text = ""
        reason = None
        for chunk in c.chat.completions.create(
            model=MODEL, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=12, stream=True
        ):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                assert not choice.delta.tool_calls
                reason = choice.finish_reason or reason
    else:
        answer = c.chat.completions.create(
            model=MODEL, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=12
        )
        text = answer.choices[0].message.content or ""
        reason = answer.choices[0].finish_reason
        assert not answer.choices[0].message.tool_calls
        # The tool's result is in the prompt the template rendered.
        assert answer.usage is not None and first.usage is not None
        assert answer.usage.prompt_tokens > first.usage.prompt_tokens
    assert reason in ("stop", "length") and isinstance(text, str)


def test_auto_lets_the_model_answer_in_text(served: RunningServer) -> None:
    out = client(served).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=16, temperature=0
    )
    choice = out.choices[0]
    # A random model writes no <tool_call>: its text comes back as content.
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.tool_calls is None and choice.message.content is not None


# ---------------------------------------------------------------------- the text splitter


FORMAT = ToolFormat("<tool_call>", "</tool_call>", json_tools.parse_tool_call, json=True)
TOOL_LIST = [Tool("get_weather", None, WEATHER), Tool("get_time", None, TIME)]


def split(pieces: list[str], *, single: bool = False) -> tuple[str, list[tuple[str, Any]]]:
    splitter = ToolCallText(FORMAT, TOOL_LIST, single=single)
    shown = ""
    for piece in pieces:
        text, _ = splitter.push(piece)
        shown += text
    shown += splitter.finish()
    assert shown == splitter.content
    return shown, [(c.name, json.loads(c.arguments)) for c in splitter.calls]


def chars(text: str) -> list[str]:
    return list(text)


@pytest.mark.parametrize("chop", [lambda t: [t], chars])
def test_the_splitter_finds_calls_however_the_text_is_streamed(chop: Any) -> None:
    text = (
        'Let me look.<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>'
        '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
        "</tool_call>"
    )
    content, calls = split(chop(text))
    assert content == "Let me look."
    assert calls == [
        ("get_time", {"zone": 2}),
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
    ]
    content, calls = split(chop(text), single=True)
    assert calls == [("get_time", {"zone": 2})]


def test_text_that_is_no_call_stays_content() -> None:
    assert split(["a <tool_ca", "ll is not closed"]) == ("a <tool_call is not closed", [])
    unclosed = 'x<tool_call>{"name": "get_time"'
    assert split(chars(unclosed)) == (unclosed, [])
    broken = "<tool_call>not json</tool_call> after"
    assert split([broken]) == (broken, [])
    assert split(["a < b <tool", "x"]) == ("a < b <toolx", [])


# ---------------------------------------------------------------------- bad input


def post(running: RunningServer, body: Any) -> httpx.Response:
    return httpx.post(running.url + "/v1/chat/completions", json=body, timeout=60)


CHAT = {"model": MODEL, "messages": ASK, "max_tokens": 4}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not among the tools",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "object"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]", "function"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "more than once"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
        (
            {"tools": TOOLS, "response_format": {"type": "json_object"}},
            "response_format",
            "tool_choice",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "tool", "tool_call_id": "call_9", "content": "21"},
                ]
            },
            "messages[1].tool_call_id",
            "answers no tool call",
        ),
        (
            {"messages": [*ASK, {"role": "tool", "content": "21"}]},
            "messages[1].tool_call_id",
            "needs a tool_call_id",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
            "messages[0].tool_calls",
            "only assistant",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{x"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
            "not JSON",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}
                ],
                "tool_choice": "required",
            },
            "tools",
            "cannot be compiled",
        ),
    ],
)
def test_bad_tool_input_is_a_400_naming_it_and_queues_nothing(
    served: RunningServer, fields: dict[str, Any], param: str, words: str
) -> None:
    wait_idle(served)
    engine = served.server.worker.engine
    assert engine is not None
    before = (engine.stats.steps, engine.num_requests, served.server.worker.waiting)
    response = post(served, {**CHAT, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert (engine.stats.steps, engine.num_requests, served.server.worker.waiting) == before


def test_a_model_without_a_tool_format_refuses_callable_tools() -> None:
    model = build_tiny_model("gpt_oss", window=8, num_layers=2, vocab_size=len(tokenizer()))
    server = KVServer(model, build_tiny_tokenizer(), model_name="plain", max_context=256)
    with server.running() as running:
        body = {**CHAT, "model": "plain", "tools": TOOLS}
        refused = post(running, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
        # tool_choice none renders nothing callable: served.
        assert post(running, {**body, "tool_choice": "none"}).status_code == 200
