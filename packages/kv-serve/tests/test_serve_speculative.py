"""The server with speculative decoding (``--speculative ngram``): same text, fewer steps.

A tiny random-weight gpt-oss style model (sliding and full attention) with the tiny tokenizer,
driven by the official ``openai`` client: greedy completions of repetitive prompts equal a
server without speculation, token for token, streamed or not; sampled requests still sample;
``/metrics`` counts the proposals and what was kept of them. The command line refuses
``--num-speculative-tokens`` without ``--speculative`` and values outside 1..16.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from kv_serve import cli_main
from kv_serve._server import KVServer
from kv_testing import build_tiny_tokenizer, build_zoo_model

PROMPTS = [
    "the river rises in the hills; the river rises in the hills; the river",
    "one two three four one two three four one two",
    "A completely different sentence with few repeats.",
]


def metric(text: str, name: str) -> int:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[1]))
    raise AssertionError(f"{name} not in /metrics")


def completions(speculative: str | None) -> tuple[list[str], list[str], dict[str, int]]:
    tokenizer = build_tiny_tokenizer()
    model = build_zoo_model("gpt_oss", vocab_size=len(tokenizer))
    server = KVServer(
        model,
        tokenizer,
        model_name="tiny",
        max_running=4,
        max_context=512,
        page_size=8,
        speculative=speculative,
        num_speculative_tokens=3,
    )
    with server.running() as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)
        whole = [
            client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0)
            .choices[0]
            .text
            for p in PROMPTS
        ]
        streamed = []
        for p in PROMPTS:
            pieces: list[Any] = []
            for chunk in client.completions.create(
                model="tiny", prompt=p, max_tokens=24, temperature=0, stream=True
            ):
                pieces += [c.text for c in chunk.choices]
            streamed.append("".join(pieces))
        sampled = client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=5
        )
        assert sampled.usage is not None and sampled.usage.completion_tokens == 8
        text = httpx.get(running.url + "/metrics").text
        counts = {
            name: metric(text, f"kv_serve_speculative_{name}_total")
            for name in ("steps", "proposed_tokens", "accepted_tokens")
        }
    return whole, streamed, counts


def test_speculation_keeps_the_text_and_counts_what_it_kept() -> None:
    plain, plain_streamed, none = completions(None)
    assert none == {"steps": 0, "proposed_tokens": 0, "accepted_tokens": 0}
    fast, fast_streamed, counts = completions("ngram")
    assert fast == plain == plain_streamed == fast_streamed
    assert counts["steps"] > 0 and 0 <= counts["accepted_tokens"] <= counts["proposed_tokens"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative"),
        (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        (["--speculative", "ngram", "--num-speculative-tokens", "100"], "--num-speculative-tokens"),
        (["--speculative", "medusa"], "invalid choice: 'medusa'"),
    ],
)
def test_the_command_line_refuses_bad_speculation(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["serve", "--model", "gemma3-270m", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
