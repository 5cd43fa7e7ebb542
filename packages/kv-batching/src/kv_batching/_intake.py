"""Requests in: every argument of a submission checked, its sequences built and linked.

Nothing here touches the engine: a refused submission raises ``RequestStateError`` (a
``ValueError``) before any request exists, so nothing is queued and no id is used.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx

from kv_protocol import KVLifetime, KVPool, RequestStateError, check_int, check_int_sequence

from ._requests import EngineRequest
from ._sampling_params import SamplingParams

__all__ = ["UNSET", "new_requests", "short_sampling"]

#: A keyword argument not given (``None`` is a value the checks refuse or take).
UNSET: Any = object()


def short_sampling(
    sampling: SamplingParams | None, temperature: float, top_p: float, seed: int | None
) -> SamplingParams:
    """The request's params from ``sampling`` or the short keyword form (not both)."""
    given = [
        name
        for name, value in (("temperature", temperature), ("top_p", top_p), ("seed", seed))
        if value is not UNSET
    ]
    if sampling is not None:
        if given:
            raise RequestStateError(
                f"give sampling= or {', '.join(given)}, not both (they set the same fields)"
            )
        return sampling
    return SamplingParams(
        temperature=0.0 if temperature is UNSET else temperature,
        top_p=1.0 if top_p is UNSET else top_p,
        seed=None if seed is UNSET else seed,
    )


def new_requests(
    first_id: int,
    prompt_tokens: Iterable[int] | mx.array,
    max_tokens: int,
    n: int,
    *,
    sampling: SamplingParams | None,
    stop_tokens: Iterable[int] | mx.array,
    vocab_size: int,
    pool: KVPool,
) -> list[EngineRequest]:
    """The ``n`` sequences of one prompt, ids from ``first_id``, the first one leading.

    Every argument is checked (token ids in ``0 .. vocab_size - 1``, the logit bias's too;
    ``n`` sequences that could never be in ``pool`` together are refused). Sequence ``i``
    samples with seed ``(sampling.seed + i) % 2**64`` when the params have a seed.
    """
    params = sampling if sampling is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise RequestStateError(f"sampling must be a SamplingParams, got {params!r}")
    n = check_int(n, "n", minimum=1)
    top = vocab_size - 1
    prompt = check_int_sequence(
        _host_tokens(prompt_tokens, "prompt_tokens"), "prompt_tokens", minimum=0, maximum=top
    )
    if not prompt:
        raise RequestStateError("prompt_tokens must hold at least one token")
    max_tokens = check_int(max_tokens, "max_tokens", minimum=1)
    stops = check_int_sequence(
        _host_tokens(stop_tokens, "stop_tokens"), "stop_tokens", minimum=0, maximum=top
    )
    bad = [t for t in params.logit_bias if t > top]
    if bad:
        raise RequestStateError(
            f"logit_bias names token ids {bad} past the vocabulary (ids are 0..{top})"
        )
    if n > 1:
        _check_sequences_fit(pool, len(prompt), max_tokens, n)
    requests = []
    for i in range(n):
        seed = None if params.seed is None else (params.seed + i) % 2**64
        requests.append(
            EngineRequest(first_id + i, prompt, max_tokens, params, frozenset(stops), seed)
        )
    leader, followers = requests[0], requests[1:]
    for follower in followers:
        follower.leader = leader
    leader.followers = followers
    return requests


def _check_sequences_fit(pool: KVPool, prompt_len: int, max_tokens: int, n: int) -> None:
    """Refuse ``n`` sequences that could never be in the pool together."""
    total = prompt_len + max_tokens
    for sub in pool.memory_report().sub_pools:
        lifetime = KVLifetime(sub.window)
        own = lifetime.peak_pages(total, sub.page_size)
        # Full pages of the prompt are shared by every sequence of a full sub-pool.
        shared = prompt_len // sub.page_size if sub.window is None else 0
        need = own + (n - 1) * max(own - shared, 0)
        if need > sub.num_pages - 1:
            raise RequestStateError(
                f"n={n} sequences of {total} tokens need at least {need} pages of sub-pool "
                f"{sub.name!r} together, which holds {sub.num_pages - 1}; ask for fewer "
                "sequences or tokens"
            )


def _host_tokens(tokens: object, what: str) -> object:
    """Token ids as host values: an ``mx.array`` of an integer dtype becomes a list."""
    if isinstance(tokens, mx.array):
        if not mx.issubdtype(tokens.dtype, mx.integer) or tokens.ndim > 1:
            raise RequestStateError(
                f"{what} must be a 1-D integer array or a sequence of ints, got an array of "
                f"shape {tuple(tokens.shape)} and dtype {tokens.dtype}"
            )
        return tokens.reshape(-1).tolist()
    return tokens
