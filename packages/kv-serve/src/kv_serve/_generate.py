"""``generate`` and ``complete``: one prompt's completions through the batched engine.

``generate`` streams one completion as text; ``complete`` returns ``n`` of them (the prompt
prefilled once). Both take the sampling fields of the HTTP server (:class:`SamplingParams`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn

from kv_batching import DecodeEngine, SamplingParams, TokenLogprob
from kv_protocol import check_int

from ._engine import build_engine
from ._load import encode_prompt, stop_token_ids

__all__ = ["Completion", "GenerationStats", "TextStream", "complete", "generate"]


@dataclass
class GenerationStats:
    """What one :func:`generate` call did: token counts and seconds to first / last token.

    ``logprobs`` holds each generated token's :class:`~kv_batching.TokenLogprob` when the
    call asked for them.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    first_token_seconds: float = 0.0
    total_seconds: float = 0.0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens after the first, per second after the first."""
        rest = self.total_seconds - self.first_token_seconds
        return (self.generated_tokens - 1) / rest if rest > 0 and self.generated_tokens > 1 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second up to the first token."""
        t = self.first_token_seconds
        return self.prompt_tokens / t if t > 0 else 0.0


@dataclass(frozen=True)
class Completion:
    """One completion of :func:`complete`: its text, tokens, end and (if asked) logprobs."""

    text: str
    tokens: tuple[int, ...]
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] | None = None


class TextStream:
    """Turn token ids into text pieces as they arrive, never splitting a UTF-8 character.

    Decoding a token alone can give half of a multi-byte character (shown as U+FFFD); the
    text is decoded from the start of the stream and a piece is held back while it ends in
    U+FFFD.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._emitted = 0

    def push(self, token: int) -> str:
        """Add a token; return the new complete text (possibly empty)."""
        self._tokens.append(int(token))
        text = str(self._tokenizer.decode(self._tokens))
        if text.endswith("\ufffd"):
            return ""
        piece = text[self._emitted :]
        self._emitted = len(text)
        return piece

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream."""
        text = str(self._tokenizer.decode(self._tokens))
        piece = text[self._emitted :]
        self._emitted = len(text)
        return piece


def _sampling(
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    repetition_penalty: float,
    presence_penalty: float,
    frequency_penalty: float,
    logit_bias: Mapping[int, float] | None,
    seed: int | None,
    logprobs: int | None,
) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logit_bias=dict(logit_bias or {}),
        seed=seed,
        logprobs=logprobs,
    )


def _engine_for(
    model: nn.Module,
    ids: list[int],
    *,
    running: int,
    max_tokens: int,
    prefill_chunk: int,
    seed: int,
    kv_bits: int | None,
    kv_group_size: int,
    kv_quantize: str,
) -> DecodeEngine:
    """An engine sized for ``running`` sequences of the prompt ``ids`` and ``max_tokens``."""
    return build_engine(
        model,
        max_running=running,
        max_context=len(ids) + max_tokens,
        prefill_chunk=prefill_chunk,
        seed=seed,
        record_pages=False,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        kv_quantize=kv_quantize,
    )


def _stops(tokenizer: Any, engine: DecodeEngine) -> set[int]:
    """The tokenizer's end-of-sequence ids inside the engine's vocabulary."""
    return {t for t in stop_token_ids(tokenizer) if t < engine.vocab_size}


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: str,
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    logprobs: int | None = None,
    seed: int = 0,
    chat: bool = False,
    prefill_chunk: int = 512,
    stats: GenerationStats | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    kv_quantize: str = "all",
) -> Iterator[str]:
    """Stream the completion of ``prompt`` as text pieces.

    The prompt is encoded (through the chat template with ``chat``), served by an engine from
    :func:`kv_serve.build_engine` sized for this one request, and stops at the tokenizer's
    end-of-sequence ids or after ``max_tokens``. The sampling fields are the server's
    (:class:`kv_batching.SamplingParams`: ``temperature`` 0 is greedy; ``seed`` is the
    request's, so a sampled completion equals the server's answer with that seed).
    ``logprobs`` (0..20 alternatives) fills ``stats.logprobs``; ``stats``, when given, is
    filled in. ``kv_bits`` / ``kv_group_size`` / ``kv_quantize`` quantize the pool's pages
    (see :func:`kv_serve.build_engine`). A bad value raises ``RequestStateError`` (a
    ``ValueError``) naming it before anything runs.
    """
    max_tokens = check_int(max_tokens, "max_tokens", minimum=1)
    sampling = _sampling(
        temperature,
        top_p,
        top_k,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        seed,
        logprobs,
    )
    ids = encode_prompt(tokenizer, prompt, chat=chat)
    record = stats if stats is not None else GenerationStats()
    record.prompt_tokens = len(ids)
    engine = _engine_for(
        model,
        ids,
        running=1,
        max_tokens=max_tokens,
        prefill_chunk=prefill_chunk,
        seed=seed,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        kv_quantize=kv_quantize,
    )
    stops = _stops(tokenizer, engine)
    rid = engine.submit(ids, max_tokens, sampling=sampling, stop_tokens=stops)
    stream = TextStream(tokenizer)
    start = time.perf_counter()
    for _, token in engine.stream():
        if record.generated_tokens == 0:
            record.first_token_seconds = time.perf_counter() - start
        record.generated_tokens += 1
        if token in stops:
            continue
        piece = stream.push(token)
        if piece:
            yield piece
    tail = stream.flush()
    if tail:
        yield tail
    record.total_seconds = time.perf_counter() - start
    out = engine.output(rid)
    record.finish_reason = out.finish_reason
    record.logprobs = list(out.logprobs or ())


def complete(
    model: nn.Module,
    tokenizer: Any,
    prompt: str,
    *,
    n: int = 1,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    logprobs: int | None = None,
    seed: int = 0,
    chat: bool = False,
    prefill_chunk: int = 512,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    kv_quantize: str = "all",
) -> list[Completion]:
    """``n`` completions of ``prompt``: the prompt is prefilled once and its pages shared.

    Completion ``i`` samples with seed ``seed + i``, so it equals :func:`generate` (or the
    server) with that seed alone. The other arguments are :func:`generate`'s; each
    completion carries its tokens, finish reason and, with ``logprobs``, its tokens'
    :class:`~kv_batching.TokenLogprob`.
    """
    n = check_int(n, "n", minimum=1)
    max_tokens = check_int(max_tokens, "max_tokens", minimum=1)
    sampling = _sampling(
        temperature,
        top_p,
        top_k,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        seed,
        logprobs,
    )
    ids = encode_prompt(tokenizer, prompt, chat=chat)
    engine = _engine_for(
        model,
        ids,
        running=n,
        max_tokens=max_tokens,
        prefill_chunk=prefill_chunk,
        seed=seed,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        kv_quantize=kv_quantize,
    )
    stops = _stops(tokenizer, engine)
    rids = engine.submit_n(ids, max_tokens, n, sampling=sampling, stop_tokens=stops)
    engine.run()
    completions = []
    for rid in rids:
        out = engine.release(rid)
        text = str(tokenizer.decode([t for t in out.tokens if t not in stops]))
        completions.append(Completion(text, out.tokens, out.finish_reason, out.logprobs))
    return completions
