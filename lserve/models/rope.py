"""Rotary position embeddings, including the scaled variants Llama checkpoints use.

``default``, ``linear`` (positions divided by a factor), ``dynamic`` (NTK: the base grows
with the current sequence length once past the trained maximum), ``llama3``
(frequency-band-wise scaling) and ``yarn`` (a ramp between interpolated and original
frequencies, with cos/sin scaled by an attention factor; Qwen2.5's long-context variants) and
``freq_factors`` (each frequency divided by a given factor: llama.cpp's ``rope_freqs``).
The rotation is the "rotate half" convention of HF Llama.
"""

from __future__ import annotations

import math

import torch

from lserve.config import ConfigError, ModelConfig


def _kind(cfg: ModelConfig) -> str:
    rs = cfg.rope_scaling or {}
    return rs.get("rope_type", rs.get("type", "default"))


def inv_freq(cfg: ModelConfig, seq_len: int = 0, device=None) -> torch.Tensor:
    """Inverse frequencies [D/2] (float32) for a sequence currently ``seq_len`` tokens long."""
    d = cfg.head_dim
    base = cfg.rope_theta
    rs = cfg.rope_scaling or {}
    kind = _kind(cfg)
    if kind == "dynamic":
        factor = float(rs["factor"])
        max_pos = int(rs.get("original_max_position_embeddings", cfg.max_position_embeddings))
        if seq_len > max_pos:
            base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (d / (d - 2))
    freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if kind == "linear":
        freq = freq / float(rs["factor"])
    elif kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_len = float(rs.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / freq
        low_wl, high_wl = old_len / low, old_len / high
        scaled = torch.where(wavelen > low_wl, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        freq = torch.where(is_mid, mid, scaled)
    elif kind == "yarn":
        freq = _yarn(freq, rs, base, d, cfg.max_position_embeddings)
    elif kind == "freq_factors":
        factors = torch.tensor(rs["factors"], dtype=torch.float32, device=device)
        if factors.shape != freq.shape:
            raise ConfigError(f"rope freq_factors: {factors.numel()} factors for {freq.numel()} frequencies")
        freq = freq / factors
    return freq


def _yarn(freq: torch.Tensor, rs: dict, base: float, d: int, max_pos: int) -> torch.Tensor:
    """YaRN frequencies: interpolated (divided by the factor) below the low rotation count,
    original above the high one, a linear ramp between (the YaRN paper, section 3)."""
    orig = float(rs.get("original_max_position_embeddings") or max_pos)
    factor = float(rs.get("factor") or max_pos / orig)
    fast, slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension index that turns `rotations` times over `orig`
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=freq.device) - low) / (high - low)).clamp(0, 1)
    return (freq / factor) * ramp + freq * (1 - ramp)


def attention_scale(cfg: ModelConfig) -> float:
    """The factor cos and sin are multiplied by (YaRN's attention temperature; 1 otherwise)."""
    rs = cfg.rope_scaling or {}
    if _kind(cfg) != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    orig = float(rs.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = float(rs.get("factor") or cfg.max_position_embeddings / orig)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


class Rope:
    """cos/sin of positions, computed per step from the inverse frequencies; ``apply`` rotates q
    and k at given positions.

    No table over positions is kept: one for a whole ``max_model_len`` took 512 B a token of
    device memory at head dim 128 (5.1 GB at 10M tokens; built at once it took twice that and ran
    a 5.2M-token engine out of memory on the H200), where a step's own positions cost a few
    thousand sin/cos. The angle is ``float32(position) * inv_freq`` either way, the product the
    table held (and transformers computes), so the values are the same.
    """

    def __init__(self, cfg: ModelConfig, device) -> None:
        self.cfg = cfg
        self.device = device
        self.dynamic = _kind(cfg) == "dynamic"
        #: the attention factor cos and sin are scaled by (yarn's; 1 elsewhere)
        self.scale = attention_scale(cfg)
        self._freq: torch.Tensor | None = None

    def freq(self) -> torch.Tensor:
        """float32 [D/2] inverse frequencies (the trained length's, for dynamic NTK), on the device,
        built on first use (the CUDA-graph steps call it before capturing)."""
        if self._freq is None:
            self._freq = inv_freq(self.cfg, device=self.device).float().contiguous()
        return self._freq

    def cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None, max_len: int | None = None):
        """cos, sin [T, D/2] float32 for ``positions`` [T].

        ``seq_lens`` [T] (dynamic scaling only): each token's sequence length for this step.
        ``max_len`` (dynamic scaling only): an upper bound of ``seq_lens`` known on the host, which
        spares reading it from the device (a sync, and impossible inside a CUDA graph).
        """
        longest = 0
        if self.dynamic and seq_lens is not None:
            longest = max_len if max_len is not None else int(seq_lens.max())
        if longest > self.cfg.max_position_embeddings:  # dynamic NTK past the trained length
            out_c, out_s = [], []
            for L in seq_lens.unique().tolist():
                f = inv_freq(self.cfg, int(L), device=self.device)
                ang = positions.float()[:, None] * f[None, :]
                out_c.append(ang.cos())
                out_s.append(ang.sin())
            sel = torch.searchsorted(seq_lens.unique(), seq_lens)
            idx = torch.arange(positions.numel(), device=self.device)
            cos = torch.stack(out_c)[sel, idx]
            sin = torch.stack(out_s)[sel, idx]
            return cos, sin
        ang = positions.to(torch.float32)[:, None] * self.freq()[None, :]
        return ang.cos().mul_(self.scale), ang.sin().mul_(self.scale)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; cos, sin: [T, D/2] -> rotated x (same dtype)."""
        half = x.shape[-1] // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
