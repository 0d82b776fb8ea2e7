"""The local Ray head of ``lserve serve``, run in a process session of its own.

A signal sent to ``lserve serve``'s whole process group (``timeout``, ``kill -- -PGID``, container
init processes, a terminal's Ctrl-C) must reach lserve only: Ray's daemons, stopped first, would
leave lserve unable to drain. So lserve starts this module as a child in a new session; it starts
Ray's head (whose daemons die with it: Ray sets ``PR_SET_PDEATHSIG`` on them), prints the head's
address, and stops Ray when its stdin closes: lserve closes it after draining, and the kernel
closes it when lserve dies, however it dies. :class:`RayHead` is lserve's side of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

#: Seconds the head gets to stop Ray after its stdin closes before its process group is killed.
STOP_TIMEOUT_S = 30.0
#: Seconds to wait for the head's address (a first ``ray.init`` on a small machine takes ~10 s).
START_TIMEOUT_S = 120.0


class RayHead:
    """A Ray head in its own process session, fate-sharing with the process that started it.

    Parameters
    ----------
    proc : subprocess.Popen
        The head process (``python -m lserve.serve.ray_head``), the leader of its own session.
    address : str
        The GCS address to pass to ``ray.init``.
    """

    def __init__(self, proc: subprocess.Popen, address: str) -> None:
        self.proc, self.address = proc, address

    @classmethod
    def start(cls, **init_kwargs: Any) -> RayHead:
        """Start the head and wait for its address.

        Parameters
        ----------
        **init_kwargs
            Keyword arguments of ``ray.init`` (JSON-serialisable), e.g. ``num_cpus``.

        Raises
        ------
        RuntimeError
            When the head exits or does not answer within :data:`START_TIMEOUT_S`.
        """
        proc = subprocess.Popen([sys.executable, "-m", "lserve.serve.ray_head", json.dumps(init_kwargs)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        line = b""
        try:
            os.set_blocking(proc.stdout.fileno(), False)
            while not line.endswith(b"\n"):
                if proc.poll() is not None:
                    raise RuntimeError(f"Ray's head exited with status {proc.returncode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Ray's head did not start within {START_TIMEOUT_S:g}s")
                line += proc.stdout.read() or b""
                time.sleep(0.05)
        except BaseException:
            cls(proc, "").stop()
            raise
        proc.stdout.close()
        return cls(proc, json.loads(line)["address"])

    @property
    def sid(self) -> int:
        """The head's process session: Ray's daemons and workers (the head leads it)."""
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the head process still runs (Ray is gone when it does not)."""
        return self.proc.poll() is None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Let the head stop Ray (close its stdin), then kill whatever is left in its session."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        # Ray's workers (each in a process group of its own, still in this session) notice
        # that their raylet is gone within seconds; make sure of it.
        deadline = time.monotonic() + 5.0
        while session_pids(self.sid) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in session_pids(self.sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (zombies excluded), from ``/proc``.

    Parameters
    ----------
    sid : int
        A session id (the pid of its leader).
    """
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()  # after the command, which may hold spaces
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != b"Z":  # state, ppid, pgrp, session
            out.append(int(entry))
    return out


def _main(init_kwargs: dict[str, Any]) -> int:
    """The head process: start Ray, print its address, stop Ray when stdin reaches its end."""
    import ray

    def _stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its session has no terminal; lserve decides
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # Ray's own prints go to lserve's stderr, never into the address pipe
    try:
        ctx = ray.init(address="local", log_to_driver=False, **init_kwargs)
        out.write(json.dumps({"address": ctx.address_info["gcs_address"]}) + "\n")
        out.close()
        while sys.stdin.buffer.read(65536):
            pass
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_main(json.loads(sys.argv[1])))
