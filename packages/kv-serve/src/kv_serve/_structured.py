"""Structured output: JSON schemas compiled to per-sequence token constraints (llguidance).

The toolkit's engine knows only the ``TokenConstraint`` protocol of kv-protocol; this module
is the one place a grammar library is used. A :class:`GrammarCompiler` wraps the served
tokenizer once (llguidance's view of its vocabulary: every token's bytes), compiles a JSON
schema into a grammar (refusing, with llguidance's own message, one it cannot compile) and
hands out a factory that gives each generated sequence its own matcher.

JSON is generated compact (no whitespace between items, ``,`` and ``:`` as separators), so
the grammar ends exactly where the value ends: the sequence finishes (``"stop"``) with the
token that closes the value, or with an end-of-sequence token where the value could go on
(a number at the top level).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kv_protocol import TokenConstraint, TokenConstraintFactory, check_int, mask_words

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError"]


class GrammarError(ValueError):
    """A schema or grammar the grammar engine cannot compile (the message says why)."""


#: JSON compile options: compact output, so a finished value leaves nothing to generate.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class _MatcherConstraint:
    """One sequence's :class:`~kv_protocol.TokenConstraint` over an llguidance matcher."""

    __slots__ = ("_matcher", "_scratch", "_words")

    def __init__(self, matcher: Any, words: int) -> None:
        self._matcher = matcher
        self._words = words
        self._scratch = np.zeros(words, dtype=np.int32)

    def fill_next_mask(self, mask: memoryview) -> None:
        """Write the allowed next tokens into ``mask`` (bits past the tokenizer's stay 0)."""
        target = np.frombuffer(mask, dtype=np.uint32)
        scratch = self._scratch
        self._matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {self._matcher.get_error()}")
        shared = min(len(target), self._words)
        target[:shared] = scratch[:shared].view(np.uint32)
        target[shared:] = 0
        if not target.any():
            raise GrammarError("no token of the vocabulary can continue the grammar here")

    def accept_token(self, token: int) -> None:
        """Advance the matcher past ``token``; a token the grammar refuses raises."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(
                f"token {token} does not fit the grammar: {self._matcher.get_error()}"
            )

    @property
    def is_finished(self) -> bool:
        """Whether the value is complete (nothing may follow)."""
        return bool(self._matcher.is_stopped())


class GrammarCompiler:
    """Compiles JSON schemas into token constraints for one tokenizer and vocabulary.

    ``tokenizer`` is the served tokenizer (mlx-lm's ``TokenizerWrapper`` or a Hugging Face
    fast tokenizer: its ``tokenizers`` backend is what llguidance reads); ``vocab_size`` the
    engine's (masks cover ``mask_words(vocab_size)`` words; ids past the tokenizer's are
    never allowed); ``eos_ids`` the ids that may end a value that could go on. A tokenizer
    without a fast backend raises :class:`GrammarError`.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        import llguidance

        self._llg = llguidance
        vocab_size = check_int(vocab_size, "vocab_size", minimum=1)
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise GrammarError(
                f"structured output needs a fast (tokenizers-backed) tokenizer; "
                f"{type(hf).__name__} has none"
            )
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        own = int(backend.get_vocab_size(with_added_tokens=True))
        eos = sorted({int(t) for t in eos_ids if 0 <= int(t) < vocab_size})
        if not eos:
            raise GrammarError("structured output needs at least one end-of-sequence token id")
        self._tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=max(own, vocab_size), eos_token=eos
        )
        self._words = mask_words(self._tokenizer.vocab_size)
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos)

    def json_schema(self, schema: Mapping[str, Any]) -> TokenConstraintFactory:
        """A factory of constraints to JSON values valid under ``schema``.

        Raises :class:`GrammarError` with the grammar engine's message when the schema
        cannot be compiled (an unknown type, a bad pattern, an unsupported keyword).
        """
        if not isinstance(schema, Mapping):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema)
            grammar = self._llg.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        except (TypeError, ValueError) as error:
            raise GrammarError(str(error)) from None
        return self._compile(grammar)

    def json_object(self) -> TokenConstraintFactory:
        """A factory of constraints to any JSON object (``response_format: json_object``)."""
        return self.json_schema({"type": "object"})

    def tool_calls(
        self,
        tools: Sequence[tuple[str, Mapping[str, Any]]],
        *,
        start: str,
        end: str,
        parallel: bool,
    ) -> TokenConstraintFactory:
        """A factory of constraints to tool calls in the Hermes / Qwen form.

        The output is one call (``parallel`` false) or calls separated by newlines, each
        ``start`` + newline + ``{"name": <one of tools>, "arguments": <valid under that
        tool's schema>}`` + newline + ``end``; ``tools`` are ``(name, parameters schema)``
        pairs. Raises :class:`GrammarError` when a schema cannot be compiled.
        """
        options: list[dict[str, Any]] = []
        for name, parameters in tools:
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": dict(parameters)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        schema = {"anyOf": options, "x-guidance": dict(_JSON_OPTIONS)}
        repeat = ' ("\\n" call)*' if parallel else ""
        lark = (
            f"start: call{repeat}\n"
            f"call: {json.dumps(start + chr(10))} body {json.dumps(chr(10) + end)}\n"
            f"body: %json {json.dumps(schema)}\n"
        )
        return self._compile(self._llg.LLMatcher.grammar_from_lark(lark))

    def lark(self, grammar: str) -> TokenConstraintFactory:
        """A factory of constraints to a grammar in llguidance's Lark dialect.

        Special tokens are written ``<|name|>``. Raises :class:`GrammarError` when it does
        not compile.
        """
        return self._compile(self._llg.LLMatcher.grammar_from_lark(grammar))

    def _compile(self, grammar: str) -> TokenConstraintFactory:
        failed, messages = self._llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer
        )
        if failed:
            raise GrammarError("; ".join(messages) or "the grammar does not compile")
        template = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        return CompiledGrammar(grammar, template, self._words)

    def grammar(self, text: str) -> TokenConstraintFactory:
        """A factory of constraints to ``text``, a grammar as :class:`CompiledGrammar` keeps it.

        Tensor-parallel followers compile the leader's requests' grammars with it.
        """
        return self._compile(text)


class CompiledGrammar:
    """A constraint factory that keeps the grammar it was compiled from.

    ``grammar`` is llguidance's serialized form, so the grammar can be compiled again
    elsewhere (on another rank).
    """

    def __init__(self, grammar: str, template: Any, words: int) -> None:
        self.grammar = grammar
        self._template = template
        self._words = words

    def __call__(self) -> TokenConstraint:
        """A fresh constraint at the start of the grammar."""
        return _MatcherConstraint(self._template.deep_copy(), self._words)
