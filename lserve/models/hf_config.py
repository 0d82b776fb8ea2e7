"""A transformers config -> our :class:`~lserve.config.ModelConfig`, for the families we run.

Every config field that changes the forward is either carried over (and implemented by
:class:`lserve.models.llama.LlamaModel`) or refused here with one message: a checkpoint never
loads into a silently different forward.
"""

from __future__ import annotations

from lserve.config import ARCHITECTURES, HIDDEN_ACTS, ROPE_TYPES, ConfigError, ModelConfig

#: Hugging Face class name -> our architecture (``ModelConfig.architecture``).
HF_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
              "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
SUPPORTED = ", ".join(HF_CLASSES)


def architecture_of(hf) -> str:
    """Our architecture name for a transformers config (its ``architectures`` list, else its
    ``model_type``); ConfigError naming the supported ones otherwise."""
    classes = list(getattr(hf, "architectures", None) or [])
    if classes:
        known = [HF_CLASSES[c] for c in classes if c in HF_CLASSES]
        if not known:
            raise ConfigError(f"unsupported architecture {classes[0]!r}: LServe runs {SUPPORTED}")
        return known[0]
    kind = (getattr(hf, "model_type", "") or "llama").lower()
    if kind not in ARCHITECTURES:
        raise ConfigError(f"unsupported architecture (model_type {kind!r}): LServe runs {SUPPORTED}")
    return kind


def _sliding_window(hf, arch: str) -> int | None:
    """The window some layers attend within, or None when every layer attends to the whole past."""
    types = getattr(hf, "layer_types", None)
    if arch in ("qwen2", "qwen3"):
        if types is not None:
            return getattr(hf, "sliding_window", None) if "sliding_attention" in types else None
        return getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", False) else None
    if types is not None and "sliding_attention" in types:
        return getattr(hf, "sliding_window", None) or 0
    return getattr(hf, "sliding_window", None) if arch == "mistral" else None


def _refuse(name: str, what: str, hint: str = "") -> None:
    raise ConfigError(f"model {name!r}: {what} is not supported (LServe would compute a different forward)"
                      + (f"; {hint}" if hint else ""))


def hf_config(cfg: ModelConfig, **overrides):
    """The transformers config of our ``cfg`` (the inverse of :func:`config_from_hf`), e.g. to run
    transformers' own model on a preset's weights as a baseline."""
    import transformers

    cls = {v: k for k, v in HF_CLASSES.items()}[cfg.architecture].replace("ForCausalLM", "Config")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
              max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope,
              tie_word_embeddings=cfg.tie_word_embeddings, hidden_act=cfg.hidden_act)
    if cfg.architecture in ("llama", "qwen3"):
        kw["attention_bias"] = cfg.o_bias
    if cfg.architecture == "llama":
        kw["mlp_bias"] = cfg.mlp_bias
    if cfg.architecture == "mistral":
        kw["sliding_window"] = None
    return getattr(transformers, cls)(**{**kw, **overrides})


def config_from_hf(hf, name: str) -> ModelConfig:
    """Translate a transformers config (v4 or v5 rope fields) of a supported family into ours.

    Raises
    ------
    ConfigError
        For an unsupported architecture, or a field whose forward LServe does not implement
        (a sliding window, partial rotary embeddings, another activation, longrope...).
    """
    arch = architecture_of(hf)
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", None) or 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        _refuse(name, f"rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    partial = float(rope.pop("partial_rotary_factor", None) or getattr(hf, "partial_rotary_factor", None) or 1.0)
    if partial != 1.0:
        _refuse(name, f"partial_rotary_factor {partial}")
    scaling = rope if kind != "default" else None
    window = _sliding_window(hf, arch)
    if window is not None:
        _refuse(name, f"sliding-window attention (window {window})",
                "every attention path reads the whole past; serve a checkpoint without sliding_window")
    act = getattr(hf, "hidden_act", "silu")
    act = "silu" if act == "swish" else act
    if act not in HIDDEN_ACTS:
        _refuse(name, f"hidden_act {act!r} (supported: {', '.join(HIDDEN_ACTS)})")
    if int(getattr(hf, "pretraining_tp", 1) or 1) != 1:
        _refuse(name, f"pretraining_tp {hf.pretraining_tp}")
    if getattr(hf, "dual_chunk_attention_config", None):
        _refuse(name, "dual chunk attention")
    attn_bias = bool(getattr(hf, "attention_bias", False))
    eos = hf.eos_token_id
    eos = [] if eos is None else (eos if isinstance(eos, list) else [eos])
    return ModelConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or 0, rms_norm_eps=hf.rms_norm_eps, rope_theta=theta,
        rope_scaling=dict(scaling) if scaling else None, max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        bos_token_id=hf.bos_token_id, eos_token_ids=tuple(eos), name=name, architecture=arch,
        # Qwen2 always has q/k/v biases (and none on o_proj); elsewhere attention_bias covers q/k/v/o.
        qkv_bias=arch == "qwen2" or attn_bias, o_bias=arch != "qwen2" and attn_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)), qk_norm=arch == "qwen3", hidden_act=act)
