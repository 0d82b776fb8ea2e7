"""``lserve drain`` against a real server, as an operator (or a Kubernetes preStop hook) runs it.

One ``lserve serve`` process (the default model, one CPU replica, an API key) and one drain cover
the sequence: ``POST /admin/drain`` needs the key and checks its body, ``lserve drain --wait``
(the CLI, as a subprocess) starts the drain with its own grace period, ``/health`` and new
requests get 503 at once, a second drain call is a no-op that reports the drain under way, a
stream that can finish within the grace period ends normally, one that cannot is ended with an
error event then ``data: [DONE]``, the CLI returns 0 once nothing is in flight, and a SIGTERM
afterwards still shuts the server down cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from ports import free_port
from test_shutdown import Stream, _still_running, _wait_for, served

from lserve.cli import main as lserve_main

KEY = "drain-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRACE_S = 8.0  # the drain's, given to the CLI; the server's own shutdown grace period is longer


@pytest.fixture
def keyed_server(tmp_path):
    port, log = free_port(), tmp_path / "server.log"
    ray_tmp = tempfile.mkdtemp(prefix="lsd-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp, LSERVE_LOG="WARNING", LSERVE_API_KEY=KEY)
    cmd = [sys.executable, "-m", "lserve.cli", "serve", "--port", str(port), "--device", "cpu", "--replicas", "1",
           "--max-num-seqs", "4", "--max-cache-tokens", "4096", "--max-model-len", "2048", "--token-budget", "0",
           "--shutdown-grace-s", "60"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    with served(proc, url, log, ray_tmp) as tree:
        yield proc, url, log, tree


def _cli(url: str, *args: str, key: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LSERVE_API_KEY"}
    if key is not None:
        env["LSERVE_API_KEY"] = key
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return subprocess.Popen([sys.executable, "-m", "lserve", "drain", "--url", url, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_lserve_drain_drains_a_running_server(keyed_server, monkeypatch, capsys):
    proc, url, log, tree = keyed_server
    # the endpoint: the key first, then a checked body; nothing drains on a refused call
    assert httpx.post(f"{url}/admin/drain", timeout=10).status_code == 401
    monkeypatch.setenv("LSERVE_API_KEY", "wrong")
    assert lserve_main(["drain", "--url", url]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lserve: error: POST") and "401" in err and "\n" not in err, err
    for bad in ({"grace_s": -1}, {"grace_s": "10"}, {"grace": 5}):
        r = httpx.post(f"{url}/admin/drain", json=bad, headers=AUTH, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    state = httpx.get(f"{url}/admin/drain", headers=AUTH, timeout=10).json()
    assert state["draining"] is False and state["in_flight"] == 0, state
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200

    cut = Stream(url, max_tokens=1900, headers=AUTH)  # cannot finish within the grace period on this machine
    cut.start()
    cut.wait_tokens(6)
    rate = 5 / (cut.token_times[5] - cut.token_times[0])
    # still running when the drain begins (the CLI takes ~1.5 s to start), done well within the grace period
    finished = Stream(url, max_tokens=int(min(400, max(12, rate * (GRACE_S / 4 + 2)))), headers=AUTH)
    finished.start()
    finished.wait_tokens(1)

    started = time.monotonic()
    drain = _cli(url, "--grace-s", str(GRACE_S), "--wait", key=KEY)
    _wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, 10,
              "/health did not turn 503 after lserve drain")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, headers=AUTH, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
    assert r.headers.get("retry-after")
    again = httpx.post(f"{url}/admin/drain", json={"grace_s": 600}, headers=AUTH, timeout=10)
    assert again.status_code == 202, again.text
    body = again.json()
    assert body["started"] is False and body["draining"] is True and body["grace_s"] == GRACE_S, body
    assert body["in_flight_at_start"] == 2, body  # the two streams; the drain calls are not counted

    out, err = drain.communicate(timeout=GRACE_S + 30)
    assert drain.returncode == 0, (out, err)
    assert "drain started" in out and "drained: no request in flight" in out, out
    finished.join(30)
    cut.join(30)
    assert finished.error is None and cut.error is None, (finished.error, cut.error)
    assert finished.events[-1] == "[DONE]" and not any('"error"' in e for e in finished.events)
    assert json.loads(finished.events[-2])["choices"][0]["finish_reason"] == "length"
    assert finished.ended_at > started
    assert cut.ended_at - started >= GRACE_S - 1
    assert cut.events[-1] == "[DONE]", cut.events[-3:]
    error = json.loads(cut.events[-2])["error"]
    assert error["code"] == "server_shutting_down", error
    state = httpx.get(f"{url}/admin/drain", headers=AUTH, timeout=10).json()
    assert state["done"] and state["in_flight"] == 0 and state["result"]["cut"] == 1, state

    # the shutdown that follows (what Kubernetes sends after the preStop hook) joins the finished drain
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()
    out = log.read_text(errors="replace")
    assert "Traceback" not in out and f"1 request(s) still running after {GRACE_S:g}s" in out, out
    _wait_for(lambda: not _still_running(tree), 15, f"left running: {_still_running(tree)}")
