"""What the engine reads off the model and how it runs a prefill forward: vocabulary, head."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from kv_protocol import (
    GreedyHeadProjection,
    QuantizedHeadKernel,
    UnsupportedModelError,
    as_int,
    language_model_container,
    model_args,
)

__all__ = [
    "HEAD_REORDER_MIN_WEIGHTS",
    "DecodeForward",
    "LastPositionForward",
    "SplitDecodeForward",
    "VocabularyHead",
    "decode_forward",
    "last_position_forward",
    "vocabulary_size",
]

#: Attribute names under which mlx-lm models keep their input embedding table.
_EMBEDDING_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embedding")


def vocabulary_size(model: object) -> int | None:
    """Rows of the model's input embedding table (or its ``args.vocab_size``), if it tells.

    Token ids must be below it: an id past the table reads memory past its end.
    """
    owners: list[object] = [model]
    with contextlib.suppress(UnsupportedModelError):
        owners.insert(0, language_model_container(model))
    for owner in owners:
        for name in _EMBEDDING_NAMES:
            weight = getattr(getattr(owner, name, None), "weight", None)
            if isinstance(weight, mx.array) and weight.ndim == 2:
                return int(weight.shape[0])
    if isinstance(model, nn.Module):
        # Deeper containers (a multimodal wrapper's language model): the first table found.
        for path, module in model.named_modules():
            weight = getattr(module, "weight", None)
            named = path.rsplit(".", 1)[-1] in _EMBEDDING_NAMES
            if named and isinstance(weight, mx.array) and weight.ndim == 2:
                return int(weight.shape[0])
    declared = as_int(getattr(model_args(model), "vocab_size", None))
    return declared if declared is not None and declared > 0 else None


#: ``forward(tokens (1, T), caches) -> logits (1, 1, vocab)`` of the last position only.
LastPositionForward = Callable[[mx.array, list[Any]], mx.array]


def last_position_forward(
    model: nn.Module,
    vocab_size: int,
    quantized_head: QuantizedHeadKernel | None = None,
) -> LastPositionForward | None:
    """A forward that projects only the last position onto the vocabulary, if it is exact.

    mlx-lm models are ``head(backbone(tokens, cache))`` with ``head`` an ``lm_head`` or the
    tied embedding's ``as_linear``. Prefill samples from the last position only, so the
    head of every other position is wasted work (with a 262k vocabulary, more than the rest
    of the model). The split is probed once on a short random input: it is used only when its
    last-position logits equal the model's own, so a model that post-processes its logits
    (soft-capping, scaling) keeps the full path. Where decode projects a large head in the
    other operand order (:func:`decode_forward`: on the CPU, a plain head of at least
    :data:`HEAD_REORDER_MIN_WEIGHTS` weights) the last position is projected that way too
    (Gemma 3 270M: 28 against 45 ms a prompt), and a large quantized head through
    ``quantized_head`` where decode's is, checked as decode's is: the same logits to float
    rounding and the same greedy token.
    """
    backbone = getattr(model, "model", None)
    if not isinstance(backbone, nn.Module):
        return None
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module):
        head = getattr(getattr(backbone, "embed_tokens", None), "as_linear", None)
    if not callable(head):
        return None
    project: Callable[[mx.array], mx.array] = head
    faster: Callable[[mx.array], mx.array] | None = _cpu_head(model, quantized_head)
    if faster is not None:
        project = faster

    def forward(tokens: mx.array, caches: list[Any]) -> mx.array:
        hidden = backbone(tokens, cache=caches)
        return project(hidden[:, -1:, :])

    # Short: the model's own head of every probe position runs here, for a quantized head
    # through MLX's CPU product (about 150 ms a row for Gemma 3 270M's).
    probe = mx.array([[(7 * i + 3) % vocab_size for i in range(3)]], dtype=mx.int32)
    try:
        full = model(probe)[:, -1:, :]
        fast = forward(probe, cast(list[Any], None))
        tol = 1e-5 if faster is None else 1e-4
        same = (
            full.shape == fast.shape
            and bool(mx.allclose(full, fast, rtol=tol, atol=tol))
            and bool(mx.array_equal(full.argmax(-1), fast.argmax(-1)))
        )
    except Exception:  # any model the split does not fit keeps the full path
        return None
    return forward if same else None


#: ``forward(tokens (B, T), cache=caches) -> logits (B, T, vocab)``: the model's call with
#: its vocabulary head in another operand order.
DecodeForward = Callable[..., mx.array]

#: Head weights (vocabulary x hidden) from which decode projects as ``(W @ h.T).T``; a
#: smaller head is not bandwidth-bound and keeps the model's own call.
HEAD_REORDER_MIN_WEIGHTS = 1 << 24


#: Vocabulary rows per product when a head is projected in slices (see :func:`project_rows`).
HEAD_SLICE_ROWS = 4096
#: The most rows :func:`project_rows` projects in slices (more run faster whole).
HEAD_SLICED_MAX_ROWS = 112


def _padded(rows: mx.array, m: int) -> mx.array:
    if m == rows.shape[0]:
        return rows
    extra = mx.zeros((m - rows.shape[0], rows.shape[1]), dtype=rows.dtype)
    return mx.concatenate([rows, extra], axis=0)


def _sliced(weight: mx.array, rows: mx.array) -> mx.array:
    vocab = weight.shape[0]
    parts = [weight[i : i + HEAD_SLICE_ROWS] @ rows.T for i in range(0, vocab, HEAD_SLICE_ROWS)]
    return mx.concatenate(parts, axis=0).T


def project_rows(weight: mx.array, rows: mx.array) -> mx.array:
    """``rows @ weight.T`` for a large ``(vocab, hidden)`` head, in MKL's fastest form here.

    MKL's single-precision product picks its kernel by shape, and for a few rows against
    Gemma 3's 262144 x 640 head the time is far from proportional to the rows (2-core
    x86_64; ``W @ h.T`` whole, or in slices of :data:`HEAD_SLICE_ROWS` vocabulary rows):
    1 row 45 ms, 2 rows 30; 6 rows 71, 8 rows 91, 11 rows 119, 15 rows 152, but 16 rows 90
    whole and 64-68 in slices; 29 rows 150 whole, 133 in slices, 91 padded to 32 in slices;
    80 rows 199 whole, 174 in slices; 128 rows 272 whole, 318 in slices. So one row is
    padded to two, 6 to 16 rows are padded to 16 and sliced, 17 to
    :data:`HEAD_SLICED_MAX_ROWS` padded to a multiple of 8 and sliced (a speculative
    verification's rows); the zero rows are dropped again.
    """
    m = rows.shape[0]
    if m == 1:
        return (weight @ _padded(rows, 2).T)[:, :1].T
    if 6 <= m <= 16:
        return _sliced(weight, _padded(rows, 16))[:m]
    if 16 < m <= HEAD_SLICED_MAX_ROWS:
        return _sliced(weight, _padded(rows, -(-m // 8) * 8))[:m]
    return (weight @ rows.T).T


class VocabularyHead:
    """A model's vocabulary head in the CPU's faster form: ``hidden (..., D) -> (..., vocab)``.

    ``project`` makes the logits (a bias is added after); ``greedy`` (a
    ``kv_protocol.GreedyHeadProjection``'s, given only for a head without bias) picks each
    row's argmax without all of them where it can.
    """

    def __init__(
        self,
        project: Callable[[mx.array], mx.array],
        bias: mx.array | None = None,
        greedy: Callable[[mx.array], mx.array | None] | None = None,
    ) -> None:
        self._project = project
        self._bias = bias
        self._greedy = greedy if bias is None else None

    def __call__(self, hidden: mx.array) -> mx.array:
        """The logits of ``hidden``."""
        logits = self._project(hidden)
        return logits if self._bias is None else logits + self._bias

    @property
    def picks_greedy(self) -> bool:
        """Whether :meth:`greedy` may serve (it can still return ``None`` for a call)."""
        return self._greedy is not None

    def greedy(self, hidden: mx.array) -> mx.array | None:
        """``mx.argmax(self(hidden), axis=-1)`` exactly (uint32), or ``None`` where not served."""
        return None if self._greedy is None else self._greedy(hidden)

    def without_greedy(self) -> VocabularyHead:
        """The same head, its argmax always taken from the logits."""
        return VocabularyHead(self._project, self._bias)


def _cpu_head(
    model: nn.Module, quantized_head: QuantizedHeadKernel | None
) -> VocabularyHead | None:
    """The head as ``hidden (..., D) -> logits (..., vocab)`` in the CPU's faster form, if any.

    On the CPU only, for a head of at least :data:`HEAD_REORDER_MIN_WEIGHTS` weights: a
    plain ``nn.Linear`` ``lm_head`` or tied ``nn.Embedding`` as ``(W @ h.T).T``
    (:func:`project_rows`); an affine ``nn.QuantizedLinear`` / tied ``nn.QuantizedEmbedding``
    through ``quantized_head`` where it serves that head. Any other head keeps its own call.
    """
    if mx.default_device().type != mx.cpu:
        return None
    backbone = getattr(model, "model", None)
    if not isinstance(backbone, nn.Module):
        return None
    head = getattr(model, "lm_head", None)
    embedding = getattr(backbone, "embed_tokens", None)
    module = head if head is not None else embedding
    if head is not None and type(head) not in (nn.Linear, nn.QuantizedLinear):
        return None
    if head is None and type(embedding) not in (nn.Embedding, nn.QuantizedEmbedding):
        return None
    assert isinstance(module, nn.Module)
    weight = module.weight
    bias = getattr(module, "bias", None) if head is not None else None
    if type(module) in (nn.Linear, nn.Embedding):
        if weight.ndim != 2 or weight.size < HEAD_REORDER_MIN_WEIGHTS:
            return None
        return VocabularyHead(partial(_project_reordered, weight), bias)
    bits, group_size = int(module.bits), int(module.group_size)
    biases = getattr(module, "biases", None)
    hidden = int(weight.shape[-1]) * 32 // bits
    if (
        quantized_head is None
        or getattr(module, "mode", "affine") != "affine"
        or biases is None
        or weight.ndim != 2
        or int(weight.shape[0]) * hidden < HEAD_REORDER_MIN_WEIGHTS
    ):
        return None
    projection = quantized_head.prepare(
        weight, module.scales, biases, group_size=group_size, bits=bits
    )
    if projection is None:
        return None
    greedy = projection.greedy if isinstance(projection, GreedyHeadProjection) else None
    return VocabularyHead(projection, bias, greedy)


def _project_reordered(weight: mx.array, hidden: mx.array) -> mx.array:
    """``hidden (..., D)`` onto the vocabulary through :func:`project_rows`."""
    logits = project_rows(weight, hidden.reshape(-1, hidden.shape[-1]))
    return logits.reshape(*hidden.shape[:-1], logits.shape[-1])


def decode_forward(
    model: nn.Module,
    vocab_size: int,
    quantized_head: QuantizedHeadKernel | None = None,
) -> DecodeForward | None:
    """The model's forward with its vocabulary head as ``(W @ h.T).T``, where that pays.

    mlx-lm computes the head as ``h @ W.T``. On MLX's CPU backend that operand order is much
    slower for a few rows than ``W @ h.T``: Gemma 3 270M's tied 262144 x 640 head takes 103
    against 45 ms for 4 rows and 125 against 86 ms for 16 (the same for one), about half of a
    decode step (``tools/profile_decode.py``). So on the CPU, for a plain (unquantized)
    ``lm_head`` or tied embedding of at least :data:`HEAD_REORDER_MIN_WEIGHTS` weights, a
    batched decode runs the backbone and projects in that order. A quantized head of that
    size goes through ``quantized_head`` (``kv_protocol.QuantizedHeadKernel``) where it
    serves it: MLX's CPU quantized product is several times slower than float32, the
    native kernel faster (Gemma 3 270M's 8-bit head: 18-19 against 51-54 ms for one row in
    float32). Either is used only when a probe's logits equal the model's own (to float
    rounding) with the same greedy token in every row; otherwise, and on other devices,
    ``None``. The forward is a :class:`SplitDecodeForward`; where the quantized head's
    projection also picks greedy tokens (``kv_protocol.GreedyHeadProjection``), its head
    keeps that pick only when the probe's picks equal the argmax of its logits.
    """
    head = _cpu_head(model, quantized_head)
    backbone = getattr(model, "model", None)
    if head is None or not isinstance(backbone, nn.Module):
        return None
    forward = SplitDecodeForward(backbone, head)
    # Four rows of one token (see last_position_forward's probe for why so few).
    probe = mx.array([[(7 * 3 * j + 1) % vocab_size] for j in range(4)])
    try:
        full = model(probe)
        hidden = backbone(probe)
        fast = head(hidden)
        same = (
            full.shape == fast.shape
            and bool(mx.allclose(full, fast, rtol=1e-4, atol=1e-4))
            and bool(mx.array_equal(full.argmax(-1), fast.argmax(-1)))
        )
        if same and head.picks_greedy:
            picked = head.greedy(hidden)
            if picked is not None and not bool(mx.array_equal(picked, fast.argmax(-1))):
                forward = SplitDecodeForward(backbone, head.without_greedy())
    except Exception:  # a model the split does not fit keeps its own call
        return None
    return forward if same else None


class SplitDecodeForward:
    """A model's decode forward as ``head(backbone(tokens, cache))``, parts callable apart.

    The :data:`DecodeForward` :func:`decode_forward` returns; a greedy step runs the
    backbone and picks its tokens through :meth:`VocabularyHead.greedy`, without the logits.
    """

    def __init__(self, backbone: nn.Module, head: VocabularyHead) -> None:
        self.backbone = backbone
        self.head = head

    def __call__(self, tokens: mx.array, cache: Any = None) -> mx.array:
        """The logits ``(B, T, vocab)`` of ``tokens (B, T)`` through ``cache``."""
        logits: mx.array = self.head(self.backbone(tokens, cache=cache))
        return logits
