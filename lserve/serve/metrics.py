"""Prometheus metrics (``lserve:`` names, vLLM style), shared across Ray processes of one host.

Engine replicas and the ingress are separate processes. Each one gets ``PROMETHEUS_MULTIPROC_DIR``
(through its Ray ``runtime_env``) before ``prometheus_client`` is imported, so every process writes
its samples to files there; the ingress's ``GET /metrics`` merges them (:func:`render_metrics`).
Every series carries ``model`` and ``replica`` labels. Gauges use the ``livemostrecent`` mode, and
files of processes that no longer exist are dropped when rendering, so a replaced replica's gauges
disappear while its counters and histograms keep counting in the totals.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lserve.cache.host_tier import HostKVStats

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "lserve:"

# Seconds. TTFT/e2e reach minutes for long prompts on a CPU; ITL/TPOT are per token.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 10.0)

_METRICS: EngineMetrics | None = None
_HTTP: HttpMetrics | None = None


def new_metrics_dir(app_name: str) -> str:
    """A fresh, empty folder for one deployment's multi-process metrics."""
    root = os.path.join(tempfile.gettempdir(), "lserve-metrics")
    path = os.path.join(root, f"{app_name}-{uuid.uuid4().hex[:12]}")
    os.makedirs(path, exist_ok=True)
    return path


def ensure_metrics_dir() -> str | None:
    """Create this process's ``PROMETHEUS_MULTIPROC_DIR`` if it is set; returns it."""
    path = os.environ.get(MULTIPROC_ENV)
    if path:
        os.makedirs(path, exist_ok=True)
    return path


class EngineMetrics:
    """The engine replica's series, labelled with ``model`` and ``replica``.

    Parameters
    ----------
    model : str
        Served model name.
    replica : str
        Ray Serve replica id.
    """

    def __init__(self, model: str, replica: str) -> None:
        ensure_metrics_dir()
        from prometheus_client import Counter, Gauge, Histogram

        labels = ("model", "replica")
        self.labels = {"model": model, "replica": replica}

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, labels + extra, multiprocess_mode="livemostrecent")

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + extra)

        self.ttft = hist("time_to_first_token_seconds", "Time from request arrival at the replica to its first token.",
                         LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens of a request.",
                        TOKEN_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Decode time of a request divided by its output tokens after the first.", TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival at the replica to the last token.",
                        LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time a request waited in the engine before it was scheduled.",
                          LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time from first scheduling to the first token.",
                            LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time from the first token to the last.", LATENCY_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the engine's queue.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache pages in use, per pool (dense/streaming).",
                              ("pool",))
        self.dense_pages = gauge("kv_cache_dense_pages_used", "Dense-pool KV pages in use.")
        self.queued_prompt = gauge("num_queued_prompt_tokens", "Prompt tokens accepted but not yet prefilled.")
        self.step_time = gauge("engine_step_seconds", "Duration of the engine's most recent step.")
        self.token_budget = gauge("sparsity_token_budget", "Decode token budget of dense heads (0: selection off).")
        self.streaming_heads = gauge("sparsity_streaming_heads_fraction", "Fraction of KV heads that are streaming heads.")
        self.selected_pages = gauge("sparsity_selected_pages_per_run",
                                    "Mean KV pages kept per page-selector run (one run = one layer of one sequence, "
                                    "pages summed over its dense KV heads) over the last export interval.")
        self.selector_runs = counter("sparsity_selector_runs", "Page-selector runs (per layer and sequence).")
        self.selector_reuses = counter("sparsity_selection_reuses",
                                       "Layer-steps that reused a stored page selection instead of selecting.")
        self.selector_pages = counter("sparsity_selected_pages", "KV pages kept by page-selector runs.")
        self.selector_time = counter("sparsity_selector_seconds", "Time spent in the page selector.")
        self.kv_read_fraction = gauge("decode_kv_read_fraction",
                                      "KV bytes decode steps read as a fraction of what dense attention reads "
                                      "(streaming heads' ring + selected pages + unselected layers' context) over "
                                      "the last export interval.")
        self.kv_read_tokens = counter("decode_kv_read_head_tokens",
                                      "Cached tokens x KV heads read by decode steps (all layers).")
        self.kv_dense_tokens = counter("decode_kv_dense_head_tokens",
                                       "Cached tokens x KV heads dense attention would have read at those steps.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens of admitted requests looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache.")
        self.prefix_pages = gauge("prefix_cache_pages", "Dense KV pages the prefix cache holds (in use or idle).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of prefilled requests (prefix-cache hits included).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.finished = counter("request_success", "Requests finished, by finish reason (stop, length, abort, error).",
                                ("finished_reason",))
        self.preemptions = counter("num_preemptions", "Sequences preempted (pages freed, recomputed later).")
        self.aborts = counter("num_aborted_requests",
                              "Accepted requests that ended before the engine finished them (client gone, cancelled, "
                              "cut at shutdown): the events of request_success{finished_reason=\"abort\"}.")
        self.steps = counter("engine_steps", "Engine steps run.")
        # The host KV tier's series (issue 39) are created only when the tier is on (init_series).
        self.host_pages_used = gauge("host_kv_pages_on_host", "Host KV tier: host page slots holding a page.")
        self.host_pages = gauge("host_kv_host_pages", "Host KV tier: host page slots in all.")
        self.resident_used = gauge("host_kv_resident_slots_used",
                                   "Host KV tier: device-resident dense page slots in use, summed over layers.")
        self.resident_slots = gauge("host_kv_resident_slots",
                                    "Host KV tier: device-resident dense page slots, summed over layers.")
        self.hot_pages = gauge("host_kv_hot_pages", "Host KV tier: pages held on the device only (no host copy).")
        self.host_hit_rate = gauge("host_kv_hit_rate",
                                   "Host KV tier: share of selected pages (per layer) found resident on the device "
                                   "over the last export interval.")
        self.host_h2d_per_step = gauge("host_kv_bytes_h2d_per_step",
                                       "Host KV tier: mean bytes copied host-to-device per engine step over the "
                                       "last export interval.")
        #: HostKVStats field -> counter.
        self.host_counters = {
            "hits": counter("host_kv_hits", "Host KV tier: selected pages (per layer) found resident."),
            "misses": counter("host_kv_misses", "Host KV tier: selected pages (per layer) not resident."),
            "fetched": counter("host_kv_pages_fetched",
                               "Host KV tier: pages (per layer) copied from the host into the resident set."),
            "deferred": counter("host_kv_pages_deferred",
                                "Host KV tier: missed picks (per layer) the admission rule left on the host."),
            "streamed": counter("host_kv_pages_streamed",
                                "Host KV tier: pages (per layer) read from the host without entering the resident set."),
            "spilled": counter("host_kv_pages_spilled", "Host KV tier: pages copied to the host (all layers)."),
            "fetch_layers_skipped": counter("host_kv_fetch_layers_skipped",
                                            "Host KV tier: layers of a selection not fetched into the resident set "
                                            "(the next selection came first; the per-step host budget)."),
            "prefill_streamed": counter("host_kv_prefill_pages_streamed",
                                        "Host KV tier: pages (per layer) prefill chunks read of their past from the host."),
            "prefill_bytes_h2d": counter("host_kv_prefill_bytes_h2d",
                                         "Host KV tier: bytes prefill chunks read of their past from the host."),
            "h2d_copies": counter("host_kv_h2d_copies",
                                  "Host KV tier: bulk host-to-device copies (runs of consecutive host pages, per "
                                  "layer) that scans read the host with."),
            "staged_parts": counter("host_kv_staged_parts",
                                    "Host KV tier: head parts of selected pages on the host staged on the device "
                                    "(once a selection; the decode kernels read them there)."),
            "bytes_h2d": counter("host_kv_bytes_h2d", "Host KV tier: bytes copied host-to-device."),
            "bytes_d2h": counter("host_kv_bytes_d2h", "Host KV tier: bytes copied device-to-host."),
        }

    def init_series(self, host_kv: bool = False) -> None:
        """Create every series at zero, so counters and histograms are exported before the first event.

        Parameters
        ----------
        host_kv : bool
            The engine has the host KV tier: create its counters too (they stay absent otherwise).
        """
        for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill, self.decode,
                       self.prompt_tokens, self.generation_tokens, self.preemptions, self.aborts, self.steps,
                       self.selector_runs, self.selector_reuses, self.selector_pages, self.selector_time,
                       self.prefix_queries, self.prefix_hits,
                       self.kv_read_tokens, self.kv_dense_tokens):
            self.of(metric)
        for reason in ("stop", "length", "abort", "error"):
            self.of(self.finished, finished_reason=reason)
        if host_kv:
            for metric in self.host_counters.values():
                self.of(metric)

    def export_host_kv(self, now: HostKVStats, before: HostKVStats, steps: int) -> None:
        """Export the host KV tier's state: gauges from ``now``, counters advanced by what changed
        since ``before`` (the previous export's snapshot), interval ratios when there was traffic.

        Parameters
        ----------
        now, before : HostKVStats
            This export's and the previous export's snapshots of the engine's ``host_kv``.
        steps : int
            Engine steps run between the two snapshots.
        """
        for metric, value in ((self.host_pages_used, now.pages_on_host), (self.host_pages, now.host_pages),
                              (self.resident_used, now.resident_slots_used),
                              (self.resident_slots, now.resident_slots), (self.hot_pages, now.hot_pages)):
            self.of(metric).set(value)
        delta = {key: getattr(now, key) - getattr(before, key) for key in self.host_counters}
        for key, metric in self.host_counters.items():
            if delta[key] > 0:
                self.of(metric).inc(delta[key])
        selected = delta["hits"] + delta["misses"]
        if selected > 0:
            self.of(self.host_hit_rate).set(delta["hits"] / selected)
        if steps > 0:
            self.of(self.host_h2d_per_step).set(delta["bytes_h2d"] / steps)

    def of(self, metric, **extra):
        """``metric`` with this replica's labels (plus ``extra``)."""
        return metric.labels(**self.labels, **extra)


def get_engine_metrics(model: str, replica: str) -> EngineMetrics:
    """The process-wide :class:`EngineMetrics` (created on first use)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = EngineMetrics(model, replica)
    return _METRICS


class HttpMetrics:
    """The ingress's series: HTTP responses by endpoint and status code."""

    def __init__(self, model: str, replica: str) -> None:
        ensure_metrics_dir()
        from prometheus_client import Counter

        self.labels = {"model": model, "replica": replica}
        self.responses = Counter(PREFIX + "http_responses",
                                 "HTTP responses of the OpenAI ingress by route and status (probes and scrapes "
                                 "not counted); status 499: the client went away before its response was complete.",
                                 ("model", "replica", "endpoint", "status"))

    def count(self, endpoint: str, status: int) -> None:
        self.responses.labels(**self.labels, endpoint=endpoint, status=str(status)).inc()


def get_http_metrics(model: str, replica: str) -> HttpMetrics:
    """The process-wide :class:`HttpMetrics` (created on first use)."""
    global _HTTP
    if _HTTP is None:
        _HTTP = HttpMetrics(model, replica)
    return _HTTP


_PID_FILE = re.compile(r"gauge_live\w+?_(\d+)\.db$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drop_dead_processes(path: str) -> list[int]:
    """Remove the live-gauge files of processes that no longer exist; returns their pids."""
    from prometheus_client import multiprocess

    dead = set()
    for f in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        m = _PID_FILE.search(os.path.basename(f))
        if m and not _pid_alive(int(m.group(1))):
            dead.add(int(m.group(1)))
    for pid in dead:
        multiprocess.mark_process_dead(pid, path)
    return sorted(dead)


def render_metrics() -> tuple[bytes, str]:
    """The ``lserve:`` series of every process sharing this process's metrics folder.

    Returns
    -------
    (bytes, str)
        The exposition text and its content type.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

    path = ensure_metrics_dir()
    registry = CollectorRegistry()
    if path:
        drop_dead_processes(path)
        collector = multiprocess.MultiProcessCollector(None, path=path)
    else:  # single process (tests without Ray): the default registry
        from prometheus_client import REGISTRY as collector

    class _Only:
        def collect(self):
            for family in collector.collect():
                if family.name.startswith(PREFIX):
                    yield family

    registry.register(_Only())
    return generate_latest(registry), CONTENT_TYPE_LATEST
