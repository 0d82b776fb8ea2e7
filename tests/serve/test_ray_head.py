"""``lserve serve``'s Ray head leaves nothing running when lserve dies without a chance to stop it
(SIGKILL, the OOM killer): its daemons and workers, in a session of their own, go with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from lserve.serve.ray_head import session_pids

DRIVER = """
import os, sys, time
import ray
from lserve.serve.ray_head import RayHead

head = RayHead.start(num_cpus=1, include_dashboard=False, logging_level="WARNING")
ray.init(address=head.address, namespace="lserve-head-test", logging_level="WARNING")

@ray.remote(num_cpus=0)
class Actor:  # detached, as Ray Serve's controller and replicas are
    def where(self):
        return os.getpid(), os.getsid(0)

actor = Actor.options(name="probe", lifetime="detached").remote()
pid, sid = ray.get(actor.where.remote())
print(head.sid, pid, sid, flush=True)
time.sleep(600)
"""


def test_ray_goes_when_lserve_is_killed():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": tempfile.mkdtemp(prefix="lsh-", dir="/tmp")}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=env, text=True)
    head_sid = None
    try:
        head_sid, actor_pid, actor_sid = map(int, proc.stdout.readline().split())
        assert actor_sid == head_sid != os.getsid(0)  # Ray's workers too are in the head's session
        started = session_pids(head_sid)
        assert actor_pid in started and len(started) >= 4, started  # head, GCS, raylet, workers
        assert os.getpgid(proc.pid) not in {os.getpgid(p) for p in started}  # no group signal reaches them
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 30
        while session_pids(head_sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not session_pids(head_sid), "Ray processes outlived lserve"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in session_pids(head_sid) if head_sid else []:
            os.kill(pid, signal.SIGKILL)
