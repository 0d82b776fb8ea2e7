"""Host memory that kernels read and write in place: the host KV tier's pools on the cupy backend.

A zeroed CPU buffer is page-locked and mapped into the GPU's address space (``cudaHostRegister``
with the portable and mapped flags); on GPUs that use the host pointer for registered memory
(Hopper and every recent GPU on Linux, checked here) a kernel dereferences the host address
directly, over PCIe. The buffer is handed out as a CUDA tensor, so torch ops (index copies) and
our kernels move pages between tiers on the GPU's stream, ordered with everything else; its CPU
twin (the same bytes as a CPU tensor) is the source of bulk copies (``copy_`` of a slice: one DMA
at PCIe bandwidth, where a kernel's reads of mapped memory are many small PCIe transactions).
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
    return mapped_pair(shape, dtype, device)[0]


def mapped_pair(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`mapped_zeros`, with its CPU twin: (CUDA-typed tensor, CPU tensor) over the same bytes."""
    device = torch.device(device)
    if not host_pointer_usable(device):
        raise RuntimeError(f"{device} cannot read host memory at its host address "
                           "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0): the host KV tier needs it")
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    reg = _Registered(nbytes)
    raw = torch.as_tensor(reg, device=device)  # uint8 over the host bytes, no copy (it holds ``reg``)
    return raw[:nbytes].view(dtype).view(shape), reg.cpu[:nbytes].view(dtype).view(shape)


class MappedAllocator:
    """``alloc`` for :class:`~lserve.cache.paged_pool.PagedPool`: mapped pinned tensors of
    ``device``, whose CPU twins it keeps in allocation order (:attr:`cpu`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu: list[torch.Tensor] = []

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        gpu, cpu = mapped_pair(shape, dtype, self.device)
        self.cpu.append(cpu)
        return gpu


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` (a CPU tensor) on ``device`` without waiting for the stream: a CUDA copy from pageable
    memory synchronizes the stream first, which would leave the GPU idle while the host goes on
    planning and launching (pinned memory is kept until the copy has run)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
