"""``lserve bench profile-prefill-threshold``: where block-sparse prefill starts to pay, saved for engines."""

import json

from lserve.calibration.threshold_sweep import first_paying
from lserve.cli import main


def test_first_paying_needs_every_longer_context_to_pay():
    rows = [{"context": c, "dense_s": 1.0, "sparse_s": s} for c, s in ((1024, 1.2), (2048, 0.9), (4096, 1.1), (8192, 0.5))]
    assert first_paying(rows, "dense_s", "sparse_s") == (8192, 8192)
    rows[2]["sparse_s"] = 0.8
    assert first_paying(rows, "dense_s", "sparse_s") == (2048, 2048)
    rows[3]["sparse_s"] = 1.5
    assert first_paying(rows, "dense_s", "sparse_s") == (None, 16384)  # off as far as measured
    rows[3]["sparse_s"] = 0.98
    assert first_paying(rows, "dense_s", "sparse_s") == (2048, 2048)
    assert first_paying(rows, "dense_s", "sparse_s", margin=0.03) == (None, 16384)  # 2% is noise


def test_profiled_min_len_is_what_an_auto_engine_uses(tmp_path, monkeypatch):
    """The CLI measures the sweep on this machine, saves min_len under this device and model
    shape, and an engine with a tau and the length left at auto prefills sparse from that length on."""
    from lserve.config import PREFILL_MIN_LEN_UNPROFILED, SparsityConfig
    from lserve.engine import LLM

    profile = tmp_path / "prefill_threshold.json"
    monkeypatch.setenv("LSERVE_PREFILL_THRESHOLD_FILE", str(profile))
    tau = SparsityConfig(prefill_sparsity=0.9)
    before = LLM("tiny", sparsity=tau)
    assert before.backend.sp.prefill_sparsity_min_len == PREFILL_MIN_LEN_UNPROFILED  # a set tau, unprofiled
    assert before.prefill_threshold_source is None
    rc = main(["bench", "profile-prefill-threshold", "--model", "tiny", "--device", "cpu", "--contexts", "512", "1024",
               "--prefill-sparsity", "0.9", "--out", str(tmp_path), "--name", "pt"])
    assert rc == 0
    report = json.loads((tmp_path / "pt.json").read_text())
    assert [r["context"] for r in report["rows"]] == [512, 1024]
    assert all(r["dense_s"] > 0 and r["sparse_s"] > 0 for r in report["rows"])
    saved = json.loads(profile.read_text())[report["key"]]
    assert saved["min_len"] == report["min_len"] and saved["tau"] == 0.9
    assert report["min_len"] in (512, 1024, 2048)  # 2048: never paid (twice the longest)
    assert (tmp_path / "pt.png").stat().st_size > 0
    after = LLM("tiny", sparsity=tau)
    assert after.backend.sp.prefill_sparsity_min_len == report["min_len"]
    assert after.prefill_threshold_source == str(profile)
    explicit = LLM("tiny", sparsity=SparsityConfig(prefill_sparsity=0.9, prefill_sparsity_min_len=100))
    assert explicit.backend.sp.prefill_sparsity_min_len == 100  # a given length is kept


def test_auto_needs_a_calibration(tmp_path, capsys):
    """The profile's default tau is auto: a model without shipped taus is refused in one line."""
    rc = main(["bench", "profile-prefill-threshold", "--model", "tiny", "--device", "cpu", "--contexts", "512",
               "--no-save", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "ships no prefill calibration" in err and "Traceback" not in err


def test_profile_prefill_threshold_rejects_several_taus(capsys):
    assert main(["bench", "profile-prefill-threshold", "--prefill-sparsity", "0.5", "0.9", "--no-save"]) != 0
    assert "one --prefill-sparsity" in capsys.readouterr().err

