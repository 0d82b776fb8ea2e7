"""The ``lserve serve`` subprocess ``lserve bench serve`` drives: start, health, admin reads, stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lserve.serve.settings import API_KEY_ENV


def auth_headers() -> dict[str, str]:
    """The bearer token of ``$LSERVE_API_KEY``: the servers this bench starts inherit its
    environment and then ask every API request for it."""
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


class Server:
    """An ``lserve serve`` subprocess (its output goes to ``log_path``).

    Parameters
    ----------
    flags : list of str
        Flags after ``lserve serve``.
    port : int
    log_path : Path
    """

    def __init__(self, flags: list[str], port: int, log_path: Path) -> None:
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "lserve", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
        self._log.write("$ " + " ".join(cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until ``/health`` answered 200; raises if the process died or time ran out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lserve serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"lserve serve not healthy after {timeout_s:.0f} s; see {self.log_path}")

    def get_json(self, path: str) -> dict:
        req = urllib.request.Request(self.base_url + path, headers=auth_headers())
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)

    def scrape(self) -> str:
        """The server's ``/metrics`` text ("" if the scrape failed: the load point is still measured)."""
        try:
            with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as r:
                return r.read().decode()
        except OSError:
            return ""

    def engine_steps(self) -> list[dict]:
        """Each replica's step counters (``/admin/engines``; [] if the request failed: the load point
        is still measured)."""
        try:
            return [{"replica": r["replica"], "step_kinds": r.get("step_kinds", {}),
                     "step_seconds": r.get("step_seconds", {}), "budget": r.get("budget", {})}
                    for r in self.get_json("/admin/engines")["replicas"]]
        except (OSError, KeyError, ValueError):
            return []

    def stop(self) -> None:
        """SIGINT (the server drains and shuts Ray down), then kill after a grace period."""
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def dump_stacks(path: Path) -> None:
    """Python stacks of every Ray and lserve process (py-spy, where installed) into ``path``."""
    import shutil

    spy = shutil.which("py-spy")
    with open(path, "w") as f:
        if spy is None:
            f.write("py-spy is not installed\n")
            return
        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
        for line in ps:
            pid, _, cmd = line.strip().partition(" ")
            if "ray::" in cmd or "lserve" in cmd:
                f.write(f"==== {pid} {cmd[:200]}\n")
                r = subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=30)
                f.write(r.stdout + r.stderr)
                f.flush()
