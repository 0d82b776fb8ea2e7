"""One layer's dense pool with the host tier on: the :class:`~lserve.cache.paged_pool.PagedPool`
reading interface over virtual page ids, each read from the resident slot when there is one and
from the host slot otherwise (:meth:`lserve.cache.host_tier.HostTier.locate`). Reads of a
sequence's pages in order (a prefill chunk's past, a decode scan: the callers pass the ids as a
host list) bring the host part to the device in bulk copies of runs of consecutive host slots
(:meth:`~lserve.cache.host_tier.HostTier.stage`) and read nothing twice."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lserve.cache.host_memory import upload
from lserve.cache.host_tier import HostTier
from lserve.cache.paged_pool import PagedPool


class TieredPool:
    """Virtual-page view of one layer's resident and host pools.

    Parameters
    ----------
    tier : HostTier
        The shared page table.
    layer : int
    resident, host : PagedPool
        This layer's pools in the tier.
    """

    def __init__(self, tier: HostTier, layer: int, resident: PagedPool, host: PagedPool) -> None:
        self.tier, self.layer, self.resident, self.host = tier, layer, resident, host
        self.num_heads, self.page_size, self.head_dim = resident.num_heads, resident.page_size, resident.head_dim
        self.kv_quant, self.dtype = resident.kv_quant, resident.dtype
        self._head_rows: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes on the device (the resident slots); the host pool's are :meth:`host_nbytes`."""
        return self.resident.nbytes()

    def host_nbytes(self) -> int:
        return self.host.nbytes()

    def page_bytes(self) -> int:
        """Bytes of one page of this layer (either tier)."""
        return self.resident.page_bytes()

    def write(self, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens of pages this step pinned (resident). pages, offsets: [T] long; k, v: [T, H, D]."""
        if self.num_heads == 0 or pages.numel() == 0:
            return
        self.resident.write(self.tier.resident_slots(self.layer, pages), offsets, k, v)

    def _merged(self, pages: torch.Tensor, read: Callable[[PagedPool, torch.Tensor], tuple]) -> tuple:
        """``read(pool, slots)`` of both tiers, each page taken from where it lives."""
        if self.tier.mirror:  # the device table: no host sync (both pools are addressable here)
            slots, host_slots, on_dev = self.tier.device_slots(self.layer, pages)
            kd, vd = read(self.resident, slots)
            kh, vh = read(self.host, host_slots)
            m = on_dev.view(*on_dev.shape, *([1] * (kd.dim() - on_dev.dim())))
            return torch.where(m, kd, kh), torch.where(m, vd, vh)
        slots, host_slots, on_dev = self.tier.locate(self.layer, pages)
        kd, vd = read(self.resident, slots)
        if bool(on_dev.all()):
            return kd, vd
        hdev = self.host.k.device
        kh, vh = read(self.host, host_slots.to(hdev))
        m = on_dev.view(*on_dev.shape, *([1] * (kd.dim() - on_dev.dim())))
        return torch.where(m, kd, kh.to(kd.device)), torch.where(m, vd, vh.to(vd.device))

    def _scanned(self, page_list, read: Callable[[PagedPool, torch.Tensor], tuple], dim: int,
                 prefill: bool) -> tuple:
        """``read(pool, slots)`` of the pages ``page_list`` (host ids, in order), resident ones from
        their slots and the rest staged from the host in bulk; the page axis of the result is ``dim``."""
        sc = self.tier.scan(self.layer, page_list, prefill)
        dev = self.resident.k.device
        def on_dev(a):
            return upload(torch.from_numpy(a), dev)
        if not sc.runs:
            return read(self.resident, on_dev(sc.res_slots))
        staged = self.tier.stage(self.layer, sc.runs)
        kh, vh = read(staged, torch.arange(staged.num_pages, device=dev))
        if not sc.res_pos.size:
            return kh, vh
        kd, vd = read(self.resident, on_dev(sc.res_slots))
        rp, hp = on_dev(sc.res_pos), on_dev(sc.host_pos)
        out = []
        for d, h in ((kd, kh), (vd, vh)):
            shape = list(d.shape)
            shape[dim] = len(page_list)
            x = d.new_empty(shape)
            x.index_copy_(dim, rp, d)
            x.index_copy_(dim, hp, h)
            out.append(x)
        return tuple(out)

    def gather(self, pages: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`PagedPool.gather`: pages [R, C], heads [R, 1] -> two [R, C, N_P, D]."""
        return self._merged(pages, lambda pool, s: pool.gather(s, heads.to(s.device)))

    def read(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`PagedPool.read`: pages [n] -> two [n, H, N_P, D]."""
        return self._merged(pages, lambda pool, s: pool.read(s))

    def pages_view(self, pages: torch.Tensor, page_list: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`PagedPool.pages_view` (always a copy: pages may sit in either tier); with
        ``page_list`` (the same ids on the host) a scan, the host pages staged in bulk."""
        if page_list is None or self.num_heads == 0:
            return self.read(pages)
        return self._scanned(page_list[: pages.numel()], lambda pool, s: pool.read(s), 0, False)

    def sequence_kv(self, pages: torch.Tensor, length: int,
                    page_list: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`PagedPool.sequence_kv`: positions [0, length) of every head -> two [H, length, D].
        With ``page_list`` (the same ids on the host) a prefill chunk's past: a scan, the host
        pages staged in bulk, counted as the prefill's."""
        h = self.num_heads
        dev = self.resident.k.device if page_list is not None else pages.device
        if self._head_rows is None or self._head_rows.device != dev:
            self._head_rows = torch.arange(h, device=dev)[:, None]
        n = -(-length // self.page_size)
        if page_list is None or h == 0:
            k, v = self.gather(pages[:n].expand(h, -1), self._head_rows)
        else:
            k, v = self._scanned(page_list[:n], lambda pool, s: pool.gather(s.expand(h, -1), self._head_rows), 1, True)
        d = k.shape[-1]
        return k.view(h, -1, d)[:, :length], v.view(h, -1, d)[:, :length]
