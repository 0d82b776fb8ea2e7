"""Per-pod metrics sidecar: serves the ``lserve:*`` series of every LServe process on this pod.

LServe's processes (the OpenAI ingress and engine replicas) write Prometheus samples to files in a
multi-process folder (``PROMETHEUS_MULTIPROC_DIR``, one per deployment under
``$TMPDIR/lserve-metrics/``). The ingress's ``/metrics`` only sees the folder of its own host, so
on Kubernetes, where engine replicas run on several GPU pods, each Ray pod runs this exporter as
a sidecar: it shares that folder (an ``emptyDir``) and the pod's process namespace
(``shareProcessNamespace: true``, so gauges of dead processes can be told apart) and serves
``GET /metrics`` on its own port for the PodMonitor.

    python deploy/metrics_exporter.py --root /tmp/lserve-metrics --host 0.0.0.0 --port 9400

Every sub-folder of ``--root`` is one deployment's folder; series of all of them are merged,
except folders without a live process (engine replicas keep live gauges): those belong to a
deployment that was replaced, and their frozen counters would only add stale series.
``GET /healthz`` answers ``ok``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PREFIX = "lserve:"


def deployment_dirs(root: Path) -> list[Path]:
    """Multi-process folders under ``root`` (sub-folders holding ``*.db`` files), or ``root`` itself.

    Parameters
    ----------
    root : Path

    Returns
    -------
    list of Path
    """
    if not root.is_dir():
        return []
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("*.db")))
    if any(root.glob("*.db")):
        dirs.insert(0, root)
    return dirs


class MergedCollector:
    """Collects the ``lserve:`` families of several multi-process folders into one set.

    Parameters
    ----------
    root : Path
        Parent of the deployments' folders.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock = threading.Lock()

    def collect(self):
        """Yield merged metric families (samples of one name from all folders in one family)."""
        from prometheus_client import multiprocess

        from lserve.serve.metrics import drop_dead_processes

        merged: dict[str, object] = {}
        with self.lock:  # dropping dead processes' files must not race with itself
            for folder in deployment_dirs(self.root):
                drop_dead_processes(str(folder))
                if not any(folder.glob("gauge_live*.db")):
                    continue  # no live process left: a deployment that was replaced or deleted
                for family in multiprocess.MultiProcessCollector(None, path=str(folder)).collect():
                    if not family.name.startswith(PREFIX):
                        continue
                    if family.name in merged:
                        merged[family.name].samples.extend(family.samples)
                    else:
                        merged[family.name] = family
        yield from merged.values()


def render(root: Path) -> tuple[bytes, str]:
    """Exposition text of every ``lserve:`` series under ``root``.

    Parameters
    ----------
    root : Path

    Returns
    -------
    (bytes, str)
        Body and content type.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(MergedCollector(root))
    return generate_latest(registry), CONTENT_TYPE_LATEST


def make_handler(root: Path):
    """The HTTP handler class serving ``/metrics`` and ``/healthz`` for ``root``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.split("?")[0] == "/metrics":
                try:
                    body, ctype = render(root)
                    status = 200
                except Exception as e:  # noqa: BLE001 - report, keep serving
                    body, ctype, status = f"metrics collection failed: {e}\n".encode(), "text/plain", 500
            elif self.path == "/healthz":
                body, ctype, status = b"ok\n", "text/plain", 200
            else:
                body, ctype, status = b"not found\n", "text/plain", 404
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # noqa: A002 - quiet access log
            pass

    return Handler


def main(argv: list[str] | None = None) -> int:
    """Serve until interrupted.

    Parameters
    ----------
    argv : list of str, optional

    Returns
    -------
    int
    """
    default_root = Path(os.environ.get("TMPDIR", "/tmp")) / "lserve-metrics"
    p = argparse.ArgumentParser(description="Serve the lserve:* metrics of every LServe process on this host.")
    p.add_argument("--root", type=Path, default=default_root, help="parent of the multi-process metrics folders")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9400)
    a = p.parse_args(argv)
    a.root.mkdir(parents=True, exist_ok=True)
    server = ThreadingHTTPServer((a.host, a.port), make_handler(a.root))
    print(f"lserve metrics exporter: {a.root} on http://{a.host}:{server.server_port}/metrics", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
