"""Defaults shared by ``build_engine`` and the command line, importable without mlx."""

from __future__ import annotations

__all__ = ["DEFAULT_KV_SLAB_BYTES"]

#: How much a sub-pool's buffers grow at a time by default (``build_pool``'s
#: ``kv_slab_bytes``, ``--kv-slab-mib``): the pool's memory follows its load in steps of
#: about this size.
DEFAULT_KV_SLAB_BYTES = 16 * 2**20
