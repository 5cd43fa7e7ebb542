"""A zoo of tiny random-weight instances of mlx-lm's hybrid architectures.

One entry per mlx-lm model module whose ``make_cache()`` yields sliding-window layers
(``RotatingKVCache``) or recurrent state layers (``ArraysCache``), plus a few plain
full-attention ones. Each entry is a hand-written tiny configuration (fp32, four layers,
hidden size 64, vocab 128, sliding windows of 8 so that short prompts cross them) that is
passed through the module's own ``ModelArgs.from_dict``; nothing is downloaded. Used by the
architecture-coverage test and ``tools.support_table``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

__all__ = ["ZOO", "ZOO_UNBUILDABLE", "ZooEntry", "build_zoo_model", "zoo_config"]

#: The sliding window every zoo config uses (short prompts cross it).
ZOO_WINDOW = 8
_LAYERS = 4
_VOCAB = 128

#: Fields most ``ModelArgs`` share; ``from_dict`` keeps only those a module declares.
_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": _LAYERS,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": _VOCAB,
    "rms_norm_eps": 1e-6,
    "norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "sliding_window": ZOO_WINDOW,
    "rope_scaling": None,
}

_SWA = "sliding_attention"
_FULL = "full_attention"
#: Two sliding layers then a full one, repeated: every kind appears in four layers.
_SWA_TYPES = [_SWA, _FULL, _SWA, _FULL]
_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "num_shared_experts": 1,
}


@dataclass(frozen=True, kw_only=True)
class ZooEntry:
    """One tiny architecture: its mlx-lm module and the config overrides that make it tiny.

    ``config`` is merged over the common tiny fields and handed to the module's
    ``ModelArgs.from_dict``; ``text_config`` wraps it as ``{"text_config": ...}`` for the
    multimodal-style modules whose ``ModelArgs`` holds the text model's arguments.
    """

    module: str
    config: dict[str, Any] = field(default_factory=dict)
    text_config: bool = False
    note: str = ""


def _entry(module: str, *, text_config: bool = False, note: str = "", **config: Any) -> ZooEntry:
    return ZooEntry(module=module, config=config, text_config=text_config, note=note)


#: Every architecture of the zoo, by name (the mlx-lm module name, or a variant of it).
ZOO: dict[str, ZooEntry] = {
    # ---------------------------------------------------------------- sliding / full hybrids
    "afmoe": _entry(
        "afmoe", layer_types=_SWA_TYPES, num_dense_layers=1, n_group=1, topk_group=1, **_MOE
    ),
    "baichuan_m1": _entry(
        "baichuan_m1", sliding_window_layers=[0, 2], conv_window=2, num_swa_attention_heads=4
    ),
    "cohere2": _entry("cohere2", sliding_window_pattern=2),
    "exaone4": _entry("exaone4", sliding_window_pattern="LG"),
    "exaone_moe": _entry(
        "exaone_moe", layer_types=_SWA_TYPES, is_moe_layer=[False, True, True, True], **_MOE
    ),
    "gear": _entry(
        "gear",
        layer_types=[_SWA, "conv_mixer", _FULL, _SWA],
        query_pre_attn_scalar=16,
    ),
    "gemma3_text": _entry("gemma3_text", sliding_window_pattern=2, query_pre_attn_scalar=16),
    "gemma3n": _entry(
        "gemma3n",
        text_config=True,
        model_type="gemma3n_text",
        num_kv_shared_layers=0,
        vocab_size_per_layer_input=_VOCAB,
        rope_local_base_freq=10000.0,
        final_logit_softcapping=30.0,
        layer_types=_SWA_TYPES,
        activation_sparsity_pattern=[0.0] * _LAYERS,
        hidden_size_per_layer_input=8,
        altup_num_inputs=2,
        altup_coef_clip=120.0,
        altup_correct_scale=True,
        altup_active_idx=0,
        laurel_rank=8,
    ),
    "gemma4_text": _entry(
        "gemma4_text",
        num_kv_shared_layers=0,
        global_head_dim=16,
        vocab_size_per_layer_input=_VOCAB,
        hidden_size_per_layer_input=8,
        layer_types=_SWA_TYPES,
        use_double_wide_mlp=False,
    ),
    "gpt_oss": _entry(
        "gpt_oss", layer_types=_SWA_TYPES, num_local_experts=4, num_experts_per_tok=2
    ),
    "iquestloopcoder": _entry("iquestloopcoder", loop_num=2, loop_window_size=ZOO_WINDOW),
    "laguna": _entry(
        "laguna",
        layer_types=_SWA_TYPES,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        shared_expert_intermediate_size=32,
        **_MOE,
    ),
    "llama": _entry("llama", layer_types=_SWA_TYPES),
    "mellum": _entry(
        "mellum",
        layer_types=_SWA_TYPES,
        norm_topk_prob=True,
        rope_parameters={_SWA: {"rope_theta": 10000.0}, _FULL: {"rope_theta": 50000.0}},
        **_MOE,
    ),
    "mimo_v2_flash": _entry(
        "mimo_v2_flash",
        hybrid_layer_pattern=[1, 0, 1, 0],
        moe_layer_freq=[0, 1, 1, 1],
        add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False,
        sliding_window_size=ZOO_WINDOW,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        routed_scaling_factor=1.0,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        n_group=1,
        topk_group=1,
        layernorm_epsilon=1e-6,
        swa_rope_theta=10000.0,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        # As in the released MiMo-V2-Flash: values narrower than keys.
        v_head_dim=8,
        swa_head_dim=16,
        swa_v_head_dim=8,
        partial_rotary_factor=1.0,
    ),
    "ministral3": _entry(
        "ministral3",
        layer_types=_SWA_TYPES,
        # llama-4 attention scaling grows with the position: every 4 tokens here.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.5,
            "original_max_position_embeddings": 4,
        },
    ),
    "muse_glimmer": _entry("muse_glimmer", layer_types=_SWA_TYPES),
    "muse_spark": _entry(
        "muse_spark",
        text_config=True,
        post_norm_eps=1e-8,
        rope_parameters={"rope_theta": 10000.0},
        layer_rope_theta=[10000.0] * _LAYERS,
        layer_types=_SWA_TYPES,
        final_logit_softcapping=20.0,
        output_multiplier=0.2,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_hidden_size=32,
        moe_intermediate_size=32,
    ),
    "olmo3": _entry("olmo3", layer_types=_SWA_TYPES),
    "plamo3": _entry(
        "plamo3", window_size=ZOO_WINDOW, sliding_window_pattern=2, rope_local_theta=10000.0
    ),
    "recurrent_gemma": _entry(
        "recurrent_gemma",
        conv1d_width=4,
        logits_soft_cap=30.0,
        attention_window_size=ZOO_WINDOW,
        block_types=["recurrent", "attention", "recurrent", "attention"],
        num_key_value_heads=1,
    ),
    "spark2_5": _entry(
        "spark2_5",
        layer_types=_SWA_TYPES,
        rope_parameters={_SWA: {"rope_theta": 10000.0}, _FULL: {"rope_theta": 50000.0}},
    ),
    "step3p5": _entry(
        "step3p5",
        num_attention_groups=2,
        layer_types=_SWA_TYPES,
        moe_num_experts=4,
        moe_top_k=2,
        moe_intermediate_size=32,
        share_expert_dim=32,
        moe_layers_enum="1,2,3",
    ),
    # ---------------------------------------------------------------- recurrent / linear hybrids
    "bailing_hybrid": _entry(
        "bailing_hybrid",
        first_k_dense_replace=1,
        layer_group_size=2,
        group_norm_size=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        **_MOE,
    ),
    "bailing_moe_linear": _entry(
        "bailing_moe_linear",
        first_k_dense_replace=1,
        layer_group_size=2,
        group_norm_size=1,
        norm_topk_prob=True,
        **_MOE,
    ),
    "bailing_moe_v3": _entry(
        "bailing_moe_v3",
        moe_shared_expert_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        layer_group_size=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        **_MOE,
    ),
    "falcon_h1": _entry(
        "falcon_h1",
        mamba_d_conv=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_d_state=8,
        mamba_n_heads=4,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        mlp_expansion_factor=2,
    ),
    "granitemoehybrid": _entry(
        "granitemoehybrid",
        embedding_multiplier=1.0,
        attention_multiplier=0.25,
        logits_scaling=1.0,
        residual_multiplier=1.0,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_proj_bias=False,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_n_groups=1,
        mamba_conv_bias=True,
        shared_intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "jamba": _entry(
        "jamba",
        attn_layer_offset=1,
        attn_layer_period=2,
        expert_layer_offset=1,
        expert_layer_period=2,
        mamba_d_conv=4,
        mamba_d_state=8,
        mamba_expand=2,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "kimi_k3": _entry(
        "kimi_k3",
        text_config=True,
        model_type="kimi_linear",
        linear_attn_config={
            "kda_layers": [1, 3],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
    "kimi_linear": _entry(
        "kimi_linear",
        linear_attn_config={
            "kda_layers": [1, 3],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        model_max_length=4096,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
    "lfm2": _entry(
        "lfm2",
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_ff_dim=128,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        layer_types=["conv", _FULL, "conv", _FULL],
    ),
    "lfm2_moe": _entry(
        "lfm2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        use_expert_bias=True,
        num_dense_layers=1,
        conv_bias=False,
        conv_L_cache=3,
        layer_types=["conv", _FULL, "conv", _FULL],
    ),
    "longcat_flash_ngram": _entry(
        "longcat_flash_ngram",
        ffn_hidden_size=128,
        moe_topk=2,
        expert_ffn_hidden_size=32,
        n_routed_experts=4,
        zero_expert_num=1,
        num_layers=2,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        routed_scaling_factor=1.0,
        mla_scale_q_lora=True,
        mla_scale_kv_lora=True,
        ngram_vocab_size_ratio=2,
    ),
    "mamba": _entry(
        "mamba",
        state_size=8,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=8,
    ),
    "mamba2": _entry(
        "mamba2",
        num_heads=8,
        head_dim=16,
        state_size=8,
        conv_kernel=4,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        time_step_limit=(0.0, float("inf")),
        time_step_rank=8,
    ),
    "nemotron_h": _entry(
        "nemotron_h",
        hybrid_override_pattern=["M", "*", "M", "-"],
        mamba_num_heads=4,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=8,
        conv_kernel=4,
        n_groups=1,
        mlp_bias=False,
        use_bias=False,
        use_conv_bias=True,
    ),
    "olmo_hybrid": _entry(
        "olmo_hybrid",
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=True,
        layer_types=["linear_attention", _FULL, "linear_attention", _FULL],
    ),
    "plamo2": _entry(
        "plamo2",
        hidden_size_per_head=16,
        attention_window_size=ZOO_WINDOW,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_num_heads=4,
        mamba_step=2,
        mamba_chunk_size=16,
    ),
    "qwen3_5": _entry(
        "qwen3_5",
        text_config=True,
        model_type="qwen3_5_text",
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        full_attention_interval=2,
        rope_parameters={
            "type": "default",
            "mrope_section": [2, 1, 1],
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    ),
    "qwen3_next": _entry(
        "qwen3_next",
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[],
        partial_rotary_factor=0.5,
        full_attention_interval=2,
        **_MOE,
    ),
    "rwkv7": _entry(
        "rwkv7",
        a_low_rank_dim=8,
        v_low_rank_dim=8,
        gate_low_rank_dim=8,
        decay_low_rank_dim=8,
    ),
    # ---------------------------------------------------------------- plain full attention
    "llama_full": _entry("llama", sliding_window=None, note="plain llama, every layer full"),
    "qwen3": _entry("qwen3"),
}

#: mlx-lm modules with sliding or state layers that the zoo cannot instantiate, and why.
ZOO_UNBUILDABLE: dict[str, str] = {}


def zoo_config(name: str) -> dict[str, Any]:
    """The dict handed to ``ModelArgs.from_dict`` for zoo architecture ``name``."""
    if name not in ZOO:
        raise KeyError(f"unknown zoo architecture {name!r}; expected one of {sorted(ZOO)}")
    entry = ZOO[name]
    config = {**_COMMON, "model_type": entry.module, **entry.config}
    if entry.text_config:
        return {"model_type": entry.module, "text_config": config}
    return config


def build_zoo_model(
    name: str, *, seed: int = 0, dtype: mx.Dtype = mx.float32, vocab_size: int | None = None
) -> nn.Module:
    """A tiny random-weight mlx-lm model of zoo architecture ``name`` (fp32 by default).

    ``vocab_size`` replaces the zoo's vocabulary (to pair the model with a tokenizer).

    Weights are drawn from N(0, 0.2^2) with ``seed``, so logits are spread enough that greedy
    tokens are not decided by rounding; ``nn.Module`` parameters that are not floating point
    (indices, masks) are kept as the module built them.
    """
    config = zoo_config(name)
    if vocab_size is not None:
        inner = config["text_config"] if ZOO[name].text_config else config
        inner["vocab_size"] = vocab_size
    module = importlib.import_module(f"mlx_lm.models.{ZOO[name].module}")
    mx.random.seed(seed)
    model: nn.Module = module.Model(module.ModelArgs.from_dict(config))
    params = tree_map(
        lambda p: (
            (mx.random.normal(p.shape) * 0.2).astype(dtype)
            if mx.issubdtype(p.dtype, mx.floating)
            else p
        ),
        model.parameters(),
    )
    model.update(params)
    mx.eval(model.parameters())
    return model
