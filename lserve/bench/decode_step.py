"""The pure decode step of a batch: ``C`` sequences at one context decoding together, nothing
else in the step, as the engine runs it (CUDA-graph replay and async decode where the engine
uses them).

``lserve bench serve`` uses it for its throughput bound (a served closed loop cannot decode
faster than this), ``scripts/profile_steps.py`` to fill a batch before profiling it.

Prompts of up to :data:`SHARE_FROM` tokens are distinct random prompts (a batch reading one set
of KV pages would find it in L2 and decode faster than served traffic does); longer ones are one
prompt repeated, prefilled once and shared through the prefix cache (at these lengths one
sequence's KV per layer is far larger than L2, so sharing changes little, and it saves
``C - 1`` long prefills of device time). Either way a shorter step is the error it can make,
which keeps a bound built on it an upper bound.
"""

from __future__ import annotations

import time

import torch

from lserve.config import CacheConfig, EngineConfig, SparsityConfig
from lserve.engine.llm_engine import LLMEngine
from lserve.engine.sampling import SamplingParams
from lserve.models.loader import LoadedModel

SHARE_FROM = 8192  # longer prompts are one prompt shared through the prefix cache
DECODE_KINDS = ("graph", "decode_eager")  # step kinds with no prefill in them


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed_steps(engine: LLMEngine, steps: int) -> list[float]:
    """Wall seconds of each of ``steps`` engine steps, the device idle before the first; the last
    interval runs to the device's idle again, so the sum is the whole window's time."""
    sync(engine.config.device)
    times = []
    t0 = time.perf_counter()
    for i in range(steps):
        engine.step()
        if i == steps - 1:
            sync(engine.config.device)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return times


def output_tokens(batch: int, steps: int, warmup: int) -> int:
    """Output tokens per sequence: enough that none finishes before the timed steps end (earlier
    sequences decode while later ones prefill: up to ``batch`` extra tokens)."""
    return 1 + warmup + steps + batch + 2


def decode_engine(loaded: LoadedModel, model: str, sp: SparsityConfig, context: int, max_batch: int, device: str,
                  backend: str, steps: int = 16, warmup: int = 4, cuda_graphs: bool = True) -> LLMEngine:
    """An engine sized for :func:`start_batch` / :func:`decode_step_s` at ``context`` and batches
    up to ``max_batch`` (one prompt per step, as the engine's own TTFT is timed)."""
    out = output_tokens(max_batch, steps, warmup)
    per_seq = out + 2 * CacheConfig().page_size + 64
    pool = context + max_batch * per_seq if context > SHARE_FROM else max_batch * (context + per_seq)
    cfg = EngineConfig(model=model, sparsity=sp, cache=CacheConfig(dense_pool_tokens=pool), device=device,
                       backend=backend, max_num_seqs=max_batch, max_batched_tokens=max(context, 16),
                       max_model_len=context + out + 64, cuda_graphs=cuda_graphs)
    return LLMEngine(cfg, loaded)


def random_prompt(engine: LLMEngine, context: int, seed: int) -> list[int]:
    """``context`` random token ids (the first prompt of :func:`start_batch` for ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.model_config.vocab_size - 2, (context,), generator=g).tolist()


def start_batch(engine: LLMEngine, context: int, batch: int, max_tokens: int, seed: int = 0) -> list[str]:
    """Admit ``batch`` random prompts of ``context`` tokens and step until each has its first
    token; returns their request ids. One prompt shared by all past :data:`SHARE_FROM` tokens
    (its prefill runs once; the others reuse its pages), else a distinct prompt each."""
    shared = context > SHARE_FROM

    def prompt(i: int) -> list[int]:
        return random_prompt(engine, context, seed + (0 if shared else i))

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started: set[str] = set()

    def run_until_started(ids: list[str]) -> None:
        while not started.issuperset(ids):
            outs = engine.step()
            if not outs and not engine.has_unfinished():
                raise RuntimeError("the engine stopped before every prompt of the batch had its first token")
            started.update(o.request_id for o in outs if o.token_ids)

    ids = [engine.add_request(prompt(0), params)]
    if shared:
        run_until_started(ids)  # the prompt's pages enter the prefix cache
    ids += [engine.add_request(prompt(i), params) for i in range(1, batch)]
    run_until_started(ids)
    return ids


def decode_step_s(engine: LLMEngine, context: int, batch: int, steps: int = 16, warmup: int = 4,
                  seed: int = 0) -> float:
    """Seconds per decode-only step of ``batch`` sequences at ``context`` tokens: the mean over
    ``steps`` steps, the device synchronised before the first and after the last.

    The batch is started (:func:`start_batch`), runs ``warmup`` steps (a CUDA graph is captured
    at a batch size's first sight), then the timed steps; the sequences are then run to the end.
    The mean over a synchronised window, not single intervals between ``step()`` returns: with
    async decode a step returns once the next one is launched, so one interval can be far shorter
    than a step (the fastest one measured 1.3 ms for a 5.7 ms step on the H200).

    Raises
    ------
    RuntimeError
        If a timed step was not a decode-only step of the whole batch.
    """
    start_batch(engine, context, batch, output_tokens(batch, steps, warmup), seed)
    for _ in range(warmup):
        engine.step()
    before = engine.stats()
    total = sum(timed_steps(engine, steps))
    after = engine.stats()
    kinds = {k: after.step_kinds.get(k, 0) - before.step_kinds.get(k, 0) for k in after.step_kinds}
    decode_only = sum(kinds.get(k, 0) for k in DECODE_KINDS) == steps
    if not decode_only or before.running != batch or after.running != batch or after.waiting:
        raise RuntimeError(f"decode step at batch {batch}, context {context}: the timed steps were {kinds} with "
                           f"{before.running}/{after.running} running, not {steps} decode steps of the batch")
    while engine.has_unfinished():
        engine.step()
    return total / steps
