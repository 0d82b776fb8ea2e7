// Unified block-sparse prefill attention over paged KV (mma.sync m16n8k16, bf16/fp16 in, fp32 acc).
//
// One CTA = one query tile of one KV head: BM rows, each a (position, query head) pair, the GQA
// group folded into the tile position-major (row m: position q0 + m / G, query head kvh * G + m % G),
// so every K/V block loaded to shared memory serves the whole group. A tile never straddles a
// block-list row (the host cuts tiles inside rows). The key blocks (BN = 64 keys) it visits:
//   dense head with a list (row >= 0): the row's kept blocks (rowptr/indices, ascending),
//                                      those past the tile's last position dropped
//   dense head without a list:         every causal block [0, q1)
//   streaming head:                    [0, sink) and [q0 - local + 1, q1) (Λ pattern)
// Causal / Λ / range-end masks are applied per element only in blocks that need them.
// Keys come from the paged pool (dense heads when pool_k != 0: [P, pool_heads, page_size, D],
// a sequence's pages listed at pages[page_off ..]; chunked prefill reads its cached past and its
// own keys, written there before the launch) or from the step's K/V rows (streaming heads, and
// dense heads when pool_k == 0; those need start == 0). P is rounded to 16 bits before P V
// (as FlashAttention and cuDNN do). Sequences are packed varlen-style (tile and sequence tables).
#include "common.cuh"

#if LS_DTYPE == 2
#error "bsp_prefill is bf16/fp16 only"
#endif

#define D LS_HEAD_DIM
#ifndef LS_BSP_MT
#define LS_BSP_MT 2  // 16-row m-tiles per warp: 2 = 32 rows, each K/V fragment feeds two MMAs
#endif
#define MT LS_BSP_MT
#ifndef LS_BSP_WARPS
#define LS_BSP_WARPS 4
#endif
#define NWARPS LS_BSP_WARPS
#define NTHREADS (NWARPS * 32)
#define BM (NWARPS * 16 * MT)
#define BN 64
#define ROWP (D + 8)  // shared row pitch (elements): +16 bytes keeps ldmatrix conflict-free
#define DK (D / 16)
#define NT (BN / 8)
#define DT (D / 8)
#define QCH (D / 8)  // 16-byte chunks per row

#include "mma.cuh"

extern "C" __global__ void __launch_bounds__(NTHREADS)
ls_bsp_prefill(const act_t* __restrict__ q, i64 q_tok_stride,         // [T, Hq, D]
               act_t* __restrict__ out, i64 out_tok_stride,           // [T, Hq, D]
               const act_t* __restrict__ k, const act_t* __restrict__ v, i64 kv_tok_stride,  // [T, Hkv, D]
               const act_t* __restrict__ pool_k, const act_t* __restrict__ pool_v,  // [P, pool_heads, NP, D]
               int pool_heads, int page_size, const int* __restrict__ pages,
               const int* __restrict__ tiles,    // [n_tiles, 4]: sequence, q0, q1 (absolute), list row or -1
               const int* __restrict__ seqs,     // [n_seq, 4]: t0 (first step row), start, n_new, page_off
               const int* __restrict__ rowptr,   // [n_dense, n_rows, 2]: (first, end) into indices, or null
               const int* __restrict__ indices,  // kept KV block ids, ascending within a row
               int n_rows, int head0, int n_dense, int group, int sink, int local, float qscale) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw);  // [BM][ROWP]
    u16* sK = sQ + BM * ROWP;                    // [2][BN][ROWP]
    u16* sV = sK + 2 * BN * ROWP;                // [2][BN][ROWP]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int* tl = tiles + 4 * blockIdx.x;
    const int si = tl[0], q0 = tl[1], q1 = tl[2], lrow = tl[3];
    const int t0 = seqs[4 * si], start = seqs[4 * si + 1], page_off = seqs[4 * si + 3];
    const int kvh = head0 + blockIdx.y;
    const bool dense = kvh < n_dense;
    const bool paged = dense && pool_k != nullptr;
    const int G = group;
    const int rows_used = min(BM / G, q1 - q0) * G;  // rows of whole positions inside [q0, q1)

    // ---- the key blocks this tile visits -------------------------------------------------------
    int nblk, rs1 = 0, nb0 = 0;  // streaming: blocks [0, nb0) from 0, then from rs1
    const int* list = nullptr;
    if (dense && lrow >= 0) {
        const int* ip = rowptr + ((i64)kvh * n_rows + lrow) * 2;
        list = indices + ip[0];
        nblk = ip[1] - ip[0];
        while (nblk > 0 && list[nblk - 1] * BN >= q1) --nblk;  // blocks past the tile's last position
    } else if (dense) {
        nblk = (q1 + BN - 1) / BN;
    } else {
        const int a_end = min(sink, q1);
        const int b_start = max(a_end, q0 - local + 1);
        nb0 = (a_end + BN - 1) / BN;
        rs1 = max(b_start / BN * BN, nb0 * BN);
        nblk = nb0 + (q1 > rs1 ? (q1 - rs1 + BN - 1) / BN : 0);
    }
    auto block_start = [&](int j) -> int {
        if (list) return list[j] * BN;
        if (dense) return j * BN;
        return j < nb0 ? j * BN : rs1 + (j - nb0) * BN;
    };
    // element offset of key t's row for this head (t < q1)
    auto key_off = [&](int t) -> i64 {
        if (paged) {
            const int pg = pages[page_off + t / page_size];
            return ((i64)pg * pool_heads + kvh) * page_size * D + (i64)(t % page_size) * D;
        }
        return (i64)(t0 + t - start) * kv_tok_stride + (i64)kvh * D;
    };
    const act_t* kbase = paged ? pool_k : k;
    const act_t* vbase = paged ? pool_v : v;

    // ---- Q tile -> shared (rows past the tile's positions zero-filled) --------------------------
    for (int c = tid; c < BM * QCH; c += NTHREADS) {
        const int m = c / QCH, col = (c % QCH) * 8;
        const bool ok = m < rows_used;
        const int pos = q0 + (ok ? m / G : 0);
        const i64 src = (i64)(t0 + pos - start) * q_tok_stride + (i64)(kvh * G + (ok ? m % G : 0)) * D + col;
        cp_async16(smem_u32(sQ + m * ROWP + col), q + src, ok ? 16 : 0);
    }
    auto load_block = [&](int j, int stage) {
        const int kb = block_start(j);
        u16* dK = sK + stage * BN * ROWP;
        u16* dV = sV + stage * BN * ROWP;
        for (int c = tid; c < BN * QCH; c += NTHREADS) {
            const int row = c / QCH, col = (c % QCH) * 8;
            const int t = kb + row;
            const bool ok = t < q1;
            const i64 off = key_off(ok ? t : kb) + col;
            cp_async16(smem_u32(dK + row * ROWP + col), kbase + off, ok ? 16 : 0);
            cp_async16(smem_u32(dV + row * ROWP + col), vbase + off, ok ? 16 : 0);
        }
    };
    if (nblk > 0) load_block(0, 0);
    cp_async_commit();  // Q and block 0 in one group

    // this thread's rows: m = wrow + mt * 16 + (lane >> 2) + 8 * hr; position -1 masks every key
    const int wrow = warp * 16 * MT;
    int prow[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int m = wrow + mt * 16 + (lane >> 2) + 8 * hr;
            prow[mt][hr] = m < rows_used ? q0 + m / G : -1;
        }

    float o[MT][DT][4];
    float mrow[MT][2], lsum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
        mrow[mt][0] = mrow[mt][1] = LS_NEG_INF;
        lsum[mt][0] = lsum[mt][1] = 0.f;
    }
    const int mi = lane >> 3, ri = lane & 7, cq = (lane & 3) * 2;

    for (int j = 0; j < nblk; ++j) {
        if (j + 1 < nblk) {
            load_block(j + 1, (j + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* Ks = sK + (j & 1) * BN * ROWP;
        const u16* Vs = sV + (j & 1) * BN * ROWP;
        const int kb = block_start(j);

        // S = Q K^T: this warp's 16 * MT rows x BN keys
        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            u32 qa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldsm_x4(smem_u32(sQ + (wrow + mt * 16 + (lane & 15)) * ROWP + kk * 16 + (lane >> 4) * 8),
                        qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3]);
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                u32 b0, b1, b2, b3;
                ldsm_x4(smem_u32(Ks + (nt * 8 + ri + (mi >> 1) * 8) * ROWP + kk * 16 + (mi & 1) * 8), b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816(s[mt][nt], qa[mt], b0, b1);
                    mma16816(s[mt][nt + 1], qa[mt], b2, b3);
                }
            }
        }
        // masks only where a key can be invisible to some row of the tile
        if (!dense || kb + BN - 1 > q0) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int p = prow[mt][e >> 1];
                        const int t = kb + nt * 8 + cq + (e & 1);
                        const bool ok = t <= p && (dense || t < sink || p - t < local);
                        if (!ok) s[mt][nt][e] = LS_NEG_INF;
                    }
        }
        // online softmax in base 2 (qscale = softmax scale * log2 e); a quad shares a row
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                float mx = LS_NEG_INF;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hr], s[mt][nt][2 * hr + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mnew = fmaxf(mrow[mt][hr], mx * qscale);
                const bool none = mnew == LS_NEG_INF;
                const float alpha = none ? 1.f : fast_exp2(mrow[mt][hr] - mnew);
                const float msub = none ? 0.f : mnew;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                        const float pr = fast_exp2(fmaf(s[mt][nt][e], qscale, -msub));
                        s[mt][nt][e] = pr;
                        sum += pr;
                    }
                lsum[mt][hr] = lsum[mt][hr] * alpha + sum;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) { o[mt][dt][2 * hr] *= alpha; o[mt][dt][2 * hr + 1] *= alpha; }
                mrow[mt][hr] = mnew;
            }
        // O += P V, P re-packed from the S accumulators as the A operand
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int x = 0; x < 4; ++x)
                    pa[mt][x] = pack2(s[mt][2 * kk + (x >> 1)][2 * (x & 1)], s[mt][2 * kk + (x >> 1)][2 * (x & 1) + 1]);
#pragma unroll
            for (int dt = 0; dt < DT; dt += 2) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(smem_u32(Vs + (kk * 16 + ri + (mi & 1) * 8) * ROWP + (dt + (mi >> 1)) * 8), b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816(o[mt][dt], pa[mt], b0, b1);
                    mma16816(o[mt][dt + 1], pa[mt], b2, b3);
                }
            }
        }
        __syncthreads();  // this stage is overwritten by the load issued next iteration
    }
    cp_async_wait<0>();  // a tile with no block still has its Q copies in flight

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float l = lsum[mt][hr];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int m = wrow + mt * 16 + (lane >> 2) + 8 * hr;
            if (m >= rows_used) continue;
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const int pos = q0 + m / G;
            u32* dst = reinterpret_cast<u32*>(out + (i64)(t0 + pos - start) * out_tok_stride + (i64)(kvh * G + m % G) * D);
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) dst[(dt * 8 + cq) >> 1] = pack2(o[mt][dt][2 * hr] * inv, o[mt][dt][2 * hr + 1] * inv);
        }
}
