"""Offline calibration of ``select_layers``: where does page selection keep the attention mass?

The model runs densely (no streaming heads, no selection) on locally generated long prompts
(:mod:`lserve.eval.tasks`, seeds other than the accuracy harness's). At every decode step and
layer, the page selector (:func:`~lserve.sparsity.selector.page_scores` +
:func:`~lserve.sparsity.selector.top_pages` over the cache's own key statistics, with the
engine's page sizes and the request's budget) picks pages for each KV head, and the fraction
of each query head's softmax mass that falls in those pages is recorded. The mean over prompts
and steps, per (layer, KV head), is the calibration. A layer keeps selection when every head
that is dense under the head pattern keeps at least ``threshold`` of its mass; layers without
dense heads are not listed (there is nothing to select).

The selector runs fresh at every step here (reuse interval 1): reuse only adds the pages
appended since, so this is the mass of the steps that select.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

import torch

from lserve.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SparsityConfig
from lserve.identity import identity
from lserve.sparsity.layer_select import CALIBRATION_KIND, CALIBRATION_NAME
from lserve.sparsity.selector import page_scores, top_pages


@dataclass
class CalibrationConfig:
    """Settings of ``lserve calibrate-selection``.

    Parameters
    ----------
    model : str
        Model spec as for ``lserve generate``.
    out : str or None
        Output JSON; None writes ``selection_layers.json`` beside the model's shipped pattern
        (an error for models without one).
    budget : str
        Decode token budget: a token count or a fraction of the context (``"1/8"``).
    min_budget : int
        Floor of a fractional budget (the accuracy harness's ``lserve`` uses 512).
    pattern : str or None
        Head pattern deciding which heads are dense (``"auto"``: the shipped one; None: all).
    threshold : float
        A layer selects when each of its dense heads keeps at least this mean mass.
    seed : int
        Prompt seed; the default is not one the accuracy harness uses (0, 1, ...).
    """

    model: str = "default"
    out: str | None = None
    tasks: tuple[str, ...] = ("passkey", "niah")
    contexts: tuple[int, ...] = (2048, 4096, 8192)
    depths: tuple[float, ...] = (0.25, 0.75)
    samples: int = 1
    seed: int = 100
    budget: str = "1/8"
    min_budget: int = 512
    page_size: int = 64
    logical_page_size: int = 16
    select_mode: str = "kv"
    pattern: str | None = "auto"
    static_sparsity: float = 0.5
    threshold: float = 0.9
    device: str = "cpu"
    dtype: str = "auto"
    max_batched_tokens: int = 4096
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"threshold must be in (0, 1], got {self.threshold}")
        try:
            Fraction(self.budget)
        except (ValueError, ZeroDivisionError):
            raise ConfigError(f"budget must be a token count or a fraction like 1/8, got {self.budget!r}") from None
        if not self.contexts or not self.tasks or self.samples < 1:
            raise ConfigError("calibration needs at least one task, context and sample")
        # Validates page sizes, select mode and static sparsity with the engine's own messages.
        CacheConfig(page_size=self.page_size, logical_page_size=self.logical_page_size)
        SparsityConfig(static_sparsity=self.static_sparsity, select_mode=self.select_mode)

    def budget_for(self, context: int) -> int:
        """Token budget at ``context`` tokens (as :meth:`lserve.eval.harness.RunConfig.budget_for`)."""
        frac = Fraction(self.budget)
        tokens = int(frac * context) if frac < 1 else int(frac)
        return max(tokens, self.min_budget, 2 * self.page_size)


class MassProbe:
    """Wraps a torch backend's decode; records the selected pages' share of the attention mass.

    Attributes
    ----------
    total : torch.Tensor
        float64 [L, H_kv]: sum over observations of each KV head's mass (mean over its query heads).
    count : torch.Tensor
        int64 [L]: observations (decode steps where the context exceeds the budget) per layer.
    """

    def __init__(self, backend, select_mode: str) -> None:
        model = backend.model
        if any(n != model.num_kv_heads for n in backend.cache.n_dense):
            raise ValueError("the probe needs an all-dense head layout (original head order)")
        self.backend, self.mode = backend, select_mode
        self.total = torch.zeros(model.num_layers, model.num_kv_heads, dtype=torch.float64)
        self.count = torch.zeros(model.num_layers, dtype=torch.long)
        self._inner = backend._decode
        backend._decode = self._decode  # this engine only: it exists for the calibration

    def _decode(self, layer: int, sp, q: torch.Tensor) -> torch.Tensor:
        if sp.step.decode and sp.n_pages > sp.budget_pages:
            self.total[layer] += self.head_mass(layer, sp, q).double().cpu()
            self.count[layer] += 1
        return self._inner(layer, sp, q)

    def head_mass(self, layer: int, sp, q: torch.Tensor) -> torch.Tensor:
        """Mass the selected pages hold, per KV head: float32 [H_kv]. q: [H_q, D]."""
        b = self.backend
        G, N, n = b.group, b.cache.page_size, sp.n_pages
        stats = b.cache.stats[layer]
        scores = page_scores(q, stats.kmax[sp.pages], stats.kmin[sp.pages], G, self.mode)  # [H_sel, n]
        idx = top_pages(scores, sp.budget_pages)  # [H_sel, K]
        k, _ = b.cache.dense[layer].sequence_kv(sp.pages, sp.length)  # [H, L, D]
        h, length, d = k.shape
        logits = torch.bmm(q.float().view(h, G, d), k.float().transpose(1, 2)) * b.scale  # [H, G, L]
        p = torch.nn.functional.pad(torch.softmax(logits, dim=-1), (0, n * N - length))
        page_mass = p.view(h, G, n, N).sum(-1)  # [H, G, n]
        idx = idx[:, None, :].expand(h, G, -1) if self.mode == "kv" else idx.view(h, G, -1)  # [H, G, K]
        return page_mass.gather(2, idx).sum(-1).mean(1)  # [H]


def _default_out(model: ModelConfig) -> Path:
    from lserve.sparsity.shipped import default_pattern_for

    folder = default_pattern_for(model)
    if folder is None:
        raise ConfigError(f"no shipped pattern folder for model {model.name!r}: pass --out FILE.json")
    return folder / CALIBRATION_NAME


def calibrate_selection(cfg: CalibrationConfig, progress: bool = True) -> dict:
    """Measure per-layer selection mass and choose ``select_layers``; writes and returns the JSON.

    Returns
    -------
    dict
        ``kind``, ``model``, ``num_layers``, ``num_kv_heads``, ``settings``, ``head_mass``
        ([L][H_kv] mean mass, None where never observed), ``dense_heads`` ([L] original indices
        dense under the pattern), ``layer_mass`` / ``layer_mass_mean`` (min / mean over the dense
        heads, None without any), ``select_layers``, ``observations`` and ``seconds``.
    """
    from lserve.engine import LLMEngine, SamplingParams
    from lserve.engine.llm_engine import build_layout
    from lserve.eval.harness import EvalPlan
    from lserve.models.loader import load_model

    t0 = time.perf_counter()
    base = EngineConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype)
    loaded = load_model(cfg.model, dtype=base.torch_dtype(), device=cfg.device)
    mc = loaded.config
    out = Path(cfg.out) if cfg.out else _default_out(mc)
    plan = EvalPlan(tasks=list(cfg.tasks), contexts=list(cfg.contexts), depths=list(cfg.depths),
                    samples=cfg.samples, seed=cfg.seed)
    cases = plan.cases(loaded.tokenizer)
    max_len = max(c.context + c.max_tokens for c in cases) + cfg.page_size
    # Dense run: original head order, no streaming; select_layers "none" keeps decode dense
    # while the planner still sizes each request's budget (SeqPlan.budget_pages).
    sp = SparsityConfig(pattern=None, token_budget=0, dynamic_threshold=0, select_mode=cfg.select_mode,
                        select_layers="none")
    cc = CacheConfig(page_size=cfg.page_size, logical_page_size=cfg.logical_page_size, dense_pool_tokens=max_len)
    engine = LLMEngine(EngineConfig(model=cfg.model, sparsity=sp, cache=cc, device=cfg.device, dtype=cfg.dtype,
                                    max_num_seqs=1, max_batched_tokens=cfg.max_batched_tokens,
                                    max_model_len=max_len), loaded)
    probe = MassProbe(engine.backend, cfg.select_mode)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(cases), desc="calibrate", unit="prompt", dynamic_ncols=True)
    for c in cases:
        engine.generate([c.prompt_ids], SamplingParams(max_tokens=c.max_tokens, temperature=0.0,
                                                       token_budget=cfg.budget_for(c.context)))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(ctx=c.context, task=c.task)
    if bar is not None:
        bar.close()

    counts = probe.count.tolist()
    head_mass = [[round(float(m) / n, 4) if n else None for m in row]
                 for row, n in zip(probe.total.tolist(), counts)]
    pattern_cfg = EngineConfig(model=cfg.model, sparsity=SparsityConfig(
        pattern=cfg.pattern, static_sparsity=cfg.static_sparsity if cfg.pattern else 0.0))
    dense = build_layout(pattern_cfg, mc).dense
    layer_min, layer_mean = [], []
    for row, heads in zip(head_mass, dense):
        vals = [row[h] for h in heads if row[h] is not None]
        layer_min.append(min(vals) if vals else None)
        layer_mean.append(round(sum(vals) / len(vals), 4) if vals else None)
    selected = [i for i, m in enumerate(layer_min) if m is not None and m >= cfg.threshold]
    result = {
        "kind": CALIBRATION_KIND,
        "model": mc.name,
        "model_identity": identity(mc),
        "num_layers": mc.num_layers,
        "num_kv_heads": mc.num_kv_heads,
        "settings": {k: v for k, v in asdict(cfg).items() if k not in ("out", "extra")} | cfg.extra,
        "rule": "a layer selects when min over its dense heads of the mean mass >= threshold",
        "select_layers": selected,
        "layers_with_dense_heads": sum(1 for h in dense if h),
        "layer_mass": layer_min,
        "layer_mass_mean": layer_mean,
        "dense_heads": dense,
        "head_mass": head_mass,
        "observations": counts,
        "prompts": len(cases),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    result["path"] = str(out)
    return result
