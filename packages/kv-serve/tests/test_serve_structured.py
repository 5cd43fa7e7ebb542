"""JSON schemas compiled by kv-serve (llguidance) and decoded inside the engine's batch.

Every constrained output is checked by ``jsonschema`` (an independent validator): it parses and
validates, for random-weight tiny models of several architectures (sliding/full hybrids and
recurrent-state ones), greedy and sampled, in batches that mix schemas and free rows. The
schemas are bounded (lengths, ranges, item counts), so the grammar closes whatever the model
prefers, and each output ends with ``"stop"``. A schema the grammar engine cannot compile is
a :class:`GrammarError` naming the problem.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jsonschema
import numpy as np
import pytest

from kv_batching import SamplingParams
from kv_protocol import mask_words
from kv_serve import build_engine, stop_token_ids
from kv_serve._structured import GrammarCompiler, GrammarError
from kv_testing import build_tiny_tokenizer, build_zoo_model

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["red", "green", 3, None]}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -40, "maximum": 40},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "pattern": "^[a-z]{1,3}$"},
                        "maxItems": 3,
                    },
                },
                "required": ["x", "tags"],
                "additionalProperties": False,
            },
            "kind": {"const": "point"},
        },
        "required": ["p", "kind"],
        "additionalProperties": False,
    },
    {
        "anyOf": [
            {"type": "integer", "minimum": -5, "maximum": 5},
            {"type": "string", "maxLength": 3},
        ]
    },
]

#: Sliding/full hybrids and models with recurrent-state layers.
ARCHS = ["gemma3_text", "gpt_oss", "lfm2", "mamba2", "recurrent_gemma"]


@cache
def tokenizer() -> Any:
    return build_tiny_tokenizer()


@cache
def eos() -> frozenset[int]:
    return frozenset(stop_token_ids(tokenizer()))


@cache
def compiler() -> GrammarCompiler:
    return GrammarCompiler(tokenizer(), len(tokenizer()), eos())


def text_of(tokens: tuple[int, ...]) -> str:
    return str(tokenizer().decode([t for t in tokens if t not in eos()]))


def valid(text: str, schema: dict[str, Any]) -> bool:
    jsonschema.validate(json.loads(text), schema)
    return True


@pytest.mark.parametrize("arch", ARCHS)
def test_random_models_generate_valid_json_in_batches_with_free_rows(arch: str) -> None:
    tok = tokenizer()
    model = build_zoo_model(arch, vocab_size=len(tok))
    engine = build_engine(model, max_running=16, max_context=320, page_size=8, prefill_chunk=32)
    prompts = [tok.encode(t) for t in ("The river rises", "Children swim", "def main():")]
    constrained = []
    for j, schema in enumerate(SCHEMAS):
        make = compiler().json_schema(schema)
        for i, params in enumerate(
            (
                SamplingParams(constraint=make),
                SamplingParams(temperature=1.0, seed=j * 10 + 1, constraint=make),
                SamplingParams(temperature=0.7, top_p=0.9, seed=j, constraint=make),
            )
        ):
            rid = engine.submit(prompts[(i + j) % 3], 256, sampling=params, stop_tokens=eos())
            constrained.append((rid, schema))
    free = [engine.submit(p, 24, stop_tokens=eos()) for p in prompts]
    engine.run()
    for rid, schema in constrained:
        out = engine.output(rid)
        assert out.finish_reason == "stop", (arch, text_of(out.tokens))
        assert valid(text_of(out.tokens), schema)
    assert all(engine.output(rid).finish_reason in ("stop", "length") for rid in free)


def test_n_sequences_each_follow_the_schema_with_their_own_state() -> None:
    tok = tokenizer()
    model = build_zoo_model("gemma3_text", vocab_size=len(tok))
    engine = build_engine(model, max_running=8, max_context=320, page_size=8)
    schema = SCHEMAS[0]
    ids = engine.submit_n(
        tok.encode("Caf\u00e9"),
        256,
        5,
        sampling=SamplingParams(
            temperature=1.0, seed=11, constraint=compiler().json_schema(schema)
        ),
        stop_tokens=eos(),
    )
    engine.run()
    texts = [text_of(engine.output(rid).tokens) for rid in ids]
    assert all(valid(t, schema) for t in texts)
    assert len(set(texts)) > 1  # sampled sequences differ; each kept its own grammar state


def test_the_mask_allows_exactly_the_grammar_s_next_tokens() -> None:
    # The compiled constraint's first mask for {"const": "point"}-like objects: only "{".
    make = compiler().json_schema(
        {"type": "object", "properties": {}, "additionalProperties": False}
    )
    constraint = make()
    vocab = len(tokenizer())
    words = np.zeros(mask_words(vocab) + 1, dtype=np.uint32)  # wider than the tokenizer
    constraint.fill_next_mask(words.data)
    allowed = [t for t in range(32 * len(words)) if (int(words[t // 32]) >> (t % 32)) & 1]
    assert [text_of((t,)) for t in allowed] == ["{"] * len(allowed) and allowed
    constraint.accept_token(allowed[0])
    assert not constraint.is_finished
    constraint.fill_next_mask(words.data)
    allowed = [t for t in range(32 * len(words)) if (int(words[t // 32]) >> (t % 32)) & 1]
    closing = [t for t in allowed if text_of((t,)) == "}"]
    assert closing
    constraint.accept_token(closing[0])
    assert constraint.is_finished
    with pytest.raises(GrammarError):
        make().accept_token(closing[0])  # a fresh sequence cannot start with "}"


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "frobnicate"}, "frobnicate"),
        ({"type": "string", "pattern": "(("}, "unclosed group"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ],
)
def test_a_schema_that_does_not_compile_is_a_grammar_error_naming_it(
    schema: dict[str, Any], problem: str
) -> None:
    with pytest.raises(GrammarError, match=problem):
        compiler().json_schema(schema)


def test_a_tokenizer_without_a_fast_backend_is_refused() -> None:
    with pytest.raises(GrammarError, match="fast"):
        GrammarCompiler(object(), 10, [0])
