"""Per-layer thresholds of block-sparse prefill (``prefill_sparsity`` "auto").

One global tau keeps very different shares of the true attention mass in different layers of the
same model (on the default model, layer 18's KV head 2 holds 0.73-0.85 of it at tau 0.9 while
most heads hold > 0.95, ``benchmarks/prefill_sparsity/prefill_sparsity_notes.md``). ``lserve calibrate-prefill``
runs the model densely on generated prompts, captures every layer's RoPE'd queries and keys of
each prompt's one-chunk prefill, and for each (layer, KV head) finds the smallest tau of
:data:`TAU_GRID` at which that head's own block list (the engine's estimator and rule,
:func:`~lserve.sparsity.prefill_blocks.select_blocks`) holds at least ``target_mass`` of its
query heads' exact mass on every prompt. A layer's tau is the largest of its dense heads'
(every KV head of a row keeps the same count, so the neediest head sets it).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lserve.config import ConfigError
from lserve.sparsity.prefill_taus import CALIBRATION_KIND, CALIBRATION_NAME, TAU_GRID


def capture_prefill_qk(engine, prompt_ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's RoPE'd queries [H_q, L, D] and keys [H_kv, L, D] of one prompt's prefill.

    The engine must prefill the prompt in one chunk from position 0 (``max_batched_tokens`` at
    least its length; no prefix cache hit), with every head dense so that all heads are seen.
    """
    from lserve.engine import SamplingParams

    captured: dict[int, list] = {}
    backend = engine.backend
    run = backend.run

    def capture(layer, q, k, v, plan):
        if q.shape[0] > 1:  # the prefill step
            captured.setdefault(layer, []).append((q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous()))
        return run(layer, q, k, v, plan)

    backend.run = capture
    try:
        engine.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    finally:
        del backend.run  # the class's method again
    n = len(prompt_ids)
    if any(len(c) != 1 or c[0][0].shape[1] != n for c in captured.values()) or len(captured) != engine.model_config.num_layers:
        raise RuntimeError(f"the {n}-token prompt was not prefilled in one chunk")
    return {layer: c[0] for layer, c in captured.items()}


def head_mass_curve(q: torch.Tensor, k: torch.Tensor, scale: float, block: int, q_block: int, stride: int,
                    estimator: str, taus=TAU_GRID) -> torch.Tensor:
    """float32 [len(taus), H_kv]: the exact mass each KV head's own list holds at each tau (mean over
    its query heads and rows; one chunk from position 0). q: [H_q, L, D]; k: [H_kv, L, D]."""
    from lserve.sparsity.prefill_blocks import combine_group, estimate_masses, recalled_mass, select_blocks

    hkv, L = k.shape[0], k.shape[1]
    g = q.shape[0] // hkv
    exact_q = estimate_masses(q, k, 0, block, scale, "oracle", stride, q_block)
    mass = combine_group(estimate_masses(q, k, 0, block, scale, estimator, stride, q_block), g)
    out = torch.zeros(len(taus), hkv)
    for i, tau in enumerate(taus):
        for h in range(hkv):
            blocks = select_blocks(mass[h: h + 1], tau, 0, L, block, q_block)
            out[i, h] = recalled_mass(exact_q[h * g: (h + 1) * g], blocks, g).mean()
    return out


@dataclass
class PrefillCalibrationConfig:
    """Settings of ``lserve calibrate-prefill``.

    Parameters
    ----------
    model : str
        Model spec as for ``lserve generate``.
    out : str or None
        Output JSON; None writes ``prefill_taus.json`` beside the model's shipped pattern.
    target_mass : float
        Exact attention mass each dense head's kept tiles must hold on every prompt.
    pattern : str or None
        Head pattern deciding which heads are dense (``"auto"``: the shipped one; None: all).
    """

    model: str = "default"
    out: str | None = None
    tasks: tuple[str, ...] = ("passkey", "niah")
    contexts: tuple[int, ...] = (4096, 8192)
    depths: tuple[float, ...] = (0.5,)
    samples: int = 1
    seed: int = 200
    target_mass: float = 0.95
    pattern: str | None = "auto"
    static_sparsity: float = 0.5
    device: str = "cpu"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if not 0.0 < self.target_mass <= 1.0:
            raise ConfigError(f"target_mass must be in (0, 1], got {self.target_mass}")
        if not self.contexts or min(self.contexts) < 1:
            raise ConfigError("contexts must be positive token counts")


def choose_taus(curves: torch.Tensor, target: float, taus=TAU_GRID) -> list[float]:
    """curves [prompts, len(taus), H_kv] -> per KV head, the smallest tau whose mass reaches
    ``target`` on every prompt (1.0: every tile)."""
    worst = curves.amin(0)  # [len(taus), H]
    out = []
    for h in range(worst.shape[1]):
        ok = [t for i, t in enumerate(taus) if worst[i, h] >= target]
        out.append(min(ok) if ok else 1.0)
    return out


def calibrate_prefill(cfg: PrefillCalibrationConfig, progress: bool = True) -> dict:
    """Measure every layer's mass curves on generated prompts and write the per-layer taus.

    Returns
    -------
    dict
        ``kind``, ``model``, ``num_layers``, ``num_kv_heads``, ``settings``, ``tau_grid``,
        ``head_taus`` [L][H_kv], ``dense_heads`` [L], ``layer_taus`` [L] (1.0 where a layer has
        no dense head), ``worst_mass`` [L][len(grid)][H_kv] (min over prompts), ``prompts``, ``seconds``.
    """
    from lserve.config import CacheConfig, EngineConfig, SparsityConfig
    from lserve.engine import LLMEngine
    from lserve.engine.llm_engine import build_layout
    from lserve.eval.harness import EvalPlan
    from lserve.models.loader import load_model
    from lserve.sparsity.shipped import shipped_folder

    t0 = time.perf_counter()
    sp_defaults = SparsityConfig()
    base = EngineConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype)
    loaded = load_model(cfg.model, dtype=base.torch_dtype(), device=cfg.device)
    mc = loaded.config
    if cfg.out:
        out = Path(cfg.out)
    else:
        folder = shipped_folder(mc)
        if folder is None:
            raise ConfigError(f"no shipped calibration folder for model {cfg.model!r}: pass --out FILE.json")
        out = folder / CALIBRATION_NAME
    plan = EvalPlan(tasks=list(cfg.tasks), contexts=list(cfg.contexts), depths=list(cfg.depths),
                    samples=cfg.samples, seed=cfg.seed)
    cases = plan.cases(loaded.tokenizer)
    max_len = max(len(c.prompt_ids) for c in cases) + 64
    engine = LLMEngine(EngineConfig(model=cfg.model, sparsity=SparsityConfig(pattern=None, token_budget=0),
                                    cache=CacheConfig(dense_pool_tokens=max_len), device=cfg.device, dtype=cfg.dtype,
                                    max_num_seqs=1, max_batched_tokens=max_len, max_model_len=max_len,
                                    prefix_cache=False), loaded)
    scale = mc.head_dim ** -0.5
    curves = [[] for _ in range(mc.num_layers)]  # per layer: one [len(grid), H_kv] per prompt
    for i, c in enumerate(cases):
        tc = time.perf_counter()
        qk = capture_prefill_qk(engine, c.prompt_ids)
        for layer in range(mc.num_layers):
            q, k = qk.pop(layer)
            curves[layer].append(head_mass_curve(q.float(), k.float(), scale, sp_defaults.prefill_block,
                                                 sp_defaults.prefill_q_block, sp_defaults.prefill_stride,
                                                 sp_defaults.prefill_estimator))
        if progress:
            print(f"calibrate-prefill: prompt {i + 1}/{len(cases)} ({c.task}, {len(c.prompt_ids)} tokens) in "
                  f"{time.perf_counter() - tc:.1f} s", flush=True)
    head_taus = [choose_taus(torch.stack(cs), cfg.target_mass) for cs in curves]
    pattern_cfg = EngineConfig(model=cfg.model, sparsity=SparsityConfig(
        pattern=cfg.pattern, static_sparsity=cfg.static_sparsity if cfg.pattern else 0.0))
    dense = build_layout(pattern_cfg, mc).dense
    layer_taus = [max((ht[h] for h in heads), default=1.0) for ht, heads in zip(head_taus, dense)]
    result = {
        "kind": CALIBRATION_KIND,
        "model": mc.name,
        "num_layers": mc.num_layers,
        "num_kv_heads": mc.num_kv_heads,
        "settings": asdict(cfg) | {"block": sp_defaults.prefill_block, "q_block": sp_defaults.prefill_q_block,
                                   "stride": sp_defaults.prefill_stride, "estimator": sp_defaults.prefill_estimator},
        "rule": "head tau: smallest grid tau whose own list holds >= target_mass of the exact mass on every "
                "prompt; layer tau: the largest over the layer's dense heads",
        "tau_grid": list(TAU_GRID),
        "layer_taus": layer_taus,
        "head_taus": head_taus,
        "dense_heads": dense,
        "worst_mass": [[[round(float(x), 4) for x in row] for row in torch.stack(cs).amin(0).tolist()]
                       for cs in curves],
        "prompts": len(cases),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    result["path"] = str(out)
    return result
