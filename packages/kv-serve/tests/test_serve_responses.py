"""OpenAI's Responses API through the official ``openai`` client against the real server.

The same tiny random-weight model with a Hermes / Qwen style tool template as the other tool
tests. The oracle of an answer is the chat completions endpoint: a Responses request is the
chat request it maps onto (``instructions`` a system message, ``input`` the messages), so its
greedy text and prompt tokens equal that chat request's. Checked: text answers, whole and
streamed (the client's own stream helper, which refuses events out of order, assembles
them); usage with the prefix cache's tokens; a tool round trip through stored responses
(``previous_response_id``) equal to the same conversation sent whole; custom (free-form)
tools; ``text.format`` under its schema's grammar; retrieving and deleting stored responses;
Codex's request shape (hosted and namespaced tools, fields of its own) answered with the
ignored-field warning; and bad requests, which are 400s naming the field with nothing queued.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any, get_type_hints

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import response_create_params
from serve_support import Serve, wait_idle
from serve_support import openai_client as client

from kv_serve._server import RunningServer
from kv_serve._server_responses import RESPONSES_FIELDS
from kv_testing import build_tiny_model, build_tiny_tokenizer

MODEL = "tiny-responses"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather now",
        "parameters": WEATHER,
    },
    {
        "type": "function",
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
        },
    },
]
GREEDY: dict[str, Any] = {"temperature": 0}


@cache
def tokenizer() -> Any:
    return build_tiny_tokenizer(tools=True)


@pytest.fixture(scope="module")
def served(serve: Serve) -> RunningServer:
    model = build_tiny_model("gpt_oss", window=8, num_layers=4, vocab_size=len(tokenizer()))
    return serve(
        model, tokenizer(), model_name=MODEL, max_running=8, max_context=2048, page_size=16
    )


def chat_oracle(served: RunningServer, messages: list[Any], max_tokens: int) -> Any:
    return client(served).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


# ---------------------------------------------------------------------- text


def test_a_text_answer_is_the_chat_request_it_maps_onto(served: RunningServer) -> None:
    c = client(served)
    response = c.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="Name a river.",
        max_output_tokens=12,
        **GREEDY,
    )
    oracle = chat_oracle(
        served,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}],
        12,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL and response.instructions == "Be brief."
    assert response.output_text == oracle.choices[0].message.content
    assert response.usage is not None and oracle.usage is not None
    assert response.usage.input_tokens == oracle.usage.prompt_tokens
    assert response.usage.output_tokens == oracle.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    # Cut at max_output_tokens: incomplete, as OpenAI reports it.
    assert oracle.choices[0].finish_reason == "length"
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant"


def test_input_items_are_the_conversation(served: RunningServer) -> None:
    items: list[Any] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "user", "content": "Name a river."},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "The Rhine."}],
        },
        {"role": "user", "content": [{"type": "input_text", "text": "Another."}]},
    ]
    response = client(served).responses.create(
        model=MODEL, input=items, max_output_tokens=8, **GREEDY
    )
    oracle = chat_oracle(
        served,
        [
            {"role": "system", "content": "Hi"},
            {"role": "user", "content": "Name a river."},
            {"role": "assistant", "content": "The Rhine."},
            {"role": "user", "content": "Another."},
        ],
        8,
    )
    assert response.output_text == oracle.choices[0].message.content
    assert response.usage is not None and oracle.usage is not None
    assert response.usage.input_tokens == oracle.usage.prompt_tokens


def _whole_text(served: RunningServer) -> str:
    c = client(served)
    response = c.responses.create(
        model=MODEL, input="Weather in Oslo?", max_output_tokens=30, **GREEDY
    )
    return str(response.output_text)


def test_the_stream_assembles_the_same_answer(served: RunningServer) -> None:
    whole = _whole_text(served)
    assert len(whole) > 6
    stop = whole[4:6]
    body: dict[str, Any] = {"model": MODEL, "input": "Weather in Oslo?", "max_output_tokens": 30}
    cut = client(served).responses.create(**body, extra_body={"stop": [stop]}, **GREEDY)
    assert cut.status == "completed" and cut.output_text == whole[: whole.find(stop)]
    kinds = []
    numbers = []
    text = ""
    with client(served).responses.stream(**body, extra_body={"stop": [stop]}, **GREEDY) as s:
        for event in s:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = s.get_final_response()
    assert numbers == list(range(len(numbers)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert text == final.output_text == cut.output_text
    assert final.usage is not None and cut.usage is not None
    assert final.usage.output_tokens == cut.usage.output_tokens


def test_a_stream_cut_at_max_output_tokens_ends_incomplete(served: RunningServer) -> None:
    events = list(
        client(served).responses.create(
            model=MODEL, input="Weather in Oslo?", max_output_tokens=5, stream=True, **GREEDY
        )
    )
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage is not None and last.response.usage.output_tokens == 5


def test_a_repeated_prompt_reports_its_cached_tokens(served: RunningServer) -> None:
    wait_idle(served)
    ask = "Count the herons on the fjord, slowly."
    usages = [
        client(served).responses.create(model=MODEL, input=ask, max_output_tokens=3).usage
        for _ in range(2)
    ]
    assert usages[0] is not None and usages[1] is not None
    prompt = usages[1].input_tokens
    # The page size is 16: the repeat reads every whole page but the last token's.
    assert usages[1].input_tokens_details.cached_tokens == 16 * ((prompt - 1) // 16)
    assert (
        usages[1].input_tokens_details.cached_tokens > usages[0].input_tokens_details.cached_tokens
    )


# ---------------------------------------------------------------------- tools


def calls_of(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_through_a_stored_response(served: RunningServer, stream: bool) -> None:
    c = client(served)
    ask = "Weather in Oslo?"
    args: dict[str, Any] = {
        "model": MODEL,
        "input": ask,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 300,
        "temperature": 0.7,
        "parallel_tool_calls": False,
        "extra_body": {"seed": 7},
    }
    if stream:
        with c.responses.stream(**args) as s:
            kinds = [event.type for event in s]
            first = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
    else:
        first = c.responses.create(**args)
    assert first.status == "completed"
    calls = calls_of(first)
    assert len(calls) == 1 and calls[0].name == "get_weather"  # one: parallel calls are off
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    outputs: list[Any] = [
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}
        for call in calls
    ]
    stored = c.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=outputs,
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=8,
        **GREEDY,
    )
    assert stored.previous_response_id == first.id and not calls_of(stored)
    # The same conversation sent whole, without the store.
    history: list[Any] = [
        {"role": "user", "content": ask},
        *[
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            }
            for call in calls
        ],
        *outputs,
    ]
    whole = c.responses.create(
        model=MODEL,
        input=history,
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=8,
        store=False,
        **GREEDY,
    )
    assert whole.output_text == stored.output_text
    assert whole.usage is not None and stored.usage is not None
    assert whole.usage.input_tokens == stored.usage.input_tokens
    # The second turn reads the first's pages from the prefix cache.
    assert stored.usage.input_tokens_details.cached_tokens > 0


PATCH_TOOL: Any = {"type": "custom", "name": "apply_patch", "description": "Apply a patch"}
#: How the model is offered a custom tool: a function taking its input as one string.
PATCH_FUNCTION: Any = {
    "type": "function",
    "function": {
        "name": "apply_patch",
        "description": "Apply a patch",
        "parameters": {
            "type": "object",
            "properties": {"input": {"type": "string"}},
            "required": ["input"],
        },
    },
}


def test_a_custom_tool_is_a_function_of_its_input_text(served: RunningServer) -> None:
    history: list[Any] = [
        {"role": "user", "content": "Fix the bug."},
        {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": "+x"},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "done"},
    ]
    response = client(served).responses.create(
        model=MODEL,
        input=history,
        tools=[PATCH_TOOL],
        tool_choice="none",
        max_output_tokens=6,
        **GREEDY,
    )
    oracle = client(served).chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Fix the bug."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "apply_patch", "arguments": '{"input": "+x"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "done"},
        ],
        tools=[PATCH_FUNCTION],
        tool_choice="none",
        max_tokens=6,
        temperature=0,
    )
    assert response.output_text == oracle.choices[0].message.content
    assert response.usage is not None and oracle.usage is not None
    assert response.usage.input_tokens == oracle.usage.prompt_tokens


def test_a_call_of_a_custom_tool_is_a_custom_tool_call_item() -> None:
    from kv_serve._server_response_output import output_items
    from kv_serve._server_tools import ToolCall

    calls = [
        ToolCall("call_1", "apply_patch", '{"input": "*** Begin Patch"}'),
        ToolCall("call_2", "get_weather", '{"city": "Oslo"}'),
    ]
    items = output_items("", "", calls, frozenset({"apply_patch"}))
    assert [(i["type"], i["call_id"]) for i in items] == [
        ("custom_tool_call", "call_1"),
        ("function_call", "call_2"),
    ]
    assert items[0]["input"] == "*** Begin Patch" and items[1]["arguments"] == '{"city": "Oslo"}'


def test_text_format_follows_its_schema(served: RunningServer) -> None:
    schema = {
        "type": "object",
        "properties": {"river": {"type": "string", "maxLength": 10}},
        "required": ["river"],
        "additionalProperties": False,
    }
    response = client(served).responses.create(
        model=MODEL,
        input="Name a river.",
        text={"format": {"type": "json_schema", "name": "river", "schema": schema, "strict": True}},
        max_output_tokens=200,
        **GREEDY,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


# ---------------------------------------------------------------------- the store


def test_stored_responses_are_retrieved_and_deleted(served: RunningServer) -> None:
    c = client(served)
    made = c.responses.create(model=MODEL, input="Hello", max_output_tokens=3)
    got = c.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text
    c.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        c.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        c.responses.create(model=MODEL, input="Hi", previous_response_id=made.id)
    unstored = c.responses.create(model=MODEL, input="Hello", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_the_store_is_bounded(served: RunningServer) -> None:
    from kv_serve._server_response_output import ResponseStore

    store = ResponseStore(max_responses=2)
    for k in range(3):
        store.put({"id": f"r{k}"}, [{"role": "user", "content": "x" * k}])
    assert len(store) == 2 and store.get("r0") is None and store.get("r2") is not None
    small = ResponseStore(max_chars=200)
    small.put({"id": "big"}, [{"role": "user", "content": "x" * 500}])
    assert small.get("big") is None


# ---------------------------------------------------------------------- an agent's request


def codex_body(stream: bool) -> dict[str, Any]:
    """The shape of Codex CLI's first request (its texts shortened): developer messages,
    a namespace tool, a hosted tool, reasoning and fields of its own."""
    return {
        "model": MODEL,
        "stream": stream,
        "input": [
            {
                "type": "message",
                "id": "msg_a",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are a coding agent."}],
            },
            {
                "type": "message",
                "id": "msg_b",
                "role": "user",
                "content": [{"type": "input_text", "text": "<cwd>/tmp</cwd>"}],
            },
            {
                "type": "message",
                "id": "msg_c",
                "role": "user",
                "content": [{"type": "input_text", "text": "Say hi"}],
            },
        ],
        "tools": [
            {**TOOLS[0], "strict": False},
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "Sub-agents.",
                "tools": [{"type": "function", "name": "close_agent", "parameters": {}}],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0197",
        "client_metadata": {"turn_id": "0197"},
        "max_output_tokens": 6,
        "temperature": 0,
    }


@pytest.mark.parametrize("stream", [False, True])
def test_codex_s_request_is_answered_with_a_warning(served: RunningServer, stream: bool) -> None:
    got = httpx.post(served.url + "/v1/responses", json=codex_body(stream), timeout=60)
    assert got.status_code == 200, got.text
    assert got.headers["X-KV-Serve-Ignored"].split(", ") == [
        "client_metadata",
        "tools[1]",
        "tools[2]",
        "reasoning.summary",
    ]
    plain = {
        "model": MODEL,
        "input": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "<cwd>/tmp</cwd>"},
            {"role": "user", "content": "Say hi"},
        ],
        "tools": [TOOLS[0]],
        "max_output_tokens": 6,
        "temperature": 0,
    }
    oracle = httpx.post(served.url + "/v1/responses", json=plain, timeout=60).json()
    if stream:
        completed = [
            json.loads(line.removeprefix("data: "))
            for line in got.text.splitlines()
            if line.startswith("data: ")
        ][-1]
        assert completed["type"] == "response.incomplete"
        answer = completed["response"]
    else:
        answer = got.json()
    assert answer["output"][0]["content"] == oracle["output"][0]["content"]
    assert answer["usage"]["input_tokens"] == oracle["usage"]["input_tokens"]


# ---------------------------------------------------------------------- bad input

GOOD: dict[str, Any] = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": MODEL}, "input is required"),
        ({**GOOD, "input": 7}, "input"),
        ({**GOOD, "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {
                **GOOD,
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            },
            "input[0].content[0].type",
        ),
        ({**GOOD, "input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        (
            {
                **GOOD,
                "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
            },
            "input[0].arguments",
        ),
        (
            {**GOOD, "input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
            "answers no tool call",
        ),
        ({**GOOD, "background": True}, "background"),
        ({**GOOD, "conversation": "conv_1"}, "conversation"),
        ({**GOOD, "max_output_tokens": 0}, "max_output_tokens"),
        ({**GOOD, "tools": TOOLS, "tool_choice": {"type": "function", "name": "x"}}, "not among"),
        ({**GOOD, "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
        ({**GOOD, "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({**GOOD, "temperature": 3}, "temperature"),
        ({**GOOD, "truncation": "sometimes"}, "truncation"),
    ],
)
def test_bad_requests_are_400s_naming_the_field_and_queue_nothing(
    served: RunningServer, body: dict[str, Any], words: str
) -> None:
    wait_idle(served)
    engine = served.server.worker.engine
    assert engine is not None
    before = (engine.stats.steps, engine.num_requests, served.server.worker.waiting)
    response = httpx.post(served.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    assert (engine.stats.steps, engine.num_requests, served.server.worker.waiting) == before


# ---------------------------------------------------------------------- the field table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_field_of_the_openai_client_is_in_the_table() -> None:
    fields = set(get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    assert fields <= {r.name for r in RESPONSES_FIELDS}


def test_the_readme_table_is_the_field_table() -> None:
    text = README.read_text()
    section = text[text.index("### OpenAI's Responses API") :]
    section = section[: section.index("\n### ")]
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| (.+) \|$", section, flags=re.M)
    assert rows == [(r.name, r.treatment, r.note) for r in RESPONSES_FIELDS]
