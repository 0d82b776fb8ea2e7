"""Kept KV blocks of a prefill chunk for the dense heads (dynamic block-sparse prefill, issue 20).

A chunk holds query positions ``start .. start + Lq - 1`` and attends to keys ``0 .. L - 1``
(``L = start + Lq``: the cached past plus itself). Positions are cut into blocks of ``block``
tokens aligned to absolute positions; row ``r`` of the result is query block ``start // block + r``.
Per (KV head, query block) the kept KV blocks are: the sink block 0, the diagonal block and the one
before it, then the others in descending estimated attention mass until the row's cumulative
estimate (mandatory blocks included) reaches ``tau``. ``tau >= 1`` keeps every causal block.

Estimators of a tile's mass (each a distribution over the row's causal blocks, per query head;
the GQA group is combined by a max and renormalised so that one list serves the KV head):

* ``"antidiagonal"`` (XAttention-style): strided antidiagonal sums of ``Q K^T`` inside each tile
  (stride ``S``), a softmax over those sums, summed per tile and averaged over the block's queries.
* ``"bound"``: the decode selector's min/max upper bound (:mod:`lserve.sparsity.selector`) of the
  query block's mean query against each key block's per-channel min/max of keys, softmaxed.
* ``"oracle"``: exact block masses from full scores (measurement only: O(Lq L D)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ESTIMATORS = ("antidiagonal", "bound", "oracle")


@dataclass
class PrefillBlocks:
    """A BSR block list: row ``(h, r)`` keeps ``indices[indptr[h, r]:indptr[h, r + 1]]``.

    ``indptr``: int32 [H_kv, R + 1], offsets into the flat ``indices`` (row-major over heads);
    ``indices``: int32 [nnz], ascending KV block ids within each row.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    block: int
    start: int
    length: int

    @property
    def n_rows(self) -> int:
        """R, query blocks the chunk touches."""
        return self.indptr.shape[1] - 1

    @property
    def first_row_block(self) -> int:
        """Absolute id of the query block of row 0."""
        return self.start // self.block

    def row(self, h: int, r: int) -> torch.Tensor:
        """Kept KV block ids of head ``h``, row ``r`` (int32, ascending)."""
        return self.indices[int(self.indptr[h, r]): int(self.indptr[h, r + 1])]

    def block_mask(self) -> torch.Tensor:
        """bool [H_kv, R, n_kv_blocks]: kept tiles."""
        h, r = self.indptr.shape[0], self.n_rows
        nkb = -(-self.length // self.block)
        counts = (self.indptr[:, 1:] - self.indptr[:, :-1]).reshape(-1).long()
        rows = torch.repeat_interleave(torch.arange(h * r, device=counts.device), counts)
        m = torch.zeros(h * r, nkb, dtype=torch.bool, device=counts.device)
        m[rows, self.indices.long()] = True
        return m.view(h, r, nkb)

    def causal_tiles(self) -> int:
        """Causal (query block, KV block) tiles of one head: the denominator of :meth:`kept_fraction`."""
        b0 = self.first_row_block
        return sum(b0 + r + 1 for r in range(self.n_rows))

    def kept_fraction(self) -> float:
        """Kept tiles over causal tiles, over every head."""
        return self.indices.numel() / (self.causal_tiles() * self.indptr.shape[0])

    def token_mask(self) -> torch.Tensor:
        """bool [H_kv, Lq, L]: query i (position start + i) sees key j iff j <= start + i and j's
        block is kept in i's row (the reference semantics of blocked attention)."""
        B, lq = self.block, self.length - self.start
        qpos = torch.arange(self.start, self.length, device=self.indices.device)
        kpos = torch.arange(self.length, device=self.indices.device)
        bm = self.block_mask()  # [H, R, nkb]
        rows = qpos // B - self.first_row_block
        m = bm[:, rows][:, :, kpos // B]  # [H, Lq, L]
        return m & (kpos[None, :] <= qpos[:, None])[None].expand(bm.shape[0], lq, -1)


def _block_sum(x: torch.Tensor, B: int, dim: int) -> torch.Tensor:
    """Sum groups of ``B`` along ``dim`` (its size a multiple of B)."""
    s = list(x.shape)
    s[dim: dim + 1] = [s[dim] // B, B]
    return x.reshape(s).sum(dim + 1)


def _pad_positions(x: torch.Tensor, lo: int, hi: int, first: int) -> torch.Tensor:
    """x: [H, n, D] at positions first .. first + n - 1 -> [H, hi - lo, D] at lo .. hi - 1, zeros elsewhere."""
    h, n, d = x.shape
    out = x.new_zeros(h, hi - lo, d)
    out[:, first - lo: first - lo + n] = x
    return out


def _oracle(q, k, start, B, scale, rows=512):
    """Exact masses [Hq, R, nkb]: softmax over causal keys, summed per key block, mean over the
    block's queries. q: [Hq, Lq, D]; k: [Hq, L, D] (expanded to the query heads)."""
    hq, lq, _ = q.shape
    L = k.shape[1]
    nkb = -(-L // B)
    b0 = start // B
    R = (L - 1) // B - b0 + 1
    acc = torch.zeros(hq, R, nkb, dtype=torch.float32, device=q.device)
    cnt = torch.zeros(R, dtype=torch.float32, device=q.device)
    kpos = torch.arange(L, device=q.device)
    for a in range(0, lq, rows):
        b = min(lq, a + rows)
        qpos = torch.arange(start + a, start + b, device=q.device)
        s = torch.bmm(q[:, a:b].float(), k.float().transpose(1, 2)).mul_(scale)  # [Hq, n, L]
        s.masked_fill_(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = torch.nn.functional.pad(p, (0, nkb * B - L))
        pb = _block_sum(p, B, 2)  # [Hq, n, nkb]
        r = qpos // B - b0
        acc.index_add_(1, r, pb)
        cnt.index_add_(0, r, torch.ones_like(r, dtype=torch.float32))
    return acc / cnt[None, :, None]


def _antidiagonal(q, k, start, B, scale, stride):
    """Antidiagonal estimate [Hq, R, nkb]. q: [Hq, Lq, D]; k: [Hq, L, D]."""
    hq, lq, d = q.shape
    L = k.shape[1]
    S = stride
    nkb = -(-L // B)
    b0 = start // B
    R = (L - 1) // B - b0 + 1
    qp = _pad_positions(q.float(), b0 * B, (b0 + R) * B, start)  # [Hq, R*B, D]
    kp = _pad_positions(k.float(), 0, nkb * B, 0)  # [Hq, nkb*B, D]
    # group a's vector: concat_i q[aS + i]; key group c's: concat_i k[cS + S - 1 - i]
    qg = qp.reshape(hq, -1, S * d)  # [Hq, R*B/S, S*D]
    kg = kp.reshape(hq, -1, S, d).flip(2).reshape(hq, -1, S * d)  # [Hq, nkb*B/S, S*D]
    s = torch.bmm(qg, kg.transpose(1, 2)).mul_(scale / S)  # [Hq, nqg, nkg]: mean score per antidiagonal
    qgi = torch.arange(qg.shape[1], device=q.device) + b0 * B // S  # absolute query group ids
    kgi = torch.arange(kg.shape[1], device=q.device)
    hide = (kgi[None, :] > qgi[:, None]) | (kgi[None, :] * S >= L)
    s.masked_fill_(hide[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    # query groups holding no query of the chunk do not count
    gpos = qgi * S
    valid = ((gpos + S > start) & (gpos < L)).float()  # [nqg]
    p = p * valid[None, :, None]
    pb = _block_sum(_block_sum(p, B // S, 2), B // S, 1)  # [Hq, R, nkb]
    n = _block_sum(valid[None, :, None], B // S, 1)  # [1, R, 1]
    return pb / n


def _bound(q, k, start, B, scale):
    """Min/max bound estimate [Hq, R, nkb]. q: [Hq, Lq, D]; k: [Hq, L, D]."""
    hq, lq, d = q.shape
    L = k.shape[1]
    nkb = -(-L // B)
    b0 = start // B
    R = (L - 1) // B - b0 + 1
    qf = q.float()
    r = torch.arange(start, L, device=q.device) // B - b0
    qsum = torch.zeros(hq, R, d, device=q.device).index_add_(1, r, qf)
    qmean = qsum / torch.bincount(r, minlength=R).float()[None, :, None]  # [Hq, R, D]
    kf = k.float()
    pad = nkb * B - L
    kmax = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("-inf")).reshape(hq, nkb, B, d).amax(2)
    kmin = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("inf")).reshape(hq, nkb, B, d).amin(2)
    s = (qmean.clamp(min=0) @ kmax.transpose(1, 2) + qmean.clamp(max=0) @ kmin.transpose(1, 2)).mul_(scale)
    rb = torch.arange(R, device=q.device) + b0
    s.masked_fill_((torch.arange(nkb, device=q.device)[None, :] > rb[:, None])[None], float("-inf"))
    return torch.softmax(s, dim=-1)  # [Hq, R, nkb]


def estimate_masses(q: torch.Tensor, k: torch.Tensor, start: int, block: int, scale: float, estimator: str,
                    stride: int = 8) -> torch.Tensor:
    """Per query head, the estimated share of attention mass of each causal tile.

    Parameters
    ----------
    q : torch.Tensor
        [H_kv * G, Lq, D] the chunk's queries (query head h uses KV head h // G).
    k : torch.Tensor
        [H_kv, L, D] keys of positions 0 .. L - 1 (L = start + Lq).
    start : int
        Position of the chunk's first query.
    block : int
        Tokens per block (a multiple of ``stride`` for ``"antidiagonal"``).
    scale : float
    estimator : str
        One of :data:`ESTIMATORS`.
    stride : int
        Antidiagonal stride S.

    Returns
    -------
    torch.Tensor
        float32 [H_kv * G, R, n_kv_blocks]; each row sums to 1 over its causal tiles.
    """
    g = q.shape[0] // k.shape[0]
    ke = k.repeat_interleave(g, 0) if g > 1 else k
    if estimator == "oracle":
        return _oracle(q, ke, start, block, scale)
    if estimator == "antidiagonal":
        if block % stride:
            raise ValueError(f"block {block} must be a multiple of the stride {stride}")
        return _antidiagonal(q, ke, start, block, scale, stride)
    if estimator == "bound":
        return _bound(q, ke, start, block, scale)
    raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")


def combine_group(mass: torch.Tensor, group: int) -> torch.Tensor:
    """[H_kv * G, R, nkb] -> [H_kv, R, nkb]: max over the group, renormalised per row."""
    h, r, n = mass.shape
    m = mass.view(h // group, group, r, n).amax(1)
    return m / m.sum(-1, keepdim=True).clamp(min=1e-30)


def mandatory_tiles(start: int, length: int, block: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(always kept [R, nkb], causal [R, nkb]) bool: sink block 0, the diagonal and the block before it."""
    b0 = start // block
    R = (length - 1) // block - b0 + 1
    nkb = -(-length // block)
    rb = (torch.arange(R, device=device) + b0)[:, None]
    kb = torch.arange(nkb, device=device)[None, :]
    causal = kb <= rb
    return causal & ((kb == 0) | (kb >= rb - 1)), causal


def select_blocks(mass: torch.Tensor, tau: float, start: int, length: int, block: int) -> PrefillBlocks:
    """The block list of a chunk from per-KV-head masses.

    Parameters
    ----------
    mass : torch.Tensor
        [H_kv, R, nkb] estimated shares (rows sum to 1 over causal tiles), e.g. :func:`combine_group`.
    tau : float
        Cumulative estimated mass to reach per row, in [0, 1]; ``>= 1`` keeps every causal tile.
    start, length, block : int
        Chunk's first position, tokens in cache after it, block size.

    Returns
    -------
    PrefillBlocks
    """
    must, causal = mandatory_tiles(start, length, block, mass.device)
    h = mass.shape[0]
    if tau >= 1.0:
        keep = causal[None].expand(h, -1, -1)
    else:
        prio = mass.masked_fill(~causal[None], -1.0).masked_fill(must[None], 2.0)  # mandatory first
        order = prio.argsort(dim=-1, descending=True)
        m_sorted = mass.masked_fill(~causal[None], 0.0).gather(-1, order)
        before = m_sorted.cumsum(-1) - m_sorted  # mass held before each tile is added
        keep_sorted = (before < tau) | must[None].expand(h, -1, -1).gather(-1, order)
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted) & causal[None]
    counts = keep.sum(-1).reshape(-1)  # [H*R]
    indptr = torch.zeros(h * keep.shape[1] + 1, dtype=torch.int64, device=mass.device)
    indptr[1:] = counts.cumsum(0)
    indices = keep.reshape(h * keep.shape[1], -1).nonzero()[:, 1]  # row-major: ascending within each row
    R = keep.shape[1]
    ip = torch.cat((indptr[:-1].view(h, R), indptr[1:].view(h, R)[:, -1:]), dim=1)
    return PrefillBlocks(ip.to(torch.int32), indices.to(torch.int32), block, start, length)


def prefill_blocks(q: torch.Tensor, k: torch.Tensor, start: int, block: int, scale: float, tau: float,
                   estimator: str = "antidiagonal", stride: int = 8) -> PrefillBlocks:
    """Estimate and cut in one call: q [H_kv * G, Lq, D], k [H_kv, L, D] -> :class:`PrefillBlocks`."""
    g = q.shape[0] // k.shape[0]
    mass = combine_group(estimate_masses(q, k, start, block, scale, estimator, stride), g)
    return select_blocks(mass, tau, start, k.shape[1], block)


def oracle_at_counts(exact: torch.Tensor, blocks: PrefillBlocks) -> PrefillBlocks:
    """The best list with the same number of kept tiles per row as ``blocks``: mandatory tiles plus
    the largest exact (group-combined) masses. exact: [H_kv, R, nkb]."""
    must, causal = mandatory_tiles(blocks.start, blocks.length, blocks.block, exact.device)
    counts = (blocks.indptr[:, 1:] - blocks.indptr[:, :-1]).long()  # [H, R]
    prio = exact.masked_fill(~causal[None], -1.0).masked_fill(must[None], 2.0)
    order = prio.argsort(dim=-1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=exact.device)
                                            .expand_as(order).contiguous())
    keep = (rank < counts[..., None]) & causal[None]
    h, R, _ = keep.shape
    flat = keep.reshape(h * R, -1)
    indptr = torch.zeros(h * R + 1, dtype=torch.int64, device=exact.device)
    indptr[1:] = flat.sum(-1).cumsum(0)
    ip = torch.cat((indptr[:-1].view(h, R), indptr[1:].view(h, R)[:, -1:]), dim=1)
    return PrefillBlocks(ip.to(torch.int32), flat.nonzero()[:, 1].to(torch.int32), blocks.block, blocks.start,
                         blocks.length)


def recalled_mass(exact_q: torch.Tensor, blocks: PrefillBlocks, group: int) -> torch.Tensor:
    """Mean over each query head's rows of the TRUE mass its kept tiles hold.

    exact_q: [H_kv * G, R, nkb] exact masses per query head (:func:`estimate_masses` with
    ``"oracle"``) -> float32 [H_kv * G] (rows weighted equally).
    """
    bm = blocks.block_mask().repeat_interleave(group, 0)  # [Hq, R, nkb]
    return (exact_q * bm).sum(-1).mean(-1)
