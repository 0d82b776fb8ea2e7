"""The unified block-sparse prefill kernel against its torch oracle (fresh random inputs, output
poisoned with NaN): groups 1/4/5/7/8, head dims 64/128, page sizes 16/32/64, ragged lengths, chunks
with cached past, dense and streaming heads in one launch, block lists and every block kept; every
tile-shape variant of ``lserve.bench.bsp_prefill.VARIANTS`` (v1 mma.sync, v2 wgmma, v3 warp-specialized
"ws"/"wsp"/"wsi", v4 "v4_s2"/"v4_s3" (128 keys a step, Q in shared memory); all but v1 head dim 128 only)."""

import pytest
import torch

from lserve.bench.bsp_prefill import TOL, VARIANTS, parity

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_bsp_prefill_matches_reference(variant, seed):
    if variant.impl != "mma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup MMA kernel: sm_90 only")
    cases = parity((variant,), seed)
    bad = [(c["case"], c["max_rel_err"]) for c in cases if not c["ok"]]
    assert len(cases) == (8 if variant.supports(64) else 6) and not bad, f"max rel err above {TOL}: {bad}"
