"""``response_format`` through the official ``openai`` client against the real HTTP server.

``json_object`` and ``json_schema`` on ``/v1/completions`` and ``/v1/chat/completions``,
streamed and not: every choice's text parses and validates under its schema (``jsonschema``,
an independent validator) and ends with ``finish_reason == "stop"``. Constrained requests
decode in the same batches as free ones; a free greedy request's text is the same as when it
runs alone. A schema the grammar engine cannot compile, and every malformed
``response_format``, is a 400 naming what is wrong, and nothing is queued.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any, cast

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONSchema
from serve_support import Serve, wait_idle
from serve_support import openai_client as client

from kv_serve._server import RunningServer
from kv_testing import build_tiny_model, build_tiny_tokenizer

MODEL = "tiny"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
JSON_SCHEMA: ResponseFormatJSONSchema = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Describe a person as JSON."}
]


@cache
def tokenizer() -> Any:
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def served(serve: Serve) -> RunningServer:
    model = build_tiny_model("gpt_oss", window=8, num_layers=4, vocab_size=len(tokenizer()))
    return serve(
        model,
        tokenizer(),
        model_name=MODEL,
        max_running=8,
        max_context=512,
        page_size=8,
        prefill_chunk=64,
    )


def person(text: str) -> dict[str, Any]:
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    assert isinstance(value, dict)
    return value


def an_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    assert isinstance(value, dict)
    return value


# ---------------------------------------------------------------------- completions


def test_completions_json_schema_greedy_and_sampled(served: RunningServer) -> None:
    out = client(served).completions.create(
        model=MODEL,
        prompt="The river rises",
        max_tokens=200,
        temperature=1.0,
        seed=7,
        n=3,
        extra_body={"response_format": JSON_SCHEMA},
    )
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        person(choice.text)
    greedy = client(served).completions.create(
        model=MODEL,
        prompt="Children swim",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": JSON_SCHEMA},
    )
    assert greedy.choices[0].finish_reason == "stop"
    person(greedy.choices[0].text)


def test_completions_json_object_streamed(served: RunningServer) -> None:
    stream = client(served).completions.create(
        model=MODEL,
        prompt=["The river rises", "def main():"],
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"response_format": {"type": "json_object"}},
    )
    texts = ["", ""]
    reasons: list[str | None] = [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert reasons == ["stop", "stop"]
    for text in texts:
        an_object(text)


# ---------------------------------------------------------------------- chat


def test_chat_json_schema_not_streamed_and_streamed(served: RunningServer) -> None:
    chat = client(served).chat.completions
    out = chat.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        temperature=0.9,
        seed=3,
        n=2,
        response_format=JSON_SCHEMA,
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        person(choice.message.content or "")
    stream = chat.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        temperature=0.9,
        seed=3,
        n=2,
        response_format=JSON_SCHEMA,
        stream=True,
    )
    texts = ["", ""]
    for chunk in stream:
        for part in chunk.choices:
            texts[part.index] += part.delta.content or ""
    # The same seeds give the same sequences, streamed or not.
    assert texts == [c.message.content for c in out.choices]


def test_chat_json_object_streamed(served: RunningServer) -> None:
    stream = client(served).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
        stream=True,
    )
    text = ""
    reason = None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    assert reason == "stop"
    an_object(text)


def test_free_greedy_requests_are_unchanged_by_constrained_neighbours(
    served: RunningServer,
) -> None:
    c = client(served)
    prompts = ["The river rises in the hills", "In spring the water", "Children swim"]

    def free(prompt: str) -> str:
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        return out.choices[0].text

    def constrained(i: int) -> str:
        out = c.completions.create(
            model=MODEL,
            prompt=prompts[i % 3],
            max_tokens=200,
            temperature=1.0,
            seed=i,
            extra_body={"response_format": JSON_SCHEMA},
        )
        return out.choices[0].text

    wait_idle(served)
    alone = [free(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        constrained_runs = [pool.submit(constrained, i) for i in range(5)]
        free_runs = [pool.submit(free, p) for p in prompts]
        mixed = [f.result() for f in free_runs]
        for run in constrained_runs:
            person(run.result())
    assert mixed == alone


# ---------------------------------------------------------------------- bad input


def post(running: RunningServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(running.url + path, json=body, timeout=60)


GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize(
    ("path", "response_format", "param", "words"),
    [
        (
            "/v1/chat/completions",
            schema_format({"type": "frobnicate"}),
            "response_format.json_schema.schema",
            "frobnicate",
        ),
        (
            "/v1/completions",
            schema_format({"type": "string", "pattern": "(("}),
            "response_format.json_schema.schema",
            "unclosed group",
        ),
        ("/v1/completions", {"type": "xml"}, "response_format.type", "json_schema"),
        ("/v1/chat/completions", "json", "response_format", "object"),
        (
            "/v1/chat/completions",
            {"type": "json_schema"},
            "response_format.json_schema",
            "name and schema",
        ),
        (
            "/v1/chat/completions",
            {"type": "json_schema", "json_schema": {"schema": PERSON}},
            "response_format.json_schema.name",
            "name",
        ),
        (
            "/v1/chat/completions",
            {"type": "json_schema", "json_schema": {"name": "p"}},
            "response_format.json_schema.schema",
            "schema",
        ),
        (
            "/v1/chat/completions",
            {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "x": 1}},
            "response_format.json_schema.x",
            "not a json_schema field",
        ),
        (
            "/v1/chat/completions",
            {"type": "json_object", "json_schema": {}},
            "response_format.json_schema",
            "takes no",
        ),
        (
            "/v1/chat/completions",
            {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": 1}},
            "response_format.json_schema.strict",
            "boolean",
        ),
    ],
)
def test_a_bad_response_format_is_a_400_naming_the_problem_and_queues_nothing(
    served: RunningServer, path: str, response_format: Any, param: str, words: str
) -> None:
    wait_idle(served)
    engine = served.server.worker.engine
    assert engine is not None
    before = (engine.stats.steps, engine.num_requests, served.server.worker.waiting)
    body = {**(GOOD if path == "/v1/completions" else CHAT), "response_format": response_format}
    response = post(served, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"]
    assert (engine.stats.steps, engine.num_requests, served.server.worker.waiting) == before


def test_the_openai_client_sees_a_bad_schema_as_bad_request(served: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        client(served).chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format=cast(ResponseFormatJSONSchema, schema_format({"type": "frobnicate"})),
        )


def test_min_tokens_with_a_json_format_is_refused(served: RunningServer) -> None:
    body = {**CHAT, "response_format": {"type": "json_object"}, "min_tokens": 3}
    response = post(served, "/v1/chat/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "min_tokens"


def test_text_format_is_plain_generation(served: RunningServer) -> None:
    plain = post(served, "/v1/completions", {**GOOD, "temperature": 0})
    text = post(
        served,
        "/v1/completions",
        {**GOOD, "temperature": 0, "response_format": {"type": "text"}},
    )
    assert plain.status_code == text.status_code == 200
    assert plain.json()["choices"][0]["text"] == text.json()["choices"][0]["text"]
