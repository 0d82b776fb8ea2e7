"""``--stream-interval``: an engine replica's outputs of one request gathered into fewer, larger
streamed events.

Every item a replica yields to Ray Serve costs its process a fixed slice of CPU, paid per
token and per stream when each engine step's output goes out alone; past a dozen streams that
host time outgrows the device step. :class:`ChunkBuffer` holds a request's outputs back and
merges them (:meth:`RequestOutput.then`: text, token ids and logprobs concatenated in order)
until ``interval`` generated tokens are pending, as vLLM's ``--stream-interval`` does, and, with
``--stream-interval-ms``, until that long has passed since the stream's previous event (as Ray Serve
LLM's ``stream_batching_interval_ms``): a time floor adds at most one engine step to a token's wait
and holds nothing back when steps are already slower than it (long prefill chunks next to decodes).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lserve.engine.sequence import RequestOutput


class ChunkBuffer:
    """The outputs of one request, held back until a streamed event of them is due.

    An output is due at once when it finishes the request, when it carries the request's first
    generated tokens (the time to first token is unchanged) or when ``interval`` is 1 and there is
    no ``min_gap_s``; otherwise outputs are merged until at least ``interval`` generated tokens are
    pending and at least ``min_gap_s`` has passed since the previous event with tokens. What is held
    when the stream stops early (an error) is taken with :meth:`flush`. Merging keeps every delta in
    order, so the events' concatenated text, token ids and logprobs are those of interval 1.

    Parameters
    ----------
    interval : int or None
        Generated tokens per event (>= 1; 1: every output goes out as it comes); None: a request
        nobody streams (its first tokens and its finish only, as vLLM sends a non-streaming one).
    min_gap_s : float
        Least seconds between two events with tokens (0: no floor).
    clock : callable
        Seconds now (``time.monotonic``; tests pass their own).
    """

    def __init__(self, interval: int | None, min_gap_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval is not None and interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        if min_gap_s < 0:
            raise ValueError(f"min_gap_s must be >= 0, got {min_gap_s}")
        self.interval = interval
        self.min_gap_s = min_gap_s
        self._clock = clock
        self._held: RequestOutput | None = None
        self._sent_tokens = False  # an event with generated tokens has gone out
        self._last_sent = 0.0  # when it went out (read only with a min_gap_s)

    def add(self, out: RequestOutput) -> RequestOutput | None:
        """Take the request's next output; returns the merged output due now, or None (held).

        Parameters
        ----------
        out : RequestOutput
            The next snapshot of the request (its deltas follow those already added).

        Returns
        -------
        RequestOutput or None
            Everything held so far with ``out`` merged in, when an event is due; else None.
        """
        merged = out if self._held is None else self._held.then(out)
        pending = len(merged.delta_token_ids)
        now = self._clock() if self.min_gap_s else 0.0
        due = (merged.finished or (pending > 0 and not self._sent_tokens)
               or (self.interval == 1 and not self.min_gap_s)
               or (self.interval is not None and pending >= self.interval
                   and now - self._last_sent >= self.min_gap_s))
        if not due:
            self._held = merged
            return None
        self._held = None
        if pending > 0:
            self._sent_tokens, self._last_sent = True, now
        return merged

    def flush(self) -> RequestOutput | None:
        """What is held (None when nothing is), which is then no longer held."""
        held, self._held = self._held, None
        return held
