// Block-sparse prefill attention on tensor cores (mma.sync m16n8k16, bf16/fp16 in, fp32 acc).
//
// One CTA = one tile of BM = 64 query rows of one sequence and one query head (4 warps x 16
// rows). It visits only the key blocks its rows can see:
//   dense (streaming == 0):  keys [0, q_end)                                  (causal)
//   streaming heads:         keys [0, min(sink, q_end)) and [q0 - local + 1, q_end) (Λ mask)
// iterating over the (at most two) non-empty ranges in blocks of BN = 64 keys, with no
// per-block skip branch; the element mask t <= p and (t < sink or p - t < local) is applied
// inside each block. K/V blocks are double-buffered in shared memory with cp.async; rows past a
// range end are zero-filled. Works on fresh chunk K/V ([T, H_kv, D] rows of the step), i.e.
// prefill without cached past (start == 0); sequences are packed varlen-style (tile table).
#include "common.cuh"

#if LS_DTYPE == 2
#error "prefill kernel is bf16/fp16 only"
#endif

#define D LS_HEAD_DIM
#define BM 64
#define BN 64
#define NTHREADS 128
#define ROWP (D + 8)  // shared row pitch (elements): +16 bytes keeps ldmatrix conflict-free
#define DK (D / 16)   // k-steps of Q K^T
#define NT (BN / 8)   // 8-key n-tiles of S
#define DT (D / 8)    // 8-dim n-tiles of O

#include "mma.cuh"

extern "C" __global__ void __launch_bounds__(NTHREADS)
ls_prefill(const act_t* __restrict__ q, i64 q_tok_stride,   // [T, Hq, D]
           const act_t* __restrict__ k, i64 k_tok_stride,   // [T, Hkv, D]
           const act_t* __restrict__ v, i64 v_tok_stride,   // [T, Hkv, D]
           act_t* __restrict__ out, i64 out_tok_stride,     // [T, Hq, D]
           const int* __restrict__ tiles,                   // [n_tiles, 2]: (sequence, first row)
           const int* __restrict__ seqs,                    // [n_seq, 2]: (first token row t0, length)
           int head0, int group, int streaming, int sink, int local, float qscale) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* sK = reinterpret_cast<u16*>(smem_raw);  // [2][BN][ROWP]
    u16* sV = sK + 2 * BN * ROWP;                 // [2][BN][ROWP]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int si = tiles[2 * blockIdx.x], q0 = tiles[2 * blockIdx.x + 1];
    const int t0 = seqs[2 * si], n = seqs[2 * si + 1];
    const int qh = head0 + blockIdx.y;
    const int kvh = qh / group;
    const int q_end = min(n, q0 + BM);

    // The (at most two) key ranges this tile can see.
    int rs0 = 0, re0 = q_end, rs1 = 0, re1 = 0;
    if (streaming) {
        const int a_end = min(sink, q_end);
        const int b_start = max(a_end, q0 - local + 1);
        if (b_start > a_end) { re0 = a_end; rs1 = b_start; re1 = q_end; }
    }
    const int nb0 = (re0 - rs0 + BN - 1) / BN;
    const int nblk = nb0 + (re1 - rs1 + BN - 1) / BN;

    // Q fragments (A operand, row-major 16x16 per k-step) straight from global memory.
    const int r_lo = q0 + warp * 16 + (lane >> 2);  // this thread's rows: r_lo and r_lo + 8
    const int cq = (lane & 3) * 2;
    u32 qa[DK][4];
    {
        const u32* row0 = reinterpret_cast<const u32*>(q + (i64)(t0 + r_lo) * q_tok_stride + (i64)qh * D);
        const u32* row1 = reinterpret_cast<const u32*>(q + (i64)(t0 + r_lo + 8) * q_tok_stride + (i64)qh * D);
        const bool ok0 = r_lo < n, ok1 = r_lo + 8 < n;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            const int c = (kk * 16 + cq) >> 1;
            qa[kk][0] = ok0 ? row0[c] : 0u;
            qa[kk][1] = ok1 ? row1[c] : 0u;
            qa[kk][2] = ok0 ? row0[c + 4] : 0u;
            qa[kk][3] = ok1 ? row1[c + 4] : 0u;
        }
    }

    auto block_range = [&](int j, int& kb, int& kend) {
        if (j < nb0) { kb = rs0 + j * BN; kend = re0; }
        else { kb = rs1 + (j - nb0) * BN; kend = re1; }
    };
    auto load_block = [&](int j, int stage) {
        int kb, kend;
        block_range(j, kb, kend);
        u16* dK = sK + stage * BN * ROWP;
        u16* dV = sV + stage * BN * ROWP;
        for (int c = tid; c < BN * (D / 8); c += NTHREADS) {
            const int row = c / (D / 8), col = (c % (D / 8)) * 8;
            const int t = kb + row;
            const bool ok = t < kend;
            const i64 tr = (i64)(t0 + (ok ? t : kb));
            cp_async16(smem_u32(dK + row * ROWP + col), k + tr * k_tok_stride + (i64)kvh * D + col, ok ? 16 : 0);
            cp_async16(smem_u32(dV + row * ROWP + col), v + tr * v_tok_stride + (i64)kvh * D + col, ok ? 16 : 0);
        }
        cp_async_commit();
    };

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float mrow[2] = {LS_NEG_INF, LS_NEG_INF}, lrow[2] = {0.f, 0.f};

    if (nblk > 0) load_block(0, 0);
    for (int j = 0; j < nblk; ++j) {
        if (j + 1 < nblk) {
            load_block(j + 1, (j + 1) & 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16* Ks = sK + (j & 1) * BN * ROWP;
        const u16* Vs = sV + (j & 1) * BN * ROWP;
        int kb, kend;
        block_range(j, kb, kend);

        // S = Q K^T for this warp's 16 rows x BN keys.
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        const int mi = lane >> 3, ri = lane & 7;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                const int key = nt * 8 + ri + (mi >> 1) * 8;
                const int dim = kk * 16 + (mi & 1) * 8;
                u32 b0, b1, b2, b3;
                ldsm_x4(smem_u32(Ks + key * ROWP + dim), b0, b1, b2, b3);
                mma16816(s[nt], qa[kk], b0, b1);
                mma16816(s[nt + 1], qa[kk], b2, b3);
            }
        }
        // Mask (causal, Λ, range end) and scale into base-2 logits.
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int p = r_lo + (e >> 1) * 8;
                const int t = kb + nt * 8 + cq + (e & 1);
                const bool ok = t < kend && t <= p && (!streaming || t < sink || p - t < local);
                s[nt][e] = ok ? s[nt][e] * qscale : LS_NEG_INF;
            }
        }
        // Online softmax, rows r_lo (hr = 0) and r_lo + 8 (hr = 1); a quad shares a row.
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float mx = LS_NEG_INF;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * hr], s[nt][2 * hr + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(mrow[hr], mx);
            const bool none = mnew == LS_NEG_INF;
            const float alpha = none ? 1.f : fast_exp2(mrow[hr] - mnew);
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                    const float p = none ? 0.f : fast_exp2(s[nt][e] - mnew);
                    s[nt][e] = p;
                    sum += p;
                }
            }
            lrow[hr] = lrow[hr] * alpha + sum;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) { o[dt][2 * hr] *= alpha; o[dt][2 * hr + 1] *= alpha; }
            mrow[hr] = mnew;
        }
        // O += P V; P re-packed from the S accumulators as the A operand, split into a 16-bit
        // head and remainder (two mma each) so it keeps ~16 significant bits like the fp32
        // softmax of the reference.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 ph[4], pl[4];
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const float a = s[2 * kk + (x >> 1)][2 * (x & 1)], c = s[2 * kk + (x >> 1)][2 * (x & 1) + 1];
                const float ah = h2f(f2h(a)), ch = h2f(f2h(c));
                ph[x] = pack2(ah, ch);
                pl[x] = pack2(a - ah, c - ch);
            }
#pragma unroll
            for (int dt = 0; dt < DT; dt += 2) {
                const int key = kk * 16 + ri + (mi & 1) * 8;
                const int dim = (dt + (mi >> 1)) * 8;
                u32 b0, b1, b2, b3;
                ldsm_x4_t(smem_u32(Vs + key * ROWP + dim), b0, b1, b2, b3);
                mma16816(o[dt], ph, b0, b1);
                mma16816(o[dt + 1], ph, b2, b3);
                mma16816(o[dt], pl, b0, b1);
                mma16816(o[dt + 1], pl, b2, b3);
            }
        }
        __syncthreads();  // this stage is overwritten by the load issued next iteration
    }

#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float l = lrow[hr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int p = r_lo + hr * 8;
        if (p < n) {
            u32* dst = reinterpret_cast<u32*>(out + (i64)(t0 + p) * out_tok_stride + (i64)qh * D);
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) dst[(dt * 8 + cq) >> 1] = pack2(o[dt][2 * hr] * inv, o[dt][2 * hr + 1] * inv);
        }
    }
}
