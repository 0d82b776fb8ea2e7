"""CUDA graphs for decode steps: one replay instead of hundreds of kernel launches.

A decode step of a 32-layer model launches ~500 kernels; at long context with sparse attention
the GPU finishes them faster than the host can launch them. Pure-decode steps (no prefill in
the batch) therefore run as CUDA graphs:

* Every input lives in fixed device buffers: token ids, positions, write locations (int64,
  :attr:`DecodeGraphs.inputs`) and the attention backend's tables (int32, planned by
  ``CupyBackend.plan(..., host=True)`` as views of ``CupyBackend.static_buffer``; their split-K
  units are fixed per graph key). Before a replay the host fills them from pinned memory with
  two asynchronous copies; the only synchronisation in the decode loop is reading the sampled
  tokens back. With async decode (:mod:`lserve.engine.async_decode`) the token ids of a step
  come from the previous step's tokens on the device (a gather after the upload), and the
  pinned staging buffers alternate, since the host fills the next step's while the GPU may
  not have copied the previous one yet.
* Graphs are keyed by what fixes the launch shapes (batch size, a bucket of the longest
  sequence, which sequences select pages this step; see ``CupyBackend.plan``), so a
  sequence growing token by token replays the same graph until its page table crosses a
  bucket (every 1/32 to 1/64 of its length), and the page-selection steps (every C-th) have their own.
* A key is captured the second time it is seen (one-off shapes stay eager), after one eager
  warm-up run. The warm-up and the first replay both write the step's K/V and selection;
  both writes are idempotent (same values, same places).

Selector statistics (host counters) are recorded at capture and added per replay.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from lserve.sparsity.plan import StepPlan

log = logging.getLogger("lserve")

N_INPUTS = 10  # ids, pos, seq_lens, logit rows, dense writes (3), stream writes (3)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # float32 [nb, vocab]
    greedy: torch.Tensor  # long [nb]
    stats: tuple[int, int, int]  # selector runs, reuses, pages per replay
    keep: StepPlan  # the plan (and its tables) the graph was captured with: their buffers stay alive


class DecodeGraphs:
    """Captures and replays decode steps of one engine.

    Parameters
    ----------
    model : LlamaModel
    backend : CupyBackend
    max_num_seqs : int
        Largest decode batch (sizes the input buffers).
    max_len : int
        Longest sequence: the forward's host-side bound of a step's lengths (dynamic-NTK RoPE past
        the trained length is not captured).
    max_graphs : int
        Graphs kept (least recently used dropped first).
    """

    def __init__(self, model, backend, max_num_seqs: int, max_len: int, max_graphs: int = 32) -> None:
        self.model, self.backend = model, backend
        self.device = model.device
        self.max_len = max_len
        self.max_graphs = max_graphs
        self.inputs = torch.zeros(N_INPUTS * max_num_seqs, dtype=torch.long, device=self.device)
        # two of each: the host fills one while the GPU may still copy from the other
        self._pin64 = [torch.zeros(N_INPUTS * max_num_seqs, dtype=torch.long).pin_memory() for _ in range(2)]
        self._pin32: list[torch.Tensor | None] = [None, None]
        self._flip = 0
        self._graphs: OrderedDict = OrderedDict()
        self._seen: set = set()
        self._generation = -1
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0
        self.replays = 0
        self.disabled: str | None = None  # why capture was given up, if it was
        self.events: list | None = None  # a list: (start, end) CUDA events around each replay (benchmarks)
        model.rope.freq()  # built before any capture: a captured step must not allocate it

    @staticmethod
    def supported(model, max_len: int) -> bool:
        """Dynamic-NTK RoPE past the trained length depends on each step's lengths: not capturable."""
        return not (model.rope.dynamic and max_len > model.cfg.max_position_embeddings)

    def run(self, plan: StepPlan, ids: list[int], pos: list[int], seq_lens: list[int],
            logit_rows: list[int], prev_tokens: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run a decode-only step planned on the host.

        Parameters
        ----------
        plan
            ``backend.plan(steps, host=True)``: its ``tables`` are the capturable ones (None:
            the step cannot be captured).
        ids, pos, seq_lens, logit_rows
            The step, as the eager forward takes it (host lists).
        prev_tokens : torch.Tensor, optional
            Device long tensor (the previous step's tokens): ``ids`` are then rows of it, and
            the id input is gathered from it on the device, in stream order before the replay.

        Returns
        -------
        (logits [nb, V], greedy [nb]) or None
            The graph's output buffers (the next replay of the same graph overwrites them), or
            None when the step cannot be captured (the caller runs it eagerly).
        """
        step = plan.tables  # CupyStep bound to the static buffer, or None
        if step is None:
            return None
        bkey, generation = step.key, self.backend.static_generation
        if generation != self._generation:  # buffers a graph points into were reallocated
            self._drop_all()
            self._generation = generation
        nb = len(ids)
        has_stream = plan.stream_write_decode[0].numel() > 0
        key = (bkey, nb, has_stream)
        entry = self._graphs.get(key)
        if entry is None and (key not in self._seen or self.disabled):
            self._seen.add(key)
            return None  # first sight of this shape: eager (nothing to upload)
        self._upload(plan, ids, pos, seq_lens, logit_rows, step.packed)
        if prev_tokens is not None:
            self.inputs[:nb].copy_(prev_tokens.index_select(0, self.inputs[:nb]))
        if entry is None:
            try:
                entry = self._capture(key, plan, nb, step)
            except RuntimeError as e:  # keep serving eagerly, and say why
                self.disabled = str(e).splitlines()[0][:300]
                log.warning("CUDA graph capture failed, decoding eagerly from now on: %s", self.disabled)
                torch.cuda.synchronize(self.device)
                return None
        self._graphs.move_to_end(key)
        if self.events is not None:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
            entry.graph.replay()
            ev[1].record()
            self.events.append(ev)
        else:
            entry.graph.replay()
        self.replays += 1
        st = self.backend.selector_stats
        st.runs += entry.stats[0]
        st.reuses += entry.stats[1]
        st.pages += entry.stats[2]
        return entry.logits, entry.greedy

    def replay_ms(self) -> list[float]:
        """GPU milliseconds of each timed replay (synchronizes; for benchmarks)."""
        torch.cuda.synchronize(self.device)
        return [a.elapsed_time(b) for a, b in self.events or []]

    # -- internals ------------------------------------------------------------------------------
    def _drop_all(self) -> None:
        """Forget every graph. Their memory pool dies with the last of them, so later captures
        need a new one (capturing into a dead pool trips an allocator assertion)."""
        self._graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()

    def _upload(self, plan: StepPlan, ids, pos, seq_lens, logit_rows, tables: np.ndarray) -> None:
        nb = len(ids)
        self._flip ^= 1  # the other pair was the previous step's (async decode: maybe not copied yet)
        pin64, pin32 = self._pin64[self._flip], self._pin32[self._flip]
        h = pin64.numpy()
        cols = [ids, pos, seq_lens, logit_rows]
        cols += [w.numpy() for w in plan.dense_write_decode]
        sw = plan.stream_write_decode
        cols += [w.numpy() for w in sw] if sw[0].numel() else [np.zeros(nb, np.int64)] * 3
        for i, c in enumerate(cols):
            h[i * nb: (i + 1) * nb] = c
        self.inputs[: N_INPUTS * nb].copy_(pin64[: N_INPUTS * nb], non_blocking=True)
        if pin32 is None or pin32.numel() < tables.size:
            pin32 = self._pin32[self._flip] = torch.empty(max(tables.size, 4096) * 2, dtype=torch.int32).pin_memory()
        pin32.numpy()[: tables.size] = tables
        self.backend.static_buffer[: tables.size].copy_(pin32[: tables.size], non_blocking=True)

    def _static_plan(self, plan: StepPlan, nb: int) -> tuple[StepPlan, list[torch.Tensor]]:
        """The plan re-pointed at the input buffers (same tables), plus the model inputs."""
        x = [self.inputs[i * nb: (i + 1) * nb] for i in range(N_INPUTS)]
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        none3 = (empty, empty, empty)
        stream = (x[7], x[8], x[9]) if plan.stream_write_decode[0].numel() else none3
        return StepPlan(list(plan.seqs), plan.num_tokens, (x[4], x[5], x[6]), none3, stream, none3,
                        tables=plan.tables), x[:4]

    def _forward(self, splan: StepPlan, x: list[torch.Tensor]) -> torch.Tensor:
        return self.model.forward(x[0], x[1], splan, self.backend, x[3], x[2], self.max_len)

    def _capture(self, key, plan: StepPlan, nb: int, step) -> _Graph:
        be = self.backend
        be.graph_units(step)  # the key's split-K units: fixed buffers the graph reads
        splan, x = self._static_plan(plan, nb)  # the forward's attention runs on the static step's tables
        stats = be.selector_stats
        before = (stats.runs, stats.reuses, stats.pages)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: allocator, cuBLAS and kernel caches
            self._forward(splan, x)
        torch.cuda.current_stream(self.device).wait_stream(side)
        after = (stats.runs, stats.reuses, stats.pages)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(splan, x)
            greedy = self.model.greedy(logits)
        stats.runs, stats.reuses, stats.pages = before  # the replay that follows counts the step
        entry = _Graph(graph, logits, greedy, tuple(a - b for a, b in zip(after, before)), splan)
        self._graphs[key] = entry
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        log.debug("captured decode graph %s (%d kept)", key, len(self._graphs))
        return entry
