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
        ({**GOOD, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({**GOOD, "temperature": 1.5}, "temperature"),
        ({**GOOD, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({**GOOD, "frequency_penalty": 1}, "frequency_penalty"),
        ({**GOOD, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({**GOOD, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]"),
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
    refused = post(served, "/v1/messages/count_tokens", {**GOOD})
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]
