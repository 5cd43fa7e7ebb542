"""A draft model as a speculative proposer: a smaller model's greedy guesses.

:class:`EngineDraftProposer` implements :class:`kv_batching.BatchProposer`: the draft runs on
a :class:`kv_batching.DecodeEngine` of its own (its own paged pool, prefix caching on), and
each step the texts of every proposing request are submitted to it together and decoded as
one batch; what a text shares with an earlier one (the request's previous proposal step) is
found in the draft's prefix cache, so only the tail is prefilled again.
:class:`DraftModelProposer` is the one-request form on mlx-lm's own caches, kept per text
prefix and trimmed back to what the next text shares. A draft must share the served model's
tokenizer: :func:`draft_speculation` refuses another vocabulary size and the command line
compares the two tokenizers' vocabularies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kv_batching import DecodeEngine, SpeculationConfig, vocabulary_size
from kv_protocol import KVCacheError, UnsupportedModelError

from ._sizes import DRAFT_SPECULATIVE_TOKENS

__all__ = ["DraftModelProposer", "EngineDraftProposer", "draft_speculation"]


class EngineDraftProposer:
    """A draft model's greedy guesses for a whole step's proposals, decoded as one batch.

    ``engine`` serves the draft (build it with :meth:`build`). :meth:`propose_batch`
    submits every text with its ``k``, runs the draft engine until they are done and
    releases them: greedy, so each guess is the draft's own continuation of its text. A
    text the draft engine cannot take (longer than its context) gets no proposal.
    """

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine

    @classmethod
    def build(
        cls,
        draft: nn.Module,
        *,
        max_running: int = 16,
        max_context: int = 4096,
        kv_budget_bytes: int | None = None,
    ) -> EngineDraftProposer:
        """A proposer whose draft engine holds ``max_running`` texts of ``max_context``."""
        from ._engine import build_engine

        engine = build_engine(
            draft,
            max_running=max_running,
            max_context=max_context,
            kv_budget_bytes=kv_budget_bytes,
            record_pages=False,
        )
        return cls(engine)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """The draft model's ``k`` greedy tokens after ``tokens``."""
        return self.propose_batch([tokens], [k])[0]

    def propose_batch(self, texts: Sequence[Sequence[int]], ks: Sequence[int]) -> list[list[int]]:
        """Each text's ``ks[i]`` greedy draft tokens, all decoded in the draft engine at once."""
        engine = self.engine
        out: list[list[int]] = [[] for _ in texts]
        ids: dict[int, int] = {}
        try:
            for i, (text, k) in enumerate(zip(texts, ks, strict=True)):
                if k <= 0 or not text:
                    continue
                try:
                    ids[i] = engine.submit([int(t) for t in text], int(k))
                except KVCacheError:
                    continue  # too long for the draft's context: no proposal
            while engine.has_work:
                engine.step()
        finally:
            for i, rid in ids.items():
                if not engine.is_finished(rid):
                    engine.abort(rid)
                result = engine.release(rid)
                if result.error is None:
                    out[i] = list(result.tokens)
        return out

    def close(self) -> None:
        """Stop the draft engine (puts the draft model's attention modules back)."""
        self.engine.close()


@dataclass
class _Entry:
    tokens: list[int]
    caches: list[Any]


class DraftModelProposer:
    """Proposes the greedy continuation of a draft model (mlx-lm caches per text prefix).

    At most ``max_entries`` texts keep a cache (least recently used out). A proposal for a
    text starts from the kept cache that shares the longest prefix with it, trimmed back to
    that prefix (a cache that cannot be trimmed, such as a recurrent state's, starts over).
    """

    def __init__(self, model: nn.Module, *, max_entries: int = 32) -> None:
        self.model = model
        self.max_entries = max_entries
        self._entries: list[_Entry] = []

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """The draft model's ``k`` greedy tokens after ``tokens``."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

        text = [int(t) for t in tokens]
        if not text or k <= 0:
            return []
        entry, shared = self._closest(text)
        if entry is not None:
            self._entries.remove(entry)
            # At least one token is fed, so the draft has logits to start from.
            keep = min(shared, len(text) - 1)
            extra = len(entry.tokens) - keep
            if extra and can_trim_prompt_cache(entry.caches):
                trim_prompt_cache(entry.caches, extra)
                entry.tokens = entry.tokens[:keep]
            elif extra:
                entry = None
        if entry is None:
            entry = _Entry([], make_prompt_cache(self.model))
        feed = text[len(entry.tokens) :]
        proposal: list[int] = []
        logits = self.model(mx.array(feed, dtype=mx.int32)[None], cache=entry.caches)
        entry.tokens = [*entry.tokens, *feed]
        while True:
            token = int(mx.argmax(logits[0, -1]).tolist())  # type: ignore[arg-type]
            proposal.append(token)
            if len(proposal) == k:
                break
            logits = self.model(mx.array([[token]], dtype=mx.int32), cache=entry.caches)
            entry.tokens.append(token)
        self._entries.append(entry)
        del self._entries[: max(0, len(self._entries) - self.max_entries)]
        return proposal

    def _closest(self, text: list[int]) -> tuple[_Entry | None, int]:
        """The kept entry sharing the longest prefix with ``text``, and that length."""
        best: _Entry | None = None
        best_len = 0
        for entry in self._entries:
            n = 0
            for a, b in zip(entry.tokens, text, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = entry, n
        return best, best_len


def draft_speculation(
    draft: nn.Module,
    model: nn.Module,
    *,
    num_tokens: int = DRAFT_SPECULATIVE_TOKENS,
    max_batch: int = 2,
    batched: bool = True,
    max_running: int = 16,
    max_context: int = 4096,
) -> SpeculationConfig:
    """Speculation with ``draft`` proposing for ``model``; refused if their vocabularies differ.

    ``batched`` (the default): an :class:`EngineDraftProposer`, the draft on its own engine
    and pool holding ``max_running`` texts of ``max_context`` tokens, every step's proposals
    decoded as one batch; ``False``: a :class:`DraftModelProposer` (mlx-lm caches, one
    request at a time).
    """
    ours, theirs = vocabulary_size(model), vocabulary_size(draft)
    if ours is None or theirs is None or ours != theirs:
        raise UnsupportedModelError(
            f"the draft model's vocabulary ({theirs} tokens) is not the model's ({ours}): a "
            "draft must share the served model's tokenizer"
        )
    proposer: DraftModelProposer | EngineDraftProposer
    if batched:
        proposer = EngineDraftProposer.build(
            draft, max_running=max_running, max_context=max_context
        )
    else:
        proposer = DraftModelProposer(draft)
    return SpeculationConfig(proposer=proposer, num_tokens=num_tokens, max_batch=max_batch)
