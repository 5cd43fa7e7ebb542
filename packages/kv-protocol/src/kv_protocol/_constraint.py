"""The contract between a grammar and the engine: which tokens a sequence may take next.

A structured-output request (a JSON schema, a tool call's grammar) is served by a
:class:`TokenConstraint` per generated sequence. The engine asks every constrained row of a
step for its allowed-token mask, applies the masks to the step's logits in one batched
operation, and tells each constraint the token that was sampled. No grammar library is
named here: whoever builds the grammar (kv-serve) implements this protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["TokenConstraint", "TokenConstraintFactory", "mask_words"]


def mask_words(vocab_size: int) -> int:
    """32-bit words of one row's token mask over ``vocab_size`` tokens (``ceil(vocab / 32)``)."""
    return (vocab_size + 31) // 32


@runtime_checkable
class TokenConstraint(Protocol):
    """One sequence's rule over its next token: a mask, then the token that was taken.

    The mask of a row is a bit set over the vocabulary packed into 32-bit words: token ``t``
    is allowed when bit ``t % 32`` (least significant first) of word ``t // 32`` is set.
    The engine calls :meth:`fill_next_mask` before each token of the sequence (possibly more
    than once for the same token, when a step is retried), and :meth:`accept_token` once
    with the token it took, which the last mask allowed. After a token that completes the
    output, :attr:`is_finished` is true and the sequence ends (``finish_reason ==
    "stop"``).
    """

    def fill_next_mask(self, mask: memoryview) -> None:
        """Write the allowed set of the next token into ``mask``.

        ``mask`` is a writable, C-contiguous buffer of ``mask_words(vocab)`` unsigned 32-bit
        words (format ``"I"``) for the engine's vocabulary; every word must be written
        (tokens the constraint does not know are not allowed). Must not change the
        constraint's state: the mask of the same token may be asked for again.
        """
        ...

    def accept_token(self, token: int) -> None:
        """Advance past ``token``; raise (any ``Exception``) if the constraint cannot take it."""
        ...

    @property
    def is_finished(self) -> bool:
        """Whether the output is complete: the sequence must end after its last token."""
        ...


#: Makes a fresh :class:`TokenConstraint` for one generated sequence (each of a request's
#: ``n`` sequences gets its own, so each keeps its own grammar state).
TokenConstraintFactory = Callable[[], TokenConstraint]
