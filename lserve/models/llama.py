"""Our Llama-family forward over the paged two-way cache (Llama, Mistral, Qwen2, Qwen3).

RMSNorm, RoPE (scaled variants in :mod:`lserve.models.rope`), GQA, SwiGLU (or a GELU gate),
tied embeddings, optional q/k/v, output and MLP biases, and Qwen3's per-head RMSNorm of
queries and keys before RoPE (so the cache, the page statistics and the prefix cache hold the
keys attention reads).
Weights arrive with Hugging Face names; q/k/v and gate/up projections are fused, and each
layer's KV heads (with their query groups) are permuted so dense heads come first, which is
the layout the two-way cache and the kernels expect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lserve.config import ModelConfig
from lserve.models.norm import rms_norm
from lserve.models.rope import Rope

if TYPE_CHECKING:  # the engine hands the forward these; the model layer imports neither at run time
    from lserve.attention.base import AttentionBackend
    from lserve.sparsity.patterns import HeadLayout
    from lserve.sparsity.plan import StepPlan


class _Layer:
    __slots__ = ("ln1", "wqkv", "bqkv", "qn", "kn", "wo", "bo", "ln2", "wgu", "bgu", "wd", "bd")


def activation(name: str):
    """The MLP gate activation ``ModelConfig.hidden_act`` names."""
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    return lambda x: F.gelu(x, approximate="tanh")  # gelu_pytorch_tanh


class LlamaModel:
    """Weights + forward. Not an ``nn.Module``: inference only, no autograd state.

    Parameters
    ----------
    weights : dict
        Hugging Face parameter names -> tensors (any dtype/device; converted here).
    layout : HeadLayout
        Dense/streaming KV heads per layer; the weights are permuted to match.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], layout: HeadLayout,
                 dtype: torch.dtype, device) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.layout = layout

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint is missing weight {name!r}")
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = self.embed if tied else w("lm_head.weight")
        D, G = cfg.head_dim, cfg.group_size
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            order = torch.tensor(layout.order(i), dtype=torch.long)
            kv_rows = (order[:, None] * D + torch.arange(D)).reshape(-1)
            q_heads = (order[:, None] * G + torch.arange(G)).reshape(-1)
            q_rows = (q_heads[:, None] * D + torch.arange(D)).reshape(-1)
            kv_rows, q_rows = kv_rows.to(self.device), q_rows.to(self.device)
            L = _Layer()
            L.ln1 = w(p + "input_layernorm.weight")
            L.wqkv = torch.cat((w(p + "self_attn.q_proj.weight")[q_rows],
                                w(p + "self_attn.k_proj.weight")[kv_rows],
                                w(p + "self_attn.v_proj.weight")[kv_rows]))
            L.bqkv = torch.cat((w(p + "self_attn.q_proj.bias")[q_rows], w(p + "self_attn.k_proj.bias")[kv_rows],
                                w(p + "self_attn.v_proj.bias")[kv_rows])) if cfg.qkv_bias else None
            # one [D] weight shared by every head, so the head permutation leaves it alone
            L.qn = w(p + "self_attn.q_norm.weight") if cfg.qk_norm else None
            L.kn = w(p + "self_attn.k_norm.weight") if cfg.qk_norm else None
            L.wo = w(p + "self_attn.o_proj.weight")[:, q_rows].contiguous()
            L.bo = w(p + "self_attn.o_proj.bias") if cfg.o_bias else None
            L.ln2 = w(p + "post_attention_layernorm.weight")
            L.wgu = torch.cat((w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")))
            L.bgu = torch.cat((w(p + "mlp.gate_proj.bias"), w(p + "mlp.up_proj.bias"))) if cfg.mlp_bias else None
            L.wd = w(p + "mlp.down_proj.weight")
            L.bd = w(p + "mlp.down_proj.bias") if cfg.mlp_bias else None
            self.layers.append(L)
        self.rope = Rope(cfg, self.device)
        self.act = activation(cfg.hidden_act)
        self.fused = None  # FusedOps once enable_fused() succeeded (CUDA)

    def enable_fused(self) -> str | None:
        """Use the fused CUDA kernels for the elementwise steps (after checking them against the
        torch code on random inputs). Returns None when enabled, else why not."""
        from lserve.models.fused import FusedOps

        cfg = self.cfg
        if self.device.type != "cuda":
            return "not on a CUDA device"
        if cfg.hidden_act != "silu":
            return f"the fused MLP kernel is SiLU-gated, the model uses {cfg.hidden_act}"
        try:
            ops = FusedOps(self.dtype, cfg.head_dim)
            problem = ops.self_check(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads + cfg.num_kv_heads,
                                     cfg.head_dim, cfg.rms_norm_eps, self.device)
        except Exception as e:  # a kernel that does not build or run here: keep the torch path
            problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if problem is None:
            self.fused = ops
        return problem

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of float32 logits [B, V] -> long [B] (the fused kernel once enabled)."""
        return self.fused.argmax(logits) if self.fused is not None else torch.argmax(logits, dim=-1)

    def nbytes(self) -> int:
        """Bytes of weights (the floor of a decode step is reading them once)."""
        ts = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for L in self.layers:
            ts += [t for t in (L.ln1, L.wqkv, L.bqkv, L.qn, L.kn, L.wo, L.bo, L.ln2, L.wgu, L.bgu, L.wd, L.bd)
                   if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: StepPlan,
                backend: AttentionBackend, logits_index: torch.Tensor,
                seq_lens: torch.Tensor | None = None, max_len: int | None = None,
                hidden_index: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run one step.

        Parameters
        ----------
        input_ids, positions : [T] long
            Tokens of every sequence in the step, concatenated in plan order.
        logits_index : [B] long
            Token rows whose next-token logits are wanted (last token of each sequence).
        seq_lens : [T] long, optional
            Per token, its sequence's length after this step (dynamic RoPE only).
        max_len : int, optional
            Host-side upper bound of ``seq_lens`` (dynamic RoPE: no device read of the lengths).
        hidden_index : [E] long, optional
            More token rows whose final (normed) hidden states are wanted: prompt logprobs need
            every position of a chunk, and :meth:`lm_logits` turns them into logits a block at a
            time instead of one [T, vocab] tensor.

        Returns
        -------
        torch.Tensor or (torch.Tensor, torch.Tensor)
            float32 [B, vocab] logits; with ``hidden_index`` also the hidden states [E, hidden].
        """
        cfg = self.cfg
        T = input_ids.shape[0]
        hq, D = cfg.num_heads, cfg.head_dim
        if self.fused is not None and not (self.rope.dynamic and (max_len is None or
                                                                  max_len > cfg.max_position_embeddings)):
            return self._forward_fused(input_ids, positions, plan, backend, logits_index, hidden_index)
        cos, sin = self.rope.cos_sin(positions, seq_lens, max_len)
        h = self.embed[input_ids]  # [T, H]
        for i, L in enumerate(self.layers):
            q, k, v = self.project_qkv(L, rms_norm(h, L.ln1, cfg.rms_norm_eps), cos, sin)
            a = backend.run(i, q, k, v, plan)  # [T, Hq, D]
            h = h + F.linear(a.reshape(T, hq * D), L.wo, L.bo)
            h = h + self.mlp(L, rms_norm(h, L.ln2, cfg.rms_norm_eps))
        logits = self.lm_logits(rms_norm(h[logits_index], self.norm, cfg.rms_norm_eps))
        if hidden_index is None:
            return logits
        return logits, rms_norm(h[hidden_index], self.norm, cfg.rms_norm_eps)

    def project_qkv(self, L: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed hidden states x [..., T, H] -> q [..., T, Hq, D], k and v [..., T, Hkv, D]: the
        projections (and biases), the per-head q/k RMSNorm when the model has one, then RoPE
        (cos, sin [T, D/2]). The keys are those the cache stores and the selector scores."""
        cfg = self.cfg
        hq, hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        lead = x.shape[:-1]
        qkv = F.linear(x, L.wqkv, L.bqkv)  # [..., (Hq + 2 Hkv) D]
        q = qkv[..., : hq * D].view(*lead, hq, D)
        k = qkv[..., hq * D: (hq + hkv) * D].view(*lead, hkv, D)
        v = qkv[..., (hq + hkv) * D:].view(*lead, hkv, D)
        if L.qn is not None:
            q, k = rms_norm(q, L.qn, cfg.rms_norm_eps), rms_norm(k, L.kn, cfg.rms_norm_eps)
        return Rope.apply(q, cos, sin), Rope.apply(k, cos, sin), v

    def mlp(self, L: _Layer, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP of layer ``L`` on normed hidden states x [..., H]."""
        gate, up = F.linear(x, L.wgu, L.bgu).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, L.wd, L.bd)

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, hidden] -> float32 logits [N, vocab]."""
        return F.linear(x, self.lm_head).float()

    def _forward_fused(self, input_ids, positions, plan, backend, logits_index, hidden_index=None):
        """:meth:`forward` with the elementwise steps in :mod:`lserve.models.fused` kernels (the
        residual add folds into the next RMSNorm)."""
        cfg, f = self.cfg, self.fused
        T = input_ids.shape[0]
        hq, hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        cos, sin = self.rope.cos_sin(positions)  # float32 [T, D/2], once for every layer
        h = self.embed[input_ids]  # [T, H], our own copy: updated in place
        x = torch.empty_like(h)
        delta = None
        for i, L in enumerate(self.layers):
            f.add_rmsnorm(h, delta, L.ln1, eps, x)
            qkv = f.linear(x, L.wqkv)  # [T, (Hq + 2 Hkv) D]
            if L.bqkv is not None:
                qkv += L.bqkv
            if L.qn is not None:  # per-head RMSNorm before RoPE (Qwen3), written back into qkv
                qk = qkv[:, : (hq + hkv) * D].view(T, hq + hkv, D)
                qk[:, :hq] = rms_norm(qk[:, :hq], L.qn, eps)
                qk[:, hq:] = rms_norm(qk[:, hq:], L.kn, eps)
            f.rope_(qkv, hq + hkv, D, cos, sin)
            q = qkv[:, : hq * D].view(T, hq, D)
            k = qkv[:, hq * D: (hq + hkv) * D].view(T, hkv, D)
            v = qkv[:, (hq + hkv) * D:].view(T, hkv, D)
            a = backend.run(i, q, k, v, plan)  # [T, Hq, D]
            out = f.linear(a.reshape(T, hq * D), L.wo)
            f.add_rmsnorm(h, out if L.bo is None else out + L.bo, L.ln2, eps, x)
            delta = F.linear(f.silu_mul(F.linear(x, L.wgu, L.bgu)), L.wd, L.bd)
        f.add_rmsnorm(h, delta, self.norm, eps, x)
        logits = self.lm_logits(x[logits_index])
        return logits if hidden_index is None else (logits, x[hidden_index])
