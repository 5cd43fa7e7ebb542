"""mlx-lm's own caches holding what a quantized pool's pages give back: the quantized oracle."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kv_protocol import KVQuantization

__all__ = ["stored_kv_caches"]


def stored_kv_caches(
    model: Any, quantization: KVQuantization | Mapping[str, KVQuantization | None] | None
) -> list[Any]:
    """``make_prompt_cache(model)`` whose caches store ``dequantize(quantize(kv))`` of each write.

    ``quantization`` is one :class:`kv_protocol.KVQuantization` for every layer, or a mapping
    from layer kind (``"full"``, ``"sliding"``: a rotating cache) to one or ``None`` (that
    kind stores K/V as given). A quantized pool's pages hold exactly those values (each row
    is quantized on its own), so a model on these caches attends over what the pool returns,
    sliding layers included, which mlx-lm's own quantized cache cannot do.
    """
    caches = make_prompt_cache(model)
    for cache in caches:
        kind = "sliding" if hasattr(cache, "max_size") else "full"
        quant = quantization.get(kind) if isinstance(quantization, Mapping) else quantization
        if quant is None:
            continue
        base_update = type(cache).update_and_fetch

        def update_and_fetch(
            keys: mx.array,
            values: mx.array,
            cache: Any = cache,
            base: Any = base_update,
            quant: KVQuantization = quant,
        ) -> Any:
            return base(
                cache, quant.quantize(keys).dequantize(), quant.quantize(values).dequantize()
            )

        cache.update_and_fetch = update_and_fetch
    return caches
