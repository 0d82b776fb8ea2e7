"""Head patterns: which KV heads of each layer are streaming heads.

A pattern is DuoAttention's format: a TSV of gate values alpha (one row per layer, one
column per KV head; high alpha = retrieval/dense) plus the sink/local sizes it was trained
with (``config.json`` beside the TSV). At run time the ``static_sparsity`` quantile of all
alphas is the threshold: the heads below it become streaming heads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lserve.config import ConfigError

TSV_NAME = "full_attention_heads.tsv"
META_NAME = "config.json"


@dataclass
class HeadPattern:
    """Gate values alpha [num_layers, num_kv_heads] and the window they were trained with."""

    alphas: np.ndarray
    sink_tokens: int = 128
    local_tokens: int = 256
    meta: dict | None = None

    def save(self, path: str | Path) -> Path:
        """Write ``full_attention_heads.tsv`` and ``config.json`` into directory ``path``."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        np.savetxt(d / TSV_NAME, self.alphas, delimiter="\t", fmt="%.6f")
        meta = dict(self.meta or {}, sink_size=self.sink_tokens, recent_size=self.local_tokens)
        (d / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        return d


def load_pattern(path: str | Path) -> HeadPattern:
    """Read a pattern from a directory (TSV + optional config.json) or a TSV file."""
    p = Path(path)
    tsv = p / TSV_NAME if p.is_dir() else p
    if not tsv.is_file():
        raise ConfigError(f"head pattern not found: {tsv}")
    try:
        alphas = np.loadtxt(tsv, delimiter="\t", ndmin=2)
    except ValueError as e:
        raise ConfigError(f"head pattern {tsv} is not a tab-separated table of numbers: {e}") from None
    meta_path = tsv.parent / META_NAME
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return HeadPattern(alphas, int(meta.get("sink_size", 128)), int(meta.get("recent_size", 256)), meta)


def random_pattern(num_layers: int, num_kv_heads: int, seed: int = 0) -> HeadPattern:
    """Uniform random gates: the baseline a learned pattern must beat."""
    rng = np.random.default_rng(seed)
    return HeadPattern(rng.random((num_layers, num_kv_heads)), meta={"kind": "random", "seed": seed})


@dataclass
class HeadLayout:
    """Per layer, which original KV heads are dense and which streaming.

    Dense heads come first after the load-time permutation ``order(layer)``.
    """

    dense: list[list[int]]
    stream: list[list[int]]

    @classmethod
    def all_dense(cls, num_layers: int, num_kv_heads: int) -> HeadLayout:
        return cls([list(range(num_kv_heads)) for _ in range(num_layers)], [[] for _ in range(num_layers)])

    @classmethod
    def from_pattern(cls, pattern: HeadPattern, num_layers: int, num_kv_heads: int,
                     static_sparsity: float, dense_layers: int = 0) -> HeadLayout:
        """Threshold the gates at the ``static_sparsity`` quantile.

        Exactly ``round(static_sparsity * heads)`` heads with the lowest alpha (ties broken by
        position) become streaming, counted over the layers not forced dense.
        """
        a = np.asarray(pattern.alphas, dtype=np.float64)
        if a.shape != (num_layers, num_kv_heads):
            raise ConfigError(f"head pattern has shape {a.shape[0]}x{a.shape[1]} (layers x KV heads) but the "
                              f"model has {num_layers}x{num_kv_heads}")
        eligible = [(a[layer, h], layer, h) for layer in range(dense_layers, num_layers) for h in range(num_kv_heads)]
        n_stream = int(round(static_sparsity * len(eligible)))
        streaming = {(layer, h) for _, layer, h in sorted(eligible)[:n_stream]}
        dense = [[h for h in range(num_kv_heads) if (layer, h) not in streaming] for layer in range(num_layers)]
        stream = [[h for h in range(num_kv_heads) if (layer, h) in streaming] for layer in range(num_layers)]
        return cls(dense, stream)

    def order(self, layer: int) -> list[int]:
        """KV-head permutation of a layer: dense heads, then streaming heads."""
        return self.dense[layer] + self.stream[layer]

    def n_dense(self) -> list[int]:
        return [len(d) for d in self.dense]

    def streaming_fraction(self) -> float:
        total = sum(len(d) + len(s) for d, s in zip(self.dense, self.stream))
        return sum(len(s) for s in self.stream) / total if total else 0.0
