"""Random-weight presets with the shapes of real models, for speed benchmarks (no download)."""

from __future__ import annotations

import torch

from lserve.config import ConfigError, ModelConfig

PRESETS: dict[str, dict] = {
    # Llama-3-8B: 32 layers, GQA 4 (32 query / 8 KV heads), head_dim 128.
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, rope_theta=500000.0, max_position_embeddings=262144),
    # Llama-2-7B: multi-head attention (32 KV heads).
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                      num_heads=32, num_kv_heads=32, rope_theta=10000.0, max_position_embeddings=262144),
    # Llama-3.1-Minitron-4B (width-pruned): 32 layers, 24 query / 8 KV heads, head_dim 128.
    "minitron-4b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=9216, num_layers=32,
                        num_heads=24, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                        max_position_embeddings=262144),
    # Qwen2.5-7B: 28 layers, GQA 7 (28 query / 4 KV heads), head_dim 128, q/k/v biases.
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                       num_heads=28, num_kv_heads=4, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       max_position_embeddings=262144, architecture="qwen2", qkv_bias=True),
    # Qwen3-8B: 36 layers, GQA 4 (32 query / 8 KV heads), head_dim 128, q/k RMSNorm before RoPE.
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=262144, architecture="qwen3", qk_norm=True),
    # Mistral-7B (v0.3, no sliding window): 32 layers, GQA 4, head_dim 128.
    "mistral-7b": dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, rope_theta=1000000.0, max_position_embeddings=262144,
                       architecture="mistral"),
    # Tiny test shape: GQA 4, head_dim 64, byte vocabulary.
    "tiny": dict(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=4,
                 num_heads=8, num_kv_heads=2, rope_theta=10000.0, max_position_embeddings=262144),
}


def preset_config(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name`` (EOS is the byte tokenizer's 257)."""
    return ModelConfig(name=name, eos_token_ids=(257,), bos_token_id=256, **PRESETS[name])


def layer_config(name: str) -> ModelConfig:
    """One attention layer of preset ``name`` (its heads, KV heads and head dim; one layer, a tiny
    vocabulary and MLP), the shape the kernel benchmarks time.

    Raises
    ------
    ConfigError
        ``name`` is not a preset, or it has fewer than 2 KV heads (the benchmarks split them
        half streaming, half dense).
    """
    if name not in PRESETS:
        raise ConfigError(f"--model: unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    p = PRESETS[name]
    cfg = ModelConfig(vocab_size=128, hidden_size=p["hidden_size"], intermediate_size=128, num_layers=1,
                      num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
                      head_dim=p.get("head_dim", 0), name=f"{name}-layer")
    if cfg.num_kv_heads < 2:
        raise ConfigError(f"--model {name}: the kernel benchmarks need at least 2 KV heads (half of them streaming)")
    return cfg


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Variance-preserving random weights (HF names), made directly on ``device``.

    The LM head is scaled up so greedy decoding has clear winners (no near-ties), which
    keeps cross-backend token comparisons meaningful.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        t = torch.empty(out_f, in_f, dtype=dtype, device=device)
        return t.normal_(0.0, gain / in_f ** 0.5, generator=g)

    w = {"model.embed_tokens.weight": torch.empty(cfg.vocab_size, H, dtype=dtype, device=device).normal_(generator=g),
         "model.norm.weight": torch.ones(H, dtype=dtype, device=device),
         "lm_head.weight": lin(cfg.vocab_size, H, gain=4.0)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(H, dtype=dtype, device=device)
        w[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=dtype, device=device)
        w[p + "self_attn.q_proj.weight"] = lin(cfg.num_heads * D, H, gain=2.0)
        w[p + "self_attn.k_proj.weight"] = lin(cfg.num_kv_heads * D, H, gain=2.0)
        w[p + "self_attn.v_proj.weight"] = lin(cfg.num_kv_heads * D, H)
        w[p + "self_attn.o_proj.weight"] = lin(H, cfg.num_heads * D)
        w[p + "mlp.gate_proj.weight"] = lin(I, H)
        w[p + "mlp.up_proj.weight"] = lin(I, H)
        w[p + "mlp.down_proj.weight"] = lin(H, I)
        if cfg.qkv_bias:
            for name, rows in (("q", cfg.num_heads * D), ("k", cfg.num_kv_heads * D), ("v", cfg.num_kv_heads * D)):
                w[p + f"self_attn.{name}_proj.bias"] = torch.empty(rows, dtype=dtype, device=device).normal_(
                    0.0, 0.1, generator=g)
        if cfg.qk_norm:
            w[p + "self_attn.q_norm.weight"] = torch.ones(D, dtype=dtype, device=device)
            w[p + "self_attn.k_norm.weight"] = torch.ones(D, dtype=dtype, device=device)
    return w
