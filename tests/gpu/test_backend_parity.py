"""The cupy backend against the torch oracle, step by step, on mixed batches.

Each scenario runs staggered sequences through prefill (whole, and chunked with cached past),
mixed prefill + decode steps and decode steps with page selection and reuse, comparing every
layer's output (NaN-poisoned before the launch), the selection state after each selection, and
finally the whole cache (pools, scales, key statistics).
"""

from __future__ import annotations

import pytest
import torch
from gpu_harness import Pair, Seq

SCENARIOS = {
    # GQA 4, head_dim 128, one streaming + one dense head in layer 0, all dense in layer 1.
    "bf16-d128-g4-kv": dict(dtype=torch.bfloat16, D=128, hkv=2, G=4, n_dense=(1, 2)),
    # MHA (G=1), INT8, a layer of only streaming heads, one entry per split-K unit.
    "bf16-d64-g1-int8-many": dict(dtype=torch.bfloat16, D=64, hkv=4, G=1, n_dense=(2, 0), kv_quant="int8",
                                  split="many"),
    # GQA 8, INT4, fp16, page 32, per-query-head selection.
    "fp16-d128-g8-int4-query": dict(dtype=torch.float16, D=128, hkv=2, G=8, n_dense=(1, 1), kv_quant="int4",
                                    page_size=32, logical=8, sink=64, local=64, budget=256, select_mode="query"),
    # fp16, head_dim 64, query mode, one unit per work item (direct writes, no merge).
    "fp16-d64-g4-query-direct": dict(dtype=torch.float16, D=64, hkv=2, G=4, n_dense=(2, 1), select_mode="query",
                                     split="direct"),
    # One KV head (G=8), INT4, no sink (sink 0).
    "bf16-d64-g8-int4-nosink": dict(dtype=torch.bfloat16, D=64, hkv=1, G=8, n_dense=(1, 0), kv_quant="int4",
                                    sink=0, split="many"),
    # Llama-3-like layer, page 64, INT8, first layer forced dense (no selection there).
    "bf16-d128-g4-int8-p64": dict(dtype=torch.bfloat16, D=128, hkv=4, G=4, n_dense=(4, 2), kv_quant="int8",
                                  page_size=64, logical=16, sink=64, local=128, budget=512, dense_layers=1),
    # Selection only in the middle layer (select_layers): the others read every page.
    "bf16-d128-g4-select-layers": dict(dtype=torch.bfloat16, D=128, hkv=2, G=4, n_dense=(2, 1, 2),
                                       select_layers=(1,)),
    # fp32 model (prefill falls back to torch code; decode/selector/writes on the kernels).
    "fp32-d64-g4": dict(dtype=torch.float32, D=64, hkv=2, G=4, n_dense=(1, 2)),
    # G = 16 runs as two CTAs of 8 query heads per KV head; query mode masks span both.
    "bf16-d128-g16-query": dict(dtype=torch.bfloat16, D=128, hkv=2, G=16, n_dense=(1, 2), select_mode="query",
                                split="many"),
    # The CUDA-core decode kernel on unquantized bf16 pools (the tensor-core one is the default).
    # GQA groups that are not powers of two (Qwen2.5-7B: 7, Qwen2.5-14B: 5): tensor-core decode and
    # scores, the CUDA-core decode (INT8), query mode, the dense prefill kernel.
    "bf16-d128-g7-kv": dict(dtype=torch.bfloat16, D=128, hkv=2, G=7, n_dense=(1, 2)),
    "fp16-d64-g5-query": dict(dtype=torch.float16, D=64, hkv=2, G=5, n_dense=(2, 1), select_mode="query"),
    "bf16-d128-g7-int8-cudacore": dict(dtype=torch.bfloat16, D=128, hkv=2, G=7, n_dense=(1, 2), kv_quant="int8",
                                       decode_impl="cuda"),
    "bf16-d64-g5-kernelprefill": dict(dtype=torch.bfloat16, D=64, hkv=2, G=5, n_dense=(2, 1), prefill_kernel=True),
    "bf16-d128-g4-cudacore": dict(dtype=torch.bfloat16, D=128, hkv=2, G=4, n_dense=(1, 2), decode_impl="cuda"),
    # The CUDA-core page scores (tensor cores are the default for 16-bit caches): four dense
    # heads with 4 heads per CTA (kv mode), and with 1 (the older layout); query mode with 4 heads
    # per CTA, the next layer's 2 dense heads 2 per CTA.
    "bf16-d128-g4-hpc4": dict(dtype=torch.bfloat16, D=128, hkv=4, G=4, n_dense=(4, 4), score_impl="cuda"),
    "bf16-d128-g4-hpc1": dict(dtype=torch.bfloat16, D=128, hkv=4, G=4, n_dense=(4, 2), score_hpc=1,
                              score_impl="cuda"),
    "fp16-d64-g2-query-hpc4": dict(dtype=torch.float16, D=64, hkv=4, G=2, n_dense=(4, 2), select_mode="query",
                                   score_impl="cuda"),
    # CUDA-core page scores with groups that are not powers of two (the row sums are padded to 4 x 8):
    # kv mode G=7, query mode G=5 and G=3, and the fp32 cache (CUDA-core scores are its only path) G=6.
    "bf16-d128-g7-cudascores": dict(dtype=torch.bfloat16, D=128, hkv=2, G=7, n_dense=(2, 1), score_impl="cuda"),
    "fp16-d64-g5-query-cudascores": dict(dtype=torch.float16, D=64, hkv=2, G=5, n_dense=(1, 2), select_mode="query",
                                         score_impl="cuda"),
    "bf16-d64-g3-query-cudascores": dict(dtype=torch.bfloat16, D=64, hkv=4, G=3, n_dense=(4, 2), select_mode="query",
                                         score_impl="cuda"),
    "fp32-d128-g6": dict(dtype=torch.float32, D=128, hkv=2, G=6, n_dense=(2, 1)),
    # Tensor-core page scores with 1, 2, 8 and 16 logical pages per page (the others use 4).
    "bf16-d128-g4-scores-g1": dict(dtype=torch.bfloat16, D=128, hkv=2, G=4, n_dense=(1, 2), logical=16),
    "fp16-d64-g8-query-scores-g2": dict(dtype=torch.float16, D=64, hkv=2, G=8, n_dense=(2, 1), logical=8,
                                        select_mode="query"),
    "bf16-d64-g4-scores-g8": dict(dtype=torch.bfloat16, D=64, hkv=2, G=4, n_dense=(2, 2), page_size=32, logical=4,
                                  sink=32, local=64, budget=256),
    "bf16-d128-g2-query-scores-g16": dict(dtype=torch.bfloat16, D=128, hkv=2, G=2, n_dense=(2, 1), page_size=64,
                                          logical=4, sink=64, local=128, budget=512, select_mode="query"),
    # No streaming heads at all; dense prefill heads through our mma kernel instead of SDPA.
    "bf16-d128-g4-dense-kernelprefill": dict(dtype=torch.bfloat16, D=128, hkv=2, G=4, n_dense=(2, 2),
                                             prefill_kernel=True),
    # Tensor-core decode with pages of >= 64 tokens (one row base per 64-token tile): page 64 with
    # ring wrap-around, and fp16 page 128 with GQA 8.
    "bf16-d128-g4-p64-tc": dict(dtype=torch.bfloat16, D=128, hkv=4, G=4, n_dense=(4, 2), page_size=64, logical=16,
                                sink=64, local=128, budget=512),
    "fp16-d64-g8-p128-tc": dict(dtype=torch.float16, D=64, hkv=2, G=8, n_dense=(1, 2), page_size=128, logical=32,
                                sink=128, local=256, budget=1024),
    # Adaptive per-layer budgets (mean 128 tokens = 8 pages): layer 0 keeps 4 pages, layer 1 16
    # (reads every page of the shorter sequences), layer 2 the mean; query mode, and INT8.
    "bf16-d128-g4-adaptive": dict(dtype=torch.bfloat16, D=128, hkv=2, G=4, n_dense=(1, 2, 2),
                                  ratios=(0.5, 2.0, None)),
    "fp16-d64-g4-adaptive-query-int8": dict(dtype=torch.float16, D=64, hkv=2, G=4, n_dense=(2, 1, 2),
                                            select_mode="query", kv_quant="int8", ratios=(0.25, 4.0, 1.0)),
    # Every kernel launched the plain way (no programmatic dependent launch, the default on sm_90+).
    "bf16-d128-g4-query-nopdl": dict(dtype=torch.bfloat16, D=128, hkv=2, G=4, n_dense=(2, 1), select_mode="query",
                                     pdl=False),
}

LENGTHS = {"bf16-d128-g4-int8-p64": [3001, 1500, 77], "bf16-d128-g4-p64-tc": [3001, 1500, 77],
           "bf16-d128-g2-query-scores-g16": [3001, 1500, 77],
           "fp16-d64-g8-p128-tc": [2600, 700, 130]}


def run_scenario(pair: Pair, lengths: list[int], decode_steps: int, chunk: int = 250) -> None:
    """Sequence i joins at step i; sequence 1 is prefilled in chunks of ``chunk`` tokens."""
    seqs = [Seq(i, n) for i, n in enumerate(lengths)]
    decoded = [0] * len(seqs)
    step = 0
    while any(d < decode_steps for d in decoded):
        work = []
        for i, s in enumerate(seqs):
            if i > step or decoded[i] >= decode_steps:
                continue
            if s.computed < s.tokens:
                n = s.tokens - s.computed if i != 1 else min(chunk, s.tokens - s.computed)
                work.append((s, n, False))
            else:
                work.append((s, 1, True))
                decoded[i] += 1
        pair.step(work)
        step += 1
    pair.compare_caches()
    for s in seqs:
        pair.release(s)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_backend_parity(name, seed):
    kw = dict(SCENARIOS[name])
    prefill_kernel = kw.pop("prefill_kernel", False)
    decode_impl = kw.pop("decode_impl", None)
    score_hpc = kw.pop("score_hpc", None)
    score_impl = kw.pop("score_impl", None)
    pdl = kw.pop("pdl", None)
    pair = Pair(seed=seed, **kw)
    if pdl is not None:
        pair.cup.pdl = pdl
    pair.cup.score_hpc = score_hpc
    if score_impl:
        pair.cup.score_impl = score_impl
    if prefill_kernel:
        pair.cup.prefill_dense = "kernel"
    if decode_impl:
        pair.cup.decode_impl = decode_impl
    lengths = LENGTHS.get(name, [700, 1013, 333, 45])
    run_scenario(pair, lengths, decode_steps=9)
    assert pair.selections_checked > 0, "the scenario never ran the page selector"
    print(f"{name}: max rel err {max(pair.errors):.3g} over {len(pair.errors)} checks, "
          f"{pair.selections_checked} selections")


def test_release_and_slot_reuse(seed):
    """Finished sequences free their selection slot; a new sequence reuses it without stale state."""
    pair = Pair(seed=seed, dtype=torch.bfloat16, D=64, hkv=2, G=4, n_dense=(1, 1), reuse=2)
    a, b = Seq(0, 600), Seq(1, 900)
    pair.step([(a, 600, False), (b, 900, False)])
    for _ in range(3):
        pair.step([(a, 1, True), (b, 1, True)])
    slot_a = pair.cup.table_planner.slots[0]
    pair.release(a)
    c = Seq(2, 1400)
    pair.step([(c, 1400, False), (b, 1, True)])
    for _ in range(4):
        pair.step([(c, 1, True), (b, 1, True)])
    assert pair.cup.table_planner.slots[2] == slot_a
    pair.compare_caches()
