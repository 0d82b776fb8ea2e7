// Page scores on tensor cores (bf16/fp16 statistics): the scores of ls_page_scores
// (selector.cu) as a matrix product, S = Q+ Kmax^T + Q- Kmin^T, where the rows of Q+ / Q- are
// max(q, 0) / min(q, 0) of the CTA's GQ query heads (exact in the storage type; rows >= GQ are
// zero) and the columns of Kmax / Kmin are the statistics rows of logical pages. Per logical
// page, max(q kmax, q kmin) summed over dims equals that product because kmax >= kmin.
//
// One CTA per (page range, dense KV head and query sub-group, selecting sequence): its logical
// rows stream in tiles of BN = 64 through a STAGES-deep cp.async ring (kmax and kmin tiles, like
// decode_tc's K and V), warp w scores rows [16w, 16w + 16) of each tile with mma.sync, and the
// scores are max-reduced over the g logical rows of each physical page (and, in "kv" mode, over
// the GQ query heads) through shuffles. The CUDA-core kernel was issue-bound: 256 FMAs per lane
// and tile on top of the loads (benchmarks/kernels/kernels_notes.md).
#include "mma.cuh"

#define D LS_HEAD_DIM
#define GQ LS_GQ
#define NWARPS 4
#define NTHREADS (NWARPS * 32)
#define BN 64
#define ROWP (D + 8)  // shared row pitch (elements): +16 bytes keeps ldmatrix conflict-free
#define DK (D / 16)
#define STAGES 3
#define PPB_MAX 128  // most physical pages per CTA (launch argument ppb)

#include "decode_meta.cuh"  // META_* rows: the one layout every kernel reads

#if GQ > 8
#error "the tensor-core page scores take at most 8 query heads per CTA"
#endif

// The non-negative / non-positive part of two packed 16-bit values (sign bit: negative or -0).
__device__ __forceinline__ u32 pos_part(u32 x) {
    return ((x & 0x8000u) ? 0u : (x & 0xffffu)) | ((x & 0x80000000u) ? 0u : (x & 0xffff0000u));
}
__device__ __forceinline__ u32 neg_part(u32 x) {
    return ((x & 0x8000u) ? (x & 0xffffu) : 0u) | ((x & 0x80000000u) ? (x & 0xffff0000u) : 0u);
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 2)
ls_page_scores_tc(const act_t* __restrict__ q, i64 q_tok_stride,                   // [T, Hq, D]
                  const act_t* __restrict__ kmax, const act_t* __restrict__ kmin,  // [P, g, hd, D]
                  int hd, int g_log, int g_shift,                                 // g = 1 << g_shift
                  const int* __restrict__ meta, int nb,
                  const int* __restrict__ rows,                                   // [R] selecting sequences
                  const int* __restrict__ pages, int pages_stride,
                  float* __restrict__ scores, int score_stride,                   // [R, rows_per_seq, score_stride]
                  int group, int nqs, int qmode, int ppb) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* sX = reinterpret_cast<u16*>(smem_raw);  // [STAGES][BN][ROWP] kmax rows
    u16* sN = sX + STAGES * BN * ROWP;            // [STAGES][BN][ROWP] kmin rows
    __shared__ i64 s_base[PPB_MAX];               // element offset of (page, logical row 0, head h)

    const int r = blockIdx.z;
    const int b = rows[r];
    const int h = blockIdx.y / nqs, qsub = blockIdx.y % nqs;
    const int tid = threadIdx.x;
    // Host-copied tables only before the wait; q and the statistics come from earlier kernels.
    // No pdl_trigger at the start (see ls_page_scores): only in the last tile, below.
    const int npg = meta[META_NPAGES * nb + b];
    const int p_begin = blockIdx.x * ppb;
    const int p_end = min(npg, p_begin + ppb);
    for (int i = tid; i < p_end - p_begin; i += NTHREADS)
        s_base[i] = ((i64)pages[(i64)b * pages_stride + p_begin + i] * g_log * hd + h) * D;
    const int tok = meta[META_TOK * nb + b];
    pdl_wait();
    if (p_begin >= npg) return;  // uniform per CTA
    __syncthreads();

    const int warp = tid >> 5, lane = tid & 31;
    const int nrows = (p_end - p_begin) << g_shift;  // logical rows of the CTA
    const int ntiles = (nrows + BN - 1) / BN;
    const int qh0 = h * group + qsub * GQ;

    // Q+ and Q- as A operands: row r_lo = query head r_lo (rows r_lo + 8 >= 8 >= GQ are zero).
    const int r_lo = lane >> 2, cq = (lane & 3) * 2;
    u32 qp[DK][2], qn[DK][2];  // (a0, a2) of each k-step; a1 = a3 = 0
    {
        const bool ok = r_lo < GQ;
        const u32* row = reinterpret_cast<const u32*>(q + (i64)tok * q_tok_stride + (i64)(qh0 + (ok ? r_lo : 0)) * D);
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            const int c = (kk * 16 + cq) >> 1;
            const u32 x0 = ok ? row[c] : 0u, x2 = ok ? row[c + 4] : 0u;
            qp[kk][0] = pos_part(x0); qp[kk][1] = pos_part(x2);
            qn[kk][0] = neg_part(x0); qn[kk][1] = neg_part(x2);
        }
    }

    const i64 row_step = (i64)hd * D;  // between logical rows of one page
    const TilePairCopy<BN, NTHREADS, D, ROWP> copy(sX, sN);
    auto load_tile = [&](int t, int stage) {  // kmax and kmin rows of logical rows [t * BN, + BN)
        copy(t, stage, nrows, kmax, kmin, [&](int L) {
            const int pi = L >> g_shift;
            return s_base[pi] + (L - (pi << g_shift)) * row_step;
        });
    };

    const int rows_per_seq = qmode ? hd * group : hd * nqs;
    float* srow = scores + (i64)r * rows_per_seq * score_stride;
    ring_start<STAGES>(ntiles, load_tile);
    for (int t = 0; t < ntiles; ++t) {
        ring_next<STAGES>(t, ntiles, load_tile);  // tile t landed; stage (t-1) % STAGES refilled
        // The top-k may launch once every CTA is in its last tile: all CTAs of this one-wave grid
        // are resident by then, so its CTAs take no slot a score CTA needs (see ls_page_scores).
        if (t == ntiles - 1) pdl_trigger();
        const u16* Xs = sX + (t % STAGES) * BN * ROWP + warp * 16 * ROWP;
        const u16* Ns = sN + (t % STAGES) * BN * ROWP + warp * 16 * ROWP;
        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            const u32 a_p[4] = {qp[kk][0], 0u, qp[kk][1], 0u};
            const u32 a_n[4] = {qn[kk][0], 0u, qn[kk][1], 0u};
            mma_rows16(s, a_p, Xs, ROWP, kk * 16);
            mma_rows16(s, a_n, Ns, ROWP, kk * 16);
        }
        // Column n of this warp = logical row L0 + n; this lane holds row (query head) r_lo of
        // columns nt * 8 + cq + e. Max over the g logical rows of each page: within the lane
        // (g >= 2), across lanes xor 1 (g >= 4) and 2 (g >= 8), across the two n-tiles (g = 16).
        const int L0 = t * BN + warp * 16;
        float m[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                m[nt][e] = (r_lo < GQ && L0 + nt * 8 + cq + e < nrows) ? s[nt][e] : LS_NEG_INF;
        if (g_shift >= 1) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) m[nt][0] = m[nt][1] = fmaxf(m[nt][0], m[nt][1]);
        }
        if (g_shift >= 2) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                m[nt][0] = fmaxf(m[nt][0], __shfl_xor_sync(0xffffffffu, m[nt][0], 1));
                if (g_shift >= 3) m[nt][0] = fmaxf(m[nt][0], __shfl_xor_sync(0xffffffffu, m[nt][0], 2));
                m[nt][1] = m[nt][0];
            }
        }
        if (g_shift >= 4) m[0][0] = m[0][1] = m[1][0] = m[1][1] = fmaxf(m[0][0], m[1][0]);
        if (!qmode) {  // max over the query heads (lanes 4 apart)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e)
#pragma unroll
                    for (int o = 4; o < 32; o <<= 1) m[nt][e] = fmaxf(m[nt][e], __shfl_xor_sync(0xffffffffu, m[nt][e], o));
        }
        // The lane holding the first column of a page writes it (kv: head row 0; query: its head).
        if (qmode ? r_lo < GQ : r_lo == 0) {
            float* dst = srow + (i64)(qmode ? qh0 + r_lo : h * nqs + qsub) * score_stride;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int n = nt * 8 + cq + e;
                    const int L = L0 + n;
                    if (L < nrows && (n & ((1 << g_shift) - 1)) == 0) dst[p_begin + (L >> g_shift)] = m[nt][e];
                }
        }
    }
}
