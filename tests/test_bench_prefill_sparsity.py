"""``lserve bench prefill-sparsity`` on the tiny random model: the JSON's fields and per-row ranges."""

import json

from lserve.bench import prefill_sparsity as ps
from lserve.config import SparsityConfig
from lserve.eval.harness import PRESET_CONFIGS


def test_defaults_come_from_the_preset_and_config():
    pre = PRESET_CONFIGS["lserve-prefill-sparse"]
    assert (ps.TAUS[0], ps.Q_BLOCK) == (pre.prefill_sparsity, pre.prefill_q_block)
    assert (ps.BLOCK, ps.STRIDE) == (SparsityConfig().prefill_block, SparsityConfig().prefill_stride)


def test_prefill_sparsity_bench_tiny(tmp_path):
    # 512 tokens: the shortest passkey prompt of the byte tokenizer is ~260; blocks of 16, rows of 32.
    r = ps.run_prefill_sparsity(str(tmp_path), contexts=(512,), taus=(0.9,), block=16, q_block=32, stride=8,
                                name="t", model="tiny", progress=False)
    d = json.loads((tmp_path / "t.json").read_text())
    assert d["summary"] == r["summary"]
    assert (d["block"], d["q_block"], d["stride"], d["taus"], d["contexts"]) == (16, 32, 8, [0.9], [512])
    assert d["dense_from"] is None and d["num_kv_heads"] == 2
    assert len(d["rows"]) == d["num_layers"] * len(ps.ESTIMATORS)
    for row in d["rows"]:
        for key in ("kept_fraction", "head_alone_kept_fraction", "mass", "oracle_same_kept_mass"):
            assert len(row[key]) == 2 and all(0 < x <= 1 + 1e-6 for x in row[key]), (key, row)
        # Every KV head keeps the shared count: at least what any head alone would keep.
        assert min(row["kept_fraction"]) == max(row["kept_fraction"]) >= max(row["head_alone_kept_fraction"])
    assert {(s["estimator"], s["tau"]) for s in d["summary"]} == {(e, 0.9) for e in ps.ESTIMATORS}
