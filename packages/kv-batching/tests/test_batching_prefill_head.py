"""Prefill projects only the last position onto the vocabulary, where that is provably exact."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from batching_fakes import FakeKernels, fake_prefill_cache

from kv_batching import DecodeEngine, last_position_forward
from kv_protocol import layout_from_model
from kv_testing import ARCHITECTURES, ReferenceKVPool, build_tiny_model, mlx_lm_greedy

VOCAB = 64


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_split_is_exact_or_refused(arch: str) -> None:
    model = build_tiny_model(arch, window=8, num_layers=4, vocab_size=VOCAB)
    forward = last_position_forward(model, VOCAB)
    if arch == "cohere2":
        # cohere2 scales its logits after the head: the probe must see the difference.
        assert forward is None
        return
    assert forward is not None
    tokens = mx.array([[5, 9, 2, 33, 17, 8, 1]])
    full = model(tokens)[:, -1:, :]
    assert mx.allclose(forward(tokens, None), full, atol=1e-5).item()  # type: ignore[arg-type]


def test_a_model_that_post_processes_logits_keeps_the_full_path() -> None:
    model = build_tiny_model("llama", window=8, num_layers=2, vocab_size=VOCAB)
    original = type(model)

    def capped(self: Any, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        return 3.0 * mx.tanh(original.__call__(self, inputs, cache=cache, **kwargs) / 3.0)

    model.__class__ = type("Capped", (original,), {"__call__": capped})
    assert last_position_forward(model, VOCAB) is None


@pytest.mark.parametrize("last_only", [True, False])
def test_engine_tokens_do_not_depend_on_the_prefill_head(last_only: bool) -> None:
    model: nn.Module = build_tiny_model("gemma3_text", window=4, num_layers=4, vocab_size=VOCAB)
    prompts = [[(3 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((3, 11, 26))]
    want = [mlx_lm_greedy(model, p, 8) for p in prompts]
    pool = ReferenceKVPool(layout_from_model(model), num_pages=64, page_size=2)
    engine = DecodeEngine(
        model,
        pool,
        FakeKernels(),
        fake_prefill_cache,
        prefill_chunk=5,
        prefill_last_logits=last_only,
    )
    assert (engine._prefill_forward is not None) == last_only
    ids = [engine.submit(p, 8) for p in prompts]
    out = engine.run()
    assert [out[i] for i in ids] == want
