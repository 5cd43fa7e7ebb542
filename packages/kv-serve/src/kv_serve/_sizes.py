"""Defaults shared by ``build_engine`` and the command line, importable without mlx."""

from __future__ import annotations

__all__ = ["DEFAULT_KV_SLAB_BYTES", "DRAFT_SPECULATIVE_TOKENS", "NGRAM_SPECULATIVE_TOKENS"]

#: How much a sub-pool's buffers grow at a time by default (``build_pool``'s
#: ``kv_slab_bytes``, ``--kv-slab-mib``): the pool's memory follows its load in steps of
#: about this size.
DEFAULT_KV_SLAB_BYTES = 16 * 2**20

#: The longest prompt-lookup proposal unless told otherwise (``build_engine``'s
#: ``num_speculative_tokens``, ``--num-speculative-tokens`` with ``--speculative ngram``). A
#: lookup costs nothing to make and each request's length adapts down to what is accepted.
#: On Gemma 3 270M (2-core x86_64, ``tools/bench_spec.py``) proposals of up to 8 against 4
#: copy a passage 3.32x / 2.17x / 1.33x as fast as plain decoding at batch 1 / 4 / 16 against
#: 2.45x / 1.95x / 1.20x, with open-ended text at 1.19x / 0.99x / 1.01x against 1.33x / 0.99x /
#: 0.97x.
NGRAM_SPECULATIVE_TOKENS = 8

#: The longest draft-model proposal unless told otherwise (``draft_speculation``'s
#: ``num_tokens``, ``--num-speculative-tokens`` with ``--draft-model``): every proposed token
#: costs a decode step of the draft.
DRAFT_SPECULATIVE_TOKENS = 4
