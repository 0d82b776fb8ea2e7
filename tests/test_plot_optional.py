"""Plots are an optional extra: without matplotlib the tools still write their JSON."""

import json
import sys

import lserve.plotting as plotting


def _no_matplotlib(monkeypatch):
    # A None entry makes `import matplotlib` raise ImportError, as on a serving-only install.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    monkeypatch.setattr(plotting, "_warned", False)


def test_pyplot_missing_prints_hint_once(monkeypatch, capsys):
    _no_matplotlib(monkeypatch)
    assert plotting.pyplot() is None
    assert plotting.pyplot() is None
    err = capsys.readouterr().err
    assert err.count(plotting.PLOT_HINT) == 1


def test_eval_plots_skip_without_matplotlib(monkeypatch, tmp_path):
    from lserve.eval.plots import plot_all

    _no_matplotlib(monkeypatch)
    summary = {"rows": [{"config": "dense@512", "task": "passkey", "context": 2048, "budget": 512,
                         "accuracy": 100.0}],
               "depth_rows": [{"config": "dense", "task": "passkey", "context": 2048, "depth": 0.5,
                               "accuracy": 100.0}]}
    assert plot_all(summary, str(tmp_path / "acc")) == []
    assert not list(tmp_path.glob("*.png"))


def test_bench_json_written_without_matplotlib(monkeypatch, tmp_path):
    from lserve.bench.report import write_json
    from lserve.bench.selection_mass_plot import plot_mass_by_layer

    _no_matplotlib(monkeypatch)
    report = {"rows": []}
    # The benches' order: JSON first, then the PNG, which is skipped here.
    write_json(tmp_path / "b.json", report)
    plot_mass_by_layer(report, tmp_path / "b.png")
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == []
    assert not (tmp_path / "b.png").exists()


def test_load_tests_png_skipped_without_matplotlib(monkeypatch, tmp_path, capsys):
    from load_tests.report import write_png

    _no_matplotlib(monkeypatch)
    assert write_png(tmp_path / "r.png", [], {}, "t") is None
    assert "lserve[plot]" in capsys.readouterr().err
