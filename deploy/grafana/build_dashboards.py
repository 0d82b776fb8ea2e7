"""Write the Grafana dashboard JSON of LServe (``deploy/grafana/dashboards/*.json``).

The dashboard is generated so that its many similar panels (p50/p90/p99 of four histograms, total
and per-replica views) stay consistent. Run ``python deploy/grafana/build_dashboards.py`` after a
change and commit the JSON; ``--check`` exits 1 when the committed JSON is stale. Then
``python deploy/render_k8s.py`` refreshes the Kubernetes ConfigMap that carries it.

Every query filters on the ``model`` and ``replica`` template variables (regex, "All" = ``.*``)
and uses ``$__rate_interval`` for rates.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT_DIR = HERE / "dashboards"

SEL = 'model=~"$model", replica=~"$replica"'
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"

HISTOGRAMS = {
    "TTFT": "lserve:time_to_first_token_seconds",
    "ITL": "lserve:inter_token_latency_seconds",
    "TPOT": "lserve:request_time_per_output_token_seconds",
    "E2E latency": "lserve:e2e_request_latency_seconds",
}


class Layout:
    """Places panels left to right on Grafana's 24-column grid, opening rows as asked."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = self.y = 0
        self.row_h = 0
        self.next_id = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        """Start a new row titled ``title`` below everything placed so far."""
        self.newline()
        self.panels.append({"id": self._id(), "type": "row", "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def newline(self) -> None:
        """Move below the current line of panels."""
        if self.x:
            self.y += self.row_h
            self.x, self.row_h = 0, 0

    def add(self, title: str, targets: list[tuple[str, str]], unit: str, description: str, w: int = 8,
            h: int = 8, stack: bool = False, max_value: float | None = None) -> None:
        """Place a time-series panel.

        Parameters
        ----------
        title, description : str
        targets : list of (str, str)
            PromQL expression and legend format of each query.
        unit : str
            Grafana unit of the y axis.
        w, h : int
            Width (of 24 columns) and height in grid units.
        stack : bool
            Stack the series.
        max_value : float, optional
            Fixed y-axis maximum (minimum 0).
        """
        if self.x + w > 24:
            self.newline()
        defaults: dict = {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10 if stack else 0,
                                                   "stacking": {"mode": "normal" if stack else "none"}}}
        if max_value is not None:
            defaults["max"] = max_value
            defaults["min"] = 0
        self.panels.append({
            "id": self._id(), "type": "timeseries", "title": title, "description": description,
            "datasource": DS, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
                         "range": True} for i, (expr, legend) in enumerate(targets)],
        })
        self.x += w
        self.row_h = max(self.row_h, h)


def quantile(q: float, metric: str, by: str = "") -> str:
    """``histogram_quantile`` of ``metric``'s buckets, summed over replicas (or kept ``by`` a label)."""
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket{{{SEL}}}[{RI}])))"


def variables() -> list[dict]:
    """Template variables: Prometheus data source, model and replica (multi-value, All = ``.*``)."""
    def query_var(name: str, query: str) -> dict:
        return {"name": name, "label": name, "type": "query", "datasource": DS,
                "definition": query, "query": {"query": query, "refId": f"{name}-var"},
                "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1}

    return [
        {"name": "datasource", "label": "data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1},
        query_var("model", "label_values(lserve:num_requests_running, model)"),
        query_var("replica", 'label_values(lserve:num_requests_running{model=~"$model"}, replica)'),
    ]


def overview() -> dict:
    """The LServe dashboard: latency, throughput, scheduler, KV cache and sparsity, total and per replica."""
    g = Layout()
    g.row("Latency (all replicas)")
    for name, metric in HISTOGRAMS.items():
        g.add(f"{name} p50 / p90 / p99", [(quantile(q, metric), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)], "s",
              f"{name} percentiles over every replica of the selected models ({metric}).", w=6)
    g.row("Latency per replica")
    for name in ("TTFT", "ITL", "TPOT"):
        metric = HISTOGRAMS[name]
        g.add(f"{name} p99 per replica", [(quantile(0.99, metric, "replica"), "{{replica}}")], "s",
              f"p99 {name} of each engine replica.")
    g.add("Queue time p90 per replica",
          [(quantile(0.9, "lserve:request_queue_time_seconds", "replica"), "{{replica}}")], "s",
          "Time requests waited in the engine before their first scheduling step.", w=12)
    g.add("Prefill time p90 per replica",
          [(quantile(0.9, "lserve:request_prefill_time_seconds", "replica"), "{{replica}}")], "s",
          "Time from first scheduling to the first token (prompt processing).", w=12)

    g.row("Throughput")
    g.add("Requests finished / s by reason",
          [(f"sum by (finished_reason) (rate(lserve:request_success_total{{{SEL}}}[{RI}]))", "{{finished_reason}}")],
          "reqps", "Requests finished per second: stop, length, abort (client gone) or error.", stack=True)
    g.add("Tokens / s (all replicas)",
          [(f"sum(rate(lserve:prompt_tokens_total{{{SEL}}}[{RI}]))", "prompt"),
           (f"sum(rate(lserve:generation_tokens_total{{{SEL}}}[{RI}]))", "generated")],
          "short", "Prompt tokens prefilled and tokens generated per second, summed over replicas.")
    g.add("HTTP responses / s by status",
          [(f'sum by (status) (rate(lserve:http_responses_total{{model=~"$model"}}[{RI}]))', "{{status}}")],
          "reqps", "Responses of the OpenAI ingress by HTTP status (429/503: overload).", stack=True)
    g.add("Requests finished / s per replica",
          [(f"sum by (replica) (rate(lserve:request_success_total{{{SEL}}}[{RI}]))", "{{replica}}")],
          "reqps", "Requests each engine replica finished per second.", w=12)
    g.add("Generated tokens / s per replica",
          [(f"sum by (replica) (rate(lserve:generation_tokens_total{{{SEL}}}[{RI}]))", "{{replica}}")],
          "short", "Decode throughput of each engine replica.", w=12)

    g.row("Scheduler")
    g.add("Running / waiting (all replicas)",
          [(f"sum(lserve:num_requests_running{{{SEL}}})", "running"),
           (f"sum(lserve:num_requests_waiting{{{SEL}}})", "waiting")],
          "short", "Requests in the running batches and in the engines' queues, summed over replicas.")
    g.add("Running / waiting per replica",
          [(f"sum by (replica) (lserve:num_requests_running{{{SEL}}})", "{{replica}} running"),
           (f"sum by (replica) (lserve:num_requests_waiting{{{SEL}}})", "{{replica}} waiting")],
          "short", "Running and waiting requests of each engine replica.")
    g.add("Queued prompt tokens per replica",
          [(f"sum by (replica) (lserve:num_queued_prompt_tokens{{{SEL}}})", "{{replica}}")],
          "short", "Prompt tokens accepted but not yet prefilled: the token load the router balances.")
    g.add("Engine steps / s per replica",
          [(f"sum by (replica) (rate(lserve:engine_steps_total{{{SEL}}}[{RI}]))", "{{replica}}")],
          "short", "Forward steps each engine ran per second.", w=12)
    g.add("Last step duration per replica",
          [(f"max by (replica) (lserve:engine_step_seconds{{{SEL}}})", "{{replica}}")],
          "s", "Duration of each engine's most recent step.", w=12)

    g.row("KV cache")
    g.add("KV usage per pool (max over replicas)",
          [(f"max by (pool) (lserve:kv_cache_usage_perc{{{SEL}}})", "{{pool}}")],
          "percentunit", "Fraction of KV pages in use in the dense and streaming pools, fullest replica.",
          max_value=1)
    g.add("KV usage per replica and pool",
          [(f"max by (replica, pool) (lserve:kv_cache_usage_perc{{{SEL}}})", "{{replica}} {{pool}}")],
          "percentunit", "Fraction of KV pages in use, per engine replica and pool.", max_value=1)
    g.add("Dense KV pages used per replica",
          [(f"sum by (replica) (lserve:kv_cache_dense_pages_used{{{SEL}}})", "{{replica}}")],
          "short", "Dense-pool pages held by running sequences.")
    g.add("Preemptions / s",
          [(f"sum(rate(lserve:num_preemptions_total{{{SEL}}}[{RI}]))", "total"),
           (f"sum by (replica) (rate(lserve:num_preemptions_total{{{SEL}}}[{RI}]))", "{{replica}}")],
          "short", "Sequences evicted for lack of KV pages (recomputed later), total and per replica.", w=12)
    g.add("Aborted requests / s",
          [(f"sum by (replica) (rate(lserve:num_aborted_requests_total{{{SEL}}}[{RI}]))", "{{replica}}")],
          "short", "Requests aborted in the engine (client disconnected or cancelled).", w=12)
    g.add("Prefix cache hit rate",
          [(f"sum(rate(lserve:prefix_cache_hits_total{{{SEL}}}[{RI}])) / "
            f"sum(rate(lserve:prefix_cache_queries_total{{{SEL}}}[{RI}]))", "all replicas"),
           (f"sum by (replica) (rate(lserve:prefix_cache_hits_total{{{SEL}}}[{RI}])) / "
            f"sum by (replica) (rate(lserve:prefix_cache_queries_total{{{SEL}}}[{RI}]))", "{{replica}}")],
          "percentunit", "Prompt tokens served from the prefix cache over prompt tokens looked up (vLLM's "
                         "prefix_cache_hits / prefix_cache_queries), over all replicas and per replica.",
          w=12, max_value=1)
    g.add("Prefix cache pages per replica",
          [(f"max by (replica) (lserve:prefix_cache_pages{{{SEL}}})", "{{replica}}")],
          "short", "Dense KV pages each replica's prefix cache holds (read by running requests or idle; idle "
                   "ones are evicted, least recently used first, when pages run out).", w=12)

    g.row("Sparsity")
    g.add("Page selector time",
          [(f"sum(rate(lserve:sparsity_selector_seconds_total{{{SEL}}}[{RI}])) / "
            f"sum(rate(lserve:sparsity_selector_runs_total{{{SEL}}}[{RI}]))", "per run (all replicas)"),
           (f"sum by (replica) (rate(lserve:sparsity_selector_seconds_total{{{SEL}}}[{RI}]))",
            "{{replica}} share of time")],
          "s", "Mean time of one page-selector run (one layer of one sequence), and the share of each "
               "replica's wall time spent selecting pages (seconds per second).")
    g.add("Pages selected per run",
          [(f"sum(rate(lserve:sparsity_selected_pages_total{{{SEL}}}[{RI}])) / "
            f"sum(rate(lserve:sparsity_selector_runs_total{{{SEL}}}[{RI}]))", "all replicas"),
           (f"max by (replica) (lserve:sparsity_selected_pages_per_run{{{SEL}}})", "{{replica}}")],
          "short", "KV pages the dense heads' selector keeps per run: over all replicas, and each replica's "
                   "mean over its last export interval.")
    g.add("Selector runs and reuses / s",
          [(f"sum by (replica) (rate(lserve:sparsity_selector_runs_total{{{SEL}}}[{RI}]))", "{{replica}} runs"),
           (f"sum by (replica) (rate(lserve:sparsity_selection_reuses_total{{{SEL}}}[{RI}]))", "{{replica}} reuses")],
          "short", "Page selections computed, and layer-steps that reused the stored selection (reuse interval).")
    g.add("Token budget and streaming heads",
          [(f"max by (replica) (lserve:sparsity_token_budget{{{SEL}}})", "{{replica}} token budget"),
           (f"max by (replica) (lserve:sparsity_streaming_heads_fraction{{{SEL}}})", "{{replica}} streaming heads")],
          "short", "Decode token budget of dense heads (0: selection off) and fraction of KV heads that stream.")
    g.add("Decode KV read fraction",
          [(f"sum(rate(lserve:decode_kv_read_head_tokens_total{{{SEL}}}[{RI}])) / "
            f"sum(rate(lserve:decode_kv_dense_head_tokens_total{{{SEL}}}[{RI}]))", "all replicas"),
           (f"max by (replica) (lserve:decode_kv_read_fraction{{{SEL}}})", "{{replica}}")],
          "percentunit", "KV bytes decode steps read as a fraction of what dense attention would read (streaming "
                         "heads' ring, selected pages at each layer's budget, unselected layers' whole context): "
                         "over all replicas, and each replica's last export interval.", max_value=1)

    g.row("Host KV tier (--host-kv-gib)")
    g.add("Host KV pages",
          [(f"sum by (replica) (lserve:host_kv_pages_on_host{{{SEL}}})", "{{replica}} on host"),
           (f"sum by (replica) (lserve:host_kv_resident_slots_used{{{SEL}}})", "{{replica}} resident slots used")],
          "short", "Pages the host tier holds in host memory, and device-resident dense page slots in use (summed "
                   "over layers). No data when the tier is off.")
    g.add("GPU page-cache hit rate",
          [(f"sum(rate(lserve:host_kv_hits_total{{{SEL}}}[{RI}])) / "
            f"(sum(rate(lserve:host_kv_hits_total{{{SEL}}}[{RI}])) + "
            f"sum(rate(lserve:host_kv_misses_total{{{SEL}}}[{RI}])))", "all replicas"),
           (f"max by (replica) (lserve:host_kv_hit_rate{{{SEL}}})", "{{replica}}")],
          "percentunit", "Share of the pages the selector picks (per layer) that were already resident on the "
                         "device: over all replicas, and each replica's last export interval with selections.",
          max_value=1)
    g.add("Host KV bytes copied",
          [(f"sum by (replica) (rate(lserve:host_kv_bytes_h2d_total{{{SEL}}}[{RI}])) / "
            f"sum by (replica) (rate(lserve:engine_steps_total{{{SEL}}}[{RI}]))", "{{replica}} host-to-device / step"),
           (f"sum by (replica) (rate(lserve:host_kv_bytes_d2h_total{{{SEL}}}[{RI}])) / "
            f"sum by (replica) (rate(lserve:engine_steps_total{{{SEL}}}[{RI}]))", "{{replica}} device-to-host / step"),
           (f"sum by (replica) (rate(lserve:host_kv_prefill_bytes_h2d_total{{{SEL}}}[{RI}])) / "
            f"sum by (replica) (rate(lserve:engine_steps_total{{{SEL}}}[{RI}]))", "{{replica}} prefill past reads / step")],
          "bytes", "Bytes the host tier copied per engine step (fetches and host reads; spills), per replica, and "
                   "the part of the host-to-device bytes that prefill chunks read of their offloaded past.")
    g.newline()
    return {
        "uid": "lserve-overview", "title": "LServe", "description":
            "LServe serving: latency percentiles, throughput, scheduler, KV cache, sparsity and the host KV tier, "
            "total and per replica.",
        "tags": ["lserve", "llm-serving"], "timezone": "browser", "editable": True, "graphTooltip": 1,
        "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables()}, "annotations": {"list": []}, "links": [], "panels": g.panels,
    }


DASHBOARDS = {"lserve-overview.json": overview}


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard.

    Returns
    -------
    dict
    """
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check``, compare) the dashboard files; returns the exit status.

    Parameters
    ----------
    argv : list of str, optional

    Returns
    -------
    int
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a committed file differs from what it would be")
    a = p.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = OUT_DIR / name
        if a.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("stale (run python deploy/grafana/build_dashboards.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
