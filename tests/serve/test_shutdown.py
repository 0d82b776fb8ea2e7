"""``lserve serve`` shuts down by draining: signals sent to a real server process, streams read as a client.

For each way a signal arrives (SIGTERM to the process; SIGTERM to its whole process group, as
``timeout``, ``kill -- -PGID`` and container inits send it; SIGINT to a server that inherited
SIGINT as ignored, as one started with ``cmd &`` from a script does), one server (the default
model, one CPU replica, a short grace period) and one signal cover the whole sequence: new requests
and ``/health`` get 503 at once, a stream that can finish within the grace period ends normally
with ``data: [DONE]``, one that cannot is ended at the grace period's end with an error event then
``data: [DONE]``, the process exits 0 without a traceback, and none of the processes it started
(Ray's daemons and workers) is left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from ports import free_port

GRACE_S = 10.0
START_TIMEOUT_S = 300.0



class Stream(threading.Thread):
    """One streaming completion read line by line, with when each token and the end arrived
    (``headers``: e.g. the API key's)."""

    def __init__(self, url: str, max_tokens: int, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.headers = url, max_tokens, headers or {}
        self.events: list[str] = []
        self.token_times: list[float] = []
        self.ended_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": "Once upon a time, in a land far away,", "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=self.headers,
                              timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    self.events.append(line[6:])
                    if line.startswith("data: {") and json.loads(line[6:]).get("choices", [{}])[0].get("text"):
                        self.token_times.append(time.monotonic())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.ended_at = time.monotonic()

    def wait_tokens(self, n: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.token_times) < n:
            assert self.error is None and self.ended_at is None, (self.error, self.events[-3:])
            assert time.monotonic() < deadline, "no tokens"
            time.sleep(0.02)


def _start_server(port: int, log: Path, ray_tmp: str, how: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("LSERVE_API_KEY", "RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp, LSERVE_LOG="WARNING")
    cmd = [sys.executable, "-m", "lserve.cli", "serve", "--port", str(port), "--device", "cpu", "--replicas", "1",
           "--max-num-seqs", "4", "--max-cache-tokens", "4096", "--max-model-len", "2048", "--token-budget", "0",
           "--shutdown-grace-s", str(GRACE_S)]
    def ignore_sigint():  # what a non-interactive shell does to `cmd &`
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    with open(log, "wb") as out:
        # a group of its own, so that the group signal reaches the server's processes only
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=ignore_sigint if how == "sigint-inherited-ignored" else None)


def _process_tree(pid: int) -> dict[int, bytes]:
    """``pid`` and its descendants, each with its start time (to tell a reused pid apart)."""
    stats = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and fields[0] != b"Z":
            stats[int(entry)] = (int(fields[1]), fields[19])  # ppid, start time
    tree, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        if p in stats:
            tree[p] = stats[p][1]
            frontier += [c for c, (ppid, _) in stats.items() if ppid == p]
    return tree


def _still_running(tree: dict[int, bytes]) -> list[int]:
    return [pid for pid, start in tree.items() if _process_tree(pid).get(pid) == start]


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"server exited early:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not healthy after {timeout}s:\n{log.read_text()}"
        time.sleep(0.5)


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


WAYS = ("sigterm-process", "sigterm-process-group", "sigint-inherited-ignored")


def _signal(proc: subprocess.Popen, how: str) -> None:
    if how == "sigterm-process":
        proc.send_signal(signal.SIGTERM)
    elif how == "sigterm-process-group":
        os.killpg(proc.pid, signal.SIGTERM)  # the server leads its group (start_new_session)
    else:
        proc.send_signal(signal.SIGINT)


@pytest.fixture(params=WAYS)
def server(request, tmp_path):
    how, port, log = request.param, free_port(), tmp_path / "server.log"
    ray_tmp = tempfile.mkdtemp(prefix="lsd-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    proc = _start_server(port, log, ray_tmp, how)
    with served(proc, f"http://127.0.0.1:{port}", log, ray_tmp) as tree:
        yield proc, f"http://127.0.0.1:{port}", log, how, tree


@contextlib.contextmanager
def served(proc: subprocess.Popen, url: str, log: Path, ray_tmp: str, timeout: float = START_TIMEOUT_S):
    """A started server once healthy (within ``timeout`` s): yields its process tree; on exit kills
    what is left of it and removes its Ray folder."""
    tree = {}
    try:
        _wait_healthy(proc, url, log, timeout)
        tree = _process_tree(proc.pid)
        yield tree
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in _still_running(tree):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_signal_drains_running_streams_then_cuts_the_rest(server):
    proc, url, log, how, tree = server
    assert len(tree) > 5, tree  # lserve, Ray's daemons, the Serve controller, proxy and replicas
    cut = Stream(url, max_tokens=1900)  # cannot finish within the grace period on this machine
    cut.start()
    cut.wait_tokens(6)
    rate = 5 / (cut.token_times[5] - cut.token_times[0])  # tokens/s of one stream, measured here
    # about a quarter of the grace period's worth at the measured rate: still running when the
    # signal arrives, done well before the grace period ends (two streams share the CPU)
    drained = Stream(url, max_tokens=int(min(400, max(12, rate * GRACE_S / 4))))
    drained.start()
    drained.wait_tokens(1)
    signalled = time.monotonic()
    _signal(proc, how)

    def health_status() -> int:
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code
        except httpx.HTTPError:
            return 0

    _wait_for(lambda: health_status() == 503, 10, "/health did not turn 503 while draining")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
    assert r.headers.get("retry-after")

    drained.join(GRACE_S + 30)
    cut.join(GRACE_S + 30)
    assert drained.error is None and cut.error is None, (drained.error, cut.error)
    # the drained stream was still running at the signal and finished normally
    assert drained.ended_at > signalled and drained.token_times[-1] > signalled
    assert drained.events[-1] == "[DONE]"
    assert json.loads(drained.events[-2])["choices"][0]["finish_reason"] == "length"
    assert not any('"error"' in e for e in drained.events)
    # the long one was cut when the grace period ran out: an error event, then [DONE]
    assert cut.ended_at - signalled >= GRACE_S - 1
    assert cut.events[-1] == "[DONE]", cut.events[-3:]
    err = json.loads(cut.events[-2])["error"]
    assert err["code"] == "server_shutting_down" and err["type"] == "service_unavailable", err
    assert len(cut.token_times) < 1900

    rc = proc.wait(60)
    out = log.read_text(errors="replace")
    assert rc == 0, out
    assert "Traceback" not in out and "ActorDiedError" not in out, out
    assert "1 request(s) still running" in out, out
    # nothing it started is left running (Ray's workers notice their raylet is gone within seconds)
    _wait_for(lambda: not _still_running(tree), 15, f"left running: {_still_running(tree)}")


def test_a_signal_as_soon_as_health_answers_drains(tmp_path):
    """The app serves, and /health answers 200, a moment before ``serve.run`` returns in the
    server: a signal then (a rolling update that stops a pod right after its readiness probe
    passed) drains like any other, instead of stopping without a drain."""
    port, log = free_port(), tmp_path / "server.log"
    ray_tmp = tempfile.mkdtemp(prefix="lsd-", dir="/tmp")
    proc = _start_server(port, log, ray_tmp, "sigterm-process")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # poll fast: the signal must land as soon as /health says 200
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
        out = log.read_text(errors="replace")
        assert rc == 0, out
        assert "refusing new requests" in out and "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        shutil.rmtree(ray_tmp, ignore_errors=True)
