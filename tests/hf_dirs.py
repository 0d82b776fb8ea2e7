"""Tiny random transformers checkpoints saved to disk, as a user's ``--model DIR`` is."""

from __future__ import annotations

import torch


def random_hf_model(vocab_size: int, cls_name: str, seed: int = 1, **kw):
    """A tiny transformers model of config class ``cls_name`` (2 layers, width 64) with random
    weights large enough that RoPE, biases and norms change its output."""
    import transformers

    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg = getattr(transformers, cls_name)(**{**base, **kw})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # HF init is near-zero
            p.normal_(0.0, 0.2)
    return model


def make_hf_dir(path, tok, cls_name: str, seed: int = 1, **kw):
    """A tiny random transformers model of ``cls_name`` saved to ``path`` as sharded safetensors,
    with ``tok`` (our tokenizer wrapper) saved beside it; returns the transformers model."""
    model = random_hf_model(tok.vocab_size, cls_name, seed, **kw)
    model.save_pretrained(path, max_shard_size="1MB")
    tok.save(path)
    return model
