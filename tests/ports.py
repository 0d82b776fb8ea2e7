"""Ports for the servers tests start.

``bind(("127.0.0.1", 0))`` returns a port from the kernel's ephemeral range (32768-60999 here),
the range every outgoing connection and Ray's own randomly placed services draw from too, so
between the test closing its probe socket and its server binding (Ray starts first, seconds)
another process could take the port; a server test once got a 405 from a foreign process that
way. Below the ephemeral range and above Ray's worker ports (10002-19999) nothing draws ports at
random.
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, drawn from [LOW, HIGH)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(LOW, HIGH)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{LOW}, {HIGH}) after 200 tries")
