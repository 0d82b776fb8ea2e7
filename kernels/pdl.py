"""Programmatic dependent launch (PDL, sm_90+) through the driver's ``cuLaunchKernelEx``.

CuPy launches with ``cuLaunchKernel``, which has no launch attributes. A kernel launched here
carries ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: its CTAs may start while the
previous kernel in the stream finishes, and it must call ``pdl_wait()`` (``common.cuh``) before
reading what earlier kernels wrote. The decode step is a chain of short, latency-bound kernels
(page scores -> top-k -> attention), so the launch gap between them is a visible share of the
step. Stream capture records the programmatic edges, so CUDA graphs keep the overlap.
"""

from __future__ import annotations

import ctypes
import functools
import struct

import numpy as np

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: 4-byte id, padding to 8, a 64-byte value union (cuda.h, CUDA 12/13)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig (56 bytes on x86-64; hStream at 32, attrs at 40, numAttrs at 48)
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_FORMATS = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i", np.dtype(np.float32): "f"}
_LAYOUTS: dict = {}  # (CUfunction, argument count) -> _Layout


class _Layout:
    """One buffer holding a launch's arguments, each at its natural alignment: one
    ``struct.pack`` per launch instead of a ctypes object per argument (that cost ~0.2 ms a
    launch on a slow host). Cached per kernel: its argument types never change."""

    def __init__(self, dtypes) -> None:
        fmt, offs, off = "<", [], 0
        for dt in dtypes:
            ch = _FORMATS[dt]
            size = struct.calcsize("<" + ch)
            pad = -off % size
            fmt += f"{pad}x" if pad else ""
            off += pad
            offs.append(off)
            fmt += ch
            off += size
        self.packer = struct.Struct(fmt)
        self.offsets = np.array(offs, dtype=np.uint64)
        self.size = off
        self.params_type = ctypes.c_void_p * len(offs)


_ATTR = _LaunchAttribute()
_ATTR.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_ATTR.value[0] = 1  # programmaticStreamSerializationAllowed
_ATTR_PTR = ctypes.pointer(_ATTR)


@functools.lru_cache(maxsize=1)
def _driver_launch():
    """``cuLaunchKernelEx`` from libcuda, or None where the driver has none."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                   ctypes.c_void_p]
    return fn


def available(device_capability: tuple[int, int]) -> bool:
    """PDL can be used: compute capability 9.0 or newer and a driver with ``cuLaunchKernelEx``."""
    return device_capability >= (9, 0) and _driver_launch() is not None


def launch_pdl(function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
               shared_mem: int, stream_ptr: int) -> None:
    """Launch a CUfunction with programmatic stream serialization allowed.

    ``args`` are numpy scalars of the kernel's exact C types (uint64 pointers, int32, int64,
    float32), as for the CuPy launch.
    """
    fn = _driver_launch()
    g = tuple(grid) + (1,) * (3 - len(grid))
    b = tuple(block) + (1,) * (3 - len(block))
    cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, stream_ptr, _ATTR_PTR, 1)
    lay = _LAYOUTS.get((function_ptr, len(args)))
    if lay is None:
        lay = _LAYOUTS[(function_ptr, len(args))] = _Layout([a.dtype for a in args])
    data = bytearray(lay.size)  # alive until the call returns (the driver copies it at launch)
    lay.packer.pack_into(data, 0, *args)
    ptrs = lay.offsets + np.uint64(ctypes.addressof((ctypes.c_char * lay.size).from_buffer(data)))
    params = lay.params_type.from_buffer(ptrs)
    rc = fn(ctypes.byref(cfg), ctypes.c_void_p(function_ptr), params, None)
    if rc != 0:
        from lserve.kernels.loader import KernelError

        raise KernelError(f"cuLaunchKernelEx failed with CUresult {rc}")
