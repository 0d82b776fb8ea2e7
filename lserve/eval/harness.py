"""Accuracy harness: the same prompts through several engine configurations, side by side.

A run is a grid of tasks x context lengths x depths x samples (:mod:`lserve.eval.tasks`),
generated once, and a list of :class:`RunConfig` (dense, static only, dynamic only, LServe,
budgets, reuse intervals, learned or random patterns). Each configuration gets its own
:class:`~lserve.engine.LLMEngine` over the same loaded weights; prompts are batched through
``engine.generate`` with greedy decoding. Every scored case is appended to a JSONL file as it
finishes, so an interrupted run resumes where it stopped; the summary JSON and the plots are
rebuilt from that file.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from pathlib import Path

import torch

from lserve.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SparsityConfig
from lserve.eval.tasks import DEPTH_TASKS, EvalCase, make_case, score


@dataclass
class RunConfig:
    """One engine configuration of the comparison.

    Parameters
    ----------
    name : str
        Label in results and plots.
    pattern : str or None
        None (no streaming heads), ``"learned"`` (the model's shipped pattern), ``"random"``
        or a pattern directory/TSV.
    static_sparsity : float
        Fraction of KV heads made streaming (ignored without a pattern).
    budget : str
        Decode token budget of dense heads: ``"0"`` (off), a token count (``"1024"``) or a
        fraction of the context (``"1/8"``).
    min_budget : int
        Floor of a fractional budget (the paper's budget is never below a few pages).
    reuse_interval : int
        Page selection runs every this many decode steps.
    logical_page_size : int
        N_L of the key statistics the selector scores (the physical page stays 64 tokens).
    select_layers : str
        Layers that select pages (``SparsityConfig.select_layers``: ``auto``, ``all``, ``none``,
        ``0;5;7`` or a calibration JSON).
    adaptive_budgets : str
        Per-layer budgets around the mean ``budget`` (``SparsityConfig.adaptive_budgets``:
        ``""`` off, ``auto`` or a calibration JSON).
    prefill_sparsity : float
        Dynamic block-sparse prefill of dense heads (``SparsityConfig.prefill_sparsity``): the
        estimated attention mass each query block keeps, 0 off.
    prefill_sparsity_min_len : int
        Context from which a prefill chunk is block-sparse (``SparsityConfig.prefill_sparsity_min_len``).
    prefill_q_block : int
        Query positions sharing one block list (``SparsityConfig.prefill_q_block``, a multiple of
        the 64-token prefill block).
    """

    name: str
    pattern: str | None = None
    static_sparsity: float = 0.5
    budget: str = "0"
    min_budget: int = 0
    reuse_interval: int = 4
    select_mode: str = "kv"
    dense_layers: int = 0
    pattern_seed: int = 0
    kv_quant: str = "none"
    logical_page_size: int = 16
    select_layers: str = "auto"
    adaptive_budgets: str = ""
    prefill_sparsity: float = 0.0
    prefill_sparsity_min_len: int = SparsityConfig.prefill_sparsity_min_len
    prefill_q_block: int = SparsityConfig.prefill_q_block

    def budget_for(self, context: int, page_size: int = 64) -> int:
        """Token budget at ``context`` tokens: 0 = off, else at least two pages and ``min_budget``."""
        frac = Fraction(self.budget)
        if frac == 0:
            return 0
        tokens = int(frac * context) if frac < 1 else int(frac)
        return max(tokens, self.min_budget, 2 * page_size)

    def budget_label(self) -> str:
        return "0" if Fraction(self.budget) == 0 else self.budget

    def engine_key(self, with_reuse: bool = True) -> tuple:
        """Settings fixed per engine; configurations equal here differ only at decode (budget, and
        the reuse interval when ``with_reuse`` is False: forked variants can override it)."""
        random_seed = self.pattern_seed if self.pattern == "random" else None
        return (self.pattern, self.static_sparsity if self.pattern else 0.0, random_seed,
                self.reuse_interval if with_reuse else None, self.select_mode, self.dense_layers, self.kv_quant,
                self.logical_page_size, self.select_layers, self.adaptive_budgets,
                self.prefill_sparsity, self.prefill_sparsity_min_len, self.prefill_q_block)

    def sparsity(self, model: ModelConfig) -> SparsityConfig:
        """The engine's :class:`SparsityConfig` (budgets are set per request)."""
        from lserve.sparsity.shipped import resolve_pattern

        pattern = None if self.pattern is None else resolve_pattern(self.pattern, model)
        return SparsityConfig(pattern=pattern, static_sparsity=self.static_sparsity if pattern else 0.0,
                              token_budget=0, reuse_interval=self.reuse_interval, select_mode=self.select_mode,
                              dense_layers=self.dense_layers, pattern_seed=self.pattern_seed,
                              select_layers=self.select_layers, adaptive_budgets=self.adaptive_budgets,
                              prefill_sparsity=self.prefill_sparsity,
                              prefill_sparsity_min_len=self.prefill_sparsity_min_len,
                              prefill_q_block=self.prefill_q_block,
                              dynamic_threshold=0)  # accuracy of selection itself, at every context


# Named configurations; "<base>@<budget>" derives a budget variant (see parse_config).
PRESET_CONFIGS: dict[str, RunConfig] = {
    "dense": RunConfig("dense"),
    "static": RunConfig("static", pattern="learned"),
    "static-random-pattern": RunConfig("static-random-pattern", pattern="random"),
    "dynamic": RunConfig("dynamic", budget="1/8", min_budget=512),
    "lserve": RunConfig("lserve", pattern="learned", budget="1/8", min_budget=512),
    # The paper's behaviour: selection in every layer (``lserve`` follows the calibration).
    "lserve-all-layers": RunConfig("lserve-all-layers", pattern="learned", budget="1/8", min_budget=512,
                                   select_layers="all"),
    # Every layer selects, each with its calibrated share of a mean budget fixed in tokens, as the
    # paper fixes one per model (issue 21): 2048, the mean the shipped ratios were calibrated for.
    "lserve-adaptive": RunConfig("lserve-adaptive", pattern="learned", budget="2048",
                                 select_layers="all", adaptive_budgets="auto"),
    "lserve-no-reuse": RunConfig("lserve-no-reuse", pattern="learned", budget="1/8", min_budget=512, reuse_interval=1),
    "lserve-random-pattern": RunConfig("lserve-random-pattern", pattern="random", budget="1/8", min_budget=512),
    "lserve-query-select": RunConfig("lserve-query-select", pattern="learned", budget="1/8", min_budget=512,
                                     select_mode="query"),
    # Dynamic block-sparse prefill on top of ``lserve``: every prefill chunk, rows of 256 queries
    # (the default model's 2k-8k prompts would fit in one 2048-query row and skip little).
    "lserve-prefill-sparse": RunConfig("lserve-prefill-sparse", pattern="learned", budget="1/8", min_budget=512,
                                       prefill_sparsity=0.9, prefill_sparsity_min_len=0, prefill_q_block=256),
    # the same at tau 0.99: on the 135M model tau 0.9 lost 8k passkeys with the needle near the end
    "lserve-prefill-sparse-99": RunConfig("lserve-prefill-sparse-99", pattern="learned", budget="1/8", min_budget=512,
                                          prefill_sparsity=0.99, prefill_sparsity_min_len=0, prefill_q_block=256),
    # the shipped per-layer taus (prefill_sparsity auto) from the first token on, otherwise as served
    "lserve-prefill-auto": RunConfig("lserve-prefill-auto", pattern="learned", budget="1/8", min_budget=512,
                                     prefill_sparsity=-1.0, prefill_sparsity_min_len=0),
}


def parse_config(spec: str) -> RunConfig:
    """A configuration from its command-line spelling.

    ``NAME`` (a preset), ``NAME@BUDGET`` (a preset with another budget, no floor: ``lserve@1/32``)
    or ``NAME:key=value,...`` (fields of :class:`RunConfig` on top of a preset, or from scratch
    for a new name; e.g. ``mine:pattern=out/gates,budget=1024,reuse_interval=8``).
    """
    name, _, kv = spec.partition(":")
    base_name, _, budget = name.partition("@")
    base = PRESET_CONFIGS.get(base_name, RunConfig(base_name))
    cfg = replace(base, name=name)
    if budget:
        cfg = replace(cfg, budget=budget, min_budget=0)
    if kv:
        types = {f: type(getattr(cfg, f)) for f in asdict(cfg)}
        for item in kv.split(","):
            key, eq, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or key not in types or key == "name":
                raise ConfigError(f"bad configuration item {item!r} in {spec!r}; keys: "
                                  f"{', '.join(k for k in types if k != 'name')}")
            if key == "pattern":
                cfg.pattern = None if value in ("", "none", "None") else value
            else:
                setattr(cfg, key, (types[key] if types[key] is not type(None) else str)(value))
    if not kv and not budget and base_name not in PRESET_CONFIGS:
        raise ConfigError(f"unknown configuration {spec!r}; presets: {', '.join(PRESET_CONFIGS)} "
                          f"(or NAME@BUDGET, NAME:key=value,...)")
    try:
        Fraction(cfg.budget)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"budget must be a token count or a fraction like 1/8, got {cfg.budget!r}") from None
    return cfg


@dataclass
class EvalPlan:
    """The grid of an evaluation run."""

    tasks: list[str]
    contexts: list[int]
    depths: list[float]
    samples: int = 1
    seed: int = 0
    haystack: str | None = None

    def cases(self, tokenizer) -> list[EvalCase]:
        """Every case of the grid, generated once (tasks without depth get ``samples * len(depths)`` seeds)."""
        out = []
        for task in self.tasks:
            for ctx in self.contexts:
                if task in DEPTH_TASKS:
                    for d in self.depths:
                        for s in range(self.samples):
                            out.append(make_case(task, tokenizer, ctx, d, self.seed + s, self.haystack))
                else:
                    for s in range(self.samples * len(self.depths)):
                        out.append(make_case(task, tokenizer, ctx, None, self.seed + s, self.haystack))
        return out


def case_key(c: EvalCase) -> str:
    d = "-" if c.depth is None else f"{c.depth:.3f}"
    return f"{c.task}|{c.context}|{d}|{c.seed}"


@dataclass
class Harness:
    """Runs configurations over a plan, appending each scored case to ``out``.cases.jsonl.

    Parameters
    ----------
    out : str
        Output stem: writes ``<out>.json``, ``<out>.cases.jsonl`` and ``<out>_*.png``.
    batch_size : int
        Prompts per engine batch (each runs as many sequences as it has variants).
    fork : bool
        Prefill each prompt once per engine and fork it into its budget variants
        (:mod:`lserve.eval.fork`); False runs every (prompt, configuration) from scratch.
    rope_scaling : dict, optional
        Replaces the model's RoPE scaling (``{"rope_type": "dynamic", "factor": 2.0}``), to
        evaluate past the context the model was trained for.
    max_batched_tokens : int
        Prefill chunk of the engine.
    """

    model: str = "default"
    out: str = "benchmarks/accuracy"
    device: str = "cpu"
    dtype: str = "auto"
    backend: str = "torch"
    batch_size: int = 4
    max_batched_tokens: int = 4096
    command: str = ""
    progress: bool = True
    fork: bool = True
    rope_scaling: dict | None = None
    loaded: object = None
    _done: dict = field(default_factory=dict)

    def with_rope_scaling(self, loaded):
        """``loaded`` with this harness's RoPE scaling in its config (unchanged if none is set)."""
        if self.rope_scaling is None:
            return loaded
        return replace(loaded, config=replace(loaded.config, rope_scaling=dict(self.rope_scaling)))

    @property
    def cases_path(self) -> Path:
        return Path(self.out + ".cases.jsonl")

    def _load_done(self) -> None:
        self._done = {}
        if self.cases_path.is_file():
            for line in self.cases_path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    self._done[(r["config"], r["key"])] = r

    def _engine(self, rc: RunConfig, max_len: int, num_seqs: int):
        from lserve.engine import LLMEngine

        if self.loaded is None:  # the shipped pattern is looked up by the loaded model's identity
            from lserve.models.loader import load_model

            dtype = EngineConfig(model=self.model, device=self.device, dtype=self.dtype).torch_dtype()
            self.loaded = load_model(self.model, dtype=dtype, device=self.device)
        cc = CacheConfig(dense_pool_tokens=num_seqs * (max_len + 64), kv_quant=rc.kv_quant,
                         logical_page_size=rc.logical_page_size)
        cfg = EngineConfig(model=self.model, sparsity=rc.sparsity(self.loaded.config), cache=cc, backend=self.backend,
                           device=self.device, dtype=self.dtype, max_num_seqs=num_seqs,
                           max_batched_tokens=self.max_batched_tokens, max_model_len=max_len)
        eng = LLMEngine(cfg, self.loaded)
        self.loaded = eng.loaded
        return eng

    def run(self, configs: list[RunConfig], plan: EvalPlan) -> dict:
        """Evaluate every configuration on every case of ``plan``; returns the summary (also written)."""
        from lserve.engine import SamplingParams
        from lserve.eval.fork import generate_variants
        from lserve.models.loader import load_model

        if self.loaded is None:
            dtype = EngineConfig(model=self.model, device=self.device, dtype=self.dtype).torch_dtype()
            self.loaded = self.with_rope_scaling(load_model(self.model, dtype=dtype, device=self.device))
        Path(self.out).parent.mkdir(parents=True, exist_ok=True)
        self._load_done()
        cases = plan.cases(self.loaded.tokenizer)
        bar = None
        todo = sum(1 for rc in configs for c in cases if (rc.name, case_key(c)) not in self._done)
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=todo, desc="eval", unit="case", dynamic_ncols=True)
        groups: dict[tuple, list[RunConfig]] = {}
        for rc in configs:
            groups.setdefault(rc.engine_key(with_reuse=not self.fork), []).append(rc)
        # Shortest contexts first, every engine group at each length, so that a cut run still
        # holds complete comparisons at the lengths it reached.
        for ctx, rcs in [(x, g) for x in sorted({c.context for c in cases}) for g in groups.values()]:
            pending = [(c, [rc for rc in rcs if (rc.name, case_key(c)) not in self._done])
                       for c in cases if c.context == ctx]
            pending = [(c, v) for c, v in pending if v]
            if not pending:
                continue
            width = max(len(v) for _, v in pending)
            eng = self._engine(rcs[0], max(c.context + c.max_tokens for c, _ in pending), self.batch_size * width)
            with self.cases_path.open("a") as f:
                for i in range(0, len(pending), self.batch_size):
                    batch = pending[i: i + self.batch_size]
                    params = [[SamplingParams(max_tokens=c.max_tokens, temperature=0.0,
                                              token_budget=rc.budget_for(c.context)) for rc in v] for c, v in batch]
                    t0, tiles0 = time.perf_counter(), list(eng.backend.prefill_tiles)
                    if self.fork:
                        reuse = [[rc.reuse_interval for rc in v] for _, v in batch]
                        outs = generate_variants(eng, [c.prompt_ids for c, _ in batch], params, reuse)
                    else:  # one request per (prompt, configuration): singleton variant lists fork nothing
                        flat = generate_variants(eng, [c.prompt_ids for c, v in batch for _ in v],
                                                 [[p] for ps in params for p in ps])
                        it = iter(flat)
                        outs = [[next(it)[0] for _ in v] for _, v in batch]
                    dt = time.perf_counter() - t0
                    kept_frac = eng.backend.prefill_kept_since(tiles0)  # the batch's block-sparse prefill
                    n_out = sum(len(v) for _, v in batch)
                    for (c, v), os_, ps in zip(batch, outs, params):
                        for rc, o, p in zip(v, os_, ps):
                            rec = {"config": rc.name, "key": case_key(c), "task": c.task, "context": c.context,
                                   "depth": c.depth, "seed": c.seed, "budget": p.token_budget,
                                   "score": score(c, o.text), "answers": c.answers, "output": o.text,
                                   "shared_prefill": self.fork and len(v) > 1,
                                   "kv_read_fraction": o.metrics.get("kv_read_fraction"),
                                   "kv_read_head_tokens": o.metrics.get("kv_read_head_tokens"),
                                   "kv_dense_head_tokens": o.metrics.get("kv_dense_head_tokens"),
                                   "prefill_kept_fraction": kept_frac, "batch_seconds": round(dt, 2)}
                            f.write(json.dumps(rec) + "\n")
                            self._done[(rc.name, rec["key"])] = rec
                    f.flush()
                    if bar is not None:
                        bar.update(n_out)
                        bar.set_postfix(engine=rcs[0].name, ctx=batch[-1][0].context)
            del eng
        if bar is not None:
            bar.close()
        return self.summarize(configs, plan, cases)

    def summarize(self, configs: list[RunConfig], plan: EvalPlan, cases: list[EvalCase] | None = None) -> dict:
        """Aggregate the cases file into ``<out>.json`` and the plots; returns the summary.

        Rows aggregate every scored case of the listed configurations in the cases file, also
        those of earlier commands with other grids (each row says its ``n``); ``status`` says
        whether the current plan's cases are all done, and ``commands`` lists every command
        that wrote to this output. Each row's ``kv_read_fraction`` is the share of dense
        attention's decode KV bytes its cases read (:mod:`lserve.sparsity.kv_read`).
        """
        self._load_done()
        keys = {case_key(c) for c in cases} if cases is not None else set()
        rows, depth_rows = [], []
        for rc in configs:
            recs = [r for (name, _), r in self._done.items() if name == rc.name]
            groups: dict[tuple, list] = {}
            dgroups: dict[tuple, list] = {}
            for r in recs:
                groups.setdefault((r["task"], r["context"]), []).append(r)
                if r["depth"] is not None:
                    dgroups.setdefault((r["task"], r["context"], r["depth"]), []).append(r)
            for (task, ctx), rs in sorted(groups.items()):
                rows.append({"config": rc.name, "task": task, "context": ctx, "budget": rs[0]["budget"],
                             "budget_spec": rc.budget_label(), "accuracy": round(sum(r["score"] for r in rs) / len(rs), 2),
                             "n": len(rs), "pattern": rc.pattern, "static_sparsity": rc.static_sparsity if rc.pattern else 0.0,
                             "reuse_interval": rc.reuse_interval, "select_mode": rc.select_mode,
                             "kv_read_fraction": kv_read_fraction(rs),
                             "prefill_kept_fraction": prefill_kept_fraction(rs)})
            for (task, ctx, d), rs in sorted(dgroups.items()):
                depth_rows.append({"config": rc.name, "task": task, "context": ctx, "depth": d,
                                   "accuracy": round(sum(r["score"] for r in rs) / len(rs), 2), "n": len(rs)})
        expected = len(configs) * len(keys)
        got = sum(1 for rc in configs for k in keys if (rc.name, k) in self._done)
        previous = Path(self.out + ".json")
        commands = json.loads(previous.read_text()).get("commands", []) if previous.is_file() else []
        if self.command and self.command not in commands:
            commands.append(self.command)
        summary = {
            "command": commands[0] if commands else self.command,  # the first (the documented grid)
            "commands": commands,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "status": "complete" if got >= expected else f"partial: {got} of {expected} cases of this command's grid",
            "model": getattr(getattr(self.loaded, "config", None), "name", self.model),
            "device": self.device if not self.device.startswith("cuda") else
            f"{self.device} ({torch.cuda.get_device_name() if torch.cuda.is_available() else '?'})",
            "host": platform.node(),
            "plan": asdict(plan),
            "configs": [asdict(rc) for rc in configs],
            "rows": rows,
            "depth_rows": depth_rows,
            "comparisons": compare(rows),
        }
        Path(self.out + ".json").write_text(json.dumps(summary, indent=1) + "\n")
        from lserve.eval.plots import plot_all

        plot_all(summary, self.out)
        return summary


def kv_read_fraction(records: list[dict]) -> float | None:
    """Share of dense attention's decode KV bytes the cases read: their read head-tokens over
    their dense head-tokens (None when no case recorded them, e.g. cases of older runs)."""
    got = [r for r in records if r.get("kv_dense_head_tokens")]
    if not got:
        return None
    return round(sum(r["kv_read_head_tokens"] for r in got) / sum(r["kv_dense_head_tokens"] for r in got), 4)


def prefill_kept_fraction(records: list[dict]) -> float | None:
    """Mean over the cases of the dense heads' kept share of causal prefill tiles (block-sparse
    prefill; None when no case ran it)."""
    got = [r["prefill_kept_fraction"] for r in records if r.get("prefill_kept_fraction") is not None]
    return round(sum(got) / len(got), 4) if got else None


def compare(rows: list[dict]) -> list[dict]:
    """Accuracy differences that the claims are about, per (task, context).

    ``lserve - dense``, ``lserve-random-pattern - dense``, ``lserve - lserve-no-reuse`` and
    ``static - dense`` where both sides exist.
    """
    by = {(r["config"], r["task"], r["context"]): r for r in rows}
    pairs = [("lserve", "dense"), ("lserve-random-pattern", "dense"), ("lserve", "lserve-no-reuse"),
             ("static", "dense"), ("dynamic", "dense"), ("static-random-pattern", "dense")]
    out = []
    for a, b in pairs:
        for (cfg, task, ctx), r in sorted(by.items()):
            if cfg == a and (b, task, ctx) in by:
                o = by[(b, task, ctx)]
                out.append({"a": a, "b": b, "task": task, "context": ctx, "a_accuracy": r["accuracy"],
                            "b_accuracy": o["accuracy"], "diff": round(r["accuracy"] - o["accuracy"], 2),
                            "n": min(r["n"], o["n"]), "stderr_diff": _stderr_diff(r, o)})
    return out


def _stderr_diff(r: dict, o: dict) -> float:
    """Rough standard error (points) of a difference of two accuracies on independent-looking samples."""
    def var(x):
        p = x["accuracy"] / 100
        return p * (1 - p) / max(x["n"], 1)

    return round(100 * math.sqrt(var(r) + var(o)), 2)
