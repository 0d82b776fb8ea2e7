"""Kept KV blocks of a prefill chunk for the dense heads (dynamic block-sparse prefill, issue 20).

A chunk holds query positions ``start .. start + Lq - 1`` and attends to keys ``0 .. L - 1``
(``L = start + Lq``: the cached past plus itself). Keys are cut into blocks of ``block`` tokens and
queries into rows of ``q_block`` tokens (a multiple of ``block``), both aligned to absolute
positions; row ``r`` of the result is query row ``start // q_block + r``. Per (KV head, row) the
kept KV blocks are: the sink block 0, the blocks the row's own span touches (its diagonal) and the
block before it, then the others in descending estimated attention mass until the row's
cumulative estimate (mandatory blocks included) reaches ``tau``. ``tau >= 1`` keeps every causal
block, and so do the rows holding a prompt's last ``q_block`` positions (``dense_from``): their
outputs feed the first sampled token directly, so they read the whole context as decode does
(on the default model, estimated-mass cuts there turned retrieval answers into noise). Every KV
head of a row then keeps the same number of blocks (the most any of them needs,
rounded up to a multiple of ``q_block // block`` and capped by the causal count, the extra ones
again by estimate), so that a row's kept keys gather into one dense batch of few distinct lengths
(:func:`lserve.attention.block_sparse_prefill.sparse_prefill`).

Estimators of a tile's mass (each a distribution over the row's causal blocks, per query head;
the GQA group is combined by a max and renormalised so that one list serves the KV head):

* ``"antidiagonal"`` (XAttention-style): strided antidiagonal sums of ``Q K^T`` inside each tile
  (stride ``S``), a softmax over those sums, summed per tile and averaged over the row's query
  groups; one row at a time, so memory stays O(q_block L / S^2).
* ``"bound"``: the decode selector's min/max upper bound (:mod:`lserve.sparsity.selector`) of the
  row's mean query against each key block's per-channel min/max of keys, softmaxed.
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
    ``indices``: int32 [nnz], ascending KV block ids within each row. Rows are ``q_block`` query
    positions, KV blocks ``block`` keys (``q_block == block``: square tiles).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    block: int
    start: int
    length: int
    q_block: int = 0  # 0: same as block

    def __post_init__(self) -> None:
        if not self.q_block:
            self.q_block = self.block

    @property
    def n_rows(self) -> int:
        """R, query rows the chunk touches."""
        return self.indptr.shape[1] - 1

    @property
    def first_row_block(self) -> int:
        """Absolute id of the query row of row 0."""
        return self.start // self.q_block

    def row_span(self, r: int) -> tuple[int, int]:
        """Positions [begin, end) of row ``r`` (its end capped at ``length``)."""
        a = (self.first_row_block + r) * self.q_block
        return a, min(self.length, a + self.q_block)

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
        """Causal (query row, KV block) tiles of one head: the denominator of :meth:`kept_fraction`."""
        return causal_tile_count(self.start, self.length, self.block, self.q_block)

    def attention_flops(self, group: int, head_dim: int) -> float:
        """Matmul FLOPs (QK^T and PV) of the kept tiles over every head: the row's own span
        causal (half), kept blocks before it whole. Reads ``indptr`` on the host."""
        counts = (self.indptr[:, 1:] - self.indptr[:, :-1]).cpu()  # [H, R]
        total = 0.0
        for r in range(self.n_rows):
            rs, re = self.row_span(r)
            a = max(self.start, rs)
            nq = re - a
            own = (re - 1) // self.block - rs // self.block + 1
            keys = (counts[:, r] - own).clamp(min=0).sum().item() * self.block + counts.shape[0] * (a - rs)
            total += group * nq * (keys + counts.shape[0] * (nq + 1) / 2) * 4 * head_dim
        return total

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
        rows = qpos // self.q_block - self.first_row_block
        m = bm[:, rows][:, :, kpos // B]  # [H, Lq, L]
        return m & (kpos[None, :] <= qpos[:, None])[None].expand(bm.shape[0], lq, -1)


def _block_sum(x: torch.Tensor, B: int, dim: int) -> torch.Tensor:
    """Sum groups of ``B`` along ``dim`` (its size a multiple of B)."""
    s = list(x.shape)
    s[dim: dim + 1] = [s[dim] // B, B]
    return x.reshape(s).sum(dim + 1)


def pad_positions(x: torch.Tensor, lo: int, hi: int, first: int) -> torch.Tensor:
    """x: [H, n, D] at positions first .. first + n - 1 -> [H, hi - lo, D] at lo .. hi - 1, zeros elsewhere."""
    h, n, d = x.shape
    out = x.new_zeros(h, hi - lo, d)
    out[:, first - lo: first - lo + n] = x
    return out


def causal_tile_count(start: int, length: int, block: int, q_block: int) -> int:
    """Causal (query row, KV block) tiles of one head of a chunk of positions ``start .. length - 1``
    (rows of ``q_block`` positions, KV blocks of ``block`` keys)."""
    b0, R = chunk_rows(start, length, q_block)
    return sum((min(length, (b0 + r + 1) * q_block) - 1) // block + 1 for r in range(R))


def estimate_share(estimator: str, stride: int) -> float:
    """The estimate's score products as a share of dense attention's (QK^T and PV): the antidiagonal
    one computes one product in ``stride`` of QK^T's, ~1 / (2 stride) of both; the bound's cost
    does not grow with the queries (~0); the oracle's is all of QK^T (1/2)."""
    return {"antidiagonal": 1 / (2 * stride), "bound": 0.0, "oracle": 0.5}[estimator]


def chunk_rows(start: int, length: int, q_block: int) -> tuple[int, int]:
    """(absolute id of the first query row, rows R) of a chunk."""
    b0 = start // q_block
    return b0, (length - 1) // q_block - b0 + 1


def _tail_rows(start: int, length: int, q_block: int, dense_from: int | None, device=None) -> torch.Tensor:
    """bool [R]: rows of a chunk that end after ``dense_from`` (the prompt's tail: every causal tile kept)."""
    b0, R = chunk_rows(start, length, q_block)
    if dense_from is None:
        return torch.zeros(R, dtype=torch.bool, device=device)
    return ((torch.arange(R, device=device) + b0 + 1) * q_block).clamp(max=length) > dense_from


def _oracle(q, k, start, B, QB, scale, chunk=512):
    """Exact masses [Hq, R, nkb]: softmax over causal keys, summed per key block, mean over the
    row's queries. q: [Hq, Lq, D]; k: [Hq, L, D] (expanded to the query heads)."""
    hq, lq, _ = q.shape
    L = k.shape[1]
    nkb = -(-L // B)
    b0, R = chunk_rows(start, L, QB)
    acc = torch.zeros(hq, R, nkb, dtype=torch.float32, device=q.device)
    cnt = torch.zeros(R, dtype=torch.float32, device=q.device)
    kpos = torch.arange(L, device=q.device)
    for a in range(0, lq, chunk):
        b = min(lq, a + chunk)
        qpos = torch.arange(start + a, start + b, device=q.device)
        s = torch.bmm(q[:, a:b].float(), k.float().transpose(1, 2)).mul_(scale)  # [Hq, n, L]
        s.masked_fill_(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = torch.nn.functional.pad(p, (0, nkb * B - L))
        pb = _block_sum(p, B, 2)  # [Hq, n, nkb]
        r = qpos // QB - b0
        acc.index_add_(1, r, pb)
        cnt.index_add_(0, r, torch.ones_like(r, dtype=torch.float32))
    return acc / cnt[None, :, None]


def _antidiagonal(q, k, start, B, QB, scale, S):
    """Antidiagonal estimate [Hq, R, nkb], one query row at a time. q: [Hq, Lq, D]; k: [Hkv, L, D].

    Query group ``a`` (positions aS .. aS + S - 1) is the concatenation of its queries, key group
    ``c`` that of its keys in reverse order: their dot product is the sum of one antidiagonal of
    the S x S score tile. Products run in q's dtype on a GPU (fp32 on the CPU), softmax in fp32.
    """
    hq, lq, d = q.shape
    h, L, _ = k.shape
    g = hq // h
    nkb = -(-L // B)
    b0, R = chunk_rows(start, L, QB)
    dt = q.dtype if q.is_cuda else torch.float32
    kg = pad_positions(k.to(dt), 0, nkb * B, 0).reshape(h, -1, S, d).flip(2).reshape(h, -1, S * d)  # [Hkv, nkb*B/S, S*D]
    out = torch.zeros(hq, R, nkb, dtype=torch.float32, device=q.device)
    for r in range(R):
        rs = (b0 + r) * QB
        re = min(L, rs + QB)
        a = max(start, rs)
        ng = -(-(re - rs) // S)  # query groups of the row
        nb = (re - 1) // B + 1  # causal key blocks of the row
        qg = pad_positions(q[:, a - start: re - start].to(dt), rs, rs + ng * S, a).reshape(h, g * ng, S * d)
        s = torch.bmm(qg, kg[:, : nb * B // S].transpose(1, 2)).float().mul_(scale / S)  # [Hkv, G*ng, nb*B/S]
        qgi = torch.arange(ng, device=q.device) + rs // S  # absolute query group ids
        kgi = torch.arange(nb * B // S, device=q.device)
        hide = (kgi[None, :] > qgi[:, None]) | (kgi[None, :] * S >= L)  # [ng, nkg]
        s = s.view(h, g, ng, -1).masked_fill_(hide, float("-inf"))
        p = torch.softmax(s, dim=-1)
        gpos = qgi * S
        valid = ((gpos + S > start) & (gpos < L)).float()  # groups holding a query of the chunk
        pb = _block_sum(p, B // S, 3)  # [Hkv, G, ng, nb]
        out[:, r, :nb] = (pb * valid[:, None]).sum(2).reshape(hq, nb) / valid.sum()
    return out


def _bound(q, k, start, B, QB, scale):
    """Min/max bound estimate [Hq, R, nkb]. q: [Hq, Lq, D]; k: [Hkv, L, D]."""
    hq, lq, d = q.shape
    h, L, _ = k.shape
    nkb = -(-L // B)
    b0, R = chunk_rows(start, L, QB)
    qf = q.float()
    r = torch.arange(start, L, device=q.device) // QB - b0
    qsum = torch.zeros(hq, R, d, device=q.device).index_add_(1, r, qf)
    qmean = (qsum / torch.bincount(r, minlength=R).float()[None, :, None]).view(h, -1, d)  # [Hkv, G*R, D]
    kf = k.float()
    pad = nkb * B - L
    kmax = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("-inf")).reshape(h, nkb, B, d).amax(2)
    kmin = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("inf")).reshape(h, nkb, B, d).amin(2)
    s = (qmean.clamp(min=0) @ kmax.transpose(1, 2) + qmean.clamp(max=0) @ kmin.transpose(1, 2)).mul_(scale)
    _, causal = mandatory_tiles(start, L, B, QB, q.device)
    s = s.view(hq, R, nkb).masked_fill_(~causal[None], float("-inf"))
    return torch.softmax(s, dim=-1)  # [Hq, R, nkb]


def estimate_masses(q: torch.Tensor, k: torch.Tensor, start: int, block: int, scale: float, estimator: str,
                    stride: int = 8, q_block: int | None = None) -> torch.Tensor:
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
        Keys per KV block (a multiple of ``stride`` for ``"antidiagonal"``).
    scale : float
    estimator : str
        One of :data:`ESTIMATORS`.
    stride : int
        Antidiagonal stride S.
    q_block : int, optional
        Query positions per row (a multiple of ``block``; default ``block``).

    Returns
    -------
    torch.Tensor
        float32 [H_kv * G, R, n_kv_blocks]; each row sums to 1 over its causal tiles.
    """
    qb = q_block or block
    if qb % block:
        raise ValueError(f"q_block {qb} must be a multiple of the block {block}")
    if estimator == "oracle":
        g = q.shape[0] // k.shape[0]
        return _oracle(q, k.repeat_interleave(g, 0) if g > 1 else k, start, block, qb, scale)
    if estimator == "antidiagonal":
        if block % stride:
            raise ValueError(f"block {block} must be a multiple of the stride {stride}")
        return _antidiagonal(q, k, start, block, qb, scale, stride)
    if estimator == "bound":
        return _bound(q, k, start, block, qb, scale)
    raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")


def combine_group(mass: torch.Tensor, group: int) -> torch.Tensor:
    """[H_kv * G, R, nkb] -> [H_kv, R, nkb]: max over the group, renormalised per row."""
    h, r, n = mass.shape
    m = mass.view(h // group, group, r, n).amax(1)
    return m / m.sum(-1, keepdim=True).clamp(min=1e-30)


def mandatory_tiles(start: int, length: int, block: int, q_block: int | None = None,
                    device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(always kept [R, nkb], causal [R, nkb]) bool: sink block 0, the blocks of the row's own span
    and the block before it."""
    qb = q_block or block
    b0, R = chunk_rows(start, length, qb)
    nkb = -(-length // block)
    rs = (torch.arange(R, device=device) + b0) * qb
    first = (rs // block)[:, None]  # the row's first own block
    last = ((rs + qb).clamp(max=length) - 1)[:, None] // block
    kb = torch.arange(nkb, device=device)[None, :]
    causal = kb <= last
    return causal & ((kb == 0) | (kb >= first - 1)), causal


def _to_list(keep: torch.Tensor, block: int, start: int, length: int, q_block: int) -> PrefillBlocks:
    """bool [H, R, nkb] kept tiles -> :class:`PrefillBlocks`."""
    h, R, _ = keep.shape
    flat = keep.reshape(h * R, -1)
    indptr = torch.zeros(h * R + 1, dtype=torch.int64, device=keep.device)
    indptr[1:] = flat.sum(-1).cumsum(0)
    ip = torch.cat((indptr[:-1].view(h, R), indptr[1:].view(h, R)[:, -1:]), dim=1)
    indices = flat.nonzero()[:, 1]  # row-major: ascending within each row
    return PrefillBlocks(ip.to(torch.int32), indices.to(torch.int32), block, start, length, q_block)


def _keep_top(order: torch.Tensor, counts: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """bool [H, R, nkb]: per row, the first ``counts`` [H, R] (or [R]) tiles of ``order`` (tile ids
    by descending priority)."""
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                            .expand_as(order).contiguous())
    return (rank < counts[..., None]) & causal[None]


def select_blocks(mass: torch.Tensor, tau: float, start: int, length: int, block: int,
                  q_block: int | None = None, dense_from: int | None = None) -> PrefillBlocks:
    """The block list of a chunk from per-KV-head masses.

    Parameters
    ----------
    mass : torch.Tensor
        [H_kv, R, nkb] estimated shares (rows sum to 1 over causal tiles), e.g. :func:`combine_group`.
    tau : float
        Cumulative estimated mass to reach per row, in [0, 1]; ``>= 1`` keeps every causal tile.
    start, length, block : int
        Chunk's first position, tokens in cache after it, keys per KV block.
    q_block : int, optional
        Query positions per row (default ``block``).
    dense_from : int, optional
        Rows ending after this position keep every causal tile (the prompt's tail).

    Returns
    -------
    PrefillBlocks
    """
    qb = q_block or block
    must, causal = mandatory_tiles(start, length, block, qb, mass.device)
    h = mass.shape[0]
    if tau >= 1.0:
        return _to_list(causal[None].expand(h, -1, -1), block, start, length, qb)
    prio = mass.masked_fill(~causal[None], -1.0).masked_fill(must[None], 2.0)  # mandatory first
    order = prio.argsort(dim=-1, descending=True, stable=True)  # ties: lower tile first (as the GPU cut)
    m_sorted = mass.masked_fill(~causal[None], 0.0).gather(-1, order)
    before = m_sorted.cumsum(-1) - m_sorted  # mass held before each tile is added
    need = ((before < tau).sum(-1)).clamp(min=must.sum(-1)[None])  # [H, R]: tiles to reach tau
    quantum = qb // block
    n = (-(-need.amax(0) // quantum) * quantum).clamp(max=causal.sum(-1))  # [R]: one count per row
    n = torch.where(_tail_rows(start, length, qb, dense_from, n.device), causal.sum(-1), n)
    return _to_list(_keep_top(order, n, causal), block, start, length, qb)


def cut_blocks(mass: torch.Tensor, group: int, tau: float, start: int, length: int, block: int,
               q_block: int | None = None, dense_from: int | None = None) -> PrefillBlocks:
    """The block list of per-query-head masses [H_kv * G, R, nkb]: :func:`select_blocks` of
    :func:`combine_group` (the torch cut every backend can run)."""
    return select_blocks(combine_group(mass, group), tau, start, length, block, q_block, dense_from)


def prefill_blocks(q: torch.Tensor, k: torch.Tensor, start: int, block: int, scale: float, tau: float,
                   estimator: str = "antidiagonal", stride: int = 8, q_block: int | None = None,
                   dense_from: int | None = None, estimate=estimate_masses, cut=cut_blocks) -> PrefillBlocks:
    """Estimate and cut in one call: q [H_kv * G, Lq, D], k [H_kv, L, D] -> :class:`PrefillBlocks`
    (``dense_from``: see :func:`select_blocks`; ``estimate``: a function with
    :func:`estimate_masses`' signature and results, e.g. a backend's fused kernel; ``cut``: one with
    :func:`cut_blocks`' signature and results)."""
    g = q.shape[0] // k.shape[0]
    qb = q_block or block
    if tau >= 1.0 or bool(_tail_rows(start, k.shape[1], qb, dense_from).all()):  # every causal tile
        _, causal = mandatory_tiles(start, k.shape[1], block, qb, q.device)
        return _to_list(causal[None].expand(k.shape[0], -1, -1), block, start, k.shape[1], qb)
    mass = estimate(q, k, start, block, scale, estimator, stride, q_block)
    return cut(mass, g, tau, start, k.shape[1], block, q_block, dense_from)


def oracle_at_counts(exact: torch.Tensor, blocks: PrefillBlocks) -> PrefillBlocks:
    """The best list with the same number of kept tiles per row as ``blocks``: mandatory tiles plus
    the largest exact (group-combined) masses. exact: [H_kv, R, nkb]."""
    must, causal = mandatory_tiles(blocks.start, blocks.length, blocks.block, blocks.q_block, exact.device)
    counts = (blocks.indptr[:, 1:] - blocks.indptr[:, :-1]).long()  # [H, R]
    order = exact.masked_fill(~causal[None], -1.0).masked_fill(must[None], 2.0).argsort(dim=-1, descending=True)
    return _to_list(_keep_top(order, counts, causal), blocks.block, blocks.start, blocks.length, blocks.q_block)


def recalled_mass(exact_q: torch.Tensor, blocks: PrefillBlocks, group: int) -> torch.Tensor:
    """Mean over each query head's rows of the TRUE mass its kept tiles hold.

    exact_q: [H_kv * G, R, nkb] exact masses per query head (:func:`estimate_masses` with
    ``"oracle"``) -> float32 [H_kv * G] (rows weighted equally).
    """
    bm = blocks.block_mask().repeat_interleave(group, 0)  # [Hq, R, nkb]
    return (exact_q * bm).sum(-1).mean(-1)


def fixed_fraction_blocks(n_heads: int, start: int, length: int, frac: float, block: int = 64,
                          q_block: int = 2048, seed: int = 0) -> PrefillBlocks:
    """Block lists keeping about ``frac`` of each row's causal blocks, chosen at random.

    For speed measured at a fixed kept fraction (random weights attend almost uniformly, so an
    estimate would keep nearly everything) and for parity tests. Every row keeps the sink block,
    its own span and the block before it (as :func:`select_blocks` does), then random earlier
    blocks up to ``round(frac * causal blocks)``; every head of a row keeps the same count.
    Built on the CPU.
    """
    gen = torch.Generator().manual_seed(seed)
    first, last = start // q_block, (length - 1) // q_block
    counts, ids = [[] for _ in range(n_heads)], [[] for _ in range(n_heads)]
    for r in range(first, last + 1):
        rs, re = r * q_block, min(length, (r + 1) * q_block)
        own0, causal = max(0, rs // block - 1), (re - 1) // block + 1
        mandatory = sorted({0, *range(own0, causal)})
        pool = torch.arange(1, max(1, own0))  # blocks neither sink nor the row's own span
        extra = min(pool.numel(), max(0, round(frac * causal) - len(mandatory)))
        for h in range(n_heads):
            pick = pool[torch.randperm(pool.numel(), generator=gen)[:extra]].tolist()
            row = sorted(mandatory + pick)
            counts[h].append(len(row))
            ids[h] += row
    indptr = torch.zeros(n_heads, last - first + 2, dtype=torch.int32)
    indptr[:, 1:] = torch.tensor(counts, dtype=torch.int32).cumsum(1)
    offsets = torch.tensor([0] + [sum(c) for c in counts], dtype=torch.int32).cumsum(0)[:-1]
    return PrefillBlocks(indptr + offsets[:, None], torch.tensor([i for h in ids for i in h], dtype=torch.int32),
                         block, start, length, q_block)
