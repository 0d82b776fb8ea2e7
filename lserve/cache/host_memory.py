"""Host memory that kernels read and write in place: the host KV tier's pools on the cupy backend.

A zeroed CPU buffer is page-locked and mapped into the GPU's address space (``cudaHostRegister``
with the portable and mapped flags); on GPUs that use the host pointer for registered memory
(Hopper and every recent GPU on Linux, checked here) a kernel dereferences the host address
directly, over PCIe. The buffer is handed out as a CUDA tensor, so torch ops (index copies) and
our kernels move pages between tiers on the GPU's stream, ordered with everything else.
"""

from __future__ import annotations

import math

import torch

_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem


class _Registered:
    """A page-locked CPU buffer exported as CUDA memory (``__cuda_array_interface__``); unregistered
    when the last tensor over it goes."""

    def __init__(self, nbytes: int) -> None:
        self.cpu = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
        self.ptr = self.cpu.data_ptr()
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.ptr, self.cpu.numel(), _PORTABLE_MAPPED))
        self.__cuda_array_interface__ = {"shape": (self.cpu.numel(),), "typestr": "|u1", "data": (self.ptr, False),
                                         "version": 3, "strides": None}

    def __del__(self) -> None:
        try:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        except Exception:  # interpreter shutdown: the process lets go of it anyway
            pass


def host_pointer_usable(device: torch.device) -> bool:
    """Whether kernels on ``device`` can dereference registered host memory at its host address."""
    import cupy

    index = torch.device(device).index or 0
    return bool(cupy.cuda.runtime.deviceGetAttribute(_CAN_USE_HOST_POINTER, index))


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor in mapped pinned host memory, typed as a CUDA tensor of ``device``.

    Raises
    ------
    RuntimeError
        When ``device`` cannot address registered host memory by its host pointer.
    """
    device = torch.device(device)
    if not host_pointer_usable(device):
        raise RuntimeError(f"{device} cannot read host memory at its host address "
                           "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0): the host KV tier needs it")
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.as_tensor(_Registered(nbytes), device=device)  # uint8 over the host bytes, no copy
    return raw[:nbytes].view(dtype).view(shape)
