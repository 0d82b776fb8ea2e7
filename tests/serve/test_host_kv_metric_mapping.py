"""How :meth:`EngineMetrics.export_host_kv` maps the host tier's snapshots to ``lserve:host_kv_*``
series: none exist while the tier is off; counters advance by the change between snapshots; the
interval ratios are set only when there was traffic. Run in a clean process (its own registry)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CODE = textwrap.dedent("""\
    import json
    from prometheus_client import REGISTRY
    from lserve.cache.host_tier import HostKVStats
    from lserve.serve.metrics import EngineMetrics

    def samples():
        return {s.name: s.value for fam in REGISTRY.collect() for s in fam.samples
                if s.name.startswith("lserve:host_kv_") and not s.name.endswith("_created")}

    m = EngineMetrics("m", "r")
    m.init_series()
    out = {"off": samples()}
    m.init_series(host_kv=True)
    out["on"] = samples()
    a = HostKVStats(resident_slots_used=5, resident_slots=40, pages_on_host=7, host_pages=50, hot_pages=2, hits=6,
                    misses=2, fetched=2, deferred=1, streamed=3, spilled=7, bytes_h2d=500, bytes_d2h=700,
                    prefill_streamed=2, prefill_bytes_h2d=300, h2d_copies=1, staged_parts=3)
    m.export_host_kv(a, HostKVStats(), steps=4)
    out["first"] = samples()
    b = HostKVStats(resident_slots_used=6, resident_slots=40, pages_on_host=9, host_pages=50, hot_pages=1, hits=7,
                    misses=5, fetched=5, deferred=4, streamed=3, spilled=9, bytes_h2d=800, bytes_d2h=900,
                    prefill_streamed=2, prefill_bytes_h2d=300, h2d_copies=4, staged_parts=8)
    m.export_host_kv(b, a, steps=2)
    out["second"] = samples()
    m.export_host_kv(b, b, steps=0)  # idle: ratios keep their last values
    out["idle"] = samples()
    print(json.dumps(out))
    """)


def test_export_host_kv_maps_snapshots_to_series():
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["off"] == {}
    counters = ("hits", "misses", "pages_fetched", "pages_deferred", "pages_streamed", "pages_spilled", "bytes_h2d", "bytes_d2h",
                "prefill_pages_streamed", "prefill_bytes_h2d", "h2d_copies", "staged_parts")
    assert out["on"] == {f"lserve:host_kv_{c}_total": 0.0 for c in counters + ("fetch_layers_skipped",)}

    p = "lserve:host_kv_"
    first = out["first"]
    assert {k: first[p + k] for k in ("pages_on_host", "host_pages", "resident_slots_used", "resident_slots",
                                      "hot_pages")} == {"pages_on_host": 7, "host_pages": 50, "resident_slots_used": 5,
                                                        "resident_slots": 40, "hot_pages": 2}
    assert [first[f"{p}{c}_total"] for c in counters] == [6, 2, 2, 1, 3, 7, 500, 700, 2, 300, 1, 3]
    assert first[p + "hit_rate"] == 6 / 8 and first[p + "bytes_h2d_per_step"] == 500 / 4

    second = out["second"]
    assert [second[f"{p}{c}_total"] for c in counters] == [7, 5, 5, 4, 3, 9, 800, 900, 2, 300, 4, 8]
    assert second[p + "pages_on_host"] == 9 and second[p + "hot_pages"] == 1
    assert second[p + "hit_rate"] == 1 / 4 and second[p + "bytes_h2d_per_step"] == 300 / 2  # this interval's
    assert out["idle"] == second
