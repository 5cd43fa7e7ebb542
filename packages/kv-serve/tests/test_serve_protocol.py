"""Request checking and the logprob/text bookkeeping, without a server (pure Python).

Every field of the openai client's own request types (``CompletionCreateParams`` and the
chat ``CompletionCreateParams``) is in the server's field table, so none is silently
ignored (a field outside it is accepted and reported by name); bad values are refused naming
the field; the per-token texts and bytes a choice's
logprobs report join to the completion's text, whatever the token stream.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from kv_serve._server_protocol import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPTS,
    REQUEST_FIELDS,
    OpenAIError,
    parse_chat_request,
    parse_completion_request,
)
from kv_serve._server_text import (
    CompletionText,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
)
from kv_serve._server_warnings import (
    IGNORED_HEADER,
    MAX_HEADER_CHARS,
    IgnoredField,
    IgnoredFieldLog,
    ignored_headers,
)
from kv_testing import build_tiny_tokenizer

VOCAB = 320
MESSAGES = [{"role": "user", "content": "hi"}]
README = Path(__file__).resolve().parents[1] / "README.md"


def completion(**fields: Any) -> Any:
    return parse_completion_request({"model": "m", "prompt": "x", **fields}, vocab_size=VOCAB)


def chat(**fields: Any) -> Any:
    return parse_chat_request({"model": "m", "messages": MESSAGES, **fields}, vocab_size=VOCAB)


def refused(parse: Any, **fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(**fields)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------------- the field table


def openai_fields(params: Any) -> set[str]:
    return set(get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


def table(endpoint: str) -> set[str]:
    return {r.name for r in REQUEST_FIELDS if endpoint in r.endpoints}


def test_every_openai_field_of_both_endpoints_is_in_the_table() -> None:
    assert openai_fields(completion_create_params) <= table("completions")
    assert openai_fields(chat_create_params) <= table("chat")
    # What the table adds to OpenAI's fields is an extension, never a field called honoured.
    for endpoint, params in (
        ("completions", completion_create_params),
        ("chat", chat_create_params),
    ):
        added = table(endpoint) - openai_fields(params)
        # response_format is OpenAI's on chat; completions serve it too (as vLLM's do).
        added -= {"response_format"}
        assert {r.treatment for r in REQUEST_FIELDS if r.name in added} == {"extension"}


def test_the_readme_table_lists_every_field_with_its_treatment() -> None:
    rows = {}
    for line in README.read_text().splitlines():
        match = re.match(r"\| `(\w+)` \| (\w[\w /-]*) \| (\w+) \|", line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    assert set(rows) == {r.name for r in REQUEST_FIELDS}
    for rule in REQUEST_FIELDS:
        endpoints = "both" if len(rule.endpoints) == 2 else rule.endpoints[0]
        assert rows[rule.name] == (endpoints, rule.treatment), rule.name


@pytest.mark.parametrize("rule", [r for r in REQUEST_FIELDS if r.treatment == "refused"])
def test_each_refused_field_is_a_400_naming_it(rule: Any) -> None:
    parse = completion if "completions" in rule.endpoints else chat
    value: Any = ["x"]
    if rule.name in ("suffix", "reasoning_effort", "verbosity", "tool_choice"):
        value = "high" if rule.name != "tool_choice" else "auto"
    if rule.name == "parallel_tool_calls":
        value = True
    error = refused(parse, **{rule.name: value})
    assert error.param == rule.name and rule.name in error.message
    parse(**{rule.name: None})  # null is the same as absent


def test_defaults_of_refused_fields_pass() -> None:
    assert completion(suffix="").prompts == ("x",)
    assert chat(response_format={"type": "text"}).messages == MESSAGES
    assert chat(modalities=["text"]).messages == MESSAGES
    assert refused(chat, modalities=["text", "audio"]).param == "modalities"


def test_accepted_fields_are_type_checked_and_change_nothing() -> None:
    plain = chat()
    accepted = chat(
        user="u",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        safety_identifier="s",
        prompt_cache_key="p",
        prompt_cache_retention="24h",
        prompt_cache_options={"mode": "implicit"},
    )
    assert accepted == plain
    assert completion(user="u") == completion()
    assert refused(chat, user=3).param == "user"
    assert refused(chat, metadata={"k": 1}).param == "metadata"
    assert refused(chat, store="yes").param == "store"


def ignored_names(request: Any) -> list[str]:
    return [f.name for f in request.ignored]


def test_unknown_fields_are_accepted_and_reported_by_name() -> None:
    plain = completion()
    request = completion(best_effort=True, repetition_context_size=20)
    assert ignored_names(request) == ["best_effort", "repetition_context_size"]
    assert request.prompts == plain.prompts and request.sampling == plain.sampling
    on_chat = completion(top_logprobs=3)  # a chat field on completions
    assert on_chat.ignored[0].name == "top_logprobs"
    assert "/v1/chat/completions" in on_chat.ignored[0].reason
    assert "/v1/completions" in chat(echo=True).ignored[0].reason
    assert ignored_names(chat(best_effort=None)) == []  # null is the same as absent
    assert ignored_names(chat()) == [] and ignored_names(completion()) == []
    # A field the table says is ignored is reported with the table's reason.
    for rule in (r for r in REQUEST_FIELDS if r.treatment == "ignored"):
        got = chat(**{rule.name: {"type": "content", "content": "x"}})
        assert [(f.name, f.reason) for f in got.ignored] == [(rule.name, rule.note)]
        assert got.messages == MESSAGES


def test_message_fields_and_roles_go_to_the_template_as_given() -> None:
    messages = [
        {"role": "system", "content": "s", "cache_hint": 3},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "a", "reasoning_content": "r", "refusal": None},
        {"role": "critic", "content": "c"},
    ]
    request = chat(messages=messages)
    assert request.messages == [
        {"role": "system", "content": "s", "cache_hint": 3},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
        {"role": "critic", "content": "c"},
    ]
    assert refused(chat, messages=[{"role": "", "content": "x"}]).param == "messages[0].role"
    assert refused(chat, messages=[{"role": 3, "content": "x"}]).param == "messages[0].role"
    # What would change the answer is still refused: a user message making tool calls.
    assert refused(chat, messages=[{"role": "user", "content": "x", "tool_calls": []}]).param == (
        "messages[0].tool_calls"
    )


def test_template_arguments_are_checked_and_handed_on() -> None:
    request = chat(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert request.template_kwargs == {"enable_thinking": False, "reasoning_effort": "high"}
    assert chat().template_kwargs == {}
    assert refused(chat, chat_template_kwargs=[1]).param == "chat_template_kwargs"
    error = refused(chat, chat_template_kwargs={"tools": [], "x": 1})
    assert error.param == "chat_template_kwargs.tools" and "tools" in error.message
    assert refused(chat, reasoning_effort=3).param == "reasoning_effort"


def test_ignored_fields_are_reported_in_headers_and_logged_once_per_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fields = [
        IgnoredField(name="thinking", reason='no "thinking" blocks'),
        IgnoredField(name="tools[3]", reason="a server tool \u00e9"),
    ]
    headers = ignored_headers(fields)
    assert headers[IGNORED_HEADER] == "thinking, tools[3]"
    warning = headers["Warning"]
    assert warning.startswith('299 kv-serve "ignored thinking: no ?thinking? blocks; tools[3]')
    assert warning.count('"') == 2 and warning.isascii()
    assert ignored_headers([]) == {}
    many = ignored_headers(
        [IgnoredField(name=f"tools[{i}].a_long_field_name", reason="x" * 50) for i in range(99)]
    )
    assert all(len(v) <= MAX_HEADER_CHARS + 40 for v in many.values())
    assert many[IGNORED_HEADER].endswith("...") and many["Warning"].endswith('..."')
    log = IgnoredFieldLog()
    with caplog.at_level("WARNING", logger="kv_serve"):
        log.note("/v1/messages", fields)
        log.note("/v1/messages", [IgnoredField(name="tools[0]", reason="again")])
        log.note("/v1/chat/completions", fields[:1])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0].startswith("/v1/messages: ignored request field thinking (no")
    assert "field tools[] (a server tool" in lines[1]
    assert lines[2].startswith("/v1/chat/completions: ignored request field thinking")


def test_seed_is_an_int64() -> None:
    assert chat(seed=2**63 - 1).sampling.seed == 2**63 - 1
    assert chat(seed=-(2**63)).sampling.seed == 2**63
    assert refused(chat, seed=2**63).param == "seed"
    assert refused(chat, seed=-(2**63) - 1).param == "seed"


# ---------------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"7": 200}}, "logit_bias"),
        ({"logit_bias": {"7": "up"}}, "logit_bias"),
        ({"logit_bias": {"seven": 1}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"n": 10**6}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"prompt": ["x"] * 9, "n": 64}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"echo": "yes"}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream_options": {}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"extra": True}}, "stream_options.extra"),
        ({"stream": True, "stream_options": [1]}, "stream_options"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, [2]]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [VOCAB]}, "prompt"),
        ({"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt"),
    ],
)
def test_bad_completion_values_are_refused_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    assert refused(completion, **fields).param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": 2, "logprobs": False}, "top_logprobs"),
        ({"n": MAX_N + 1}, "n"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"min_tokens": 9, "max_completion_tokens": 8}, "min_tokens"),
    ],
)
def test_bad_chat_values_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(chat, **fields).param == param


def test_good_values_are_kept() -> None:
    request = completion(
        prompt=["a", [1, 2], "b"],
        n=2,
        best_of=3,
        echo=True,
        max_tokens=0,
        logprobs=MAX_LOGPROBS,
        top_k=-1,
        min_p=0.5,
        logit_bias={"7": -100, "8": 2.5},
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1.3,
        min_tokens=0,
        ignore_eos=True,
        stop_token_ids=[3, 4],
        seed=-5,
    )
    assert request.prompts == ("a", (1, 2), "b")
    assert (request.n, request.best_of, request.echo, request.max_tokens) == (2, 3, True, 0)
    assert request.logprobs == MAX_LOGPROBS
    s = request.sampling
    assert (s.top_k, s.min_p, s.presence_penalty, s.frequency_penalty) == (0, 0.5, -2.0, 2.0)
    assert s.logit_bias == {7: -100.0, 8: 2.5} and s.repetition_penalty == 1.3
    assert s.ignore_eos and s.stop_token_ids == (3, 4) and s.seed == 2**64 - 5
    assert completion(top_k=40).sampling.top_k == 40
    assert completion(prompt=[1, 2]).prompts == ((1, 2),)
    assert completion().max_tokens == 16 and completion().best_of == 1
    streamed = completion(stream=True, stream_options={"include_usage": True})
    assert streamed.include_usage and not streamed.continuous_usage
    continuous = completion(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    assert continuous.continuous_usage
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=True, top_logprobs=20).logprobs == 20
    assert chat(logprobs=False, top_logprobs=0).logprobs is None
    assert chat(max_tokens=5, max_completion_tokens=7).max_tokens == 7
    assert chat(n=3).best_of == 3


FIELD_VALUES = {
    "n": st.one_of(st.integers(-3, 300), st.floats(allow_nan=True), st.booleans(), st.none()),
    "logprobs": st.one_of(st.integers(-3, 30), st.booleans(), st.none(), st.text(max_size=2)),
    "top_k": st.one_of(st.integers(-5, 10**6), st.floats(-3, 3), st.none()),
    "min_p": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none()),
    "temperature": st.one_of(st.floats(-1, 3), st.none(), st.text(max_size=2)),
    "logit_bias": st.one_of(
        st.dictionaries(
            st.one_of(st.integers(-2, VOCAB + 2).map(str), st.text(max_size=3)),
            st.one_of(st.floats(-300, 300), st.booleans(), st.text(max_size=2)),
            max_size=3,
        ),
        st.none(),
    ),
    "max_tokens": st.one_of(st.integers(-2, 40), st.none()),
    "min_tokens": st.one_of(st.integers(-2, 40), st.none()),
    "echo": st.one_of(st.booleans(), st.none(), st.integers(0, 1)),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, VOCAB + 2), max_size=3), st.none()),
}


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional=FIELD_VALUES))
def test_any_body_is_parsed_or_refused_naming_a_field_it_holds(fields: dict[str, Any]) -> None:
    try:
        request = completion(**fields)
    except OpenAIError as error:
        assert error.status == 400
        assert error.param is not None and error.param.split(".")[0] in {*fields, "prompt"}
        return
    s = request.sampling
    assert 1 <= request.n <= request.best_of <= MAX_N
    assert request.logprobs is None or 0 <= request.logprobs <= MAX_LOGPROBS
    assert all(0 <= t < VOCAB and -100 <= b <= 100 for t, b in s.logit_bias.items())
    assert 0 <= s.min_p <= 1 and s.top_k >= 0 and 0 <= s.temperature <= 2
    assert request.max_tokens is not None and s.min_tokens <= request.max_tokens
    assert all(0 <= t < VOCAB for t in s.stop_token_ids)


# ---------------------------------------------------------------------- token texts


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tiny_tokenizer()


EOS = (0, 5)


def track(tok: Any, ids: list[int]) -> tuple[CompletionText, str]:
    tracked = CompletionText(tok, eos_ids=EOS, texts=TokenTexts(tok))
    pushed = ""
    for token in ids:
        pushed += tracked.push([token])
    return tracked, pushed + tracked.finish()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_token_pieces_and_bytes_join_to_the_text(tok: Any, data: st.DataObject) -> None:
    text = data.draw(st.text(alphabet="ab é€日本😀\n", min_size=1, max_size=12), label="text")
    ids = [int(i) for i in tok.encode(text)][1:]
    eos = data.draw(st.lists(st.integers(0, len(ids)), max_size=2), label="eos at")
    for at in sorted(eos, reverse=True):
        ids.insert(at, EOS[at % 2])
    tracked, pushed = track(tok, ids)
    assert pushed == tracked.text == text
    assert "".join(tracked.pieces) == text
    assert b"".join(tracked.raw) == text.encode()
    assert tracked.offsets == [len("".join(tracked.pieces[:i])) for i in range(len(ids))]
    assert [p for p, t in zip(tracked.pieces, ids, strict=True) if t in EOS] == [""] * len(eos)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(6, 319), min_size=1, max_size=16))
def test_any_token_stream_joins_to_its_decoding(tok: Any, ids: list[int]) -> None:
    """Random tokens need not be UTF-8: the bytes then decode to the text with U+FFFD."""
    tracked, pushed = track(tok, ids)
    text = str(tok.decode(ids))
    assert pushed == tracked.text == "".join(tracked.pieces) == text
    assert b"".join(tracked.raw).decode("utf-8", errors="replace") == text


def test_token_texts_give_a_partial_character_its_bytes(tok: Any) -> None:
    texts = TokenTexts(tok)
    euro = [int(i) for i in tok.encode("€")][1:]
    assert len(euro) > 1  # split over tokens: what the bytes are for
    assert b"".join(texts.raw(t) for t in euro) == "€".encode()
    first = texts.text(euro[0])
    assert first.startswith("bytes:\\x")
    assert texts.text(int(tok.encode("river")[1])) == str(tok.decode([tok.encode("river")[1]]))


class Entry:
    def __init__(self, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        self.token, self.logprob, self.top = token, logprob, tuple(top)


def test_logprob_shapes(tok: Any) -> None:
    texts = TokenTexts(tok)
    a, b, c = (int(t) for t in tok.encode("The river rises")[1:4])
    sa, sb, sc = (str(tok.decode([t])) for t in (a, b, c))
    assert len({sa, sb, sc}) == 3
    entries = [Entry(a, -0.5, [(a, -0.5), (b, -1.5)]), Entry(c, -3.0, [(b, -0.1), (a, -2.0)])]
    legacy = completion_logprobs([sa, sc], [0, 3], [None, *entries], texts, 1)
    assert legacy["token_logprobs"] == [None, -0.5, -3.0]
    # The k most likely, plus the chosen token when it is not among them.
    assert legacy["top_logprobs"] == [None, {sa: -0.5}, {sb: -0.1, sc: -3.0}]
    assert legacy["tokens"] == [sa, sc] and legacy["text_offset"] == [0, 3]
    content = chat_logprobs([sa, sc], [sa.encode(), sc.encode()], entries, texts, 2)
    assert content[1] == {
        "token": sc,
        "logprob": -3.0,
        "bytes": list(sc.encode()),
        "top_logprobs": [
            {"token": sb, "logprob": -0.1, "bytes": list(sb.encode())},
            {"token": sa, "logprob": -2.0, "bytes": list(sa.encode())},
        ],
    }
    floor = chat_logprobs(["x"], [b"x"], [Entry(a, -math.inf, [])], texts, 0)
    assert floor[0]["logprob"] == -9999.0 and floor[0]["top_logprobs"] == []
