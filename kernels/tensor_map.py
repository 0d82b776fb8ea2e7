"""TMA tensor maps of the paged KV pools, read by ``kernels/bsp_prefill_v5.cu``.

CuPy does not expose the driver's ``cuTensorMapEncodeTiled``; it is called here through ctypes on
``libcuda.so.1``. :func:`pool_map_args` computes a pool's arguments (no driver needed, so the CPU
tests check them), :func:`encode_tiled` makes the call, and :func:`pool_tensor_maps` puts the K
and V pools' maps in one device buffer whose address the kernel takes (TMA reads a map from global
memory), cached per pool so that a pool is encoded once.

A pool ``[P, pool_heads, page_size, D]`` is mapped as a 4-D tensor, innermost first (D, page_size,
pool_heads, P), with a box of 64 dims (128 bytes: the span of the 128-byte swizzle) by
:func:`box_rows` keys by one head by one page: one box per page of a key block, or one per block
for pages of 64 keys or more.
"""

from __future__ import annotations

import ctypes
import functools
from collections import OrderedDict
from dataclasses import dataclass

DATA_TYPES = {"fp16": 6, "bf16": 9}  # CUtensorMapDataType (cuda.h)
ELEMENT_BYTES = 2
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3  # CU_TENSOR_MAP_SWIZZLE_128B: 16-byte chunk c of a 128-byte row r at c ^ (r % 8)
L2_PROMOTION_256B = 3  # a key row is 256 bytes (D 128)
OOB_FILL_NONE = 0  # out-of-bounds elements read as zeros
MAP_BYTES = 128  # sizeof(CUtensorMap)
MAP_ALIGN = 64  # the driver writes a map only to a 64-byte aligned address
BOX_DIMS = 64  # head dims per box: 128 bytes of bf16/fp16
CACHE_SIZE = 32  # pools whose maps stay on the device

# CUresult cuTensorMapEncodeTiled(CUtensorMap*, CUtensorMapDataType, cuuint32_t rank, void* globalAddress,
#   const cuuint64_t* globalDim, const cuuint64_t* globalStrides, const cuuint32_t* boxDim,
#   const cuuint32_t* elementStrides, interleave, swizzle, l2Promotion, oobFill)  (enums: C int)
ENCODE_PROTOTYPE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32), ctypes.c_int,
    ctypes.c_int, ctypes.c_int, ctypes.c_int)


def _error(msg: str) -> Exception:
    from lserve.kernels.loader import KernelError

    return KernelError(msg)


def box_rows(page_size: int, block: int) -> int | None:
    """Keys per TMA box for pages of ``page_size`` keys and key blocks of ``block``: ``min(page_size,
    block)`` when such boxes tile a block without crossing a page, each at a 1024-byte aligned
    offset of the stage (a multiple of 8 rows of 128 bytes, where the swizzle pattern repeats),
    i.e. pages of 8, 16, 32 or 64 keys or multiples of the block; else None (the kernel then copies
    with cp.async)."""
    rows = min(page_size, block)
    ok = page_size > 0 and rows % 8 == 0 and (page_size % block == 0 or block % page_size == 0)
    return rows if ok else None


@dataclass(frozen=True)
class TiledMapArgs:
    """The arguments of ``cuTensorMapEncodeTiled`` besides the map and the global address.

    ``global_dim`` and ``box_dim`` are in elements, innermost dimension first; ``global_strides``
    in bytes, of dimensions 1 .. rank - 1 (dimension 0 is contiguous).
    """

    data_type: int
    global_dim: tuple[int, ...]
    global_strides: tuple[int, ...]
    box_dim: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: int = INTERLEAVE_NONE
    swizzle: int = SWIZZLE_128B
    l2_promotion: int = L2_PROMOTION_256B
    oob_fill: int = OOB_FILL_NONE

    @property
    def rank(self) -> int:
        return len(self.global_dim)


def pool_map_args(shape: tuple[int, ...], strides: tuple[int, ...], dtype: str, block: int) -> TiledMapArgs:
    """The map arguments of a pool of ``shape`` ``[P, pool_heads, page_size, D]`` and element
    ``strides`` (torch's ``Tensor.stride()``), ``dtype`` "bf16" or "fp16", key blocks of ``block``.

    Raises
    ------
    KernelError
        For anything TMA cannot map this way: another rank or dtype, head dims not contiguous or
        not a multiple of 64, a page size :func:`box_rows` refuses, a stride that is not a multiple
        of 16 bytes or not below 2**40, a dimension of 0 or above 2**32.
    """
    if len(shape) != 4 or len(strides) != 4:
        raise _error(f"a KV pool is [pages, heads, page_size, head_dim], got shape {tuple(shape)}")
    if dtype not in DATA_TYPES:
        raise _error(f"TMA maps bf16/fp16 pools, not {dtype}")
    n_pages, heads, page_size, d = (int(x) for x in shape)
    if strides[3] != 1 or d % BOX_DIMS:
        raise _error(f"the pool's head dims must be contiguous and a multiple of {BOX_DIMS} (shape {tuple(shape)}, "
                     f"strides {tuple(strides)})")
    rows = box_rows(page_size, block)
    if rows is None:
        raise _error(f"pages of {page_size} keys do not tile {block}-key blocks in TMA boxes (box_rows)")
    dims = (d, page_size, heads, n_pages)
    byte_strides = tuple(int(s) * ELEMENT_BYTES for s in (strides[2], strides[1], strides[0]))
    if not all(0 < x <= 2 ** 32 for x in dims):
        raise _error(f"pool dimensions {tuple(shape)} out of TMA's range (1 .. 2**32)")
    if not all(s % 16 == 0 and 0 < s < 2 ** 40 for s in byte_strides):
        raise _error(f"pool strides {tuple(strides)} are not multiples of 16 bytes below 2**40")
    return TiledMapArgs(DATA_TYPES[dtype], dims, byte_strides, (BOX_DIMS, rows, 1, 1), (1, 1, 1, 1))


@functools.lru_cache(maxsize=1)
def _encode_fn():
    """``cuTensorMapEncodeTiled`` of the driver, typed by :data:`ENCODE_PROTOTYPE`."""
    try:
        return ENCODE_PROTOTYPE(("cuTensorMapEncodeTiled", ctypes.CDLL("libcuda.so.1")))
    except (OSError, AttributeError) as e:
        raise _error(f"the CUDA driver has no cuTensorMapEncodeTiled (needs CUDA 12+): {e}") from None


def encode_tiled(address: int, args: TiledMapArgs) -> bytes:
    """The 128-byte tensor map of the tensor at device ``address`` (16-byte aligned) described by ``args``."""
    if address % 16:
        raise _error(f"TMA needs a 16-byte aligned tensor, got address {address:#x}")
    buf = (ctypes.c_char * (MAP_BYTES + MAP_ALIGN))()
    at = ctypes.addressof(buf)
    at += -at % MAP_ALIGN
    r = args.rank
    rc = _encode_fn()(ctypes.c_void_p(at), args.data_type, r, ctypes.c_void_p(address),
                      (ctypes.c_uint64 * r)(*args.global_dim), (ctypes.c_uint64 * (r - 1))(*args.global_strides),
                      (ctypes.c_uint32 * r)(*args.box_dim), (ctypes.c_uint32 * r)(*args.element_strides),
                      args.interleave, args.swizzle, args.l2_promotion, args.oob_fill)
    if rc != 0:
        raise _error(f"cuTensorMapEncodeTiled failed with CUresult {rc} for {args}")
    return ctypes.string_at(at, MAP_BYTES)


_MAPS: OrderedDict = OrderedDict()  # (K's, V's (address, shape, strides, dtype, device)) -> device buffer


def pool_tensor_maps(pool_k, pool_v, block: int):
    """K's then V's tensor map in one uint8 tensor of 256 bytes on the pools' device.

    Cached on what a map encodes (address, shape, strides, dtype, device of each pool), so a
    pool is encoded and copied once, and a new tensor at an old address with the old geometry
    reuses a map that describes it exactly. Keep the returned tensor alive until the kernels that
    read it have run (the cache holds its last :data:`CACHE_SIZE` entries).
    """
    import torch
    from lserve.kernels.loader import dtype_name

    pools = (pool_k, pool_v)
    key = tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device)) for t in pools)
    hit = _MAPS.get(key)
    if hit is not None:
        _MAPS.move_to_end(key)
        return hit
    if pool_k.shape != pool_v.shape or pool_k.dtype != pool_v.dtype:
        raise _error(f"K and V pools differ: {tuple(pool_k.shape)} {pool_k.dtype} vs {tuple(pool_v.shape)} {pool_v.dtype}")
    dt = dtype_name(pool_k.dtype)
    maps = b"".join(encode_tiled(t.data_ptr(), pool_map_args(tuple(t.shape), t.stride(), dt, block)) for t in pools)
    buf = torch.tensor(list(maps), dtype=torch.uint8, device=pool_k.device)
    _MAPS[key] = buf
    while len(_MAPS) > CACHE_SIZE:
        _MAPS.popitem(last=False)
    return buf
