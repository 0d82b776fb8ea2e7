"""What a model is, independent of its file name: family, shapes and a digest of some weights.

Shipped calibrations (:mod:`lserve.sparsity.shipped`) are keyed by this identity, so the same
weights get the same head pattern and calibrations whatever their file or directory is called.
It stands beside the config, below both the loader (which sets the fingerprint) and the
shipped-calibration lookup (which matches it), so neither layer imports the other for it.
"""

from __future__ import annotations

import hashlib

import torch

from lserve.config import ModelConfig

#: Embedding rows (spread over the vocabulary) that enter the digest.
FINGERPRINT_ROWS = 64


def fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """A short digest of the token embedding (rows spread over the vocabulary) and the final norm.

    Values are rounded to bfloat16 first, so a float32 and a bfloat16 copy of one checkpoint (or a
    GGUF dequantized on another day) agree.
    """
    h = hashlib.sha256()
    emb = weights["model.embed_tokens.weight"]
    rows = torch.linspace(0, emb.shape[0] - 1, FINGERPRINT_ROWS).round().long().unique().to(emb.device)
    for t in (emb.index_select(0, rows), weights["model.norm.weight"]):
        h.update(t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def identity(cfg: ModelConfig) -> dict:
    """The fields a shipped calibration must match: family, every shape, and the fingerprint."""
    return {"architecture": cfg.architecture, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "num_layers": cfg.num_layers, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "fingerprint": cfg.fingerprint}
