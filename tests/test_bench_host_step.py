"""The host-step benchmark on the CPU: its command line, its parts, its stream and emulated-device measurements."""

from __future__ import annotations

import json

import pytest

from lserve.bench.host_step import PARTS, main, measure_engine


def test_cli_refuses_a_context_without_room_for_the_distinct_tail(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--context", "16"])
    assert e.value.code == 2 and "--context" in capsys.readouterr().err


@pytest.mark.parametrize("args, flag", [(["--stream-interval", "1", "0"], "--stream-interval"),
                                        (["--ray-streams", "0"], "--ray-streams"),
                                        (["--stream-interval-ms", "5", "-1"], "--stream-interval-ms"),
                                        (["--ray-only", "--no-ray"], "--ray-only")])
def test_cli_refuses_bad_stream_interval_points(args, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_engine_parts_add_up_to_the_host_time(smol):
    r = measure_engine(smol, context=64, batch=3, steps=2, warmup=1)
    assert r["batch"] == 3 and r["steps"] == 2
    parts = r["parts_ms"]
    assert set(parts) == set(PARTS)
    assert all(parts[p]["mean"] >= 0 for p in PARTS[:-1])
    # the parts (other included) are the host time of the timed pass, which excludes the forward
    total = sum(parts[p]["mean"] for p in PARTS)
    assert total == pytest.approx(r["host_ms_timed_parts"]["mean"], abs=1e-3)  # each rounded to 0.1 us
    assert r["forward_ms"]["median"] > r["host_ms"]["median"] > 0
    assert r["cupy_tables_ms"]["median"] > 0  # the GPU path's tables of the same plans ran


def test_cli_writes_json_with_command_date_device_and_the_stream_part(tmp_path):
    main(["--out", str(tmp_path), "--name", "hs", "--batches", "2", "--context", "48", "--steps", "2",
          "--streams", "2", "--stream-tokens", "3", "--device-ms", "3", "--emulated-tokens", "6", "--no-ray"])
    rep = json.loads((tmp_path / "hs.json").read_text())
    assert {"command", "date", "device"} <= set(rep)
    assert [r["batch"] for r in rep["rows"]] == [2]
    s = rep["stream"]
    assert s["streams"] == 2 and s["tokens"] == 6 and s["loop_cpu_us_per_token"] > 0 and s["steps"] >= 3
    # the emulated device: no step, and no token, comes faster than its 3 ms
    em = rep["emulated"]
    assert em["device_ms"] == 3 and em["engine_step_ms"]["2"] >= 3 * 0.98 and em["ray"] is None
    assert [r["streams"] for r in em["in_process"]] == [1, 2]
    assert all(r["tokens"] == r["streams"] * 6 and r["itl_p50_ms"] >= 3 * 0.9 for r in em["in_process"])
