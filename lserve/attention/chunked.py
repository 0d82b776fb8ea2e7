"""Attention of a prefill chunk whose sequence already has tokens in the cache (``start > 0``).

Chunked prefill splits a long prompt over steps, so that decodes and short prompts run between
its chunks. Each later chunk attends to the cached past plus itself. Two pieces, both exact:

* Dense heads: the chunk's queries against the gathered past (no mask) and against the chunk
  itself (square causal), each through a fused attention kernel that also returns the
  log-sum-exp of its scores, merged by those (:func:`merge_lse_all`). The past part folds the GQA
  group into the query rows (no mask, so rows are independent), which spares an expanded copy
  of a long past; only the chunk's own K/V are expanded.
* Streaming heads see only the sink and the last ``local`` tokens of the past. Those (at most
  ``sink + local`` rows) are placed in front of the chunk as a *virtual sequence*: in it, index
  distances equal position distances for every key a chunk query can see, so the Λ-masked
  prefill kernel of a fresh sequence computes exactly the chunk's rows (:func:`streaming_prefix`).

:func:`attention_lse` picks the fused kernel once per process on CUDA (flash, then cuDNN, each
checked against the plain computation on random inputs first) and computes in plain torch
(float32 softmax) elsewhere. Where flash handles a lower-right causal mask and GQA exactly
(checked the same way), :func:`causal_attention` does a chunk in one call instead: its caller
writes the chunk's keys first and passes the whole sequence (unquantized caches only, so the
chunk sees its own keys exactly as computed).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("lserve")

_IMPL: dict[str, str] = {}  # device type -> chosen fused kernel ("cudnn", "flash" or "math")
_OK: dict[str, bool] = {}  # device:dtype:D:impl -> the fused kernel runs and is exact here
# Sequences at least this long run their dense heads through cuDNN (SDPA on the H200); shorter
# ones (the served path's chunks) through flash: cuDNN builds an execution plan per new shape
# (~8 ms of host time per layer shape, `scripts/probes/probe_mixed.py`: a first 256-token chunk next to
# decodes took 265 ms), which only a long prompt's attention pays back.
CUDNN_MIN_TOKENS = 16384
# A chunk with cached past runs its dense heads through cuDNN when it starts and ends on this grid
# (:func:`chunk_impl`). cuDNN plans per shape, 0.065 s on the H200 for lengths on a 128 multiple
# and 0.9 s off one (``benchmarks/probes/probe_cudnn_causal_h200.json``); the grid bounds the shapes a server ever
# plans (a 128k prompt's chunks have 64 pasts) and the scheduler puts a long prompt's chunks on it.
# 0 turns cuDNN chunks off (flash runs every chunk).
CUDNN_CHUNK_GRID = 2048


def _math_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """Plain attention. q: [H, Lq, D]; k, v: [H, Lk, D] -> (o [H, Lq, D] in q's dtype, lse [H, Lq] fp32)."""
    s = torch.bmm(q.float(), k.float().transpose(1, 2)).mul_(scale)  # [H, Lq, Lk]
    if causal:
        lq, lk = s.shape[1], s.shape[2]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq)  # lower-right aligned
        s.masked_fill_(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.bmm(torch.exp(s - lse[..., None]), v.float())
    return o.to(q.dtype), lse


def _fused_lse(impl: str, q, k, v, causal: bool, scale: float):
    """One fused kernel with its log-sum-exp. q: [H, Lq, D]; k, v: [H, Lk, D]."""
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if impl == "cpu_flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, causal, scale=scale)
    elif impl == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, causal, False,
                                                                   scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, causal, False, scale=scale)
    o, lse = res[0], res[1]
    return o[0], lse.reshape(q.shape[0], q.shape[1]).float()


def _check_impl(impl: str, device: torch.device, dtype: torch.dtype, d: int) -> None:
    """Raise RuntimeError unless ``impl`` runs and matches the plain computation on random inputs."""
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = ((4, 192, 320, False), (4, 192, 192, True))  # (heads, Lq, Lk, causal)
    for h, lq, lk, causal in shapes:
        q = torch.randn(h, lq, d, generator=gen, device=device, dtype=dtype)
        # keys as the engine passes them: the first Lk rows of a longer gathered buffer
        k, v = (torch.randn(h, lk + 16, d, generator=gen, device=device, dtype=dtype)[:, :lk] for _ in "kv")
        o, lse = _fused_lse(impl, q, k, v, causal, d ** -0.5)
        ro, rl = _math_lse(q, k, v, causal, d ** -0.5)
        err = (o.float() - ro.float()).norm() / ro.float().norm()
        if not (err < 2e-2 and torch.allclose(lse, rl, atol=2e-2, rtol=1e-3)):
            raise RuntimeError(f"mismatch (relative error {float(err):.3g})")


def impl_ok(impl: str, device: torch.device, dtype: torch.dtype, d: int) -> bool:
    """Whether fused kernel ``impl`` ("flash" / "cudnn" / "cpu_flash") runs exactly here (checked once
    per process)."""
    key = f"{device}:{dtype}:{d}:{impl}"
    if key not in _OK:
        try:
            _check_impl(impl, device, dtype, d)
            _OK[key] = True
        except (RuntimeError, AttributeError) as e:  # not built for this device/dtype (or this torch), or wrong
            log.info("chunked prefill: %s attention unusable here (%s)", impl, str(e).splitlines()[0][:200])
            _OK[key] = False
    return _OK[key]


def _pick_impl(device: torch.device, dtype: torch.dtype, d: int) -> str:
    """The first fused kernel that runs and matches the plain computation on random inputs."""
    # flash first: cuDNN builds an execution plan per new shape, and every chunk of a prefill has
    # new (chunk, past) lengths: on the H200 ~6 ms of host time per call, two calls per layer, so a
    # served 2k prompt took 20 s (the time-targeted budget then shrank the chunks, making more shapes).
    for impl in ("flash", "cudnn"):
        if impl_ok(impl, device, dtype, d):
            return impl
    return "math"


def long_impl(device: torch.device, dtype: torch.dtype, d: int, length: int) -> str | None:
    """The fused kernel for attention over ``length`` keys: cuDNN from :data:`CUDNN_MIN_TOKENS` on
    where it is exact (its per-shape plans pay back there), else None (:func:`attention_lse`'s choice)."""
    if device.type != "cuda" or dtype == torch.float32 or length < CUDNN_MIN_TOKENS:
        return None
    return "cudnn" if impl_ok("cudnn", device, dtype, d) else None


def chunk_grid(device: torch.device, dtype: torch.dtype, d: int) -> int:
    """The grid chunks must start and end on for :func:`chunk_impl` to pick cuDNN here (0: never)."""
    if not CUDNN_CHUNK_GRID or long_impl(device, dtype, d, CUDNN_MIN_TOKENS) is None:
        return 0
    return CUDNN_CHUNK_GRID


def chunk_impl(device: torch.device, dtype: torch.dtype, d: int, start: int, n: int) -> str | None:
    """The fused kernel for the dense heads of an ``n``-token chunk after ``start`` cached tokens:
    cuDNN (via :func:`dense_chunk`) for a long sequence whose chunk lies on :func:`chunk_grid`,
    else None (the caller's flash path). On the H200 cuDNN runs long attention ~1.5x faster than
    flash (``benchmarks/probes/probe_served_prefill_h200.json``); off the grid its plans would not repeat."""
    grid = chunk_grid(device, dtype, d)
    if not grid or start % grid or n % grid or start + n < CUDNN_MIN_TOKENS:  # the past in grid_segments
        return None
    return long_impl(device, dtype, d, start + n)


def warm_chunk_plans(device: torch.device, dtype: torch.dtype, d: int, group: int, dense_heads: list[int],
                     max_len: int, max_chunk: int) -> int:
    """Run cuDNN once on every shape a grid-aligned chunk of a prompt up to ``max_len`` tokens can
    have (past pieces of :func:`grid_segments` and the chunk itself, ``max_chunk`` tokens at most,
    per distinct dense-head count), so that cuDNN's plans exist before the first long prompt
    (~35 ms each on the H200: a cold 128k prompt took 17.0 s where a warm one took 9.05 s).
    Returns the number of shapes run (0 where cuDNN chunks are off)."""
    grid = chunk_grid(device, dtype, d)
    if not grid or max_len < CUDNN_MIN_TOKENS:
        return 0
    gen = torch.Generator(device=device).manual_seed(0)
    sizes = range(grid, min(max_chunk, max_len) // grid * grid + 1, grid)
    segs = [grid << i for i in range(max_len.bit_length()) if grid << i < max_len]
    runs, scale = 0, d ** -0.5
    for hd in sorted(set(dense_heads) - {0}):
        kv = {s: torch.randn(hd, s, d, generator=gen, device=device, dtype=dtype) for s in segs + list(sizes)}
        for n in sizes:
            q = torch.randn(hd * group, n, d, generator=gen, device=device, dtype=dtype)
            for s in segs:
                attention_lse(q.reshape(hd, group * n, d), kv[s], kv[s], False, scale, "cudnn")
            kn = kv[n].repeat_interleave(group, 0)
            attention_lse(q, kn, kn, True, scale, "cudnn")
            runs += len(segs) + 1
    torch.cuda.synchronize(device)
    return runs


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  impl: str | None = None):
    """Attention with its log-sum-exp.

    Parameters
    ----------
    q : torch.Tensor
        [H, Lq, D].
    k, v : torch.Tensor
        [H, Lk, D] (same heads as ``q``).
    causal : bool
        Query i sees key j iff j <= i + Lk - Lq (aligned to the lower right; only used with Lq == Lk).
    scale : float
    impl : str, optional
        ``"flash"`` or ``"cudnn"`` to force a fused kernel on CUDA (benchmarks); default: the
        one picked for this device.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        Output [H, Lq, D] in q's dtype and log-sum-exp [H, Lq] float32 (natural log).
    """
    if q.device.type == "cpu" and impl_ok("cpu_flash", q.device, q.dtype, q.shape[-1]):
        # torch's fused CPU kernel: ~4x the plain computation at 2k keys, same result to 1e-6 in fp32
        return _fused_lse("cpu_flash", q, k, v, causal, scale)
    if q.device.type != "cuda" or q.dtype == torch.float32:
        return _math_lse(q, k, v, causal, scale)
    if impl is not None:
        return _fused_lse(impl, q, k, v, causal, scale)
    key = f"{q.device}:{q.dtype}:{q.shape[-1]}"
    impl = _IMPL.get(key)
    if impl is None:
        impl = _IMPL[key] = _pick_impl(q.device, q.dtype, q.shape[-1])
        log.info("chunked prefill attention on %s: %s", key, impl)
    if impl == "math":
        return _math_lse(q, k, v, causal, scale)
    return _fused_lse(impl, q, k, v, causal, scale)


_CAUSAL: dict[str, str | None] = {}  # device:dtype:D -> "flash" (GQA native), "flash_expand", or None


def _pick_causal(device: torch.device, dtype: torch.dtype, d: int) -> str | None:
    """How flash runs a lower-right causal GQA chunk here, checked against plain attention."""
    gen = torch.Generator(device=device).manual_seed(1)
    g, hkv = 4, 2
    for impl in ("flash", "flash_expand"):
        try:
            for lq, lk in ((96, 96), (80, 336)):
                q = torch.randn(hkv * g, lq, d, generator=gen, device=device, dtype=dtype)
                k, v = (torch.randn(hkv, lk + 16, d, generator=gen, device=device, dtype=dtype)[:, :lk] for _ in "kv")
                o = _flash_causal(impl, q, k, v, d ** -0.5)
                ro, _ = _math_lse(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), True, d ** -0.5)
                err = (o.float() - ro.float()).norm() / ro.float().norm()
                if not err < 2e-2:
                    raise RuntimeError(f"mismatch (relative error {float(err):.3g})")
            return impl
        except RuntimeError as e:
            log.info("causal chunk attention: %s unusable here (%s)", impl, str(e).splitlines()[0][:200])
    return None


def _flash_causal(impl: str, q, k, v, scale: float):
    g = q.shape[0] // k.shape[0]
    if impl == "flash_expand" and g > 1:
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0,
                                                             True, False, scale=scale)
    return res[0][0]


def causal_impl(device: torch.device, dtype: torch.dtype, d: int) -> str | None:
    """The flash variant :func:`causal_attention` uses on this device (picked once per process;
    None where none is exact: the caller keeps its own path)."""
    if device.type != "cuda" or dtype == torch.float32:
        return None
    key = f"{device}:{dtype}:{d}"
    if key not in _CAUSAL:
        _CAUSAL[key] = _pick_causal(device, dtype, d)
        log.info("causal chunk attention on %s: %s", key, _CAUSAL[key])
    return _CAUSAL[key]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of a chunk's queries to its whole sequence, in one flash call.

    Parameters
    ----------
    q : torch.Tensor
        [Hq, Lq, D], the last ``Lq`` positions of the sequence (query head h uses KV head h // G).
    k, v : torch.Tensor
        [Hkv, Lk, D], positions 0 .. Lk - 1 (Lk >= Lq); query i sees keys j <= i + Lk - Lq.
    scale : float

    Returns
    -------
    torch.Tensor
        [Hq, Lq, D]. Only where :func:`causal_impl` is not None.
    """
    impl = causal_impl(q.device, q.dtype, q.shape[-1])
    if impl is None:
        raise RuntimeError("no exact flash attention on this device")
    return _flash_causal(impl, q, k, v, scale)


def merge_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Softmax-merge two attention outputs over disjoint key sets.

    o1, o2: [H, L, D]; lse1, lse2: [H, L] float32 -> [H, L, D] in o1's dtype.
    """
    return merge_lse_all([o1, o2], [lse1, lse2])


def merge_lse_all(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Softmax-merge attention outputs over disjoint key sets.

    outs: k of [H, L, D]; lses: k of [H, L] float32 -> [H, L, D] in outs[0]'s dtype.
    """
    lse = torch.stack(lses)  # [k, H, L]
    w = torch.exp(lse - lse.amax(0))
    w = w / w.sum(0)
    out = outs[0].float() * w[0, ..., None]
    for o, wi in zip(outs[1:], w[1:]):
        out.addcmul_(o.float(), wi[..., None])
    return out.to(outs[0].dtype)


def grid_segments(start: int, grid: int) -> list[tuple[int, int]]:
    """[begin, end) ranges that tile [0, start) (a multiple of ``grid``) in power-of-two multiples
    of ``grid``, largest first: a chunk's past of any length as at most log2(start / grid) + 1
    pieces from one small set of lengths, so that cuDNN's per-shape plans repeat across chunks."""
    if start % grid:
        raise ValueError(f"start {start} is not a multiple of the grid {grid}")
    out, a, units = [], 0, start // grid
    for bit in reversed(range(units.bit_length())):
        if units >> bit & 1:
            out.append((a, a + (grid << bit)))
            a += grid << bit
    return out


def dense_chunk(q: torch.Tensor, k_past, v_past, k_new: torch.Tensor, v_new: torch.Tensor, group: int,
                scale: float, impl: str | None = None) -> torch.Tensor:
    """Dense heads of one chunk: causal attention to the past and to itself.

    Parameters
    ----------
    q : torch.Tensor
        [Hd * G, n, D] queries of the chunk (query head h uses KV head h // G).
    k_past, v_past : torch.Tensor or list of torch.Tensor
        [Hd, start, D] cached keys/values of the positions before the chunk, or lists of
        [Hd, len_i, D] pieces that together are those positions (in any order: no mask).
    k_new, v_new : torch.Tensor
        [Hd, n, D] the chunk's own keys/values.
    group : int
        G, query heads per KV head.
    scale : float
    impl : str, optional
        Fused kernel to force (:func:`attention_lse`).

    Returns
    -------
    torch.Tensor
        [Hd * G, n, D].
    """
    hq, n, d = q.shape
    hd = hq // group
    # contiguous as warm_chunk_plans' queries: cuDNN keys its plans on strides too, and the
    # caller's chunk queries are a transposed slice (a missed plan cost ~0.07 s per shape on the H200)
    q = q.contiguous()
    if isinstance(k_past, torch.Tensor):
        k_past, v_past = [k_past], [v_past]
    outs, lses = [], []
    qp = q.reshape(hd, group * n, d)  # past: no mask, so the group's query rows stack into one axis
    for kp, vp in zip(k_past, v_past):
        o, lse = attention_lse(qp, kp, vp, False, scale, impl)
        outs.append(o.reshape(hq, n, d))
        lses.append(lse.reshape(hq, n))
    o, lse = attention_lse(q, k_new.repeat_interleave(group, 0), v_new.repeat_interleave(group, 0), True, scale, impl)
    return merge_lse_all(outs + [o], lses + [lse])


def streaming_prefix(start: int, sink: int, local: int) -> list[tuple[int, int]]:
    """Past positions a streaming chunk starting at ``start`` can see, as [begin, end) ranges.

    Returns the whole past when it is shorter than ``sink + local``; otherwise the sink and the
    last ``local`` positions. Placed in front of the chunk in this order, they form a virtual
    sequence in which every visible key's index distance to a chunk query equals its position
    distance, and the sinks keep indices below ``sink``.
    """
    if start <= sink + local:
        return [(0, start)]
    return [(0, sink), (start - local, start)]
