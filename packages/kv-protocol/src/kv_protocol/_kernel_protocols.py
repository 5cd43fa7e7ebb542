"""The typed contracts of the kernels a pool's layers are computed with.

A :class:`KernelSet` is what ``kv_metal_kernels.select_kernels`` builds and the engine reads:
fused RoPE + scatter into the pool, paged decode and query attention, prefill attention, and
the CPU's optional native pieces (gated activations, norms, the quantized vocabulary head).
Buffers are the pool's slot-addressed, head-major ``KVBuffer`` values (see
:mod:`kv_protocol._protocols`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import mlx.core as mx

from ._protocols import MaskSpec
from ._quantized_kv import KVBuffer
from ._rope import RopeConfig

__all__ = [
    "GatedActivationKernel",
    "GreedyHeadProjection",
    "KernelSet",
    "NormRopeKernel",
    "PagedDecodeAttention",
    "PagedQueryAttention",
    "PrefillAttention",
    "QuantizedHeadKernel",
    "RmsNormForm",
    "RopeScatterKernel",
    "SlotWriter",
]


@runtime_checkable
class RopeScatterKernel(Protocol):
    """Fused RoPE on q and k plus the write of rotated k and raw v into slot-addressed pools.

    Pools are head-major ``(n_kv_heads, num_slots, head_dim)``; a negative slot rotates but
    does not write.
    """

    @property
    def name(self) -> str:
        """Backend name (``reference``, ``metal``, ``cuda`` ...)."""
        ...

    def supports(self, rope: RopeConfig) -> bool:
        """True if the kernel computes exactly this RoPE variant."""
        ...

    def __call__(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        positions: mx.array,
        slots: mx.array,
        k_pool: mx.array,
        v_pool: mx.array,
        *,
        rope: RopeConfig,
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Rotate q ``(T, Hq, D)`` and k ``(T, Hkv, D)`` at ``positions (T,)``.

        Returns ``(q_rot, k_rot, k_pool_new, v_pool_new)``.
        """
        ...


@runtime_checkable
class PagedDecodeAttention(Protocol):
    """One decode query per request attending to its own tokens through a page table."""

    @property
    def name(self) -> str:
        """Backend name."""
        ...

    def __call__(
        self,
        q: mx.array,
        k_pool: KVBuffer,
        v_pool: KVBuffer,
        page_table: mx.array,
        seq_lens: mx.array,
        *,
        page_size: int,
        scale: float,
        window: int | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention output ``(B, Hq, 1, D)`` for q ``(B, Hq, 1, D)``.

        ``k_pool``/``v_pool`` are ``(Hkv, num_slots, D)``, plain or :class:`QuantizedKV`;
        ``page_table (B, max_pages)`` maps each request's logical pages to physical ones;
        ``seq_lens (B,)`` int32 counts the valid tokens of each request *including* the one
        being decoded (its K/V is already in the pool). With ``window``, request ``b`` sees
        only positions ``seq_lens[b] - window .. seq_lens[b] - 1``. ``sinks (Hq,)`` adds one
        learned logit per head to the softmax denominator.
        """
        ...


@runtime_checkable
class PagedQueryAttention(Protocol):
    """Several consecutive queries per request attending through a page table.

    A paged decode attention that also implements this serves a step in which a request
    verifies a speculative proposal (its last token and the proposed ones, consecutive
    positions) from one read of each request's pages, instead of one per query.
    """

    def attend_queries(
        self,
        q: mx.array,
        k_pool: KVBuffer,
        v_pool: KVBuffer,
        page_table: mx.array,
        seq_lens: mx.array,
        *,
        page_size: int,
        scale: float,
        window: int | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention output ``(B, Hq, L, D)`` for q ``(B, Hq, L, D)``, ``L >= 1``.

        As :meth:`PagedDecodeAttention.__call__`, with ``seq_lens[b]`` counting request
        ``b``'s tokens up to and including its *last* query: query ``l`` is at position
        ``seq_lens[b] - L + l`` and sees the keys up to that position (the trailing
        ``window`` of them on a sliding layer), so the queries are attended causally. A
        query at a negative position (padding) gets an unspecified output.
        """
        ...


@runtime_checkable
class PrefillAttention(Protocol):
    """Attention of a prefill chunk's queries over the request's keys (the chunk's included)."""

    @property
    def name(self) -> str:
        """Backend name."""
        ...

    def __call__(
        self,
        q: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: float,
        mask: MaskSpec,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention output ``(B, Hq, T, D)`` for q ``(B, Hq, T, D)``, keys ``(B, Hkv, S, D)``.

        The semantics of ``mx.fast.scaled_dot_product_attention``: ``mask`` is ``None``,
        ``"causal"`` (query ``t`` sees keys ``0 .. S - T + t``), a boolean keep-mask or an
        additive float mask broadcastable to ``(B, Hq, T, S)``; ``sinks (Hq,)`` adds one
        learned logit per head to the softmax denominator.
        """
        ...


@runtime_checkable
class SlotWriter(Protocol):
    """Writes a decode step's keys or values into a plain head-major buffer, in place.

    A pool calls it instead of MLX's indexed assignment (``buffer[:, slots] = rows.T``);
    like that assignment it leaves the result in the ``buffer`` object itself.
    """

    def __call__(self, buffer: mx.array, slots: mx.array, rows: mx.array) -> bool:
        """Write token-major ``rows (T, H, D)`` at ``slots (T,)`` of ``buffer (H, S, D)``.

        ``slots`` are int32, distinct and checked by the caller. Returns ``False``, having
        done nothing, where this writer does not serve the call (device, dtype, shape): the
        caller assigns with MLX.
        """
        ...


@runtime_checkable
class GatedActivationKernel(Protocol):
    """A gated MLP's ``act(gate) * up`` as one operation (:func:`kv_protocol.gated_activation`).

    The values are :func:`kv_protocol.gated_activation`'s bit for bit, from
    :data:`kv_protocol.ACTIVATION_CONSTANTS`.
    """

    def __call__(self, gate: mx.array, up: mx.array, *, activation: str) -> mx.array | None:
        """``act(gate) * up`` of two float32 arrays of one shape.

        ``activation`` is one of :data:`kv_protocol.GATED_ACTIVATIONS`. Returns ``None``,
        having done nothing, where this kernel does not serve the call (device, dtype,
        shapes, activation): the caller composes MLX's operations.
        """
        ...


@runtime_checkable
class RmsNormForm(Protocol):
    """A norm module that states its function: ``mx.fast.rms_norm(x, w, eps)``.

    ``w`` is ``weight``, or ``1 + weight`` where ``add_one`` (Gemma's norms). A module that
    has these attributes claims that its call computes exactly that, so kernels may fuse it.
    """

    weight: mx.array
    eps: float
    add_one: bool


@runtime_checkable
class NormRopeKernel(Protocol):
    """Normalises and rotates a decode step's projected query or key rows as one operation.

    The rotation is RoPE of the whole head in halves (not ``traditional``) given as two
    factors per row: ``cos_both = [cos, cos]`` and ``sin_signed = [-sin, sin]``, each
    ``(B, head_dim)``, so that a row ``x`` becomes ``x * cos_both + [x2, x1] * sin_signed``
    (``x1``, ``x2`` its halves), each product and the sum rounded as MLX rounds them.
    """

    def __call__(
        self,
        rows: mx.array,
        *,
        heads: int,
        cos_both: mx.array,
        sin_signed: mx.array,
        norm: RmsNormForm | None,
    ) -> mx.array | None:
        """``rows (B, ..., heads * head_dim)`` -> ``(B, heads, head_dim)``.

        Each head's row is normalised by ``norm`` (per head: its weight has ``head_dim``
        features; ``None``: not normalised), then rotated. Returns ``None``, having done
        nothing, where this kernel does not serve the call (device, dtype, shape): the
        caller composes the same operations with MLX.
        """
        ...


@runtime_checkable
class GreedyHeadProjection(Protocol):
    """A vocabulary head's projection that can also pick each row's argmax more cheaply.

    ``QuantizedHeadKernel.prepare`` may return one: the engine then takes a greedy step's
    tokens from :meth:`greedy` instead of an argmax of the full logits.
    """

    def __call__(self, rows: mx.array) -> mx.array:
        """The logits ``(..., vocab)`` float32 of ``rows (..., hidden)`` float32."""
        ...

    def greedy(self, rows: mx.array) -> mx.array | None:
        """``mx.argmax(self(rows), axis=-1)`` exactly, ``(...,)`` uint32, or ``None``.

        The same token in every row, ties included (the first maximum; the first NaN where
        a row has one), computed without all the logits where it can be; ``None`` where it
        is not served here (the caller takes the argmax of the logits).
        """
        ...


@runtime_checkable
class QuantizedHeadKernel(Protocol):
    """A faster product of a few rows with a large affine-quantized ``(vocab, hidden)`` head.

    The head is what ``mx.quantize`` returns (``mode="affine"``): packed codes ``weight``,
    ``scales`` and ``biases`` per group of ``group_size`` inputs.
    """

    @property
    def name(self) -> str:
        """Backend name."""
        ...

    def prepare(
        self,
        weight: mx.array,
        scales: mx.array,
        biases: mx.array,
        *,
        group_size: int,
        bits: int,
    ) -> Callable[[mx.array], mx.array] | None:
        """A projection ``rows (..., hidden) float32 -> (..., vocab) float32`` of this head.

        It equals ``mx.quantized_matmul(rows, weight, scales, biases, transpose=True,
        group_size=group_size, bits=bits)`` to float rounding (the sums run in another
        order). ``None`` where the kernel does not serve this head (its bits, group size or
        shape, or no kernel on this machine): the caller keeps MLX's own product. The
        projection returns a lazy array (a node of MLX's graph) or evaluates ``rows`` and
        returns an evaluated one. It may be a :class:`GreedyHeadProjection`.
        """
        ...


@runtime_checkable
class KernelSet(Protocol):
    """The kernels batched decode uses: ``rope is None`` means RoPE is not fused.

    A kernel set may also carry ``prefill_attention`` (a :class:`PrefillAttention`, or
    ``None``): the engine then runs the prefill chunks of the layers it wraps through it
    instead of the module's own attention call; and ``quantized_head`` (a
    :class:`QuantizedHeadKernel`, or ``None``): the engine then projects a large quantized
    vocabulary head through it on the CPU; ``norm_rope`` (a :class:`NormRopeKernel`, or
    ``None``): batched decode then normalises and rotates its query and key rows through it;
    and ``gated_activation`` (a :class:`GatedActivationKernel`, or ``None``): the engine's
    gated MLPs then take their activation from it.
    They are read with ``getattr``, so a kernel set without them keeps every module's own
    prefill, head and RoPE.
    """

    @property
    def rope(self) -> RopeScatterKernel | None:
        """The fused RoPE + pool-scatter kernel, or ``None``."""
        ...

    @property
    def attention(self) -> PagedDecodeAttention:
        """The paged decode attention."""
        ...
