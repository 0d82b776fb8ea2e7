"""The TMA tensor maps of the KV pools (``lserve.kernels.tensor_map``), checked without a driver:
the arguments computed for a pool, the ctypes call they are packed into (a Python stand-in with the
driver function's exact prototype reads them back), and the per-pool cache."""

import ctypes

import pytest
import torch
from lserve.kernels import tensor_map as tm
from lserve.kernels.loader import KernelError


def test_box_rows_tile_a_block_at_swizzle_aligned_offsets():
    assert [tm.box_rows(p, 64) for p in (8, 16, 32, 64, 128, 192, 256)] == [8, 16, 32, 64, 64, 64, 64]
    for p in (1, 2, 4, 12, 24, 48, 96, 100):
        assert tm.box_rows(p, 64) is None, p


def test_pool_map_args_for_a_contiguous_pool():
    pool = torch.zeros(37, 4, 16, 128, dtype=torch.bfloat16)
    a = tm.pool_map_args(tuple(pool.shape), pool.stride(), "bf16", 64)
    assert a.rank == 4 and a.data_type == 9  # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    assert a.global_dim == (128, 16, 4, 37)  # innermost first: dims, key rows of a page, heads, pages
    assert a.global_strides == (128 * 2, 16 * 128 * 2, 4 * 16 * 128 * 2)  # bytes, of dims 1..3
    assert a.box_dim == (64, 16, 1, 1) and a.element_strides == (1, 1, 1, 1)
    assert (a.interleave, a.swizzle, a.l2_promotion, a.oob_fill) == (0, 3, 3, 0)  # SWIZZLE_128B
    assert a.box_dim[0] * tm.ELEMENT_BYTES == 128  # the swizzle's span
    big = tm.pool_map_args((500, 8, 256, 128), (8 * 256 * 128, 256 * 128, 128, 1), "fp16", 64)
    assert big.data_type == 6 and big.box_dim == (64, 64, 1, 1) and big.global_dim == (128, 256, 8, 500)


@pytest.mark.parametrize("shape, strides, dtype, match", [
    ((4, 2, 64), (128, 64, 1), "bf16", "pages, heads"),
    ((4, 2, 64, 128), (16384, 8192, 128, 1), "fp32", "bf16/fp16"),
    ((4, 2, 64, 128), (16384, 8192, 1, 64), "bf16", "contiguous"),
    ((4, 2, 64, 96), (12288, 6144, 96, 1), "bf16", "multiple of 64"),
    ((4, 2, 24, 128), (6144, 3072, 128, 1), "bf16", "do not tile"),
    ((4, 2, 64, 128), (16384, 8192, 132, 1), "bf16", "multiples of 16 bytes"),
])
def test_pool_map_args_refuses_what_tma_cannot_map(shape, strides, dtype, match):
    with pytest.raises(KernelError, match=match):
        tm.pool_map_args(shape, strides, dtype, 64)


class _FakeDriver:
    """A Python function behind :data:`ENCODE_PROTOTYPE`: records what the ctypes call passed and
    writes a recognisable 128-byte map."""

    def __init__(self, rc: int = 0):
        self.calls, self.rc = [], rc
        self.fn = tm.ENCODE_PROTOTYPE(self._encode)

    def _encode(self, map_ptr, dtype, rank, address, dims, strides, box, elem, interleave, swizzle, l2, oob):
        self.calls.append({"map_ptr": map_ptr, "dtype": dtype, "rank": rank, "address": address,
                           "dims": [dims[i] for i in range(rank)], "strides": [strides[i] for i in range(rank - 1)],
                           "box": [box[i] for i in range(rank)], "elem": [elem[i] for i in range(rank)],
                           "enums": (interleave, swizzle, l2, oob)})
        ctypes.memmove(map_ptr, bytes(range(len(self.calls), len(self.calls) + tm.MAP_BYTES)), tm.MAP_BYTES)
        return self.rc


def test_encode_tiled_packs_the_arguments_into_the_driver_call(monkeypatch):
    fake = _FakeDriver()
    monkeypatch.setattr(tm, "_encode_fn", lambda: fake.fn)
    args = tm.pool_map_args((37, 4, 16, 128), (4 * 16 * 128, 16 * 128, 128, 1), "bf16", 64)
    got = tm.encode_tiled(0x7F00_0000_1000, args)
    c = fake.calls[0]
    assert c["map_ptr"] % tm.MAP_ALIGN == 0  # the driver writes maps to 64-byte aligned memory only
    assert (c["dtype"], c["rank"], c["address"]) == (9, 4, 0x7F00_0000_1000)
    assert c["dims"] == [128, 16, 4, 37] and c["strides"] == [256, 4096, 16384]
    assert c["box"] == [64, 16, 1, 1] and c["elem"] == [1, 1, 1, 1] and c["enums"] == (0, 3, 3, 0)
    assert got == bytes(range(1, 1 + tm.MAP_BYTES))  # the map the driver wrote, all 128 bytes
    with pytest.raises(KernelError, match="16-byte aligned"):
        tm.encode_tiled(0x7F00_0000_1008, args)
    monkeypatch.setattr(tm, "_encode_fn", lambda: _FakeDriver(rc=1).fn)
    with pytest.raises(KernelError, match="CUresult 1"):
        tm.encode_tiled(0x7F00_0000_1000, args)


def test_pool_tensor_maps_encode_a_pool_once(monkeypatch):
    fake = _FakeDriver()
    monkeypatch.setattr(tm, "_encode_fn", lambda: fake.fn)
    monkeypatch.setattr(tm, "_MAPS", type(tm._MAPS)())
    pk = torch.zeros(6, 2, 64, 128, dtype=torch.float16)
    pv = torch.zeros_like(pk)
    a = tm.pool_tensor_maps(pk, pv, 64)
    assert a.dtype == torch.uint8 and a.numel() == 2 * tm.MAP_BYTES and a.device == pk.device
    assert [c["address"] for c in fake.calls] == [pk.data_ptr(), pv.data_ptr()]  # K's map, then V's
    assert bytes(a.tolist()) == bytes(range(1, 129)) + bytes(range(2, 130))
    assert tm.pool_tensor_maps(pk, pv, 64) is a and len(fake.calls) == 2  # cached: not encoded again
    b = tm.pool_tensor_maps(pk[:3], pv[:3], 64)  # same addresses, another geometry: encoded anew
    assert b is not a and len(fake.calls) == 4 and fake.calls[2]["dims"] == [128, 64, 2, 3]
    with pytest.raises(KernelError, match="differ"):
        tm.pool_tensor_maps(pk, pv[:3], 64)
    monkeypatch.setattr(tm, "CACHE_SIZE", 2)
    tm.pool_tensor_maps(pk[:2], pv[:2], 64)  # a third pool: the least recently used one goes
    assert len(tm._MAPS) == 2 and tm.pool_tensor_maps(pk, pv, 64) is not a
