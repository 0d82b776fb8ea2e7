"""Head classification: learn which KV heads can be streaming heads (SPEC.md section 2).

DuoAttention-style gate optimisation. Every (layer, KV head) gets a gate ``alpha`` in [0, 1];
the base model is frozen. Each training sample runs twice:

* the teacher: plain causal attention everywhere (no gradient);
* the student: every head's attention output is ``alpha * full + (1 - alpha) * streaming``,
  where streaming attention sees only the first ``sink`` and the last ``local`` tokens (the Λ
  mask). For GQA the KV head is the unit: its query heads share one gate.

Loss = MSE between the final hidden states (after the last RMSNorm) of the two runs at the
answer positions + ``reg * mean(|alpha|)``; alpha is clamped to [0, 1] after every step. Heads
whose streaming output already reproduces the full output feel only the L1 pull and drift to 0
(streaming); retrieval heads are held up by the MSE.

The data are synthetic multi-passkey retrieval prompts made locally: several pass keys (numbers
or word triples) hidden in generated text, followed by the teacher-forced answer listing them.

The forward here is a differentiable re-implementation over :class:`~lserve.models.llama.LlamaModel`'s
fused weights, built with :meth:`HeadLayout.all_dense` so heads keep their original order, and
plain dense masked attention (no paged cache).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lserve.config import ConfigError, ModelConfig
from lserve.models.llama import LlamaModel
from lserve.models.norm import rms_norm
from lserve.plotting import pyplot
from lserve.sparsity.patterns import HeadLayout, HeadPattern

log = logging.getLogger("lserve.classifier")

CHECKPOINT_NAME = "checkpoint.pt"
HISTORY_NAME = "history.json"


# ----------------------------------------------------------------------------------------------
# Differentiable forward
# ----------------------------------------------------------------------------------------------
def lambda_mask(num_tokens: int, sink: int, local: int, device=None) -> torch.Tensor:
    """Streaming (Λ) mask: bool [T, T], query p sees key t iff t <= p and (t < sink or p - t < local)."""
    pos = torch.arange(num_tokens, device=device)
    rel = pos[:, None] - pos[None, :]
    return (rel >= 0) & ((pos[None, :] < sink) | (rel < local))


class GatedLlama:
    """Llama forward with autograd through activations and per-KV-head attention gates.

    Parameters
    ----------
    cfg : ModelConfig
    weights : dict
        Hugging Face parameter names -> tensors (frozen; never receive gradients).
    sink_tokens, local_tokens : int
        The streaming heads' Λ window.
    dtype, device
        Compute dtype and device of the weights and activations.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], sink_tokens: int, local_tokens: int,
                 dtype: torch.dtype = torch.float32, device="cpu") -> None:
        self.cfg = cfg
        self.sink, self.local = sink_tokens, local_tokens
        # all_dense: the identity head order, so gate [layer, h] is original KV head h.
        self.model = LlamaModel(cfg, weights, HeadLayout.all_dense(cfg.num_layers, cfg.num_kv_heads), dtype, device)
        self.dtype, self.device = dtype, self.model.device
        self.scale = cfg.head_dim ** -0.5
        self._masks: dict[int, torch.Tensor] = {}

    def _mask(self, num_tokens: int) -> torch.Tensor:
        if num_tokens not in self._masks:
            self._masks = {num_tokens: lambda_mask(num_tokens, self.sink, self.local, self.device)}
        return self._masks[num_tokens]

    def _layer(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               gate: torch.Tensor | None) -> torch.Tensor:
        """h: [B, T, H] -> [B, T, H]; gate: [Hkv] float or None (full attention only)."""
        cfg, L = self.cfg, self.model.layers[i]
        B, T, _ = h.shape
        hq, D, G = cfg.num_heads, cfg.head_dim, cfg.group_size
        q, k, v = self.model.project_qkv(L, rms_norm(h, L.ln1, cfg.rms_norm_eps), cos, sin)
        q = q.transpose(1, 2)  # [B, Hq, T, D]
        k = k.transpose(1, 2).repeat_interleave(G, dim=1)  # [B, Hq, T, D]: query head j reads KV head j // G
        v = v.transpose(1, 2).repeat_interleave(G, dim=1)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # [B, Hq, T, D]
        if gate is None:
            a = full
        else:
            stream = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(T), scale=self.scale)
            g = gate.to(full.dtype).repeat_interleave(G).view(1, hq, 1, 1)
            a = stream + g * (full - stream)
        h = h + F.linear(a.transpose(1, 2).reshape(B, T, hq * D), L.wo, L.bo)
        return h + self.model.mlp(L, rms_norm(h, L.ln2, cfg.rms_norm_eps))

    def hidden_states(self, input_ids: torch.Tensor, alpha: torch.Tensor | None = None,
                      checkpoint: bool = False) -> torch.Tensor:
        """Final hidden states (after the last RMSNorm).

        Parameters
        ----------
        input_ids : [B, T] long
        alpha : [num_layers, num_kv_heads] float, optional
            Gates; None runs plain causal attention.
        checkpoint : bool
            Recompute each layer in the backward pass instead of storing its activations.

        Returns
        -------
        torch.Tensor
            [B, T, hidden] in the compute dtype.
        """
        B, T = input_ids.shape
        pos = torch.arange(T, device=self.device)
        cos, sin = self.model.rope.cos_sin(pos, torch.full((T,), T, device=self.device))  # [T, D/2] each
        h = self.model.embed[input_ids]  # [B, T, H]
        for i in range(self.cfg.num_layers):
            gate = None if alpha is None else alpha[i]
            if checkpoint and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint as ckpt

                h = ckpt(self._layer, i, h, cos, sin, gate, use_reentrant=False)
            else:
                h = self._layer(i, h, cos, sin, gate)
        return rms_norm(h, self.model.norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] hidden states -> float32 [..., vocab] logits."""
        return F.linear(hidden, self.model.lm_head).float()


# ----------------------------------------------------------------------------------------------
# Synthetic multi-passkey data
# ----------------------------------------------------------------------------------------------
GATE_INTRO = ("There are several pass keys hidden inside a lot of irrelevant text. Find them and memorize them. "
              "I will quiz you about the pass keys at the end.\n")
GATE_NEEDLE = " The pass key number {i} is {key}. Remember it."
GATE_QUESTION = "\nWhat are the pass keys? Answer:"
GATE_ANSWER = " The pass key number {i} is {key}."


@dataclass
class GateSample:
    """One teacher-forced training sequence.

    ``input_ids`` is prompt + answer; the hidden state at position ``t`` predicts token ``t + 1``,
    so the loss positions are ``answer_start - 1 .. len(input_ids) - 2``.
    """

    input_ids: list[int]
    answer_start: int
    keys: list[str]
    needle_spans: list[tuple[int, int]]
    key_spans: list[tuple[int, int]] = field(default_factory=list)  # each key's tokens in the answer

    def loss_positions(self, on: str = "answer") -> list[int]:
        """Positions whose hidden state the loss compares.

        ``"answer"``: every answer token's predecessor. ``"keys"``: only those predicting a key
        token, the retrieval steps (the answer's template words are predictable locally, so
        they dilute the signal that tells retrieval heads apart).
        """
        if on == "keys":
            return [p for a, b in self.key_spans for p in range(a - 1, b - 1)]
        return list(range(self.answer_start - 1, len(self.input_ids) - 1))


def _make_key(rng: random.Random, kind: str) -> str:
    from lserve.eval.text import KEY_WORDS

    if kind == "mixed":
        kind = rng.choice(("digits", "words"))
    if kind == "digits":
        return str(rng.randint(10 ** 4, 10 ** 7 - 1))
    if kind == "words":
        return " ".join(rng.sample(KEY_WORDS, 3))
    raise ValueError(f"key kind must be digits, words or mixed, got {kind!r}")


def make_gate_sample(tokenizer, num_tokens: int, num_passkeys: int, rng: random.Random,
                     key_kind: str = "mixed", haystack: str | None = None) -> GateSample:
    """A multi-passkey retrieval sequence of exactly ``num_tokens`` tokens, answer included.

    Parameters
    ----------
    num_passkeys : int
        Keys hidden at random depths in 5-95% of the haystack, listed in order by the answer.
    key_kind : str
        ``"digits"`` (5-7 digit numbers), ``"words"`` (three words) or ``"mixed"``.
    haystack : str, optional
        ``"sentences"`` or ``"filler"``; random per sample if None.
    """
    from lserve.eval.text import Haystack, body_ids, insert_at_depths

    keys = [_make_key(rng, key_kind) for _ in range(num_passkeys)]
    depths = sorted(rng.uniform(0.05, 0.95) for _ in keys)
    head = tokenizer.encode(GATE_INTRO)
    needles = [(d, body_ids(tokenizer, GATE_NEEDLE.format(i=i + 1, key=k))) for i, (d, k) in enumerate(zip(depths, keys))]
    question = body_ids(tokenizer, GATE_QUESTION)
    answer, key_offsets = [], []  # tokenized piecewise so that each key's tokens are known
    for i, k in enumerate(keys):
        lead, tail = GATE_ANSWER.format(i=i + 1, key="\0").split("\0")
        answer += body_ids(tokenizer, lead.rstrip(" "))
        key_ids = body_ids(tokenizer, " " + k)  # the space goes with the key, as in running text
        key_offsets.append((len(answer), len(answer) + len(key_ids)))
        answer += key_ids + body_ids(tokenizer, tail)
    budget = num_tokens - len(head) - sum(len(n) for _, n in needles) - len(question) - len(answer)
    if budget < 32:
        raise ValueError(f"{num_tokens} tokens is too short for {num_passkeys} pass keys")
    hay = Haystack(tokenizer, haystack or rng.choice(Haystack.KINDS), seed=rng.getrandbits(32))
    body, spans = insert_at_depths(hay.sentences(budget), needles)
    prompt = head + body + question
    spans = [(s + len(head), e + len(head)) for s, e in spans]
    key_spans = [(a + len(prompt), b + len(prompt)) for a, b in key_offsets]
    return GateSample(prompt + answer, len(prompt), keys, spans, key_spans)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
@dataclass
class GateTrainConfig:
    """Settings of ``lserve classify-heads``.

    Parameters
    ----------
    model : str
        Model spec for :func:`lserve.models.loader.load_model`.
    out : str
        Output directory: pattern (TSV + config.json), history, checkpoint.
    steps : int
        Optimizer steps (one batch each).
    lr, reg : float
        AdamW learning rate and L1 weight on the gates.
    sink_tokens, local_tokens : int
        Streaming window the gates are trained for (use the engine's).
    min_context, max_context : int
        Each step's sequence length is drawn from this range (multiples of 64).
    num_passkeys : int
        Pass keys per sample.
    objective : str
        ``"mse"`` (hidden states) or ``"kl"`` (next-token distributions); see :func:`gate_loss`.
    loss_on : str
        ``"answer"`` (every answer position) or ``"keys"`` (only positions that predict a key
        token); see :meth:`GateSample.loss_positions`.
    batch_size : int
        Samples per step (same length).
    init : float
        Initial gate value.
    checkpoint_every : int
        Save a resumable checkpoint every this many steps (and at the end).
    grad_checkpoint : bool
        Recompute layers in backward (less memory, ~1/3 more compute).
    """

    model: str = "default"
    out: str = "patterns/learned"
    steps: int = 300
    lr: float = 0.02
    reg: float = 0.05
    sink_tokens: int = 128
    local_tokens: int = 256
    min_context: int = 1024
    max_context: int = 2048
    num_passkeys: int = 4
    key_kind: str = "mixed"
    objective: str = "mse"
    loss_on: str = "answer"
    batch_size: int = 1
    init: float = 1.0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    checkpoint_every: int = 25
    grad_checkpoint: bool = True
    resume: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.min_context <= self.max_context:
            raise ConfigError(f"need 0 < min_context <= max_context, got {self.min_context}/{self.max_context}")
        if self.sink_tokens < 0 or self.local_tokens < 1:
            raise ConfigError(f"need sink >= 0 and local >= 1, got {self.sink_tokens}/{self.local_tokens}")
        if self.min_context <= self.sink_tokens + self.local_tokens:
            raise ConfigError(f"min_context ({self.min_context}) must exceed sink + local "
                              f"({self.sink_tokens + self.local_tokens}): shorter sequences teach nothing")
        if self.objective not in ("mse", "kl"):
            raise ConfigError(f"objective must be 'mse' or 'kl', got {self.objective!r}")
        if self.loss_on not in ("answer", "keys"):
            raise ConfigError(f"loss_on must be 'answer' or 'keys', got {self.loss_on!r}")
        if self.steps < 1 or self.batch_size < 1 or self.num_passkeys < 1:
            raise ConfigError("steps, batch_size and num_passkeys must be >= 1")
        if not (self.lr > 0 and self.reg >= 0 and 0 <= self.init <= 1):
            raise ConfigError(f"need lr > 0, reg >= 0 and init in [0, 1], got {self.lr}/{self.reg}/{self.init}")


def gate_loss(model: GatedLlama, alpha: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
              reg: float, checkpoint: bool = False, objective: str = "mse") -> tuple[torch.Tensor, float, float]:
    """One batch's loss.

    Parameters
    ----------
    alpha : [L, Hkv] float32 leaf tensor (requires grad)
    input_ids : [B, T] long
    positions : [B, P] long
        Loss positions of each sample (same count per sample).
    objective : str
        ``"mse"``: MSE of the final hidden states (DuoAttention). ``"kl"``: KL(full || gated) of
        the next-token distributions, which weighs a hidden-state change by what it does to the
        prediction (a near-tie between copying a key and paraphrasing it shows up here).

    Returns
    -------
    loss : scalar tensor
        ``distance + reg * mean|alpha|``.
    distance, l1 : float
    """
    with torch.no_grad():
        ref = model.hidden_states(input_ids)  # [B, T, H]
        ref = torch.gather(ref, 1, positions[..., None].expand(-1, -1, ref.shape[-1])).float()  # [B, P, H]
    out = model.hidden_states(input_ids, alpha, checkpoint=checkpoint)
    out = torch.gather(out, 1, positions[..., None].expand(-1, -1, out.shape[-1])).float()  # [B, P, H]
    if objective == "kl":
        ref_lp = F.log_softmax(model.logits(ref), -1)  # [B, P, V]
        dist = F.kl_div(F.log_softmax(model.logits(out), -1), ref_lp, log_target=True, reduction="sum")
        dist = dist / (ref_lp.shape[0] * ref_lp.shape[1])  # mean over positions
    else:
        dist = F.mse_loss(out, ref)
    l1 = alpha.abs().mean()
    return dist + reg * l1, float(dist.detach()), float(l1.detach())


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _sample_batch(cfg: GateTrainConfig, tokenizer, step: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Deterministic in (seed, step), so a resumed run sees the same data. -> ids [B, T], positions [B, P], T."""
    rng = random.Random(f"gates:{cfg.seed}:{step}")
    lo, hi = -(-cfg.min_context // 64), cfg.max_context // 64
    T = 64 * rng.randint(lo, max(lo, hi)) if hi >= lo else cfg.min_context
    samples = [make_gate_sample(tokenizer, T, cfg.num_passkeys, rng, cfg.key_kind) for _ in range(cfg.batch_size)]
    # Answers differ in length; score the last P positions of each (all inside every answer).
    P = min(len(s.loss_positions(cfg.loss_on)) for s in samples)
    ids = torch.tensor([s.input_ids for s in samples], dtype=torch.long, device=device)
    pos = torch.tensor([s.loss_positions(cfg.loss_on)[-P:] for s in samples], dtype=torch.long, device=device)
    return ids, pos, T


def _dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def train_gates(cfg: GateTrainConfig, loaded=None, progress: bool = True) -> HeadPattern:
    """Train the gates and write the pattern to ``cfg.out``.

    Parameters
    ----------
    cfg : GateTrainConfig
    loaded : LoadedModel, optional
        Weights and tokenizer already in memory (else ``load_model(cfg.model)``).
    progress : bool
        Show a tqdm progress bar.

    Returns
    -------
    HeadPattern
        The learned gates (also saved: ``full_attention_heads.tsv``, ``config.json``,
        ``history.json`` and ``alphas.png`` in ``cfg.out``; ``checkpoint.pt`` for resuming).
    """
    from lserve.models.loader import load_model

    device = cfg.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is available")
    dtype = _dtype(cfg.dtype, device)
    loaded = loaded or load_model(cfg.model, dtype=dtype, device=device, seed=cfg.seed)
    mc = loaded.config
    model = GatedLlama(mc, loaded.weights, cfg.sink_tokens, cfg.local_tokens, dtype, device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / CHECKPOINT_NAME

    alpha = torch.full((mc.num_layers, mc.num_kv_heads), float(cfg.init), dtype=torch.float32, device=device,
                       requires_grad=True)  # [L, Hkv]
    opt = torch.optim.AdamW([alpha], lr=cfg.lr, weight_decay=0.0)
    history: list[dict] = []
    start = 0
    if cfg.resume and ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location=device, weights_only=False)
        old = state["config"]
        for key in ("model", "sink_tokens", "local_tokens", "seed", "lr", "reg"):
            if old.get(key) != getattr(cfg, key):
                raise ConfigError(f"checkpoint {ckpt_path} was made with {key}={old.get(key)!r}, not "
                                  f"{getattr(cfg, key)!r}: use another --out or --no-resume")
        if tuple(state["alpha"].shape) != tuple(alpha.shape):
            raise ConfigError(f"checkpoint {ckpt_path} has gates of shape {tuple(state['alpha'].shape)}, the model "
                              f"needs {tuple(alpha.shape)}")
        with torch.no_grad():
            alpha.copy_(state["alpha"])
        opt.load_state_dict(state["optim"])
        history, start = state["history"], state["step"]
        log.info("resuming from step %d of %s", start, ckpt_path)

    def save_checkpoint(step: int) -> None:
        _atomic_save({"step": step, "alpha": alpha.detach().cpu(), "optim": opt.state_dict(), "history": history,
                      "config": asdict(cfg)}, ckpt_path)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=min(start, cfg.steps), desc="gates", unit="step", dynamic_ncols=True)
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        ids, pos, T = _sample_batch(cfg, loaded.tokenizer, step, device)
        opt.zero_grad(set_to_none=True)
        loss, dist, l1 = gate_loss(model, alpha, ids, pos, cfg.reg, cfg.grad_checkpoint, cfg.objective)
        loss.backward()
        opt.step()
        with torch.no_grad():
            alpha.clamp_(0.0, 1.0)
        rec = {"step": step + 1, "loss": float(loss.detach()), cfg.objective: dist, "l1": l1, "tokens": T,
               "low": int((alpha < 0.5).sum()), "seconds": round(time.perf_counter() - t0, 3)}
        history.append(rec)
        if bar is not None:
            bar.update(1)
            bar.set_postfix({"loss": f"{rec['loss']:.4f}", cfg.objective: f"{dist:.4f}", "mean_a": f"{l1:.3f}", "T": T})
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"gate loss became {rec['loss']} at step {step + 1}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(step + 1)
    if bar is not None:
        bar.close()
    if start >= cfg.steps and not ckpt_path.is_file():
        save_checkpoint(cfg.steps)

    alphas = alpha.detach().cpu().numpy().astype(np.float64)
    meta = {"model": mc.name, "kind": "learned", "trainer": "lserve classify-heads",
            "settings": {k: v for k, v in asdict(cfg).items() if k not in ("out", "resume", "extra")},
            "final": history[-1] if history else None, "num_layers": mc.num_layers, "num_kv_heads": mc.num_kv_heads}
    meta["settings"].update(cfg.extra)
    pattern = HeadPattern(alphas, cfg.sink_tokens, cfg.local_tokens, meta)
    pattern.save(out)
    (out / HISTORY_NAME).write_text(json.dumps(history) + "\n")
    plot_alphas(alphas, out / "alphas.png", title=f"{mc.name}: gates after {len(history)} steps")
    return pattern


def plot_alphas(alphas: np.ndarray, path: Path, title: str = "") -> None:
    """Heatmap of gates [layers, KV heads] (1 = retrieval/dense, 0 = streaming)."""
    plt = pyplot()
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(2.5 + 0.5 * alphas.shape[1], 1.5 + 0.18 * alphas.shape[0]))
    im = ax.imshow(alphas, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=8)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

