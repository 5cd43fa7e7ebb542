"""A draft model as a speculative proposer: a smaller model's greedy guesses.

:class:`DraftModelProposer` implements :class:`kv_batching.Proposer`: it runs the draft
model greedily on mlx-lm's own caches, keeping them per text prefix, so the next proposal of
the same request only feeds what changed (the tokens accepted since, the model's own token)
after trimming the draft's cache back to what the two texts share. A draft must share the
served model's tokenizer: :func:`draft_speculation` refuses another vocabulary size and the
command line compares the two tokenizers' vocabularies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kv_batching import SpeculationConfig, vocabulary_size
from kv_protocol import UnsupportedModelError

__all__ = ["DraftModelProposer", "draft_speculation"]


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
    draft: nn.Module, model: nn.Module, *, num_tokens: int = 4, max_batch: int = 2
) -> SpeculationConfig:
    """Speculation with ``draft`` proposing for ``model``; refused if their vocabularies differ."""
    ours, theirs = vocabulary_size(model), vocabulary_size(draft)
    if ours is None or theirs is None or ours != theirs:
        raise UnsupportedModelError(
            f"the draft model's vocabulary ({theirs} tokens) is not the model's ({ours}): a "
            "draft must share the served model's tokenizer"
        )
    return SpeculationConfig(
        proposer=DraftModelProposer(draft), num_tokens=num_tokens, max_batch=max_batch
    )
