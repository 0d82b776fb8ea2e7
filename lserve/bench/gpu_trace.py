"""What a torch.profiler CUDA trace says about a stretch of engine steps: how long the GPU was busy
(the rest of the wall time it waited for the host) and which kernels took that time. Used by the
host-tier bench's decode profile and ``scripts/probes/probe_served_prefill.py``."""

from __future__ import annotations

import collections

from torch.autograd import DeviceType


def busy_seconds(events) -> float:
    """Seconds in which at least one GPU activity of a profile's ``events`` ran (the union of their spans)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e6


def kernel_seconds(events, top: int = 25) -> dict[str, float]:
    """GPU seconds per kernel name (first 90 characters), the ``top`` longest in total."""
    per: collections.Counter = collections.Counter()
    for e in events:
        if e.device_type == DeviceType.CUDA:
            per[e.name[:90]] += (e.time_range.end - e.time_range.start) / 1e6
    return {name: round(sec, 4) for name, sec in per.most_common(top)}
