"""``--stream-interval``: an engine replica's outputs of one request gathered into fewer, larger
streamed events.

Every item a replica yields to Ray Serve costs its process a fixed slice of CPU, paid per
token and per stream when each engine step's output goes out alone; past a dozen streams that
host time outgrows the device step. :class:`ChunkBuffer` holds a request's outputs back and
merges them (:meth:`RequestOutput.then`: text, token ids and logprobs concatenated in order)
until ``interval`` generated tokens are pending, as vLLM's ``--stream-interval`` does.
"""

from __future__ import annotations

from lserve.engine.sequence import RequestOutput


class ChunkBuffer:
    """The outputs of one request, held back until a streamed event of them is due.

    An output is due at once when it finishes the request, when it carries the request's first
    generated tokens (the time to first token is unchanged) or when ``interval`` is 1; otherwise
    outputs are merged until at least ``interval`` generated tokens are pending. What is held when
    the stream stops early (an error) is taken with :meth:`flush`. Merging keeps every delta in
    order, so the events' concatenated text, token ids and logprobs are those of interval 1.

    Parameters
    ----------
    interval : int or None
        Generated tokens per event (>= 1; 1: every output goes out as it comes); None: a request
        nobody streams (its first tokens and its finish only, as vLLM sends a non-streaming one).
    """

    def __init__(self, interval: int | None) -> None:
        if interval is not None and interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.interval = interval
        self._held: RequestOutput | None = None
        self._sent_tokens = False  # an event with generated tokens has gone out

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
        due = (self.interval == 1 or merged.finished or (self.interval is not None and pending >= self.interval)
               or (pending > 0 and not self._sent_tokens))
        if not due:
            self._held = merged
            return None
        self._held = None
        self._sent_tokens = self._sent_tokens or pending > 0
        return merged

    def flush(self) -> RequestOutput | None:
        """What is held (None when nothing is), which is then no longer held."""
        held, self._held = self._held, None
        return held
