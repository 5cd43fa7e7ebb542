"""Every sampling field, logprobs, n, best_of, echo and prompt batches, through the ``openai``
client against a served tiny hybrid model, each against an oracle that shares no code with
the server or the engine: mlx-lm's own model and caches (its logits, log-softmaxed) and plain
numpy for OpenAI's penalty formulas; n sequences with seeds against the same seeds one by one.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, cast

import httpx
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import openai
import pytest
from mlx_lm.models.cache import make_prompt_cache
from serve_support import Serve, wait_idle
from serve_support import openai_client as client

from kv_batching import MAX_LOGPROBS, DecodeEngine
from kv_pool import HybridKVPool
from kv_protocol import layout_from_model
from kv_serve import build_kernels, pool_backed_cache, stop_token_ids
from kv_serve._server import RunningServer
from kv_serve._server_protocol import MAX_LOGPROBS as SERVER_MAX_LOGPROBS
from kv_testing import build_tiny_model, build_tiny_tokenizer, mlx_lm_greedy

MODEL = "tiny"
PAGE = 4
CONTEXT = 256
PROMPT = "The river rises in the hills"
TOL = 2e-4  # the engine's batched fp32 logits against mlx-lm's own


@cache
def tokenizer() -> Any:
    return build_tiny_tokenizer()


def new_model() -> nn.Module:
    return build_tiny_model("gemma3_text", window=8, num_layers=4, vocab_size=len(tokenizer()))


@cache
def oracle_model() -> nn.Module:
    return new_model()


@cache
def eos() -> frozenset[int]:
    return frozenset(stop_token_ids(tokenizer()))


def encode(text: str) -> list[int]:
    return [int(i) for i in tokenizer().encode(text)]


def text_of(tokens: Sequence[int]) -> str:
    return str(tokenizer().decode([t for t in tokens if t not in eos()]))


# ---------------------------------------------------------------------- oracles


def mlx_lm_logprobs(ids: Sequence[int]) -> np.ndarray:
    """Row ``i``: mlx-lm's log-softmax over the token after ``ids[: i + 1]`` (its own caches)."""
    model = oracle_model()
    logits = model(mx.array([list(ids)]), cache=make_prompt_cache(model))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def numpy_processed(
    logits: mx.array,
    prompt: Sequence[int],
    out: Sequence[int],
    *,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    bias: Mapping[int, float] | None = None,
    stops: frozenset[int] = frozenset(),
    min_tokens: int = 0,
) -> np.ndarray:
    """mlx-lm's last logits after OpenAI's penalties, in numpy.

    Repetition (vLLM / mlx-lm: positive logits divided, negative multiplied, over prompt and
    output), then ``logit - frequency * count - presence * (count > 0)`` over the output,
    then the bias; stop tokens masked while fewer than ``min_tokens`` were generated.
    """
    row = np.array(logits.astype(mx.float32)).astype(np.float64)
    for t in set(prompt) | set(out):
        row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
    for t, count in Counter(out).items():
        row[t] -= frequency * count + presence
    for t, b in (bias or {}).items():
        row[t] += b
    if len(out) < min_tokens:
        row[list(stops)] = -np.inf
    return row


def greedy(ids: Sequence[int], max_tokens: int) -> list[int]:
    return mlx_lm_greedy(oracle_model(), list(ids), max_tokens, stop_tokens=eos())


# ---------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def served(serve: Serve) -> RunningServer:
    return serve(
        new_model(),
        tokenizer(),
        model_name=MODEL,
        max_running=8,
        max_queued=512,
        max_context=CONTEXT,
        page_size=PAGE,
        prefill_chunk=32,
    )


def ids_of(choice: Any) -> list[int]:
    return list(choice.token_ids)


def complete(running: RunningServer, **fields: Any) -> Any:
    extra = {k: fields.pop(k) for k in list(fields) if k in EXTENSIONS}
    extra["return_token_ids"] = True
    return client(running).completions.create(
        model=MODEL, extra_body=extra, **{"prompt": PROMPT, "temperature": 0, **fields}
    )


EXTENSIONS = {
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
}


def test_the_server_allows_the_engines_logprob_limit() -> None:
    assert SERVER_MAX_LOGPROBS == MAX_LOGPROBS


def test_a_model_is_retrieved_by_id(served: RunningServer) -> None:
    card = client(served).models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client(served).models.retrieve("gpt-4")
    assert info.value.body["param"] == "model"  # type: ignore[index]


# ---------------------------------------------------------------------- logprobs


def test_completion_logprobs_are_mlx_lms_log_softmax(served: RunningServer) -> None:
    prompt = encode(PROMPT)
    out = complete(served, max_tokens=12, logprobs=5)
    choice = out.choices[0]
    tokens = ids_of(choice)
    rows = mlx_lm_logprobs(prompt + tokens)[len(prompt) - 1 :]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(tokens)
    for i, token in enumerate(tokens):
        assert lp.token_logprobs[i] == pytest.approx(rows[i][token], abs=TOL)
        best = np.sort(rows[i])[::-1][:5]
        # Greedy: the chosen token is the most likely, so the map holds just the top 5.
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(best, abs=TOL)
        for t in np.argsort(rows[i])[::-1][:5]:
            name = str(tokenizer().decode([int(t)]))
            if "\ufffd" not in name:
                assert lp.top_logprobs[i][name] == pytest.approx(rows[i][t], abs=TOL)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(tokens))]
    # logprobs: 0 still gives the chosen token's logprob.
    zero = complete(served, max_tokens=3, logprobs=0).choices[0].logprobs
    assert [len(t) for t in zero.top_logprobs] == [1, 1, 1]
    assert complete(served, max_tokens=3).choices[0].logprobs is None


def test_sampled_logprobs_are_of_the_models_own_distribution(served: RunningServer) -> None:
    """Before temperature and penalties: the same as mlx-lm's, whatever picked the token."""
    prompt = encode(PROMPT)
    out = complete(
        served, max_tokens=10, logprobs=2, temperature=1.7, seed=3, frequency_penalty=1.5
    )
    choice = out.choices[0]
    tokens = ids_of(choice)
    rows = mlx_lm_logprobs(prompt + tokens)[len(prompt) - 1 :]
    for i, token in enumerate(tokens):
        assert choice.logprobs.token_logprobs[i] == pytest.approx(rows[i][token], abs=TOL)
        top = sorted(choice.logprobs.top_logprobs[i].values(), reverse=True)
        assert top[:2] == pytest.approx(np.sort(rows[i])[::-1][:2], abs=TOL)


def test_chat_logprobs_content(served: RunningServer) -> None:
    messages: Any = [{"role": "user", "content": "Where does the river run?"}]
    prompt = [int(i) for i in tokenizer().apply_chat_template(messages, add_generation_prompt=True)]
    out: Any = client(served).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    tokens = ids_of(choice)
    content = choice.logprobs.content
    rows = mlx_lm_logprobs(prompt + tokens)[len(prompt) - 1 :]
    assert len(content) == len(tokens) == out.usage.completion_tokens
    for i, entry in enumerate(content):
        assert entry.logprob == pytest.approx(rows[i][tokens[i]], abs=TOL)
        ranked = np.argsort(rows[i])[::-1][:3]
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(rows[i][ranked], abs=TOL)
        assert len(entry.top_logprobs) == 3
    text = choice.message.content
    assert "".join(e.token for e in content) == text
    joined = bytes(b for e in content for b in e.bytes)
    # A random model's bytes need not be UTF-8: those decode as the text does.
    assert joined.decode("utf-8", errors="replace") == text
    none: Any = client(served).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, logprobs=True, top_logprobs=0
    )
    assert [e.top_logprobs for e in none.choices[0].logprobs.content] == [[], []]


def test_streamed_logprobs_equal_the_whole_answers(served: RunningServer) -> None:
    whole = complete(served, max_tokens=10, logprobs=3).choices[0]
    tokens: list[str] = []
    logprobs: list[float] = []
    offsets: list[int] = []
    text = ""
    stream: Any = client(served).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert logprobs == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)
    messages: Any = [{"role": "user", "content": "hi"}]
    common: Any = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    chat = client(served).chat.completions.create(**common, logprobs=True, top_logprobs=2)
    entries: list[Any] = []
    content = ""
    for chunk in client(served).chat.completions.create(
        **common, logprobs=True, top_logprobs=2, stream=True
    ):
        for choice in chunk.choices:
            if choice.finish_reason is None:
                assert choice.logprobs is not None and choice.logprobs.content is not None
            content += choice.delta.content or ""
            entries += choice.logprobs.content if choice.logprobs else []
    assert content == chat.choices[0].message.content
    assert [(e.token, e.bytes) for e in entries] == [
        (e.token, e.bytes) for e in chat.choices[0].logprobs.content
    ]


def test_every_streamed_chunk_carries_its_tokens_logprobs(served: RunningServer) -> None:
    """n streams of a batch, echoed: each chunk brings tokens, and their logprobs."""
    chunks: Any = client(served).completions.create(
        model=MODEL,
        prompt=cast(Any, [PROMPT, encode(PROMPT)]),
        max_tokens=8,
        temperature=1.0,
        seed=1,
        n=2,
        echo=True,
        logprobs=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    for chunk in chunks:
        if not chunk.choices:
            assert chunk.usage.completion_tokens > 0
            continue
        choice = chunk.choices[0]
        if choice.finish_reason is not None:  # a choice's last chunk: its finish alone
            assert choice.text == "" and choice.logprobs is None
            continue
        assert choice.logprobs.tokens and all(isinstance(t, str) for t in choice.logprobs.tokens)
        if choice.index in texts:
            assert all(3 <= len(top) <= 4 for top in choice.logprobs.top_logprobs)
        else:
            assert choice.text.startswith(PROMPT)
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1, 2, 3]
    messages: Any = [{"role": "user", "content": "hi"}]
    finished: Counter[int] = Counter()
    firsts: set[int] = set()
    chat: Any = client(served).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        n=2,
        logprobs=True,
        top_logprobs=4,
        stream=True,
        temperature=1.0,
        seed=3,
    )
    for chunk in chat:
        choice = chunk.choices[0]
        if choice.index not in firsts:
            assert choice.delta.role == "assistant"
            firsts.add(choice.index)
            continue
        finished[choice.index] += choice.finish_reason is not None
        if choice.finish_reason is None:
            assert isinstance(choice.delta.content, str)
            assert [len(e.top_logprobs) for e in choice.logprobs.content][:1] == [4]
    assert finished == {0: 1, 1: 1}


def test_echo_gives_the_prompt_and_its_logprobs(served: RunningServer) -> None:
    prompt = encode(PROMPT)
    out = complete(served, max_tokens=4, echo=True, logprobs=2)
    choice = out.choices[0]
    generated = ids_of(choice)
    assert choice.text == PROMPT + text_of(generated)
    lp = choice.logprobs
    n = len(prompt)
    assert len(lp.tokens) == n + len(generated)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = mlx_lm_logprobs(prompt + generated)
    for i in range(1, n + len(generated)):
        token = (prompt + generated)[i]
        assert lp.token_logprobs[i] == pytest.approx(rows[i - 1][token], abs=TOL)
        assert 2 <= len(lp.top_logprobs[i]) <= 3
    assert lp.text_offset[n] == len(PROMPT)
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:i])) for i in range(n)]
    assert out.usage.prompt_tokens == n and out.usage.completion_tokens == len(generated)
    # max_tokens 0 with echo: the prompt alone, scored.
    scored = complete(served, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == PROMPT and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:n], abs=1e-6
    )
    # A text's token ids echo that text (the BOS encoding adds is not echoed) ...
    as_ids = complete(served, prompt=prompt, max_tokens=4, echo=True, logprobs=2).choices[0]
    assert as_ids.text == choice.text and as_ids.logprobs.tokens == lp.tokens
    # ... other token-id prompts their decoding, special tokens included; streamed, the echo
    # comes first.
    ids = [40, 0, 41, 42]
    streamed = client(served).completions.create(
        model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True, stream=True
    )
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert "<|endoftext|>" in text
    assert text == str(tokenizer().decode(ids)) + text_of(greedy(ids, 3))


# ---------------------------------------------------------------------- n, best_of, batches


def test_n_sequences_equal_their_seeds_run_one_by_one(served: RunningServer) -> None:
    out = complete(served, max_tokens=12, n=3, temperature=1.0, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2]
    alone = [
        ids_of(complete(served, max_tokens=12, temperature=1.0, seed=11 + i).choices[0])
        for i in range(3)
    ]
    assert [ids_of(c) for c in out.choices] == alone
    assert len({tuple(a) for a in alone}) > 1
    assert out.usage.prompt_tokens == len(encode(PROMPT))
    assert out.usage.completion_tokens == sum(len(a) for a in alone)
    # Streamed: one stream, each chunk one choice, every choice ends once.
    texts = ["", "", ""]
    ends = Counter[int]()
    for chunk in client(served).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, n=3, temperature=1.0, seed=11, stream=True
    ):
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        ends[choice.index] += choice.finish_reason is not None
    assert texts == [c.text for c in out.choices] and ends == {0: 1, 1: 1, 2: 1}
    messages: Any = [{"role": "user", "content": "hi"}]
    chat = client(served).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, n=2, seed=5, temperature=1.0
    )
    one = client(served).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, seed=6, temperature=1.0
    )
    assert chat.choices[1].message.content == one.choices[0].message.content
    wait_idle(served)


def test_best_of_returns_the_sequences_with_the_highest_mean_logprob(
    served: RunningServer,
) -> None:
    prompt = encode(PROMPT)
    out = complete(served, max_tokens=8, n=2, best_of=4, temperature=1.5, seed=21)
    candidates = [
        ids_of(complete(served, max_tokens=8, temperature=1.5, seed=21 + i).choices[0])
        for i in range(4)
    ]

    def mean_logprob(tokens: list[int]) -> float:
        rows = mlx_lm_logprobs(prompt + tokens)[len(prompt) - 1 :]
        return float(np.mean([rows[i][t] for i, t in enumerate(tokens)]))

    ranked = sorted(candidates, key=mean_logprob, reverse=True)
    assert [ids_of(c) for c in out.choices] == ranked[:2]
    assert out.choices[0].logprobs is None  # ranked by them, returned only when asked
    assert out.usage.completion_tokens == sum(len(c) for c in candidates)


def test_prompt_batches_are_answered_in_order(served: RunningServer) -> None:
    prompts = ["In spring the water is high", "Children swim", PROMPT]
    out = complete(served, prompt=prompts, max_tokens=6)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, out.choices, strict=True):
        assert ids_of(choice) == greedy(encode(prompt), 6)
    assert out.usage.prompt_tokens == sum(len(encode(p)) for p in prompts)
    token_prompts = [[1, 40, 41], [1, 50, 51, 52]]
    batched = complete(served, prompt=token_prompts, max_tokens=5, n=2, temperature=1.0, seed=4)
    assert [c.index for c in batched.choices] == [0, 1, 2, 3]
    for i, ids in enumerate(token_prompts):
        for j in range(2):
            alone = complete(served, prompt=ids, max_tokens=5, temperature=1.0, seed=4 + j)
            assert ids_of(batched.choices[2 * i + j]) == ids_of(alone.choices[0])
    texts = ["", ""]
    for chunk in client(served).completions.create(
        model=MODEL, prompt=prompts[:2], max_tokens=6, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in out.choices[:2]]


# ---------------------------------------------------------------------- sampling fields


PROCESSING: dict[str, dict[str, Any]] = {
    "presence": {"presence_penalty": 2.0},
    "frequency": {"frequency_penalty": 1.5},
    "negative frequency": {"frequency_penalty": -2.0},
    "repetition": {"repetition_penalty": 1.8},
    "all three": {"presence_penalty": 0.7, "frequency_penalty": 0.6, "repetition_penalty": 1.3},
    "bias against the greedy token": {"logit_bias": "first"},
    "stop token held back by min_tokens": {"stop_token_ids": "second", "min_tokens": 4},
}


@pytest.mark.parametrize("case", sorted(PROCESSING))
def test_greedy_under_penalties_bias_and_min_tokens_equals_numpy(
    served: RunningServer, case: str
) -> None:
    """OpenAI's formulas in numpy on mlx-lm's logits, greedy, fed back one token at a time."""
    prompt = encode(PROMPT)
    plain = greedy(prompt, 16)
    fields = dict(PROCESSING[case])
    stops = eos()
    bias: dict[int, float] = {}
    if fields.get("logit_bias") == "first":
        bias = {plain[0]: -100.0}
        fields["logit_bias"] = {str(plain[0]): -100}
    if fields.get("stop_token_ids") == "second":
        stop = next(t for t in plain[1:] if t not in eos() and t != plain[0])
        stops = stops | {stop}
        fields["stop_token_ids"] = [stop]
    model = oracle_model()
    caches = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=caches)[0, -1]
    expected: list[int] = []
    while len(expected) < 16:
        row = numpy_processed(
            logits,
            prompt,
            expected,
            presence=fields.get("presence_penalty", 0.0),
            frequency=fields.get("frequency_penalty", 0.0),
            repetition=fields.get("repetition_penalty", 1.0),
            bias=bias,
            stops=stops,
            min_tokens=fields.get("min_tokens", 0),
        )
        expected.append(int(np.argmax(row)))
        if expected[-1] in stops:
            break
        logits = model(mx.array([[expected[-1]]]), cache=caches)[0, -1]
    assert ids_of(complete(served, max_tokens=16, **fields).choices[0]) == expected
    if case != "negative frequency":  # a tiny model's greedy text repeats anyway
        assert expected != plain, f"{case} changes nothing here: the test could not fail"


def test_logit_bias_moves_the_greedy_token(served: RunningServer) -> None:
    prompt = encode(PROMPT)
    first = greedy(prompt, 1)[0]
    tokens = ids_of(complete(served, max_tokens=6, logit_bias={str(first): -100}).choices[0])
    assert tokens[0] != first
    forced = 77
    assert (
        ids_of(complete(served, max_tokens=4, logit_bias={str(forced): 100}).choices[0])
        == [forced] * 4
    )
    # Chat takes the same bias.
    messages: Any = [{"role": "user", "content": "hi"}]
    chat = client(served).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, logit_bias={str(forced): 100}
    )
    assert chat.choices[0].message.content == text_of([forced] * 3)


def test_top_k_top_p_and_min_p_keep_only_their_tokens(served: RunningServer) -> None:
    prompt = encode(PROMPT)
    greedy_ids = greedy(prompt, 10)
    assert ids_of(complete(served, max_tokens=10, temperature=1.5, top_k=1, seed=2).choices[0]) == (
        greedy_ids
    )
    assert ids_of(
        complete(served, max_tokens=10, temperature=1.5, min_p=1.0, seed=2).choices[0]
    ) == (greedy_ids)
    for fields in ({"top_k": 3}, {"top_p": 0.4}, {"min_p": 0.3}):
        for seed in range(3):
            tokens = ids_of(
                complete(served, max_tokens=10, temperature=1.0, seed=seed, **fields).choices[0]
            )
            rows = mlx_lm_logprobs(prompt + tokens)[len(prompt) - 1 :]
            for i, token in enumerate(tokens):
                probs = np.exp(rows[i].astype(np.float64))
                if "top_k" in fields:
                    assert token in np.argsort(probs)[::-1][:3]
                elif "top_p" in fields:
                    ranked = np.sort(probs)[::-1]
                    before = ranked[ranked > probs[token]].sum()
                    assert before < 0.4 + 1e-4
                else:
                    assert probs[token] >= 0.3 * probs.max() - 1e-5
    unconstrained = {
        tuple(ids_of(complete(served, max_tokens=10, temperature=1.0, seed=s).choices[0]))
        for s in range(3)
    }
    assert len(unconstrained) > 1  # sampling does vary: the checks above could fail


def test_stop_token_ids_min_tokens_and_ignore_eos(served: RunningServer) -> None:
    prompt = encode(PROMPT)
    plain = greedy(prompt, 12)
    stop = next(t for t in plain[1:] if t not in eos() and t != plain[0])
    at = plain.index(stop)
    out = complete(served, max_tokens=12, stop_token_ids=[stop])
    choice = out.choices[0]
    assert ids_of(choice) == plain[: at + 1] and choice.finish_reason == "stop"
    assert choice.text == text_of(plain[:at])
    late = complete(served, max_tokens=12, stop_token_ids=[stop], min_tokens=at + 2).choices[0]
    # Held back until 3 tokens are out: the same start, then anything but the stop token.
    assert ids_of(late)[:at] == plain[:at] and ids_of(late)[at] != stop
    assert stop not in ids_of(late)[: at + 2]
    # The end-of-sequence token forced by a bias ends the sequence at once, unless ignored.
    end = min(eos())
    bias = {str(end): 100}
    stopped = complete(served, max_tokens=5, logit_bias=bias).choices[0]
    assert ids_of(stopped) == [end] and stopped.finish_reason == "stop" and stopped.text == ""
    ignored = complete(served, max_tokens=5, logit_bias=bias, ignore_eos=True).choices[0]
    assert ids_of(ignored) == [end] * 5 and ignored.finish_reason == "length"
    held = complete(served, max_tokens=5, logit_bias=bias, min_tokens=3).choices[0]
    assert ids_of(held)[-1] == end and len(ids_of(held)) == 4


def test_stop_strings_wait_for_min_tokens(served: RunningServer) -> None:
    prompt = "In spring the water is high"
    plain = greedy(encode(prompt), 16)
    text = text_of(plain)
    stop = next(
        text[i : i + 2]
        for i in range(2, len(text) - 2)
        if text[i : i + 2].isascii() and text[i : i + 2].isprintable()
    )
    early = complete(served, prompt=prompt, max_tokens=16, stop=[stop]).choices[0]
    assert early.text == text[: text.index(stop)] and early.finish_reason == "stop"
    late = complete(served, prompt=prompt, max_tokens=16, stop=[stop], min_tokens=16).choices[0]
    # Not before 16 tokens: the first occurrence stays in the text.
    assert late.text.startswith(text[: text.index(stop) + len(stop)])
    assert len(ids_of(late)) == 16 and ids_of(late) == plain[:16]


def test_continuous_usage_and_the_finish_after_the_last_text(served: RunningServer) -> None:
    chunks: list[Any] = list(
        client(served).completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options=cast(Any, {"include_usage": True, "continuous_usage_stats": True}),
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    # The finish comes alone after the last text (an empty text), with the same usage.
    assert counts[:-1] == sorted(set(counts)) and counts[-1] == counts[-2] == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == [chunks[-2]] and chunks[-2].choices[0].text == ""
    assert chunks[-3].choices[0].text


# ---------------------------------------------------------------------- refusals


def post(running: RunningServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(running.url + path, json=body, timeout=60)


GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**GOOD, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {**GOOD, "top_k": -2}, "top_k"),
        ("/v1/completions", {**GOOD, "min_p": 1.5}, "min_p"),
        ("/v1/completions", {**GOOD, "logit_bias": {"100000": 1}}, "logit_bias"),
        ("/v1/completions", {**GOOD, "logit_bias": {"7": 200}}, "logit_bias"),
        ("/v1/completions", {**GOOD, "n": 0}, "n"),
        ("/v1/completions", {**GOOD, "n": 10**6}, "n"),
        ("/v1/completions", {**GOOD, "stop_token_ids": [10**6]}, "stop_token_ids"),
        ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {**GOOD, "prompt": ["a", [1, 10**6]]}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "xml"}},
            "response_format.type",
        ),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
        ("/v1/chat/completions", {**CHAT, "stream_options": {}}, "stream_options"),
    ],
)
def test_bad_fields_are_400s_naming_them_and_change_nothing(
    served: RunningServer, path: str, body: dict[str, Any], param: str
) -> None:
    wait_idle(served)
    engine = served.server.worker.engine
    assert engine is not None
    before = (engine.stats.steps, engine.num_requests, served.server.worker.waiting)
    response = post(served, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split(".")[0] in error["message"] or "token ids" in error["message"]
    assert (engine.stats.steps, engine.num_requests, served.server.worker.waiting) == before


def test_accepted_and_default_fields_are_served(served: RunningServer) -> None:
    ok = post(
        served,
        "/v1/chat/completions",
        {
            **CHAT,
            "user": "u",
            "metadata": {"a": "b"},
            "store": False,
            "service_tier": "auto",
            "response_format": {"type": "text"},
            "modalities": ["text"],
            "tools": None,
        },
    )
    assert ok.status_code == 200, ok.text
    assert post(served, "/v1/completions", {**GOOD, "user": "u", "suffix": ""}).status_code == 200
    # A field the server does not know, or one of the other endpoint, is answered and reported.
    for path, body, name in (
        ("/v1/completions", {**GOOD, "foo": 1}, "foo"),
        ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),
    ):
        answered = post(served, path, body)
        assert answered.status_code == 200 and answered.headers["X-KV-Serve-Ignored"] == name


@pytest.fixture(scope="module")
def small(serve: Serve) -> RunningServer:
    model = new_model()

    def make_engine() -> DecodeEngine:
        layout = layout_from_model(model)
        pool = HybridKVPool(layout, num_pages=48, page_size=PAGE)
        kernels = build_kernels(model, layout)
        return DecodeEngine(model, pool, kernels, pool_backed_cache, max_running=4)

    return serve(model, tokenizer(), model_name=MODEL, max_context=CONTEXT, make_engine=make_engine)


def test_n_sequences_that_can_never_fit_are_refused_at_once(small: RunningServer) -> None:
    body = {**GOOD, "prompt": PROMPT, "max_tokens": 80}
    one = post(small, "/v1/completions", body)
    assert one.status_code == 200, one.text  # one sequence fits
    start = time.monotonic()
    refused = post(small, "/v1/completions", {**body, "n": 8})
    assert refused.status_code == 400, refused.text
    assert "n=8" in refused.json()["error"]["message"]
    assert time.monotonic() - start < 5.0
    wait_idle(small)
    engine = small.server.worker.engine
    assert engine is not None and engine.num_requests == 0
    # Two fit together, sharing the prompt's pages.
    two = post(small, "/v1/completions", {**body, "n": 2, "temperature": 1.0, "seed": 1})
    assert two.status_code == 200, two.text
    assert len(json.loads(two.text)["choices"]) == 2
