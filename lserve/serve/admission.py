"""Admission control of the ingress and the engine requests it holds slots for.

:class:`Admission` counts the engine requests in flight against what the replicas and the queue
allowance hold; each :class:`SubRequest` (one choice of an HTTP request, with its open engine
stream) holds one slot until it is cancelled.
"""

from __future__ import annotations

from typing import Any


class Admission:
    """Admission control: engine requests in flight through this ingress, against the capacity.

    Capacity is what the engine replicas hold (``replicas * max_ongoing_requests``) plus the
    queue allowance (``max_queued_requests``); requests beyond it are refused at once. Admitted
    requests that find every replica busy wait in the router's queue. Counting admitted requests
    (instead of Ray's count of requests not yet assigned, which a simultaneous burst fills even
    when replicas have room) makes "queue full" mean what it says.

    Parameters
    ----------
    per_replica, queue : int
    replicas : callable
        Returns the current number of engine replicas (changes with autoscaling and failures).
    """

    def __init__(self, per_replica: int, queue: int, replicas) -> None:
        self.per_replica, self.queue, self.replicas = per_replica, queue, replicas
        self.in_flight = 0

    @property
    def capacity(self) -> int:
        if self.queue < 0:
            return 1 << 62
        return max(1, self.replicas()) * self.per_replica + self.queue

    def acquire(self) -> bool:
        if self.in_flight >= self.capacity:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)


class SubRequest:
    """One engine request (one choice) of an HTTP request, with its open event stream.

    ``cancel()`` (idempotent) stops the engine stream and gives the admission slot back.
    """

    def __init__(self, index: int, stream, first: dict[str, Any], admission: Admission) -> None:
        self.index, self.stream, self.first = index, stream, first
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.prompt_tokens = int(first.get("prompt_tokens", 0))
        self.cached_tokens = 0  # of the prompt's, reused from the replica's prefix cache
        self.completion_tokens = 0
        self.logprobs: list = []  # lserve.serve.logprobs entries of the text so far (echoed prompt first)
        self.new_logprobs: list = []  # those of the last event
        self.text_offset = 0  # completions' text_offset of the next streamed token
        self.echoed = False
        self._admission: Admission | None = admission

    def cancel(self) -> None:
        try:
            self.stream.cancel()
        except Exception:  # noqa: BLE001 - already finished or gone
            pass
        if self._admission is not None:
            self._admission.release()
            self._admission = None

    def __del__(self) -> None:  # safety net: a response that was never iterated still frees its slot
        if self._admission is not None:
            self._admission.release()
            self._admission = None
