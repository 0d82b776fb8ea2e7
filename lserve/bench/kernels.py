"""Kernel benchmark: one attention layer of a preset's shape (``--model``, default llama3-8b:
32 query / 8 KV heads, head_dim 128; qwen2.5-7b: 28 / 4, GQA group 7), bf16, batch 1, on the GPU,
our kernels against torch SDPA. Head counts below are llama3-8b's; half the KV heads stream.

Decode (contexts 4k..256k), per step of one layer:

* ``sdpa_ms``: ``F.scaled_dot_product_attention`` over contiguous K/V of the whole context.
* ``dense_ms``: our decode kernel, all 8 heads dense, every page (paged cache, page 64).
* ``streaming_ms``: 4 streaming heads (sink 128 / local 256) + 4 dense heads reading every page.
* ``dynamic_ms``: all 8 heads dense with a 4096-token budget (attention kernel on a reuse step).
* ``lserve_ms``: 4 streaming + 4 dense heads with the 4096-token budget, averaged over a
  reuse cycle of 4 steps as it runs (1 step: selector + attention, 3 steps: attention reading the
  stored selection).
* ``selector_ms``: the page selector alone (scores + top-k) for the 4 dense heads; its parts
  ``selector_scores_ms`` / ``selector_topk_ms``, and for comparison the CUDA-core score kernel
  (``selector_scores_cuda_ms``, and with fewer heads per CTA: ``_hpc1`` / ``_hpc2``).
* ``selector_reuse_ms``: what the selector stage adds to a reuse step (it launches nothing:
  the decode kernel reads the stored selection), measured as the difference between graphs of
  reuse steps with and without the stage call (so it is noise around zero).
* ``lserve_select_step_ms`` / ``lserve_reuse_step_ms``: the two kinds of LServe steps.
* ``selector_floor_ms``: bytes the selector must read (kmax + kmin of every page) over the
  measured copy bandwidth.

Prefill (8k, 32k, 128k): ``sdpa_ms`` = causal SDPA on all 32 heads; ``lserve_ms`` = 50%
streaming heads (sink 128 / local 256) through ``ls_prefill`` plus SDPA for the dense half, as
the backend runs it; extra keys: the local-8192 variant, the parts, and our mma kernel in
dense mode (the measurement behind the backend using SDPA for dense heads).

Timing: decode steps are captured in CUDA graphs (many steps per graph, rotating through
enough copies of the cache to defeat the 60 MB L2 at short contexts) and replayed; prefill
calls are timed with CUDA events. Warm-up first, medians reported. Cache writes are not timed
(neither side of the comparison appends to a cache).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lserve.bench.report import header, write_json
from lserve.config import ConfigError
from lserve.models.presets import layer_config
from lserve.plotting import pyplot

DEFAULT_MODEL = "llama3-8b"
DECODE_CONTEXTS = (4096, 16384, 65536, 131072, 262144)
PREFILL_CONTEXTS = (8192, 32768, 131072)
DENSE_KERNEL_PREFILL_MAX = 32768  # our mma kernel in dense mode is timed up to this context
PAGE, LOGICAL, BUDGET, REUSE = 64, 16, 4096, 4
SINK, LOCAL, LOCAL_PREFILL_LONG = 128, 256, 8192
ROTATE_BYTES = 320 << 20  # rotate cache copies until this many bytes are touched per pass


def median_events(fn, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


TIMING_NOTES: list[str] = []


def graph_time(step, n_inner: int, replays: int = 15) -> float:
    """Milliseconds per call of ``step(i)``, i = 0..n_inner-1, captured in one CUDA graph
    (falls back to timing the eager loop, noted in the report, if capture fails)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n_inner):  # warm-up: compiles kernels, builds cached tables
            step(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def loop():
        for i in range(n_inner):
            step(i)

    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            loop()
        g.replay()
        torch.cuda.synchronize()
        run = g.replay
    except RuntimeError as e:  # keep measuring, but say so
        torch.cuda.synchronize()
        TIMING_NOTES.append(f"graph capture failed ({str(e).splitlines()[0][:200]}); eager loop timed")
        run = loop
    return median_events(run, replays) / n_inner


def copy_bandwidth_tbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = median_events(lambda: b.copy_(a), 10)
    return 2 * nbytes / (ms * 1e-3) / 1e12


class DecodeSetup:
    """A cache holding ``n_sets`` copies of a batch-1 sequence of ``context`` tokens and the
    backends (default: budget 0 and budget 4096) over it."""

    def __init__(self, mc, context: int, n_dense: int, n_sets: int, budgets: tuple[int, ...] = (0, BUDGET)) -> None:
        from lserve.attention.cupy_backend import CupyBackend
        from lserve.cache.kv_cache import KVCache
        from lserve.config import CacheConfig, SparsityConfig
        from lserve.sparsity.plan import SeqStep

        self.context, self.n_sets, self.n_dense = context, n_sets, n_dense
        pages = -(-context // PAGE)
        cc = CacheConfig(page_size=PAGE, logical_page_size=LOGICAL, num_pages=pages * n_sets)
        self.cache = KVCache(mc, cc, [n_dense], SINK, LOCAL, n_sets, torch.bfloat16, "cuda")
        gen = torch.Generator(device="cuda").manual_seed(context + n_dense)
        for pool in self.cache.dense + self.cache.stream:
            for t in (pool.k, pool.v):
                if t.numel():
                    t.normal_(generator=gen)
        st = self.cache.stats[0]
        if st.kmax.numel():
            st.kmax.normal_(generator=gen)
            st.kmin.copy_(st.kmax - torch.rand(st.kmax.shape, device="cuda", generator=gen).to(st.kmax.dtype) * 2)
        pattern = "random" if n_dense < mc.num_kv_heads else None
        self.backends = {}
        for budget in budgets:
            sp = SparsityConfig(pattern=pattern, sink_tokens=SINK, local_tokens=LOCAL, token_budget=budget,
                                reuse_interval=REUSE)
            self.backends[budget] = CupyBackend(mc, sp, self.cache)
        self.q = [torch.randn(1, mc.num_heads, mc.head_dim, device="cuda", generator=gen).to(torch.bfloat16)
                  for _ in range(n_sets)]
        self.out = torch.empty_like(self.q[0])
        ring = self.cache.stream_pages_per_seq
        # Per set: tables of a selection step and of a reuse step (same position).
        self.tables = {}
        for budget, be in self.backends.items():
            sel, reuse = [], []
            for i in range(n_sets):
                step = SeqStep(i, context - 1, 1, True, list(range(i * pages, (i + 1) * pages)),
                               list(range(i * ring, (i + 1) * ring)))
                sel.append(be.plan([step]).tables)
                reuse.append(be.plan([step]).tables)
            self.tables[budget] = (sel, reuse)

    def select_all(self, budget: int = BUDGET) -> None:
        """Run the selector once on every set, so the reuse-step tables read a stored selection."""
        be = self.backends[budget]
        sel, _ = self.tables[budget]
        for j in range(self.n_sets):
            if sel[j].n_sel_rows:
                be.select(0, self.q[j], sel[j])

    # Steps over the rotating sets (step i uses set i % n_sets), as CUDA-graph bodies.
    def selector(self, i: int) -> None:
        """The page selector alone (scores + top-k)."""
        be, (sel, _), j = self.backends[BUDGET], self.tables[BUDGET], i % self.n_sets
        be.select(0, self.q[j], sel[j])

    def select_step(self, i: int) -> None:
        """A LServe step that runs the selector, then attention over its selection."""
        be, (sel, _), j = self.backends[BUDGET], self.tables[BUDGET], i % self.n_sets
        be.select_stage(0, self.q[j], sel[j])
        be.decode(0, self.q[j], self.out, sel[j])

    def reuse_step(self, i: int, merge: bool = True, budget: int = BUDGET) -> None:
        """A LServe step that reads the stored selection (``merge=False``: attention kernel alone)."""
        be, (_, reuse), j = self.backends[budget], self.tables[budget], i % self.n_sets
        be.decode(0, self.q[j], self.out, reuse[j], merge=merge)

    def cycle_step(self, i: int, budget: int = BUDGET) -> None:
        """Step i of the reuse cycle: each set selects on every REUSE-th pass over the sets."""
        be, (sel, reuse), j = self.backends[budget], self.tables[budget], i % self.n_sets
        st = sel[j] if (i // self.n_sets) % REUSE == 0 else reuse[j]
        be.select_stage(0, self.q[j], st)
        be.decode(0, self.q[j], self.out, st)

    def cycle_steps(self) -> int:
        """Graph steps covering whole reuse cycles of every set (at least 8 passes' worth)."""
        return self.n_sets * REUSE * max(1, math.ceil(8 / self.n_sets))

    def selector_bytes(self) -> int:
        st = self.cache.stats[0]
        return 2 * (-(-self.context // PAGE)) * st.g * self.n_dense * st.kmax.shape[-1] * st.kmax.element_size()


def sdpa_decode_ms(mc, context: int, n_sets: int, inner: int) -> float:
    """SDPA decode over contiguous K/V [1, Hkv, context, D] (n_sets copies, rotated)."""
    ks = [torch.randn(1, mc.num_kv_heads, context, mc.head_dim, device="cuda", dtype=torch.bfloat16)
          for _ in range(n_sets)]
    vs = [torch.randn_like(k) for k in ks]
    qs = [torch.randn(1, mc.num_heads, 1, mc.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(n_sets)]

    def sdpa(i):
        j = i % n_sets
        F.scaled_dot_product_attention(qs[j], ks[j], vs[j], enable_gqa=True)

    return graph_time(sdpa, inner)


def _kv_bytes(mc, context: int) -> int:
    """Bytes of bf16 K and V of one layer of shape ``mc`` at ``context`` tokens."""
    return context * mc.num_kv_heads * mc.head_dim * 2 * 2


def rotation(mc, context: int) -> tuple[int, int]:
    """(cache copies, graph steps): copies rotated so a pass touches ROTATE_BYTES of K/V (L2 stays
    cold), and at least 32 steps per graph, a whole number of rotations."""
    n_sets = max(1, min(16, math.ceil(ROTATE_BYTES / _kv_bytes(mc, context))))
    return n_sets, n_sets * max(1, math.ceil(32 / n_sets))


def head_splits(mc) -> tuple[tuple[int, tuple[str, str]], ...]:
    """(dense KV heads, (plain key, budget key)) of the two decode layouts: every KV head dense,
    then half of them streaming."""
    return ((mc.num_kv_heads, ("dense_ms", "dynamic_ms")), (mc.num_kv_heads // 2, ("streaming_ms", "lserve_ms")))


def _decode_row(mc, context: int, bw_tbps: float) -> dict:
    n_sets, inner = rotation(mc, context)
    row = {"context": context, "cache_copies": n_sets}

    row["sdpa_ms"] = sdpa_decode_ms(mc, context, n_sets, inner)
    torch.cuda.empty_cache()

    for n_dense, (plain_key, dyn_key) in head_splits(mc):
        s = DecodeSetup(mc, context, n_dense, n_sets)
        be0 = s.backends[0]
        sel0, _ = s.tables[0]

        def plain(i, s=s, be0=be0, sel0=sel0):
            j = i % s.n_sets
            be0.decode(0, s.q[j], s.out, sel0[j])

        row[plain_key] = graph_time(plain, inner)
        be = s.backends[BUDGET]
        sel, reuse = s.tables[BUDGET]
        dynamic = sel[0].dec[0].dynamic
        if n_dense == mc.num_kv_heads:
            s.select_all()  # attention alone on a reuse step (the selection stored by a first select)

            row[dyn_key] = graph_time(s.reuse_step, inner)
        else:
            row[dyn_key] = graph_time(s.cycle_step, s.cycle_steps())

            def reuse_step(i, s=s, be=be, reuse=reuse):
                j = i % s.n_sets
                be.select_stage(0, s.q[j], reuse[j])
                be.decode(0, s.q[j], s.out, reuse[j])

            row["lserve_reuse_step_ms"] = graph_time(s.reuse_step, inner)
            # The selector stage of a reuse step launches nothing; its cost is what it adds to
            # the step, measured as the difference of the two graphs (noise-level by design).
            row["selector_reuse_ms"] = graph_time(reuse_step, inner) - row["lserve_reuse_step_ms"]
            if dynamic:
                row["selector_ms"] = graph_time(s.selector, inner)
                row["lserve_select_step_ms"] = graph_time(s.select_step, inner)
                be.select(0, s.q[0], sel[0])  # leaves the score buffer the top-k part reads
                for part in ("scores", "topk"):
                    row[f"selector_{part}_ms"] = graph_time(
                        lambda i, s=s, be=be, sel=sel, part=part: be.select(0, s.q[0], sel[0], only=part), inner)
                # The CUDA-core score kernel (4 heads per CTA, and fewer), for comparison.
                impl, be.score_impl = be.score_impl, "cuda"
                for hpc, key in ((None, "cuda"), (1, "hpc1"), (2, "hpc2")):
                    be.score_hpc = hpc
                    row[f"selector_scores_{key}_ms"] = graph_time(
                        lambda i, s=s, be=be, sel=sel: be.select(0, s.q[0], sel[0], only="scores"), inner)
                be.score_hpc, be.score_impl = None, impl
            else:  # the context fits the budget: no selection happens at all
                row["selector_ms"] = row["lserve_select_step_ms"] = None
            row["lserve_attn_kernel_ms"] = graph_time(lambda i, s=s: s.reuse_step(i, merge=False), inner)
            row["selector_floor_ms"] = s.selector_bytes() / (bw_tbps * 1e12) * 1e3
            row["dynamic_active"] = bool(dynamic)
        del s
        torch.cuda.empty_cache()
    row["kv_hbm_floor_ms"] = _kv_bytes(mc, context) / (bw_tbps * 1e12) * 1e3
    return row


ADAPTIVE_CONTEXTS = (65536, 131072, 262144)


def adaptive_layers(model: str, spec: str) -> dict:
    """Per-layer decode budgets of the whole preset (``num_layers`` layers) at the mean BUDGET, for
    the adaptive comparison.

    ``spec``: ``"resampled"`` (the default model's calibration resampled to the preset's layers,
    :func:`~lserve.sparsity.adaptive_budget.resample_calibration`: presets have random weights
    and no calibration of their own) or a calibration file for that many layers. Every layer is
    taken to be the timed one (half its KV heads dense), so the dense-head-weighted mean is the
    plain mean. Returns the ratios, where they came from, and ``layer_tokens``: what each layer
    keeps, rounded down to whole pages as the engine does.
    """
    from lserve.models.presets import PRESETS
    from lserve.sparsity.adaptive_budget import layer_pages, load_ratios, resample_calibration

    mc = layer_config(model)
    num_layers = PRESETS[model]["num_layers"]
    if spec == "resampled":
        rec = resample_calibration([mc.num_kv_heads // 2] * num_layers)
        info = {k: rec[k] for k in ("resampled", "resampled_from", "source_layers", "rule")}
        ratios = rec["ratios"]
    else:
        ratios, info = list(load_ratios(spec, num_layers)), {"resampled": False, "file": spec}
    tokens = [layer_pages(r, BUDGET // PAGE, PAGE) * PAGE for r in ratios]
    return {"spec": spec, "layers": num_layers, "mean_budget": BUDGET, **info, "ratios": ratios,
            "layer_tokens": tokens, "mean_tokens": round(sum(tokens) / num_layers, 1)}


def adaptive_times(mc, context: int, budgets) -> dict[int, dict[str, float]]:
    """Per token budget: ``attention_ms`` (a reuse step: the decode kernel over the stored
    selection) and ``cycle_ms`` (selector + attention averaged over a reuse cycle) of one layer
    with half its KV heads dense, all budgets over one cache."""
    n_sets, inner = rotation(mc, context)
    s = DecodeSetup(mc, context, mc.num_kv_heads // 2, n_sets, budgets=tuple(budgets))
    out = {}
    for b in budgets:
        s.select_all(b)
        out[b] = {"attention_ms": graph_time(lambda i, b=b, s=s: s.reuse_step(i, budget=b), inner),
                  "cycle_ms": graph_time(lambda i, b=b, s=s: s.cycle_step(i, budget=b), s.cycle_steps())}
    del s
    torch.cuda.empty_cache()
    return out


def adaptive_row(mc, context: int, layer_tokens: list[int]) -> dict:
    """The sum over the layers of each layer's time at its own budget against ``num_layers`` x the
    uniform budget's, one layer timed per distinct budget (:func:`adaptive_times`)."""
    times = adaptive_times(mc, context, sorted(set(layer_tokens) | {BUDGET}))
    row = {"context": context, "per_budget": {str(b): t for b, t in times.items()}}
    for key in ("attention_ms", "cycle_ms"):
        adaptive = sum(times[t][key] for t in layer_tokens)
        uniform = len(layer_tokens) * times[BUDGET][key]
        row[f"adaptive_{key}"], row[f"uniform_{key}"] = adaptive, uniform
        row[f"adaptive_over_uniform_{key.removesuffix('_ms')}"] = round(adaptive / uniform, 4)
    return row


def prefill_backend(mc, n_dense: int, local: int):
    from lserve.attention.cupy_backend import CupyBackend
    from lserve.cache.kv_cache import KVCache
    from lserve.config import CacheConfig, SparsityConfig

    cc = CacheConfig(page_size=PAGE, logical_page_size=LOGICAL, num_pages=4)
    pattern = "random" if n_dense < mc.num_kv_heads else None
    cache = KVCache(mc, cc, [n_dense], SINK, local, 1, torch.bfloat16, "cuda")
    sp = SparsityConfig(pattern=pattern, sink_tokens=SINK, local_tokens=local, token_budget=0)
    return CupyBackend(mc, sp, cache)


def _sdpa_backends(qt, kt, vt, iters: int) -> dict:
    """Causal SDPA forced onto each of torch's fused backends (contiguous [1, H, L, D], K/V
    repeated to the query heads: not every backend takes GQA); ms, or why it did not run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    G = qt.shape[1] // kt.shape[1]
    qkv = [qt.contiguous(), kt.repeat_interleave(G, dim=1), vt.repeat_interleave(G, dim=1)]
    res = {}
    for name, b in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                    ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(b):
                res[name] = median_events(lambda: F.scaled_dot_product_attention(*qkv, is_causal=True), iters)
        except RuntimeError as e:
            res[name] = f"not run: {str(e).splitlines()[0][:160]}"
    qkv.clear()
    torch.cuda.empty_cache()
    return res


def _prefill_row(mc, context: int) -> dict:
    from lserve.sparsity.plan import SeqStep

    H, Hkv, D = mc.num_heads, mc.num_kv_heads, mc.head_dim
    G, nd = mc.group_size, Hkv // 2  # half the KV heads dense (first), half streaming
    iters = 3 if context >= 65536 else 7
    q = torch.randn(context, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(context, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(context, Hkv, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    row = {"context": context}
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, L, D] views

    def sdpa():
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    row["sdpa_ms"] = median_events(sdpa, iters)
    flops = 4 * H * D * context * (context + 1) / 2
    row["sdpa_tflops"] = flops / (row["sdpa_ms"] * 1e-3) / 1e12
    row["sdpa_backend_ms"] = _sdpa_backends(qt, kt, vt, iters)
    step = SeqStep(0, 0, context, False, [], [])
    for local, key in ((LOCAL, "lserve_ms"), (LOCAL_PREFILL_LONG, "lserve_local8192_ms")):
        be = prefill_backend(mc, nd, local)
        st = be.plan([with_pages(be, step, context)]).tables
        row[key] = median_events(lambda be=be, st=st: be.prefill(0, q, k, v, out, st), iters)
        if local == LOCAL:
            row["lserve_streaming_part_ms"] = median_events(
                lambda be=be, st=st: be.prefill_kernel(q, k, v, out, st, nd * G, (Hkv - nd) * G, True), iters)
            row["lserve_dense_part_ms"] = row["lserve_ms"] - row["lserve_streaming_part_ms"]
        else:
            row["lserve_local8192_streaming_part_ms"] = median_events(
                lambda be=be, st=st: be.prefill_kernel(q, k, v, out, st, nd * G, (Hkv - nd) * G, True), iters)
    if context <= DENSE_KERNEL_PREFILL_MAX:
        be = prefill_backend(mc, Hkv, LOCAL)
        st = be.plan([with_pages(be, step, context)]).tables
        row["kernel_dense_ms"] = median_events(lambda: be.prefill_kernel(q, k, v, out, st, 0, H, False), iters)
        row["kernel_dense_tflops"] = flops / (row["kernel_dense_ms"] * 1e-3) / 1e12
    return row


def with_pages(be, step, context: int):
    """The prefill step with enough (fake) page ids to pass the planner's size check."""
    from lserve.sparsity.plan import SeqStep

    n = -(-context // PAGE)
    ring = be.cache.stream_pages_per_seq
    return SeqStep(step.seq_id, 0, context, False, list(range(n)), list(range(ring)))


def _plot(report: dict, png: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    dec = report["decode"]
    x = [r["context"] for r in dec]
    for key, label in (("sdpa_ms", "SDPA dense"), ("dense_ms", "ours dense"), ("streaming_ms", "ours 50% streaming"),
                       ("dynamic_ms", "ours dynamic (4096)"), ("lserve_ms", "LServe (streaming+dynamic, C=4)"),
                       ("selector_ms", "page selector"), ("selector_floor_ms", "selector HBM floor")):
        pts = [(c, r.get(key)) for c, r in zip(x, dec) if r.get(key)]
        if pts:
            a.plot(*zip(*pts), marker="o", label=label, linestyle="--" if "floor" in key else "-")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("context (tokens)")
    a.set_ylabel("ms per layer")
    a.set_title(f"decode, one {report['model']} layer, batch 1")
    a.legend(fontsize=7)
    pre = report["prefill"]
    x = [r["context"] for r in pre]
    for key, label in (("sdpa_ms", "SDPA dense causal"), ("lserve_ms", "LServe 50% streaming (local 256)"),
                       ("lserve_local8192_ms", "LServe 50% streaming (local 8192)")):
        b.plot(x, [r[key] for r in pre], marker="o", label=label)
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("context (tokens)")
    b.set_ylabel("ms per layer")
    b.set_title("prefill")
    b.legend(fontsize=7)
    fig.suptitle(f"{report['device']} — {report['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def summary_table(report: dict) -> str:
    """A short text table of the report."""
    lines = [f"copy bandwidth {report['copy_bandwidth_TBps']:.2f} TB/s",
             "decode   context  sdpa_ms  dense_ms  stream_ms  dyn_ms  lserve_ms  sel_ms  sel_floor  lserve_x",
             ]
    def f(x, w):
        return f"{x:{w}.4f}" if x is not None else f"{'-':>{w}}"

    for r in report["decode"]:
        lines.append(f"       {r['context']:>8d}  {f(r['sdpa_ms'], 7)}  {f(r['dense_ms'], 8)}  {f(r['streaming_ms'], 9)}"
                     f"  {f(r['dynamic_ms'], 6)}  {f(r['lserve_ms'], 9)}  {f(r['selector_ms'], 6)}"
                     f"  {f(r['selector_floor_ms'], 9)}  {r['sdpa_ms'] / r['lserve_ms']:7.1f}x")
    ad = report.get("adaptive")
    if ad:
        lines.append(f"adaptive budgets ({ad['spec']}{', resampled from ' + ad['resampled_from'] if ad['resampled'] else ''}"
                     f"; mean {ad['mean_tokens']} tokens over {ad['layers']} layers): sum over layers, adaptive / uniform "
                     f"{BUDGET} (target <= 1.05)")
        lines.append("adaptive context  attn_adaptive_ms  attn_uniform_ms  attn_ratio  cycle_ratio")
        for r in ad["rows"]:
            lines.append(f"       {r['context']:>8d}  {r['adaptive_attention_ms']:16.4f}  {r['uniform_attention_ms']:15.4f}"
                         f"  {r['adaptive_over_uniform_attention']:10.4f}  {r['adaptive_over_uniform_cycle']:11.4f}")
    lines.append("prefill  context  sdpa_ms  lserve_ms  speedup  local8192_ms  kernel_dense_ms")
    for r in report["prefill"]:
        kd = r.get("kernel_dense_ms")
        lines.append(f"       {r['context']:>8d}  {r['sdpa_ms']:7.2f}  {r['lserve_ms']:9.2f}  "
                     f"{r['sdpa_ms'] / r['lserve_ms']:6.2f}x  {r['lserve_local8192_ms']:12.2f}  "
                     f"{'-' if kd is None else f'{kd:.2f}':>15}")
    return "\n".join(lines)


def report_name(model: str, adaptive_only: bool = False) -> str:
    """The report's file name: ``kernels_h200.json`` for the default model, else with the preset's
    name; ``kernels_adaptive...`` for the adaptive comparison alone."""
    stem = "kernels_adaptive" if adaptive_only else "kernels"
    return f"{stem}_h200.json" if model == DEFAULT_MODEL else f"{stem}_{model}_h200.json"


def run_kernel_bench(out_path: str | Path = "benchmarks/kernels_h200.json",
                     decode_contexts=DECODE_CONTEXTS, prefill_contexts=PREFILL_CONTEXTS,
                     command: str | None = None, model: str = DEFAULT_MODEL, adaptive_budgets: str | None = None,
                     adaptive_contexts=ADAPTIVE_CONTEXTS) -> dict:
    """Run the whole kernel benchmark and write the JSON report and its PNG.

    Parameters
    ----------
    out_path : str or Path
        The JSON file (a directory gets :func:`report_name` inside); the PNG goes beside it
        with the same stem.
    decode_contexts, prefill_contexts : sequence of int
        Context lengths to measure.
    command : str, optional
        The command line recorded in the report (default: this process's argv).
    model : str
        The preset whose attention layer is timed (:func:`lserve.models.presets.layer_config`).
    adaptive_budgets : str, optional
        Also compare per-layer budgets of the same mean with the uniform BUDGET at
        ``adaptive_contexts`` (:func:`adaptive_layers`, :func:`adaptive_row`; the report's
        ``adaptive``). Pass empty ``decode_contexts`` and ``prefill_contexts`` for that alone.

    Returns
    -------
    dict
        The report (also written to disk).
    """
    mc = layer_config(model)  # a bad name is refused before anything else
    adaptive = adaptive_layers(model, adaptive_budgets) if adaptive_budgets else None  # so is a bad file
    if not torch.cuda.is_available():
        raise ConfigError("lserve bench kernels times CUDA kernels and needs a CUDA GPU; none is visible here")
    out = Path(out_path)
    if out.suffix != ".json":
        out = out / report_name(model)
    t0 = time.time()
    report = header()
    if command:
        report["command"] = command
    report["model"] = model
    report["copy_bandwidth_TBps"] = copy_bandwidth_tbps()
    H, Hkv = mc.num_heads, mc.num_kv_heads
    report["config"] = {"model": f"{model} layer: {H} q heads, {Hkv} KV heads (GQA group {mc.group_size}), "
                                 f"head_dim {mc.head_dim}, bf16, batch 1",
                        "page_size": PAGE, "logical_page_size": LOGICAL, "token_budget": BUDGET,
                        "reuse_interval": REUSE, "sink": SINK, "local": LOCAL,
                        "streaming_heads": f"{Hkv - Hkv // 2} of {Hkv}",
                        "timing": "decode: CUDA-graph replay, median per step; prefill: CUDA events, median"}
    report["decode"] = []
    for ctx in decode_contexts:
        report["decode"].append(_decode_row(mc, ctx, report["copy_bandwidth_TBps"]))
        torch.cuda.empty_cache()
        print(f"decode {ctx}: {report['decode'][-1]}", file=sys.stderr, flush=True)
    report["prefill"] = []
    for ctx in prefill_contexts:
        report["prefill"].append(_prefill_row(mc, ctx))
        torch.cuda.empty_cache()
        print(f"prefill {ctx}: {report['prefill'][-1]}", file=sys.stderr, flush=True)
    if adaptive is not None:
        report["adaptive"] = adaptive
        adaptive["rows"] = []
        for ctx in adaptive_contexts:
            adaptive["rows"].append(adaptive_row(mc, ctx, adaptive["layer_tokens"]))
            print(f"adaptive {ctx}: {adaptive['rows'][-1]}", file=sys.stderr, flush=True)
    report["timing_notes"] = sorted(set(TIMING_NOTES))
    report["seconds"] = round(time.time() - t0, 1)
    write_json(out, report)
    if report["decode"] or report["prefill"]:  # the adaptive comparison alone is a table
        _plot(report, out.with_suffix(".png"))
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m lserve.bench.kernels [OUT] [--model M] [--adaptive-budgets SPEC [--adaptive-only]]``."""
    import argparse
    import os

    ap = argparse.ArgumentParser(description="one attention layer of a preset: our kernels against SDPA")
    ap.add_argument("out", nargs="?", default="benchmarks")
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"preset whose layer is timed (default {DEFAULT_MODEL})")
    ap.add_argument("--adaptive-budgets", default=None, metavar="resampled|PATH",
                    help="also time per-layer budgets of the same mean as the uniform one, summed over the preset's "
                         "layers: the default model's calibration resampled to them, or a calibration .json")
    ap.add_argument("--adaptive-only", action="store_true",
                    help="only the adaptive comparison (report kernels_adaptive[_MODEL]_h200.json)")
    args = ap.parse_args(argv)
    if args.adaptive_only and not args.adaptive_budgets:
        ap.error("--adaptive-only needs --adaptive-budgets")
    argv = sys.argv[1:] if argv is None else argv
    cmd = os.environ.get("LSERVE_BENCH_COMMAND") or " ".join(["python -m lserve.bench.kernels", *argv])
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / report_name(args.model, args.adaptive_only)
    only = {"decode_contexts": (), "prefill_contexts": ()} if args.adaptive_only else {}
    try:
        rep = run_kernel_bench(out, command=cmd, model=args.model, adaptive_budgets=args.adaptive_budgets, **only)
    except ConfigError as e:
        print(f"lserve: error: {e}", file=sys.stderr)
        return 2
    print(summary_table(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
