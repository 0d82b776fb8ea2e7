"""The elementwise steps of a Llama layer as three CUDA kernels (``kernels/fused.cu``).

Residual add + RMSNorm, RoPE on q and k, and SiLU(gate) * up take ~40 small torch kernels per
layer; at decode each costs a few microseconds even inside a CUDA graph, which for a 32-layer
model is as much time as reading the weights. The kernels round where the torch code rounds, so
the fused forward matches :meth:`LlamaModel.forward`'s torch path up to float32 summation order
in the RMS statistic; :meth:`FusedOps.self_check` compares them on random inputs before use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NORM_THREADS = 512
ARGMAX_THREADS = 1024  # kernels/fused.cu
GEMV_TMAX, GEMV_ROWS_PER_CTA = 4, 16  # ls_gemv: most rows of x; GEMV_WARPS * GEMV_R rows of W per CTA
VECTOR_MIN_ROWS = 64  # fewer rows (decode): the scalar RoPE / SiLU-mul kernels
NV8 = 2  # 8-element chunks per thread in ls_add_rmsnorm_v8 (kernels/fused.cu)


def _tolerance(dtype: torch.dtype) -> dict:
    """How far a fused kernel may be from the torch code it replaces (16-bit: a few ulps)."""
    return dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)


def _aligned16(*ts: torch.Tensor | None) -> bool:
    """Every given tensor starts on a 16-byte boundary (the 16-byte-access kernels need it)."""
    return all(t is None or t.data_ptr() % 16 == 0 for t in ts)


class FusedOps:
    """Launchers of the fused kernels for one activation dtype and head_dim (CUDA only)."""

    def __init__(self, dtype: torch.dtype, head_dim: int) -> None:
        from lserve.kernels.loader import Variant, dtype_name

        if dtype_name(dtype) is None:
            raise ValueError(f"no fused kernels for {dtype}")
        self.dtype = dtype
        self.variant = Variant("fused", dtype_name(dtype), head_dim)
        self.vector = True  # the 16-byte-access kernels where shapes allow (False: scalar ones only)
        self.gemv = dtype != torch.float32  # decode-sized projections through ls_gemv (16-bit weights)

    def _k(self, name: str):
        from lserve.kernels.loader import get_kernel

        return get_kernel(self.variant, name)

    def add_rmsnorm(self, h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float,
                    out: torch.Tensor) -> None:
        """``h += delta`` (if given) in place, then ``out = rms_norm(h) * w``. h, delta, out: [T, H]."""
        from lserve.kernels.loader import f32, i32, i64, launch, ptr

        T, H = h.shape
        for t in (h, out) + ((delta,) if delta is not None else ()):
            if t.shape != (T, H) or t.stride() != (H, 1) or t.dtype != self.dtype:
                raise ValueError(f"add_rmsnorm needs contiguous [{T}, {H}] {self.dtype} tensors")
        vec = self.vector and H % 8 == 0 and H <= 8 * NV8 * NORM_THREADS and _aligned16(h, out, w, delta) \
            and (H * h.element_size()) % 16 == 0
        launch(self._k("ls_add_rmsnorm_v8" if vec else "ls_add_rmsnorm"), (T,), (NORM_THREADS,),
               (ptr(h), ptr(delta), ptr(out), ptr(w), i32(H), i64(H), f32(eps), i32(delta is not None)))

    def rope_(self, qkv: torch.Tensor, n_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate heads [0, n_heads) of every row of ``qkv`` [T, W] in place (q heads, then k heads).

        cos, sin: float32 [T, head_dim / 2], each row's (:meth:`lserve.models.rope.Rope.cos_sin`
        of the step's positions, computed once for all layers).
        """
        from lserve.kernels.loader import i32, i64, launch, ptr

        T = qkv.shape[0]
        half = head_dim // 2
        if qkv.stride(1) != 1 or qkv.shape[1] < n_heads * head_dim:
            raise ValueError("rope_ needs row-contiguous qkv")
        if not (cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape == (T, half)):
            raise ValueError("rope_ needs contiguous [T, head_dim / 2] cos/sin rows")
        # 16-byte kernels for many rows (prefill); at decode the scalar ones spread a row over
        # more CTAs, which is what a latency-bound launch wants (measured: 1.5 vs 1.9 us).
        if (self.vector and T >= VECTOR_MIN_ROWS and half % 8 == 0 and _aligned16(qkv, cos, sin)
                and (qkv.stride(0) * qkv.element_size()) % 16 == 0):
            threads = min(512, -(-n_heads * half // 8 // 32) * 32)
            launch(self._k("ls_rope_v8"), (T,), (threads,),
                   (ptr(qkv), i64(qkv.stride(0)), ptr(cos), ptr(sin), i32(half), i32(n_heads)))
            return
        launch(self._k("ls_rope"), (T, n_heads), (min(128, half),),
               (ptr(qkv), i64(qkv.stride(0)), ptr(cos), ptr(sin), i32(half)))

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gu`` = [gate | up] [T, 2I] -> [T, I]."""
        from lserve.kernels.loader import i32, i64, launch, ptr

        T, I2 = gu.shape
        if not gu.is_contiguous() or I2 % 2:
            raise ValueError("silu_mul needs a contiguous [T, 2I] input")
        out = torch.empty((T, I2 // 2), dtype=gu.dtype, device=gu.device)
        total = T * (I2 // 2)
        if self.vector and T >= VECTOR_MIN_ROWS and (I2 // 2) % 8 == 0 and _aligned16(gu, out):
            launch(self._k("ls_silu_mul_v8"), (-(-total // 8 // 256),), (256,),
                   (ptr(gu), ptr(out), i32(I2 // 2), i64(total // 8)))
            return out
        launch(self._k("ls_silu_mul"), (-(-total // 256),), (256,), (ptr(gu), ptr(out), i32(I2 // 2), i64(total)))
        return out

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, w)``: x [T, K], w [N, K] -> [T, N]; through ``ls_gemv`` for decode-sized
        T (<= 4) with 16-bit, 16-byte aligned operands, else cuBLAS."""
        from lserve.kernels.loader import i32, i64, launch, ptr

        T, K = x.shape
        N = w.shape[0]
        if not (self.gemv and T <= GEMV_TMAX and K % 8 == 0 and x.dtype == w.dtype == self.dtype
                and w.is_contiguous() and x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0
                and _aligned16(x, w)):
            return F.linear(x, w)
        y = torch.empty((T, N), dtype=x.dtype, device=x.device)
        launch(self._k("ls_gemv"), (-(-N // GEMV_ROWS_PER_CTA),), (256,),
               (ptr(x), i64(x.stride(0)), ptr(w), i32(N), i32(K), i32(T), ptr(y), i64(N)))
        return y

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of float32 logits [B, V] -> long [B], exactly ``torch.argmax(logits, -1)``
        (ties: the lowest index; NaN above every number). One CTA per row: 28 us -> a few us
        for a 128k vocabulary at batch 1."""
        from lserve.kernels.loader import i32, i64, launch, ptr

        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
            raise ValueError("argmax needs float32 [B, V] logits with contiguous rows")
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if logits.shape[0]:
            launch(self._k("ls_argmax"), (logits.shape[0],), (ARGMAX_THREADS,),
                   (ptr(logits), i64(logits.stride(0)), i32(logits.shape[1]), ptr(out)))
        return out

    def self_check(self, hidden: int, intermediate: int, n_heads: int, head_dim: int, eps: float,
                   device) -> str | None:
        """Compare each kernel with the torch code it replaces on random inputs; None if all agree,
        else what differs."""
        for T in (5, VECTOR_MIN_ROWS + 3):  # decode-sized and prefill-sized (the 16-byte kernels)
            problem = self._check_rows(T, hidden, intermediate, n_heads, head_dim, eps, device)
            if problem:
                return f"{problem} ({T} rows)"
        g = torch.Generator(device=device).manual_seed(99)
        for T in (1, GEMV_TMAX):  # decode GEMV: an odd output count, a partial last CTA
            x = torch.randn(T, hidden, generator=g, device=device).to(self.dtype)
            w = (torch.randn(n_heads * head_dim + 3, hidden, generator=g, device=device) * hidden ** -0.5).to(self.dtype)
            if not torch.allclose(self.linear(x, w).float(), F.linear(x, w).float(), **_tolerance(self.dtype)):
                return f"gemv ({T} rows)"
        return None

    def _check_rows(self, T: int, hidden: int, intermediate: int, n_heads: int, head_dim: int, eps: float,
                    device) -> str | None:
        from lserve.models.norm import rms_norm
        from lserve.models.rope import Rope

        g = torch.Generator(device=device).manual_seed(1234 + T)
        dt = self.dtype

        def rnd(*shape):
            return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dt)

        tol = _tolerance(dt)
        h, d, w = rnd(T, hidden), rnd(T, hidden), rnd(hidden)
        ref_h = h + d
        ref = rms_norm(ref_h, w, eps)
        out = torch.empty_like(h)
        self.add_rmsnorm(h, d, w, eps, out)
        if not (torch.equal(h, ref_h) and torch.allclose(out.float(), ref.float(), **tol)):
            return "add_rmsnorm"
        qkv = rnd(T, (n_heads + 1) * head_dim)
        # each row's cos/sin (positions up to 10M, an attention factor), as Rope.cos_sin gives them
        pos = torch.randint(0, 10_000_000, (T,), generator=g, device=device)
        freq = (1.0 / 500000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)).contiguous()
        ang = pos.to(torch.float32)[:, None] * freq[None, :]
        x = qkv[:, : n_heads * head_dim].view(T, n_heads, head_dim)
        cos, sin = ang.cos().mul_(1.1), ang.sin().mul_(1.1)
        ref = Rope.apply(x, cos, sin)
        tail = qkv[:, n_heads * head_dim:].clone()
        self.rope_(qkv, n_heads, head_dim, cos, sin)
        if not (torch.allclose(x.float(), ref.float(), **tol) and torch.equal(qkv[:, n_heads * head_dim:], tail)):
            return "rope"
        gu = rnd(T, 2 * intermediate)
        gate, up = gu.chunk(2, dim=-1)
        if not torch.allclose(self.silu_mul(gu).float(), (F.silu(gate) * up).float(), **tol):
            return "silu_mul"
        # Odd vocabulary (a scalar tail), an unaligned row start, a tie, a NaN row.
        logits = torch.randn(T, 1 + 50257, generator=g, device=device)[:, 1:]
        logits[0, 7] = logits[0, 50000] = logits[0].max() + 1
        logits[-1, 123] = float("nan")
        if not torch.equal(self.argmax(logits), torch.argmax(logits, dim=-1)):
            return "argmax"
        return None
