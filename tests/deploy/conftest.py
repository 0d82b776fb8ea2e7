"""Fixtures of the deployment tests: one real ``lserve serve`` and one real Prometheus.

The server is the CLI a user runs (``lserve serve`` on 127.0.0.1, default model, CPU), started
once for the module that needs it, in its own temporary folder (Ray session files, the metrics
folder). Prometheus is the Debian ``prometheus`` binary scraping that server every second on
loopback, with the project's alert rules loaded.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from deploy_helpers import ALERTS, PROM_CONFIG, REPO, PromAPI
from ports import free_port

# load_tests/ is a top-level package of the repository, run as `python -m load_tests` from its root.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LSERVE = Path(sys.executable).with_name("lserve")
#: Small server for a 2-core machine: short context, small KV pool, and a 256-token decode budget
#: so the page selector runs on the test's ~300-token prompts. The host KV tier is on (more host
#: pages than the 192 a step pins), so its dashboard panels have data too.
SERVER_FLAGS = ["--max-model-len", "2048", "--max-cache-tokens", "16384", "--max-num-seqs", "8",
                "--token-budget", "256", "--reuse-interval", "4", "--host-kv-gib", "0.5"]


def pytest_configure(config):
    config.addinivalue_line("markers", "deploy_server: needs the deploy suite's lserve server and Prometheus")


@dataclass
class Server:
    """The running ``lserve serve``."""

    url: str
    port: int
    tmp: Path
    proc: subprocess.Popen
    log: Path

    @property
    def metrics_root(self) -> Path:
        """Parent of the server's multi-process metrics folder (``$TMPDIR/lserve-metrics``)."""
        return self.tmp / "lserve-metrics"


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the process group we started, then SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def lserve_server():
    """``lserve serve`` with the default model on 127.0.0.1 (started once, stopped after the module)."""
    if not LSERVE.exists():
        pytest.skip(f"{LSERVE} not found: install the package with its serve extra")
    tmp = Path(tempfile.mkdtemp(prefix="lsdeploy-", dir="/tmp"))
    port = free_port()
    env = dict(os.environ, TMPDIR=str(tmp), RAY_TMPDIR=str(tmp), RAY_AUTH_MODE="disabled", LSERVE_LOG="WARNING",
               PYTHONUNBUFFERED="1")
    env.pop("LSERVE_API_KEY", None)
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(LSERVE), "serve", "--host", "127.0.0.1", "--port", str(port), *SERVER_FLAGS],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        # First start on a fresh machine dequantizes the default GGUF (~40 s on 2 idle cores).
        _wait_http(f"{url}/health", proc, timeout=420, log=log)
        yield Server(url, port, tmp, proc, log)
    finally:
        _stop(proc, timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


def prometheus_config_for(target: str, rule_file: Path) -> dict:
    """``deploy/prometheus/prometheus.yml`` pointed at ``target``, scraping every second.

    Only the ``lserve`` job is kept (Ray's metrics port is not exposed by ``lserve serve``); the
    rule file is the project's, by absolute path.
    """
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    jobs = [j for j in cfg["scrape_configs"] if j["job_name"] == "lserve"]
    assert jobs, "deploy/prometheus/prometheus.yml has no 'lserve' scrape job"
    job = jobs[0]
    job["static_configs"] = [{"targets": [target]}]
    job["scrape_interval"] = "1s"
    cfg["scrape_configs"] = [job]
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(rule_file)]
    return cfg


@pytest.fixture(scope="module")
def prometheus(lserve_server):
    """A real Prometheus scraping the server every second, with deploy/prometheus/alerts.yml loaded."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (apt-get install -y prometheus)")
    tmp = Path(tempfile.mkdtemp(prefix="lsprom-", dir="/tmp"))
    port = free_port()
    cfg_path = tmp / "prometheus.yml"
    cfg_path.write_text(yaml.safe_dump(prometheus_config_for(f"127.0.0.1:{lserve_server.port}", ALERTS.resolve())))
    log = tmp / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, f"--config.file={cfg_path}", f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
                                 "--storage.tsdb.retention.time=1h"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
    api = PromAPI(f"http://127.0.0.1:{port}")
    try:
        _wait_http(f"{api.url}/-/ready", proc, timeout=60, log=log)
        # The first scrape of the server must have landed before the load starts.
        api.wait_for('up{job="lserve"}', lambda r: bool(r) and r[0]["value"][1] == "1", timeout=60)
        yield api
    finally:
        _stop(proc, timeout=20)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO
