"""The reference RoPE + pool-scatter backend: plain MLX ops, runs on every device."""

from __future__ import annotations

import mlx.core as mx

from kv_protocol import RopeConfig

from ._memo import IdentityMemo
from ._scatter import ScatterPlan, memoized_plan_scatter, scatter_token_rows
from ._validate import check_rope_scatter_args, check_rope_scatter_values

__all__ = ["ReferenceRopeScatter", "rope_tokens"]


def rope_tokens(x: mx.array, positions: mx.array, rope: RopeConfig) -> mx.array:
    """Rotate token-major ``x (T, H, D)``, token ``t`` at ``positions[t]`` (``mx.fast.rope``)."""
    t, h, d = x.shape
    # mx.fast.rope takes one offset per leading row: make each token its own row of length 1.
    out = mx.fast.rope(
        x.reshape(t, h, 1, d),
        rope.dims,
        traditional=rope.traditional,
        base=rope.base,
        scale=rope.scale,
        offset=positions,
    )
    return out.reshape(t, h, d)


class ReferenceRopeScatter:
    """RoPE on q and k plus the pool write, as MLX ops (``mx.fast.rope`` and a scatter).

    Every RoPE variant :class:`kv_protocol.RopeConfig` can describe is supported. Pools are
    head-major ``(n_kv_heads, num_slots, head_dim)``; a negative slot rotates but writes
    nothing (the pool keeps its exact bits). ``slots`` are read on the host (see
    :func:`plan_scatter`): a slot past the pool end or two tokens writing one slot raise
    before any work. The plan is kept for the last few ``slots`` array objects, so the
    layers of one decode step (which share one ``slots`` object per sub-pool) read and check
    it once; pass a new array rather than writing into one already passed.
    ``validate=True`` also checks that positions are >= 0 (a device sync).
    """

    def __init__(self, *, validate: bool = False) -> None:
        self._validate = validate
        self._plans: IdentityMemo[ScatterPlan] = IdentityMemo()

    @property
    def name(self) -> str:
        """Backend name: ``reference``."""
        return "reference"

    def supports(self, rope: RopeConfig) -> bool:
        """True for every :class:`kv_protocol.RopeConfig`."""
        return isinstance(rope, RopeConfig)

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
        """Return ``(q_rot, k_rot, k_pool_new, v_pool_new)``; see the class docstring."""
        check_rope_scatter_args(q, k, v, positions, slots, k_pool, v_pool, rope)
        plan = memoized_plan_scatter(self._plans, slots, k_pool.shape[1])
        if self._validate:
            check_rope_scatter_values(positions)
        q_rot = rope_tokens(q, positions, rope)
        k_rot = rope_tokens(k, positions, rope)
        k_new = scatter_token_rows(k_pool, plan, k_rot)
        v_new = scatter_token_rows(v_pool, plan, v)
        return q_rot, k_rot, k_new, v_new
