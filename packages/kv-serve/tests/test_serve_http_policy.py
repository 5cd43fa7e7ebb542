"""The request policy on the OpenAI endpoints, through the official ``openai`` client.

Honoured where the server can, refused by name where acting without a field would change the
answer, accepted with a visible warning otherwise: fields the server ignores come back in
the ``X-KV-Serve-Ignored`` and ``Warning`` headers and change nothing in the answer (its
tokens equal the plain request's); what the chat template is handed (``reasoning_effort``,
``chat_template_kwargs``, a message's own fields, any role) reaches it (the prompt's tokens
equal the template's own rendering); a role the template refuses is a 400. Also the stream's
last chunk (an empty delta with the finish reason), the model card's ``root`` and
``parent``, and ``--max-tokens-default``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam
from serve_support import Serve
from serve_support import openai_client as client

from kv_serve._server import RunningServer
from kv_testing import build_tiny_model, build_tiny_tokenizer

MODEL = "tiny-policy"
#: A template that reads reasoning_effort, enable_thinking and a message's reasoning_content,
#: renders the roles it knows and refuses any other, two turns of one role in a row, and a
#: system turn after the first turn.
TEMPLATE = (
    "{% if reasoning_effort %}<|system|>effort: {{ reasoning_effort }}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role not in ['system', 'user', 'assistant', 'critic'] %}"
    "{{ raise_exception('unknown role ' + message.role) }}{% endif %}"
    "{% if loop.index0 and messages[loop.index0 - 1].role == message.role %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% if loop.index0 and message.role == 'system' %}"
    "{{ raise_exception('a system turn comes first') }}{% endif %}"
    "<|{{ message.role }}|>"
    "{% if message.reasoning_content %}thought: {{ message.reasoning_content }} {% endif %}"
    "{{ message.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}no thinking {% endif %}{% endif %}"
)
ASK: list[dict[str, Any]] = [{"role": "user", "content": "Name a river."}]
#: The same, typed for the openai client.
ASK_PARAM: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a river."}]
CAP = 5


@cache
def tokenizer() -> Any:
    tok = build_tiny_tokenizer()
    tok._tokenizer.chat_template = TEMPLATE
    return tok


def rendered(messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The template's own tokens for ``messages`` (the oracle of the prompt)."""
    ids = tokenizer().apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    return [int(i) for i in ids]


@pytest.fixture(scope="module")
def served(serve: Serve) -> RunningServer:
    model = build_tiny_model("llama", num_layers=2, vocab_size=len(tokenizer()))
    return serve(
        model,
        tokenizer(),
        model_name=MODEL,
        max_running=4,
        max_context=512,
        page_size=8,
        max_tokens_default=CAP,
    )


def chat(served: RunningServer, **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "messages": ASK, "max_tokens": 6, "temperature": 0, **body}
    payload.setdefault("return_token_ids", True)
    return httpx.post(served.url + "/v1/chat/completions", json=payload, timeout=60)


def test_ignored_fields_are_answered_and_reported(served: RunningServer) -> None:
    extra = {
        "prediction": {"type": "content", "content": "Nile"},
        "web_search_options": {},
        "repetition_context_size": 20,  # mlx-lm's own field
        "unheard_of": [1, 2],
    }
    raw = client(served).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=ASK_PARAM,
        max_tokens=6,
        temperature=0,
        extra_body=extra,
    )
    plain = client(served).chat.completions.with_raw_response.create(
        model=MODEL,
        messages=ASK_PARAM,
        max_tokens=6,
        temperature=0,
    )
    assert raw.http_response.status_code == 200
    assert raw.headers["X-KV-Serve-Ignored"] == (
        "prediction, web_search_options, repetition_context_size, unheard_of"
    )
    assert raw.headers["Warning"].startswith('299 kv-serve "ignored prediction: ')
    assert "X-KV-Serve-Ignored" not in plain.headers
    assert raw.parse().choices[0].message == plain.parse().choices[0].message
    # Streamed, the headers come with the stream.
    with httpx.stream(
        "POST",
        served.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "max_tokens": 2, "stream": True, **extra},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["X-KV-Serve-Ignored"].startswith("prediction, ")
        response.read()
    # Completions too: a chat-only field there is reported as such.
    done = httpx.post(
        served.url + "/v1/completions",
        json={"model": MODEL, "prompt": "a", "max_tokens": 2, "top_logprobs": 2},
        timeout=60,
    )
    assert done.status_code == 200 and done.headers["X-KV-Serve-Ignored"] == "top_logprobs"
    assert "only on /v1/chat/completions" in done.headers["Warning"]


def test_what_the_template_is_handed_reaches_it(served: RunningServer) -> None:
    got = chat(served, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert got.status_code == 200, got.text
    prompt = got.json()["choices"][0]["prompt_token_ids"]
    assert prompt == rendered(ASK, reasoning_effort="high", enable_thinking=False)
    assert prompt != rendered(ASK)
    assert "X-KV-Serve-Ignored" not in got.headers
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet", "mood": "calm"},
        {"role": "critic", "content": "Too short."},
        *ASK,
    ]
    got = chat(served, messages=history, chat_template_kwargs={"temperature_hint": 1})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["prompt_token_ids"] == rendered(history)
    # What the template never reads is reported.
    assert got.headers["X-KV-Serve-Ignored"] == (
        "chat_template_kwargs.temperature_hint, messages[1].mood"
    )


def test_a_role_the_template_refuses_is_a_400(served: RunningServer) -> None:
    got = chat(served, messages=[{"role": "wizard", "content": "x"}])
    assert got.status_code == 400
    error = got.json()["error"]
    assert error["param"] == "messages" and "unknown role wizard" in error["message"]
    assert chat(served, chat_template_kwargs={"tools": []}).status_code == 400


def test_repeated_turns_the_template_refuses_are_joined_with_a_warning(
    served: RunningServer,
) -> None:
    parts = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi."},
        *ASK,
    ]
    got = chat(served, messages=parts)
    assert got.status_code == 200, got.text
    joined = [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "Hi.\n\nName a river."},
    ]
    assert got.json()["choices"][0]["prompt_token_ids"] == rendered(joined)
    assert got.headers["X-KV-Serve-Ignored"] == "messages"
    # Assistant turns are never joined: the template's refusal stands.
    twice = [*ASK, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    refused = chat(served, messages=twice)
    assert refused.status_code == 400 and "roles must alternate" in refused.text


def test_system_turns_the_template_refuses_later_are_joined_into_the_first(
    served: RunningServer,
) -> None:
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
        {"role": "system", "content": "Be kind."},
        *ASK,
    ]
    got = chat(served, messages=turns)
    assert got.status_code == 200, got.text
    folded = [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "Hi.\n\nName a river."},
    ]
    assert got.json()["choices"][0]["prompt_token_ids"] == rendered(folded)
    assert "system turns were joined" in got.headers["Warning"]


def test_an_agent_s_max_tokens_past_the_context_is_cut_to_it(served: RunningServer) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 100_000, "temperature": 0}
    # Anthropic's and the Responses API: cut to the context the prompt leaves, with a warning.
    got = httpx.post(served.url + "/v1/messages", json=body, timeout=120)
    assert got.status_code == 200, got.text
    usage = got.json()["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert prompt + usage["output_tokens"] <= 512
    assert got.headers["X-KV-Serve-Ignored"] == "max_tokens"
    assert f"at most {512 - prompt} tokens" in got.headers["Warning"]
    responses = {"model": MODEL, "input": ASK, "max_output_tokens": 100_000, "temperature": 0}
    answer = httpx.post(served.url + "/v1/responses", json=responses, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-KV-Serve-Ignored"] == "max_output_tokens"
    # Chat completions keep OpenAI's answer: a 400 naming the context.
    refused = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and "maximum context length" in refused.text


def test_the_last_chunk_has_an_empty_delta_and_the_finish_reason(served: RunningServer) -> None:
    stream = client(served).chat.completions.create(
        model=MODEL,
        messages=ASK_PARAM,
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last.finish_reason == "length" and last.delta.content is None
    assert last.delta.role is None and last.delta.tool_calls is None
    plain = client(served).chat.completions.create(
        model=MODEL,
        messages=ASK_PARAM,
        max_tokens=6,
        temperature=0,
    )
    assert "".join(c.delta.content or "" for c in chunks) == plain.choices[0].message.content
    texts = [
        c.choices[0]
        for c in client(served).completions.create(
            model=MODEL, prompt="a river", max_tokens=4, temperature=0, stream=True
        )
    ]
    assert texts[-1].text == "" and texts[-1].finish_reason == "length"
    assert all(t.finish_reason is None for t in texts[:-1])


def test_the_model_card_names_its_root(served: RunningServer) -> None:
    card = httpx.get(served.url + f"/v1/models/{MODEL}", timeout=10).json()
    assert card["root"] == MODEL and card["parent"] is None
    assert client(served).models.retrieve(MODEL).id == MODEL


def test_a_request_without_max_tokens_is_capped_by_the_server_default(
    served: RunningServer,
) -> None:
    body = {"model": MODEL, "messages": ASK, "ignore_eos": True, "temperature": 0}
    got = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert got["usage"]["completion_tokens"] == CAP
    assert got["choices"][0]["finish_reason"] == "length"
    asked = chat(served, max_tokens=CAP + 3, ignore_eos=True).json()
    assert asked["usage"]["completion_tokens"] == CAP + 3  # a request's own limit wins


def test_tokenize_and_detokenize_are_the_tokenizer_s(served: RunningServer) -> None:
    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(served.url + path, json=body, timeout=10)

    text = "The river rises"
    got = post("/tokenize", {"model": MODEL, "prompt": text}).json()
    ids = [int(i) for i in tokenizer().encode(text)]
    assert got == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    bare = post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == ids[1:] and ids[0] == tokenizer().bos_token_id
    strs = post("/tokenize", {"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == tokenizer().convert_ids_to_tokens(ids)
    chat = post("/tokenize", {"messages": ASK, "reasoning_effort": "low"}).json()
    assert chat["tokens"] == rendered(ASK, reasoning_effort="low")
    back = post("/detokenize", {"model": MODEL, "tokens": ids}).json()
    assert back == {"prompt": tokenizer().decode(ids)}
    assert post("/detokenize", {"tokens": [1, -1]}).status_code == 400
    assert post("/detokenize", {"tokens": "12"}).json()["error"]["param"] == "tokens"
    assert post("/tokenize", {"prompt": 3}).status_code == 400
    assert post("/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    odd = post("/tokenize", {"prompt": "x", "priority": 1})
    assert odd.status_code == 200 and odd.headers["X-KV-Serve-Ignored"] == "priority"
