"""The profile readings the benches and probes share (:mod:`lserve.bench.gpu_trace`), on made-up traces."""

from __future__ import annotations

from types import SimpleNamespace

from torch.autograd import DeviceType

from lserve.bench.gpu_trace import busy_seconds, kernel_seconds


def _ev(name: str, start_us: float, end_us: float, device=DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start_us, end=end_us))


def test_busy_time_is_the_union_of_gpu_spans_and_kernels_sum_by_name():
    events = [_ev("attn", 0, 100), _ev("copy", 50, 150),  # overlapping: 150 us busy, not 200
              _ev("attn", 300, 400), _ev("gemm", 390, 395),  # nested inside: adds nothing
              _ev("host", 150, 300, DeviceType.CPU)]  # host activity is not GPU time
    assert abs(busy_seconds(events) - 250e-6) < 1e-12
    per = kernel_seconds(events)
    assert list(per) == ["attn", "copy", "gemm"] and per["attn"] == 0.0002 and "host" not in per
    assert list(kernel_seconds(events, top=1)) == ["attn"]
