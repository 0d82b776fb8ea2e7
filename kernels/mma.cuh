// Tensor-core helpers shared by the prefill and decode kernels: mma.sync m16n8k16 (bf16/fp16
// in, fp32 accumulate), ldmatrix, cp.async, packing. Fragment layouts (PTX ISA, m16n8k16):
//   A (16x16, row): a0 = (r, c..c+1), a1 = (r+8, c..c+1), a2 = (r, c+8..), a3 = (r+8, c+8..)
//   B (16x8, col):  b0 = (k..k+1, n), b1 = (k+8..k+9, n)
//   C (16x8 fp32):  c0,c1 = (r, 2q..2q+1), c2,c3 = (r+8, 2q..2q+1)
// with r = lane/4, c = k = 2*(lane%4), n = lane/4, q = lane%4.
#pragma once
#include "common.cuh"

#if LS_DTYPE == 2
#error "tensor-core kernels are bf16/fp16 only"
#endif

#if LS_DTYPE == 0
#define MMA_AB "bf16"
#define CVT_X2 "cvt.rn.bf16x2.f32"
#else
#define MMA_AB "f16"
#define CVT_X2 "cvt.rn.f16x2.f32"
#endif

__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_AB "." MMA_AB ".f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Two floats -> packed 16-bit pair, ``lo`` in the low half (lower column / address).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    asm(CVT_X2 " %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}


__device__ __forceinline__ u32 smem_u32(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// Copies of a pair of TP_ROWS-row tiles (two global arrays, same row offsets) into stage
// ``stage`` of two shared rings [STAGES][TP_ROWS][TP_PITCH] of 16-bit rows of TP_DIM elements:
// thread t owns the 16-byte column chunk t % (TP_DIM / 8) of rows r0, r0 + RPP, ...
// (RPP = TP_THREADS / (TP_DIM / 8)). ``src(L)`` is the element offset of tile row L's first
// element, asked only for L < nrows; rows >= nrows are zero-filled. (TP_ names: the including
// kernels #define BN, NT, ROWP.)
template <int TP_ROWS, int TP_THREADS, int TP_DIM, int TP_PITCH>
struct TilePairCopy {
    static constexpr int CPR = TP_DIM / 8, RPP = TP_THREADS / CPR;
    u32 sa0, sb0;
    int col, r0;
    __device__ __forceinline__ TilePairCopy(const u16* sa, const u16* sb)
        : col((threadIdx.x % CPR) * 8), r0(threadIdx.x / CPR) {
        sa0 = smem_u32(sa) + (u32)(r0 * TP_PITCH + col) * 2u;
        sb0 = smem_u32(sb) + (u32)(r0 * TP_PITCH + col) * 2u;
    }
    template <class Src>
    __device__ __forceinline__ void operator()(int t, int stage, int nrows, const u16* a, const u16* b,
                                               Src&& src) const {
        const u32 so = (u32)(stage * TP_ROWS * TP_PITCH) * 2u;
#pragma unroll
        for (int k = 0; k < TP_ROWS / RPP; ++k) {
            const int L = t * TP_ROWS + r0 + k * RPP;
            const bool ok = L < nrows;
            const i64 off = (ok ? src(L) : 0) + col;
            const u32 dst = so + (u32)(k * RPP * TP_PITCH) * 2u;
            cp_async16(sa0 + dst, a + off, ok ? 16 : 0);
            cp_async16(sb0 + dst, b + off, ok ? 16 : 0);
        }
    }
    // The same with rows from two pools: src(L, a, b) re-points a and b at row L's first element
    // (it may pick another pool per row); rows >= nrows are zero-filled from the given a and b.
    template <class Src>
    __device__ __forceinline__ void rows(int t, int stage, int nrows, const u16* a, const u16* b,
                                         Src&& src) const {
        const u32 so = (u32)(stage * TP_ROWS * TP_PITCH) * 2u;
#pragma unroll
        for (int k = 0; k < TP_ROWS / RPP; ++k) {
            const int L = t * TP_ROWS + r0 + k * RPP;
            const bool ok = L < nrows;
            const u16* ra = a;
            const u16* rb = b;
            if (ok) src(L, ra, rb);
            const u32 dst = so + (u32)(k * RPP * TP_PITCH) * 2u;
            cp_async16(sa0 + dst, ra + col, ok ? 16 : 0);
            cp_async16(sb0 + dst, rb + col, ok ? 16 : 0);
        }
    }
};

// A STAGES-deep cp.async ring of tiles: ``load(t, stage)`` issues the copies of tile t into a
// stage. ring_start issues tiles 0 .. STAGES-2; ring_next(t) waits until tile t has landed for
// every thread (its stage may then be read) and issues tile t + STAGES - 1 into the stage that
// tile t - 1 used. One commit group per tile, empty ones included, so the wait count is fixed.
template <int STAGES, class Load>
__device__ __forceinline__ void ring_start(int ntiles, Load&& load) {
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < ntiles) load(st, st);
        cp_async_commit();
    }
}
template <int STAGES, class Load>
__device__ __forceinline__ void ring_next(int t, int ntiles, Load&& load) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (t + STAGES - 1 < ntiles) load(t + STAGES - 1, (t + STAGES - 1) % STAGES);
    cp_async_commit();
}

// s[nt] += A B_nt for one 16-wide k-step: B_nt^T = 8 shared rows (16-bit, pitch ``rowp``
// elements) at ``rows`` + nt * 8 rows, columns [k0, k0 + 16) (the K^T of attention scores).
__device__ __forceinline__ void mma_rows16(float (&s)[2][4], const u32 (&a)[4], const u16* rows, int rowp, int k0) {
    const int lane = threadIdx.x & 31, mi = lane >> 3, ri = lane & 7;
    u32 b0, b1, b2, b3;
    ldsm_x4(smem_u32(rows + (ri + (mi >> 1) * 8) * rowp + k0 + (mi & 1) * 8), b0, b1, b2, b3);
    mma16816(s[0], a, b0, b1);
    mma16816(s[1], a, b2, b3);
}

