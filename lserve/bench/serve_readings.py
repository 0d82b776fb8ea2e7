"""What a served engine says of itself during a load point of ``lserve bench serve``, beside what
the clients measured: replica-side means and ITL tail from ``/metrics``, and where the replicas'
steps went from ``/admin/engines`` (readings before and after the point)."""

from __future__ import annotations

# What a replica measured of a request (means per load point), beside what the client saw:
# client TTFT - replica TTFT is what the ingress, Ray and HTTP added; queue + prefill is the engine's part.
REPLICA_SIDE = {"ttft": "lserve:time_to_first_token_seconds", "queue": "lserve:request_queue_time_seconds",
                "prefill": "lserve:request_prefill_time_seconds"}


def histogram_totals(text: str, names) -> dict[str, tuple[float, float]]:
    """(sum, count) of Prometheus histograms ``names`` in exposition ``text``, every label set added up."""
    out = {n: [0.0, 0.0] for n in names}
    for line in text.splitlines():
        metric, _, value = line.partition(" ")
        base, _, _ = metric.partition("{")
        for n in out:
            if base in (n + "_sum", n + "_count"):
                out[n][base.endswith("_count")] += float(value.split()[0])
    return {n: (v[0], v[1]) for n, v in out.items()}


def step_time(before: list[dict], after: list[dict]) -> dict | None:
    """Where the replicas' step time went between two :meth:`Server.engine_steps` readings: per
    step kind (``graph``: decode-only replays; ``mixed_graph``: decodes replayed beside an eager
    prefill chunk; ``prefill``; ...) the steps and their mean ms, and for steps whose prefill part
    was timed apart (CUDA events) its mean ms and the rest's (decodes, host); plus the step
    budget's learnt state at the end (of the first replica). None where a reading failed."""
    if not before or not after:
        return None
    old = {r["replica"]: r for r in before}
    kinds: dict[str, list[float]] = {}
    for r in after:
        b = old.get(r["replica"], {"step_kinds": {}, "step_seconds": {}})
        for kind, n in r["step_kinds"].items():
            wall, part = r["step_seconds"].get(kind, [0.0, 0.0])
            wall0, part0 = b["step_seconds"].get(kind, [0.0, 0.0])
            acc = kinds.setdefault(kind, [0, 0.0, 0.0])
            acc[0] += n - b["step_kinds"].get(kind, 0)
            acc[1] += wall - wall0
            acc[2] += part - part0
    out: dict = {}
    for kind, (n, wall, part) in sorted(kinds.items()):
        if n <= 0:
            continue
        out[kind] = {"steps": n, "mean_ms": round(wall / n * 1e3, 2)}
        if part > 0:
            out[kind] |= {"prefill_ms": round(part / n * 1e3, 2), "rest_ms": round((wall - part) / n * 1e3, 2)}
    return {"kinds": out, "budget": after[0].get("budget", {})}


def step_line(st: dict | None) -> str:
    """:func:`step_time` in one line: ``kind n x mean ms (prefill ms + rest ms)``."""
    if not st:
        return "n/a"
    parts = []
    for kind, k in st["kinds"].items():
        split = f" ({k['prefill_ms']} + {k['rest_ms']})" if "prefill_ms" in k else ""
        parts.append(f"{kind} {k['steps']} x {k['mean_ms']} ms{split}")
    return ", ".join(parts)


#: The replicas' own inter-token latency (engine outputs as they leave the engine, before Ray and HTTP).
REPLICA_ITL = "lserve:inter_token_latency_seconds"


def bucket_counts(text: str, name: str) -> dict[float, float]:
    """Cumulative sample counts per bucket bound (``le``) of the Prometheus histogram ``name`` in
    exposition ``text``, every other label set added up."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "_bucket{"):
            continue
        labels, _, value = line.rpartition("} ")
        le = labels.split('le="', 1)[1].split('"', 1)[0]
        bound = float("inf") if le == "+Inf" else float(le)
        out[bound] = out.get(bound, 0.0) + float(value.split()[0])
    return out


def share_above(before: str, after: str, name: str, seconds: float) -> float | None:
    """Share of the samples of histogram ``name`` added between two ``/metrics`` texts that lie
    above the smallest bucket bound >= ``seconds`` (None: none added, or a scrape failed)."""
    b, a = bucket_counts(before, name), bucket_counts(after, name)
    bounds = [x for x in a if x >= seconds]
    if not before or not a or not bounds:
        return None
    total = a[float("inf")] - b.get(float("inf"), 0.0)
    if total <= 0:
        return None
    bound = min(bounds)
    return round(1.0 - (a[bound] - b.get(bound, 0.0)) / total, 4)


def replica_means(before: dict, after: dict) -> dict:
    """Mean seconds per request of each :data:`REPLICA_SIDE` histogram between two
    :func:`histogram_totals` readings (None where no request finished or a scrape failed)."""
    out = {}
    if not before or not after:
        return {f"{key}_mean_s": None for key in REPLICA_SIDE}
    for key, name in REPLICA_SIDE.items():
        ds, dc = after[name][0] - before[name][0], after[name][1] - before[name][1]
        out[f"{key}_mean_s"] = round(ds / dc, 4) if dc > 0 else None
    return out
