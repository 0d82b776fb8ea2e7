"""Reading Ray's session logs in tests."""

from __future__ import annotations


def tracebacks(logged: str) -> list[str]:
    """Every traceback in ``logged``, less Ray's own cancelled queue-length probes.

    Ray Serve 2.60's request router probes replicas' queue lengths in tasks it cancels when the
    caller leaves; asyncio then logs "Task exception was never retrieved" with a traceback made
    only of Ray frames ending in ``TaskCancelledError``. Nothing of ours runs there.
    """
    found = []
    lines = logged.splitlines()
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("Traceback (most recent call last)"):
            continue
        block = [line]
        for nxt in lines[i + 1:]:
            block.append(nxt)
            if nxt and not nxt[0].isspace():  # the exception line closes the traceback
                break
        frames = [b for b in block if b.lstrip().startswith('File "')]
        ray_probe = (frames and all("/ray/" in f for f in frames) and "get_queue_len" in frames[-1]
                     and block[-1].startswith("ray.exceptions.TaskCancelledError"))
        if not ray_probe:
            found.append("\n".join(block))
    return found
