"""Anthropic's Messages API through the official ``anthropic`` client against the real server.

The same tiny random-weight model with a Hermes / Qwen style tool template as the OpenAI tool
tests. Checked: a text answer and its usage (``input_tokens`` equal to ``count_tokens``),
Anthropic's event sequence when streamed (its text equal to the answer not streamed),
``stop_sequences`` (the text cut before the first occurrence, ``stop_reason`` and
``stop_sequence`` reported), a tool round trip (``tool_choice`` ``any`` and a named tool are
enforced; ``tool_use`` blocks whose ``input`` validates against the tool's ``input_schema``;
``tool_result`` blocks answered in the next turn), streamed and not; and bad requests, which
are 400s in Anthropic's error shape naming what is wrong, with nothing queued.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import MessageParam, ToolParam
from serve_support import Serve, wait_idle
from serve_support import anthropic_client as client

from kv_serve._server import RunningServer
from kv_testing import build_tiny_model, build_tiny_tokenizer

MODEL = "tiny-messages"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[ToolParam] = [
    {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER},
    {
        "name": "get_time",
        "input_schema": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
        },
    },
]
ASK: list[MessageParam] = [{"role": "user", "content": "Weather in Oslo?"}]
#: The client no longer takes temperature (the API still does): greedy through the body.
GREEDY = {"temperature": 0}


@cache
def tokenizer() -> Any:
    return build_tiny_tokenizer(tools=True)


@pytest.fixture(scope="module")
def served(serve: Serve) -> RunningServer:
    model = build_tiny_model("gpt_oss", window=8, num_layers=4, vocab_size=len(tokenizer()))
    return serve(
        model, tokenizer(), model_name=MODEL, max_running=8, max_context=2048, page_size=16
    )


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# ---------------------------------------------------------------------- text


def test_a_text_answer_with_its_usage_and_count_tokens(served: RunningServer) -> None:
    c = client(served)
    message = c.messages.create(
        model=MODEL, max_tokens=20, messages=ASK, system="Be brief.", extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and message.id.startswith("msg_")
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens <= 20
    assert [b.type for b in message.content] in (["text"], [])
    counted = c.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")
    usage = message.usage
    # Anthropic's input_tokens leave out the tokens read from the cache.
    read = usage.cache_read_input_tokens
    assert read is not None and usage.cache_creation_input_tokens == 0
    assert counted.input_tokens == usage.input_tokens + read > 0


def prompt_of(usage: Any) -> int:
    """The whole prompt of a Messages answer: its input tokens and those read from the cache."""
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))


def test_a_repeated_prompt_reads_its_pages_from_the_cache(served: RunningServer) -> None:
    wait_idle(served)
    c = client(served)
    ask: list[MessageParam] = [{"role": "user", "content": "Count the herons on the fjord."}]
    counted = c.messages.count_tokens(model=MODEL, messages=ask).input_tokens
    reads = []
    for _ in range(2):
        usage = c.messages.create(model=MODEL, max_tokens=3, messages=ask, extra_body=GREEDY).usage
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted
        reads.append(usage.cache_read_input_tokens or 0)
    with c.messages.stream(model=MODEL, max_tokens=3, messages=ask, extra_body=GREEDY) as s:
        streamed = s.get_final_message().usage
    assert streamed.cache_read_input_tokens == reads[1]
    assert streamed.input_tokens + reads[1] == counted
    # The page size is 16: the repeat reads every whole page but the last token's.
    assert reads[1] == 16 * ((counted - 1) // 16) > reads[0]


def test_the_stream_is_anthropic_s_event_sequence(served: RunningServer) -> None:
    c = client(served)
    whole = c.messages.create(model=MODEL, max_tokens=20, messages=ASK, extra_body=GREEDY)
    kinds = []
    text = ""
    for event in c.messages.create(
        model=MODEL, max_tokens=20, messages=ASK, extra_body=GREEDY, stream=True
    ):
        kinds.append(event.type)
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
        if event.type == "message_delta":
            assert event.delta.stop_reason == whole.stop_reason
            assert event.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    if text:
        assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert text == text_of(whole)
    # The client's own stream helper assembles the same message.
    with c.messages.stream(model=MODEL, max_tokens=20, messages=ASK, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole)


def test_stop_sequences_cut_the_text_and_are_reported(served: RunningServer) -> None:
    c = client(served)
    whole = text_of(c.messages.create(model=MODEL, max_tokens=30, messages=ASK, extra_body=GREEDY))
    assert len(whole) > 6
    stop = whole[4:6]
    cut = c.messages.create(
        model=MODEL, max_tokens=30, messages=ASK, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == whole[: whole.find(stop)]


# ---------------------------------------------------------------------- tools


def tool_uses(message: Any) -> list[Any]:
    return [block for block in message.content if block.type == "tool_use"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(served: RunningServer, stream: bool) -> None:
    c = client(served)
    first = c.messages.create(
        model=MODEL,
        max_tokens=300,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0.7},
    )
    assert first.stop_reason == "tool_use"
    uses = tool_uses(first)
    assert uses and all(u.name == "get_weather" and u.id.startswith("toolu_") for u in uses)
    for use in uses:
        jsonschema.validate(use.input, WEATHER)
    turn: list[MessageParam] = [
        *ASK,
        {"role": "assistant", "content": [u.model_dump() for u in uses]},  # type: ignore[misc]
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": "21 degrees"} for u in uses
            ],
        },
    ]
    if not stream:
        answer = c.messages.create(
            model=MODEL, max_tokens=12, messages=turn, tools=TOOLS, tool_choice={"type": "none"}
        )
        assert answer.stop_reason in ("end_turn", "max_tokens") and not tool_uses(answer)
        assert prompt_of(answer.usage) > prompt_of(first.usage)
        return
    with c.messages.stream(
        model=MODEL, max_tokens=12, messages=turn, tools=TOOLS, tool_choice={"type": "none"}
    ) as answer_stream:
        final = answer_stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens") and not tool_uses(final)


def test_streamed_tool_use_blocks_carry_their_input(served: RunningServer) -> None:
    blocks: dict[int, dict[str, Any]] = {}
    reason = None
    for event in client(served).messages.create(
        model=MODEL,
        max_tokens=300,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stream=True,
    ):
        if event.type == "content_block_start" and event.content_block.type == "tool_use":
            blocks[event.index] = {"name": event.content_block.name, "json": ""}
        if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
            blocks[event.index]["json"] += event.delta.partial_json
        if event.type == "message_delta":
            reason = event.delta.stop_reason
    assert reason == "tool_use" and len(blocks) == 1  # one call: parallel use disabled
    (block,) = blocks.values()
    schema = next(t["input_schema"] for t in TOOLS if t["name"] == block["name"])
    jsonschema.validate(json.loads(block["json"]), schema)


# ---------------------------------------------------------------------- bad input


def post(running: RunningServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(running.url + path, json=body, timeout=60)


GOOD = {"model": MODEL, "max_tokens": 4, "messages": ASK}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (
            {**GOOD, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {
                **GOOD,
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}
                ],
            },
            "messages[0].content[0].type",
        ),
        (
            {
                **GOOD,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}],
                    }
                ],
            },
            "answers no tool call",
        ),
        (
            {**GOOD, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
            "not among the tools",
        ),
        ({**GOOD, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"model": MODEL, "messages": ASK}, "max_tokens"),
        ({**GOOD, "thinking": {"type": "enabled", "budget_tokens": 10}}, "budget_tokens"),
        ({**GOOD, "thinking": {"type": "sometimes"}}, "thinking"),
        ({**GOOD, "temperature": 1.5}, "temperature"),
        ({**GOOD, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({**GOOD, "messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
        ({**GOOD, "tools": [{"type": 7, "name": "bash"}]}, "tools[0].type"),
    ],
)
def test_bad_messages_are_400s_in_anthropic_s_shape_and_queue_nothing(
    served: RunningServer, body: dict[str, Any], words: str
) -> None:
    wait_idle(served)
    engine = served.server.worker.engine
    assert engine is not None
    before = (engine.stats.steps, engine.num_requests, served.server.worker.waiting)
    response = post(served, "/v1/messages", body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error
    assert (engine.stats.steps, engine.num_requests, served.server.worker.waiting) == before


def test_a_system_turn_among_the_messages_is_a_system_message(served: RunningServer) -> None:
    """Claude Code sends system turns among the messages."""
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
    ]
    counted = post(served, "/v1/messages/count_tokens", {"model": MODEL, "messages": turns})
    assert counted.status_code == 200, counted.text
    oracle = post(served, "/tokenize", {"model": MODEL, "messages": turns}).json()
    assert counted.json()["input_tokens"] == oracle["count"]


def test_the_client_sees_anthropic_errors(served: RunningServer) -> None:
    c = client(served)
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        c.messages.create(model="other", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="image"):
        c.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": ""},
                        }
                    ],
                }
            ],
        )
    # count_tokens answers a body with generation fields, reporting them as ignored.
    counted = post(served, "/v1/messages/count_tokens", {**GOOD})
    assert counted.status_code == 200 and counted.headers["X-KV-Serve-Ignored"] == "max_tokens"


# ---------------------------------------------------------------------- the tolerant policy

#: What a coding agent's request carries beside the conversation: cache_control marks, a
#: thinking budget, an earlier turn's thinking, server tools, fields of newer API versions.
AGENT_EXTRAS: dict[str, Any] = {
    "thinking": {"type": "enabled", "budget_tokens": 2048},
    "context_management": {"edits": []},
    "future_field": {"x": 1},
}


def agent_body(stream: bool) -> dict[str, Any]:
    return {
        **GOOD,
        "max_tokens": 6,
        **GREEDY,
        "stream": stream,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "greet back", "signature": "s"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Hello."},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}
                ],
            },
        ],
        "tools": [
            {**TOOLS[0], "cache_control": {"type": "ephemeral"}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 2},
            {**TOOLS[1], "defer_loading": True},
        ],
        "metadata": {"user_id": "u"},
        **AGENT_EXTRAS,
    }


def plain_body(stream: bool) -> dict[str, Any]:
    """The same conversation with only what the server acts on."""
    body = agent_body(stream)
    for name in AGENT_EXTRAS:
        del body[name]
    body["system"] = "Be brief."
    body["messages"][1] = {"role": "assistant", "content": "Hello."}
    body["messages"][2] = {"role": "user", "content": "Weather?"}
    body["tools"] = TOOLS
    return body


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_s_extra_fields_are_answered_with_a_warning(
    served: RunningServer, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    headers = {"anthropic-beta": "interleaved-thinking-2025-05-14", "anthropic-version": "x"}
    with caplog.at_level("WARNING", logger="kv_serve"):
        got = httpx.post(
            served.url + "/v1/messages", json=agent_body(stream), headers=headers, timeout=60
        )
    plain = post(served, "/v1/messages", plain_body(stream))
    assert got.status_code == 200 == plain.status_code, got.text
    # Nothing the server ignored changed the answer.
    if stream:
        assert texts_of_events(got.text) == texts_of_events(plain.text)
    else:
        assert got.json()["content"] == plain.json()["content"]
    ignored = got.headers["X-KV-Serve-Ignored"].split(", ")
    assert ignored == [
        "thinking",
        "context_management",
        "future_field",
        "messages[1].content[1]",
        "tools[1]",
        "tools[2].defer_loading",
        "messages[1].reasoning_content",  # the chat template never reads it
    ]
    assert got.headers["Warning"].startswith('299 kv-serve "ignored thinking: ')
    assert "X-KV-Serve-Ignored" not in plain.headers
    # The server logs a field name once: here, or in the other parametrization's request.
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"field {n}" in logged for n in ("thinking", "tools[]")) or "ignored" not in logged


def texts_of_events(stream_text: str) -> list[str]:
    """The text and tool input deltas of an event stream, in order."""
    out = []
    for line in stream_text.splitlines():
        if line.startswith("data: "):
            event = json.loads(line[6:])
            delta = event.get("delta", {})
            out.append(delta.get("text", "") + delta.get("partial_json", ""))
    return out


def test_count_tokens_reports_what_it_ignored(served: RunningServer) -> None:
    body = {"model": MODEL, "messages": ASK, "thinking": {"type": "adaptive"}, "max_tokens": 3}
    got = post(served, "/v1/messages/count_tokens", body)
    plain = post(served, "/v1/messages/count_tokens", {"model": MODEL, "messages": ASK})
    assert got.json() == plain.json()
    assert got.headers["X-KV-Serve-Ignored"] == "thinking, max_tokens"
    off = {"model": MODEL, "messages": ASK, "thinking": {"type": "disabled"}}
    assert "X-KV-Serve-Ignored" not in post(served, "/v1/messages/count_tokens", off).headers
