"""``lserve drain``: start a running server's drain through ``POST /admin/drain`` and wait for it.

What a Kubernetes preStop hook runs on the Ray head (``k8s/rayservice.yaml``), and what an
operator runs before taking a server away. The API key is read from ``$LSERVE_API_KEY``.

Exit status: 0 the drain started or was already under way (with ``--wait``: and no request is in
flight any more); 1 with ``--wait``, requests were still in flight when the wait ended (or the
server stopped answering); 2 the drain could not be asked for (bad flags, no server at ``--url``,
a wrong or missing API key, an error answer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

from lserve.serve.settings import API_KEY_ENV

DEFAULT_URL = "http://127.0.0.1:8000"
#: Seconds ``--wait`` waits beyond the grace period and the cut streams' flush (answers arriving late).
WAIT_MARGIN_S = 5.0
POLL_S = 0.5
HTTP_TIMEOUT_S = 10.0


def wait_limit_s(grace_s: float) -> float:
    """The longest ``lserve drain --wait`` waits for a drain with grace period ``grace_s``.

    The grace period, then the seconds the cut streams get to send their last events, then a margin.

    Parameters
    ----------
    grace_s : float
    """
    from lserve.serve.lifecycle import Lifecycle

    return grace_s + Lifecycle.CUT_FLUSH_S + WAIT_MARGIN_S


class DrainError(Exception):
    """The drain could not be asked for: one line for the user."""


def _call(method: str, url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url.rstrip('/')}/admin/drain", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    key = os.environ.get(API_KEY_ENV)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = e.reason
        raise DrainError(f"{method} {url}/admin/drain answered {e.code}: {msg}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise DrainError(f"cannot reach the server at {url}: {reason}") from None


def drain_main(a: argparse.Namespace) -> int:
    """Run ``lserve drain``; returns the exit status (see the module docstring)."""
    if a.grace_s is not None and not 0 <= a.grace_s < float("inf"):
        print(f"lserve: error: --grace-s must be a number >= 0, got {a.grace_s}", file=sys.stderr)
        return 2
    try:
        out = _call("POST", a.url, None if a.grace_s is None else {"grace_s": a.grace_s})
    except DrainError as e:
        print(f"lserve: error: {e}", file=sys.stderr)
        return 2
    how = "started" if out["started"] else "already under way"
    print(f"lserve: drain {how} at {a.url}: grace period {out['grace_s']:g}s, {out['in_flight']} request(s) in "
          "flight", flush=True)
    if not a.wait:
        return 0
    deadline = time.monotonic() + wait_limit_s(out["grace_s"]) - out["elapsed_s"]
    while out["in_flight"] > 0 and not out["done"] and time.monotonic() < deadline:
        time.sleep(POLL_S)
        try:
            out = _call("GET", a.url)
        except DrainError as e:
            print(f"lserve: drain: the server stopped answering while requests were in flight ({e})",
                  file=sys.stderr)
            return 1
    if out["in_flight"] > 0:
        print(f"lserve: drain: {out['in_flight']} request(s) still in flight after {out['elapsed_s']:g}s",
              file=sys.stderr)
        return 1
    cut = " (some were ended with an error at the grace period's end)" if out["cut_started"] else ""
    print(f"lserve: drained: no request in flight after {out['elapsed_s']:g}s{cut}", flush=True)
    return 0


def register(sub) -> None:
    """Add ``lserve drain`` to the CLI's subcommands."""
    d = sub.add_parser("drain", help="drain a running server: 503 to new requests, running ones finish or are cut",
                       description=__doc__.split("\n\n")[0].replace("``", "'"),
                       epilog="exit status: 0 drained (or started, without --wait); 1 requests still in flight "
                              "when the wait ended; 2 the drain could not be asked for")
    d.add_argument("--url", default=DEFAULT_URL,
                   help=f"the server's base URL (default: {DEFAULT_URL}); the API key comes from $LSERVE_API_KEY")
    d.add_argument("--grace-s", type=float, default=None,
                   help="seconds running requests get before they end with an error (default: the server's "
                        "--shutdown-grace-s)")
    d.add_argument("--wait", action="store_true",
                   help="return only when no request is in flight (or the grace period and the cut are over)")
    d.set_defaults(func=drain_main)
