from __future__ import annotations

import math
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from batching_fakes import CountingPrefillAttention, FakeKernels, FakeRope, decode_step
from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kv_batching import is_patched, patch_model_attention, unpatch_model_attention
from kv_batching._attention_spec import NormMode
from kv_batching._batched_attention import BatchedAttention
from kv_batching._layer_cache import batched_layer_caches
from kv_batching._patching import wrapped_attention
from kv_protocol import (
    CacheLayout,
    LayerKind,
    LayerSpec,
    UnsupportedModelError,
    layout_from_model,
)
from kv_testing import ReferenceKVPool, build_tiny_model

ARCHS = ("gpt_oss", "gemma3_text", "cohere2", "olmo3")


@cache
def tiny(arch: str) -> Any:
    return build_tiny_model(arch, window=6, num_layers=4, vocab_size=64)


def fresh(arch: str) -> Any:
    return build_tiny_model(arch, window=6, num_layers=4, vocab_size=64)


# ---------------------------------------------------------------- toy attention modules


class ToyAttention(nn.Module):
    """A plain mlx-lm style attention with switchable quirks."""

    def __init__(
        self,
        *,
        scale_attr: str | None = "scale",
        heads: bool = True,
        head_dim_attr: bool = True,
        key_factor: float = 1.0,
        sliding: bool | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.q_proj = nn.Linear(16, 4 * 4, bias=False)
        self.k_proj = nn.Linear(16, 2 * 4, bias=False)
        self.v_proj = nn.Linear(16, 2 * 4, bias=False)
        self.o_proj = nn.Linear(16, 16, bias=False)
        self.rope = nn.RoPE(4)
        if scale_attr is not None:
            setattr(self, scale_attr, 0.5)
        if heads:
            self.n_heads, self.n_kv_heads = 4, 2
        if head_dim_attr:
            self.head_dim = 4
        if sliding is not None:
            self.is_sliding = sliding
        self._key_factor = key_factor

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, 4, 4).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(batch, length, 2, 4).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(batch, length, 2, 4).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset=offset)
        k = self.rope(k, offset=offset) * self._key_factor
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache, 0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.self_attn = attn


class Toy(nn.Module):
    def __init__(self, *attns: nn.Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.layers = [Block(a) for a in attns]


# ---------------------------------------------------------------- patching


@pytest.mark.parametrize("arch", ARCHS)
def test_patch_is_idempotent_and_reversible(arch: str) -> None:
    model = fresh(arch)
    originals = [layer.self_attn for layer in model.layers]
    assert patch_model_attention(model) == 4
    assert is_patched(model)
    wrappers = [layer.self_attn for layer in model.layers]
    assert all(isinstance(w, BatchedAttention) for w in wrappers)
    assert patch_model_attention(model) == 4
    assert [layer.self_attn for layer in model.layers] == wrappers
    # Reads fall through to the original module: the layout is unchanged by patching.
    assert layout_from_model(model) == layout_from_model(fresh(arch))
    assert unpatch_model_attention(model) == 4
    assert not is_patched(model)
    assert all(
        a is b for a, b in zip((ly.self_attn for ly in model.layers), originals, strict=True)
    )
    assert unpatch_model_attention(model) == 0


def test_probe_learns_each_architectures_attention() -> None:
    specs = {}
    for arch in ARCHS:
        model = fresh(arch)
        patch_model_attention(model)
        specs[arch] = [layer.self_attn.spec for layer in model.layers]
    assert all(s.has_sinks for s in specs["gpt_oss"])
    assert all(
        s.q_norm is NormMode.PER_HEAD and s.k_norm is NormMode.PER_HEAD
        for s in specs["gemma3_text"]
    )
    assert all(s.q_norm is NormMode.FLAT and s.k_norm is NormMode.FLAT for s in specs["olmo3"])
    # cohere2's full layer (3) has a rope child it never applies.
    assert [s.uses_rope for s in specs["cohere2"]] == [True, True, True, False]
    assert specs["cohere2"][3].rope_config is None
    assert [s.sliding for s in specs["gpt_oss"]] == [True, False, True, False]
    assert specs["gpt_oss"][0].scale == pytest.approx(1 / math.sqrt(16))


@pytest.mark.parametrize("arch", ARCHS)
def test_outside_batched_decode_the_original_module_runs(arch: str) -> None:
    plain = fresh(arch)
    patched = fresh(arch)
    patch_model_attention(patched)
    tokens = mx.array([[1, 5, 9, 2, 7, 3, 11, 4, 8, 6]])
    c1, c2 = make_prompt_cache(plain), make_prompt_cache(patched)
    assert mx.array_equal(plain(tokens, cache=c1), patched(tokens, cache=c2))
    step = mx.array([[12]])
    assert mx.array_equal(plain(step, cache=c1), patched(step, cache=c2))
    assert mx.array_equal(plain(tokens), patched(tokens))


class QuantizedLike(KVCache):
    """A plain cache that says it is quantized (``bits``): modules take their quantized path."""

    bits = 8


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_attention_reproduces_the_modules_prefill(arch: str) -> None:
    """Chunks through the wrappers' prefill (RoPE offsets, sliding masks, sinks) == the module's."""
    plain = fresh(arch)
    patched = fresh(arch)
    patch_model_attention(patched)
    kernel = CountingPrefillAttention()
    wrappers = wrapped_attention(patched)
    assert len(wrappers) == 4
    for wrapper in wrappers:
        wrapper.prefill_attention = kernel
    c1, c2 = make_prompt_cache(plain), make_prompt_cache(patched)
    for chunk in ([1, 5, 9, 2, 7, 3, 11, 4], [8, 6, 10, 13, 2], [12]):
        tokens = mx.array([chunk])
        want, got = plain(tokens, cache=c1), patched(tokens, cache=c2)
        assert mx.allclose(want, got, atol=1e-5, rtol=1e-5)
    assert kernel.calls == 4 * 3
    for a, b in zip(c1, c2, strict=True):
        assert a.offset == b.offset
        assert mx.allclose(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        assert mx.allclose(a.values, b.values, atol=1e-5, rtol=1e-5)
    # A call of another form than (x, mask, cache) goes to the module's own forward (which
    # here refuses the extra argument).
    attn = wrappers[0]
    x = mx.random.normal((1, 3, attn.inner.q_proj.weight.shape[1]))
    before = kernel.calls
    with pytest.raises(TypeError):
        attn(x, None, make_prompt_cache(patched)[0], "extra")
    assert kernel.calls == before
    # mlx-lm's quantized caches (they have `bits`) hand back packed tuples that only the
    # module's own forward reads.
    with pytest.raises((ValueError, AttributeError)):  # the module's own quantized path
        mx.eval(attn(x, "causal", QuantizedLike()))  # type: ignore[no-untyped-call]
    assert kernel.calls == before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale_attr": None}, "attention scale"),
        ({"heads": False, "head_dim_attr": False}, "head counts"),
        ({"key_factor": 2.0}, "cannot reproduce the keys"),
    ],
)
def test_unservable_attention_is_refused_and_nothing_is_patched(
    kwargs: dict[str, Any], match: str
) -> None:
    model = Toy(ToyAttention(), ToyAttention(**kwargs))
    layout = CacheLayout(
        [LayerSpec(layer_id=i, kind=LayerKind.FULL, n_kv_heads=2, head_dim=4) for i in (0, 1)]
    )
    with pytest.raises(UnsupportedModelError, match=match):
        patch_model_attention(model, layout)
    assert not any(isinstance(b.self_attn, BatchedAttention) for b in model.layers)


def test_sm_scale_and_head_counts_from_projection_widths_are_accepted() -> None:
    model = Toy(ToyAttention(scale_attr="sm_scale", heads=False))
    layout = CacheLayout([LayerSpec(layer_id=0, kind=LayerKind.FULL, n_kv_heads=2, head_dim=4)])
    assert patch_model_attention(model, layout) == 1
    spec = model.layers[0].self_attn.spec
    assert (spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.scale) == (4, 2, 4, 0.5)


def test_sliding_flag_without_window_is_refused() -> None:
    model = Toy(ToyAttention(sliding=True), ToyAttention(sliding=False))
    with pytest.raises(UnsupportedModelError, match="window"):
        patch_model_attention(model)


# ---------------------------------------------------------------- the batched path


def dense_reference(
    inner: Any, x: mx.array, history: tuple[mx.array, mx.array], window: int | None
) -> mx.array:
    """The unpatched module on one request: a plain mlx-lm KVCache preloaded with history."""
    kv = KVCache()
    s = history[0].shape[2]
    if s:
        kv.update_and_fetch(*history)
    mask = create_causal_mask(1, s, window_size=window) if window is not None else None
    out: mx.array = inner(x, mask=mask, cache=kv)
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decode_equals_each_request_alone(arch: str, fused: bool) -> None:
    model = fresh(arch)
    patch_model_attention(model)
    layout = layout_from_model(model)
    pool = ReferenceKVPool(layout, num_pages=64, page_size=3)
    rope = FakeRope() if fused else None
    kernels = FakeKernels(rope=rope)
    seq_lens = [0, 2, 5, 6, 11, 17]  # window 6: short, at and well past the window
    rng = mx.random.key(3)
    histories: dict[tuple[int, int], tuple[mx.array, mx.array]] = {}
    for rid, s in enumerate(seq_lens):
        pool.add_request(rid)
        pool.reserve(rid, s)
        for layer_id in layout.attention_layer_ids:
            geo = layout.geometry(layer_id)
            rng, k1, k2 = mx.random.split(rng, 3)
            k = mx.random.normal((1, geo.n_kv_heads, s, geo.head_dim), key=k1)
            v = mx.random.normal((1, geo.n_kv_heads, s, geo.head_dim), key=k2)
            histories[rid, layer_id] = (k, v)
            window = layout.window(layer_id)
            lo = 0 if window is None else max(0, s - window + 1)
            slots = pool.token_slots(rid, layer_id, lo, s)
            pool.set_kv(
                layer_id, slots, k[0, :, lo:].transpose(1, 0, 2), v[0, :, lo:].transpose(1, 0, 2)
            )
    set_before = pool.set_kv_calls
    ids = list(range(len(seq_lens)))
    step = decode_step(pool, ids, kernels, model=model)
    x = mx.random.normal((len(seq_lens), 1, 64), key=mx.random.key(9))
    attention = kernels.attention
    for layer_id, layer in enumerate(model.layers):
        wrapper = layer.self_attn
        got = wrapper.batched_decode(x, step.layer(layer_id))
        window = layout.window(layer_id)
        for b, rid in enumerate(ids):
            want = dense_reference(wrapper.inner, x[b : b + 1], histories[rid, layer_id], window)
            assert mx.allclose(got[b : b + 1], want, atol=1e-5, rtol=1e-4), (layer_id, rid)
    # One pool write and one attention call per layer for the whole batch: no per-request loop.
    assert attention.calls == 4
    assert attention.windows == [layout.window(i) for i in range(4)]
    fused_layers = [i for i in layout.full_layer_ids if model.layers[i].self_attn.spec.uses_rope]
    if fused:
        assert rope is not None and rope.calls == len(fused_layers)
        assert pool.replace_calls == len(fused_layers)
        assert pool.set_kv_calls - set_before == 4 - len(fused_layers)
    else:
        assert pool.replace_calls == 0 and pool.set_kv_calls - set_before == 4


def test_kernel_refusing_the_rope_variant_falls_back_to_unfused() -> None:
    model = fresh("gpt_oss")
    patch_model_attention(model)
    layout = layout_from_model(model)
    pool = ReferenceKVPool(layout, num_pages=16, page_size=4)
    pool.add_request(0)
    pool.reserve(0, 3)
    rope = FakeRope(refuse=True)
    step = decode_step(pool, [0], FakeKernels(rope=rope), model=model)
    assert [step.layer(i).route for i in range(4)] == ["unfused"] * 4
    model(mx.array([[3]]), cache=batched_layer_caches(step))
    assert rope.calls == 0 and pool.replace_calls == 0 and pool.set_kv_calls == 4
    assert all(layout.kind(i) in (LayerKind.FULL, LayerKind.SLIDING) for i in range(4))


def test_only_full_layers_on_plain_pages_take_the_fused_route() -> None:
    model = fresh("gpt_oss")
    patch_model_attention(model)
    pool = ReferenceKVPool(layout_from_model(model), num_pages=8, page_size=4)
    pool.add_request(0)
    pool.reserve(0, 3)
    step = decode_step(pool, [0], FakeKernels(rope=FakeRope()), model=model)
    assert [step.layer(i).route for i in range(4)] == ["unfused", "fused", "unfused", "fused"]
    # Without a fused kernel every wrapped layer is unfused.
    plain = decode_step(pool, [0], FakeKernels(), model=model)
    assert [plain.layer(i).route for i in range(4)] == ["unfused"] * 4
