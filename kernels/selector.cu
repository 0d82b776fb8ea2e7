// Page selector for dense heads at decode (SPEC.md section 4), two launches per layer:
//
// ls_page_scores: S_j = sum_i max(q_i kmax_ji, q_i kmin_ji) for every logical page j of every
//   selecting sequence (grid: page ranges x head groups of hpc heads x sub-groups, x rows), max-reduced over the g logical pages of each physical page and, in
//   "kv" mode, over the GQ query heads of the CTA (rows h*nqs + qsub; the top-k kernel takes
//   the max over the nqs sub-groups). "query" mode keeps one row per query head.
// ls_page_topk: one CTA per (selecting sequence, dense KV head). For each selecting row, one
//   histogram pass over bins linear in the score (or, when its boundary bin is crowded, a radix
//   select over the key bits) finds the K-1 largest scores among all pages but the last (ties
//   broken towards lower page indices), marks the kept pages in a shared bitmask (bit = query
//   head of the group in query mode), then compacts the marked pages in ascending order into
//   the selection state: sel_idx (logical page indices), sel_mask (query mode) and sel_cnt.
//   The decode kernel reads that state directly, so a reuse step launches nothing.
#include "common.cuh"

#define D LS_HEAD_DIM
#define GQ LS_GQ
#define LPT (D / 8)
#define SPW (32 / LPT)
#define NWARPS 4
#define NTHREADS (NWARPS * 32)
#define NSTREAMS (NWARPS * SPW)
#define PPB_MAX 128  // most physical pages per CTA (launch argument ppb)

#include "decode_meta.cuh"  // META_* rows: the one layout every kernel reads

// A lane's 8 elements of one statistics row, raw (converted when consumed).
#if LS_DTYPE == 2
struct StRaw { uint4 a, b; };
#else
struct StRaw { uint4 a; };
#endif

__device__ __forceinline__ void st_load(StRaw& r, const act_t* p) {
    r.a = ldg_stream16(p);
#if LS_DTYPE == 2
    r.b = ldg_stream16(p + 4);
#endif
}

__device__ __forceinline__ void st_zero(StRaw& r) {
    r.a.x = r.a.y = r.a.z = r.a.w = 0u;
#if LS_DTYPE == 2
    r.b.x = r.b.y = r.b.z = r.b.w = 0u;
#endif
}

__device__ __forceinline__ void st_float(const StRaw& r, float (&f)[8]) {
#if LS_DTYPE == 2
    f[0] = __uint_as_float(r.a.x); f[1] = __uint_as_float(r.a.y); f[2] = __uint_as_float(r.a.z); f[3] = __uint_as_float(r.a.w);
    f[4] = __uint_as_float(r.b.x); f[5] = __uint_as_float(r.b.y); f[6] = __uint_as_float(r.b.z); f[7] = __uint_as_float(r.b.w);
#else
    unpack2(r.a.x, f[0], f[1]); unpack2(r.a.y, f[2], f[3]);
    unpack2(r.a.z, f[4], f[5]); unpack2(r.a.w, f[6], f[7]);
#endif
}

// Sums of NV values per lane over the LPT lanes of a row, reduce-scattered: at each xor offset
// (LPT/2 first) a lane keeps half of its values (the upper half if its offset bit is set) and
// adds the partner's copy of that half, so NV values cost NV - 1 shuffles instead of NV * log2(LPT).
// Each final sum is the same pairwise tree as a per-value butterfly, so the results are bitwise
// equal to it. Once one value is left, the remaining offsets are a plain butterfly.
template <int N, int O>
struct ReduceScatter {
    static __device__ __forceinline__ void run(float* x, int li) {
        if constexpr (O > 0) {
            if constexpr (N > 1) {
                const bool up = (li & O) != 0;
#pragma unroll
                for (int i = 0; i < N / 2; ++i) {
                    const float send = up ? x[i] : x[i + N / 2];
                    const float keep = up ? x[i + N / 2] : x[i];
                    x[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
                }
                ReduceScatter<N / 2, O / 2>::run(x, li);
            } else {
                x[0] += __shfl_xor_sync(0xffffffffu, x[0], O);
                ReduceScatter<1, O / 2>::run(x, li);
            }
        }
    }
};

__host__ __device__ constexpr int ilog2(int n) { return n <= 1 ? 0 : 1 + ilog2(n / 2); }
// Row sums per tile and lane: 4 rows x GQP heads, GQ padded to a power of two so that every level
// of the reduce-scatter halves whole rows (the padded heads' sums stay 0 and are never read).
constexpr int GQP = GQ <= 1 ? 1 : GQ <= 2 ? 2 : GQ <= 4 ? 4 : GQ <= 8 ? 8 : 16;
constexpr int NV = 4 * GQP;
constexpr int NV_REAL = 4 * GQ;                              // values v = g * 4 + j below this are real
constexpr int RS_L = ilog2(LPT);                             // xor levels of a row's lanes
constexpr int RS_S = ilog2(NV) < RS_L ? ilog2(NV) : RS_L;    // levels that scatter
constexpr int NLOC = NV >> RS_S;                             // values a lane holds after the reduction
constexpr bool SPLIT_Q = GQ <= 4;                            // q+ / q- in registers (see ls_page_scores)
#if LS_GQ <= 4 && LS_DTYPE != 2
#define SCORE_MIN_CTAS 3  // 16-bit statistics: 168 registers, no spills, 3 CTAs per SM
#else
#define SCORE_MIN_CTAS 1  // wider tiles (fp32) or 8 heads: let the compiler take what it needs
#endif

// One tile of a stream: logical rows [j0, j0 + 4) of one physical page (kmax and kmin).
struct STile {
    StRaw mx[4], mn[4];
    int pi;  // page index in the sequence's table
    int j0;
    bool active;
};

extern "C" __global__ void __launch_bounds__(NTHREADS, SCORE_MIN_CTAS)
ls_page_scores(const act_t* __restrict__ q, i64 q_tok_stride,       // [T, Hq, D]
               const act_t* __restrict__ kmax, const act_t* __restrict__ kmin,  // [P, g, hd, D]
               int hd, int g_log,
               const int* __restrict__ meta, int nb,
               const int* __restrict__ rows,                         // [R] selecting sequences
               const int* __restrict__ pages, int pages_stride,
               float* __restrict__ scores, int score_stride,         // [R, rows_per_seq, score_stride]
               int group, int nqs, int qmode, int ppb, int hpc) {
    __shared__ i64 s_pages[PPB_MAX];
    const int r = blockIdx.z;
    const int b = rows[r];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // hpc (1, 2 or 4, dividing hd) heads per CTA, warp w on head w % hpc: the CTA's loads of one
    // (page, logical row) cover hpc adjacent heads, i.e. contiguous bytes of [P, g, hd, D].
    const int h = (blockIdx.y / nqs) * hpc + warp % hpc, qsub = blockIdx.y % nqs;
    const int nst = NSTREAMS / hpc;  // page streams per head
    // Host-copied tables only before the wait; q and the statistics come from earlier kernels.
    // No early pdl_trigger: the top-k CTAs it would let in take slots of this one-wave grid
    // (measured slower, benchmarks/probes/probe_launch_h200.json); the top-k launches as this exits.
    const int npg = meta[META_NPAGES * nb + b];
    const int p_begin = blockIdx.x * ppb;
    const int p_end = min(npg, p_begin + ppb);
    for (int i = threadIdx.x; i < p_end - p_begin; i += NTHREADS) s_pages[i] = pages[(i64)b * pages_stride + p_begin + i];
    const int tok = meta[META_TOK * nb + b];
    pdl_wait();
    if (p_begin >= npg) return;  // uniform per CTA
    const int sw = lane / LPT, li = lane % LPT, d0 = li * 8;
    const int qh0 = h * group + qsub * GQ;

    // max(q kmax, q kmin) = q+ kmax + q- kmin elementwise (q+ = max(q, 0), q- = min(q, 0)), since
    // kmax >= kmin. As two FMAs it equals the select form q * (q >= 0 ? kmax : kmin) bit for bit
    // (the zero product adds nothing) without a compare and a select per element; for GQ = 8
    // the split doubles q's registers past the budget, so that variant keeps the select.
    float qp[GQ][8];
    float qn[SPLIT_Q ? GQ : 1][8];
#pragma unroll
    for (int g = 0; g < GQ; ++g) {
        load8_act(q + (i64)tok * q_tok_stride + (i64)(qh0 + g) * D + d0, qp[g]);
        if constexpr (SPLIT_Q) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                qn[g][i] = fminf(qp[g][i], 0.f);
                qp[g][i] = fmaxf(qp[g][i], 0.f);
            }
        }
    }
    const int rows_per_seq = qmode ? hd * group : hd * nqs;
    float* srow = scores + (i64)r * rows_per_seq * score_stride;
    __syncthreads();

    // Tiles of this warp: its pages are p_begin + (warp/hpc)*SPW + k*nst (+ sw per stream), each
    // in ng groups of 4 logical rows. Double-buffered like the decode kernel; uniform trip count.
    const int ng = (g_log + 3) / 4;
    const int first = p_begin + (warp / hpc) * SPW;
    const int n_tiles = first < p_end ? ((p_end - first + nst - 1) / nst) * ng : 0;
    auto load_tile = [&](STile& T, int k) {
        T.pi = first + (k / ng) * nst + sw;
        T.j0 = (k % ng) * 4;
        T.active = T.pi < p_end;
        const i64 page = T.active ? s_pages[T.pi - p_begin] : 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (T.active && T.j0 + j < g_log) {
                const i64 off = ((page * g_log + T.j0 + j) * hd + h) * D + d0;
                st_load(T.mx[j], kmax + off);
                st_load(T.mn[j], kmin + off);
            } else {
                st_zero(T.mx[j]);
                st_zero(T.mn[j]);
            }
        }
    };
    // After the row sums are reduce-scattered, lane li holds values v = hi * NLOC + c
    // (c < NLOC) with hi = li >> (RS_L - RS_S), and v = g * 4 + j (query head g, row j).
    const int hi = li >> (RS_L - RS_S);
    float best[NLOC];
#pragma unroll
    for (int c = 0; c < NLOC; ++c) best[c] = LS_NEG_INF;
    auto consume = [&](const STile& T) {
        float x[NV];
#pragma unroll
        for (int v = NV_REAL; v < NV; ++v) x[v] = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float mx[8], mn[8];
            st_float(T.mx[j], mx);
            st_float(T.mn[j], mn);
#pragma unroll
            for (int g = 0; g < GQ; ++g) {
                float acc = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    if constexpr (SPLIT_Q) acc = fmaf(qn[SPLIT_Q ? g : 0][i], mn[i], fmaf(qp[g][i], mx[i], acc));
                    else acc = fmaf(qp[g][i], qp[g][i] >= 0.f ? mx[i] : mn[i], acc);
                }
                x[g * 4 + j] = acc;
            }
        }
        ReduceScatter<NV, LPT / 2>::run(x, li);
#pragma unroll
        for (int c = 0; c < NLOC; ++c) {
            const int v = hi * NLOC + c, j = v & 3;
            best[c] = fmaxf(best[c], T.j0 + j < g_log && v < NV_REAL ? x[c] : LS_NEG_INF);
        }
        if (T.j0 + 4 >= g_log) {  // last group of the page: write and reset
            if (qmode) {
                // Max over the 4 rows of each query head: JL rows in registers, JX lanes apart.
                constexpr int JL = NLOC >= 4 ? 4 : NLOC, JX = 4 / JL, NC = NLOC / JL;
                float m[NC];
#pragma unroll
                for (int c = 0; c < NC; ++c) {
                    m[c] = best[c * JL];
#pragma unroll
                    for (int t = 1; t < JL; ++t) m[c] = fmaxf(m[c], best[c * JL + t]);
                }
#pragma unroll
                for (int t = 1, o = 1 << (RS_L - RS_S); t < JX; t <<= 1, o <<= 1)
#pragma unroll
                    for (int c = 0; c < NC; ++c) m[c] = fmaxf(m[c], __shfl_xor_sync(0xffffffffu, m[c], o));
                const bool writer = (li & ((1 << (RS_L - RS_S)) - 1)) == 0 && hi % JX == 0;
                if (T.active && writer) {
#pragma unroll
                    for (int c = 0; c < NC; ++c) {
                        const int qg = (hi * NLOC + c * JL) >> 2;  // query head of the CTA
                        if (qg < GQ) srow[(i64)(qh0 + qg) * score_stride + T.pi] = m[c];
                    }
                }
            } else {
                float bm = best[0];
#pragma unroll
                for (int c = 1; c < NLOC; ++c) bm = fmaxf(bm, best[c]);
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, o));
                if (T.active && li == 0) srow[(i64)(h * nqs + qsub) * score_stride + T.pi] = bm;
            }
#pragma unroll
            for (int c = 0; c < NLOC; ++c) best[c] = LS_NEG_INF;
        }
    };
    STile ta, tb;
    if (n_tiles > 0) load_tile(ta, 0);
    for (int k = 0; k < n_tiles; k += 2) {
        if (k + 1 < n_tiles) load_tile(tb, k + 1);
        consume(ta);
        if (k + 1 >= n_tiles) break;
        if (k + 2 < n_tiles) load_tile(ta, k + 2);
        consume(tb);
    }
}

#define TK_THREADS 512
#define TK_BITS 11                    // radix digit width
#define TK_BINS (1 << TK_BITS)
#define TK_PER (TK_BINS / TK_THREADS)  // bins per thread in the scan
#define TK_PG_REGS 8                  // candidate pages per thread held in registers (4096 in all)

// The float whose order_key is ``key`` (common.cuh).
__device__ __forceinline__ float key_float(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The bin of the ``need``-th largest key from a histogram whose bin i holds keys below those of
// bin i + 1: *digit, the count in the bins above it (*above) and its own (*cnt). Thread t scans
// bins [TK_BINS-1 - t*TK_PER, ... - TK_PER + 1]. Contains barriers: call from every thread.
__device__ __forceinline__ void topk_find_bin(const int* hist, int need, int* scan, int* digit, int* above, int* cnt) {
    const int tid = threadIdx.x;
    int c[TK_PER], tsum = 0;
#pragma unroll
    for (int j = 0; j < TK_PER; ++j) { c[j] = hist[TK_BINS - 1 - tid * TK_PER - j]; tsum += c[j]; }
    const int incl = block_inclusive_scan(tsum, scan);
    int run = incl - tsum;
#pragma unroll
    for (int j = 0; j < TK_PER; ++j) {
        if (run < need && run + c[j] >= need) {
            *digit = TK_BINS - 1 - tid * TK_PER - j;
            *above = run;
            *cnt = c[j];
        }
        run += c[j];
    }
    __syncthreads();
}

// One CTA per (row, head) and few of them: registers over occupancy (a cap spilled).
extern "C" __global__ void __launch_bounds__(TK_THREADS, 1)
ls_page_topk(const float* __restrict__ scores, int score_stride,
             const int* __restrict__ meta, int nb,
             const int* __restrict__ rows, int hd, int group, int nqs, int qmode,
             int* __restrict__ sel_idx, int* __restrict__ sel_mask, int* __restrict__ sel_cnt,
             int sel_slot_stride, int sel_head_stride, int cnt_slot_stride,
             const int* __restrict__ pages, int pages_stride,  // [nb, pages_stride] physical pages
             int* __restrict__ sel_page) {                    // like sel_idx: the physical pages
    extern __shared__ u32 smem[];  // keys [ncand] (then physical pages), bits [ncand]
    __shared__ int s_hist[TK_BINS];
    __shared__ int s_scan[32];
    __shared__ u32 s_kmin[32], s_kmax[32];
    __shared__ int s_digit, s_above, s_cnt, s_nm;
    __shared__ u32 s_mkey[TK_THREADS];  // boundary-bin members of the linear pass
    __shared__ int s_midx[TK_THREADS];

    const int r = blockIdx.x, h = blockIdx.y;
    const int b = rows[r];
    const int npg = meta[META_NPAGES * nb + b];
    const int ncand = npg - 1;                          // the last page is always kept
    const int k = meta[META_KK * nb + b] - 1;           // pages chosen by score
    const int slot = meta[META_SLOT * nb + b];
    u32* keys = smem;
    u32* bits = smem + ncand;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Shared-memory set-up overlaps the score kernel's tail (nothing global is touched).
    for (int i = tid; i < ncand; i += TK_THREADS) bits[i] = 0u;
    for (int i = tid; i < TK_BINS; i += TK_THREADS) s_hist[i] = 0;
    // The candidates' physical pages (written out with the selection) are read from the
    // host-copied page table before the wait, so the compaction does not wait for them; they
    // replace the keys in shared memory once the keys are dead.
    const int* prow = pages + (i64)b * pages_stride;
    int pg[TK_PG_REGS];
#pragma unroll
    for (int j = 0; j < TK_PG_REGS; ++j) {
        const int i = tid + j * TK_THREADS;
        pg[j] = i < ncand ? prow[i] : 0;
    }
    pdl_wait();  // the scores (and the selection state this overwrites) belong to earlier kernels
    pdl_trigger();
    const int rows_per_seq = qmode ? hd * group : hd * nqs;
    const float* sbase = scores + (i64)r * rows_per_seq * score_stride;
    // Contiguous ranges per thread for the order-preserving steps.
    const int per = (ncand + TK_THREADS - 1) / TK_THREADS;
    const int c0 = min(ncand, tid * per), c1 = min(ncand, c0 + per);

    const int nsel_rows = k > 0 ? (qmode ? group : 1) : 0;  // K = 1: only the last page is read
    for (int sr = 0; sr < nsel_rows; ++sr) {
        __syncthreads();
        // Keys (order-preserving uint of the score) and their min / max.
        u32 kmn = 0xffffffffu, kmx = 0u;
        const float* row = sbase + (i64)(qmode ? h * group + sr : h * nqs) * score_stride;
#pragma unroll 8
        for (int i = tid; i < ncand; i += TK_THREADS) {  // unrolled: the L2 loads overlap
            float sc = row[i];
            if (!qmode)
                for (int qs = 1; qs < nqs; ++qs) sc = fmaxf(sc, row[(i64)qs * score_stride + i]);
            const u32 key = order_key(sc);
            keys[i] = key;
            kmn = min(kmn, key);
            kmx = max(kmx, key);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            kmn = min(kmn, __shfl_xor_sync(0xffffffffu, kmn, o));
            kmx = max(kmx, __shfl_xor_sync(0xffffffffu, kmx, o));
        }
        if (lane == 0) { s_kmin[warp] = kmn; s_kmax[warp] = kmx; }
        __syncthreads();
        kmn = s_kmin[0];
        kmx = s_kmax[0];
        for (int wi = 1; wi < TK_THREADS / 32; ++wi) { kmn = min(kmn, s_kmin[wi]); kmx = max(kmx, s_kmax[wi]); }
        // Radix select of the k-th largest key over the bits where keys differ (the common
        // prefix of min and max is shared by all), TK_BITS per pass, stopping early once the
        // chosen bin holds exactly the keys still needed.
        const u32 bit = 1u << sr;
        // Linear pass: bins proportional to the score between the row's min and max (monotone
        // in the score, so a higher bin holds only larger keys). One histogram finds the bin of
        // the k-th largest; the few keys in it are ranked by (key desc, page asc) directly.
        // Scores cluster far less in such bins than in the radix digits of their bit patterns,
        // so this usually replaces 2-3 radix passes; a crowded boundary bin (many equal or
        // nearly equal scores) falls back to the radix select below.
        const float fmn = key_float(kmn), span = key_float(kmx) - fmn;
        const float scale = (float)TK_BINS / span;
        bool resolved = false;
        if (k < ncand && span > 0.f && span < LS_INF && scale < LS_INF) {  // uniform per CTA
            auto lin_bin = [&](u32 key) { return min(TK_BINS - 1, (int)((key_float(key) - fmn) * scale)); };
            if (sr > 0)  // the first row's histogram was cleared before the wait
                for (int i = tid; i < TK_BINS; i += TK_THREADS) s_hist[i] = 0;
            if (tid == 0) s_nm = 0;
            __syncthreads();
            for (int i = tid; i < ncand; i += TK_THREADS) atomicAdd(&s_hist[lin_bin(keys[i])], 1);
            __syncthreads();
            topk_find_bin(s_hist, k, s_scan, &s_digit, &s_above, &s_cnt);
            const int bstar = s_digit, cb = s_cnt, need = k - s_above;  // need of the cb keys in bstar
            if (cb <= TK_THREADS) {
                resolved = true;
                for (int i = tid; i < ncand; i += TK_THREADS) {
                    const int bi = lin_bin(keys[i]);
                    if (bi > bstar || (bi == bstar && need == cb)) {
                        bits[i] |= bit;
                    } else if (bi == bstar) {
                        const int m = atomicAdd(&s_nm, 1);
                        s_mkey[m] = keys[i];
                        s_midx[m] = i;
                    }
                }
                __syncthreads();
                const int nm = s_nm;
                if (tid < nm) {
                    const u32 kt = s_mkey[tid];
                    const int it = s_midx[tid];
                    int rank = 0;
                    for (int j = 0; j < nm; ++j) {
                        const u32 kj = s_mkey[j];
                        rank += kj > kt || (kj == kt && s_midx[j] < it);
                    }
                    if (rank < need) bits[it] |= bit;
                }
            }
        }
        if (resolved) continue;
        const u32 diff = kmn ^ kmx;
        int top = diff ? 31 - __clz(diff) : -1;  // highest differing bit
        u32 pmask = top >= 31 ? 0u : ~((2u << top) - 1u);
        if (top < 0) pmask = 0xffffffffu;
        u32 prefix = kmn & pmask;
        int remaining = k;
        while (top >= 0) {
            const int nbits = min(TK_BITS, top + 1);
            const int shift = top + 1 - nbits;
            const u32 dmask = (1u << nbits) - 1u;
            for (int i = tid; i < TK_BINS; i += TK_THREADS) s_hist[i] = 0;
            __syncthreads();
            for (int i = tid; i < ncand; i += TK_THREADS) {
                const u32 key = keys[i];
                if ((key & pmask) == prefix) atomicAdd(&s_hist[(key >> shift) & dmask], 1);
            }
            __syncthreads();
            topk_find_bin(s_hist, remaining, s_scan, &s_digit, &s_above, &s_cnt);
            prefix |= ((u32)s_digit) << shift;
            pmask |= dmask << shift;
            remaining -= s_above;
            top = shift - 1;
            if (s_cnt == remaining) break;  // the whole bin is kept: no finer digit needed
        }
        // Keep keys whose masked value is above the prefix, and the first `remaining` (in page
        // order) of those equal to it.
        int eq = 0;
        for (int i = c0; i < c1; ++i) eq += (keys[i] & pmask) == prefix;
        const int eq_before = block_inclusive_scan(eq, s_scan) - eq;
        int rank = eq_before;
        for (int i = c0; i < c1; ++i) {
            const u32 km = keys[i] & pmask;
            bool keep = km > prefix;
            if (km == prefix) keep = rank++ < remaining;
            if (keep) bits[i] |= bit;
        }
    }
    __syncthreads();
    // Compact the marked pages in ascending order: warp w owns candidates [w * cw, +cw) (cw a
    // multiple of 32), counts its kept ones with ballots, and writes them after the counts of
    // the warps before it (one barrier; consecutive lanes read consecutive words).
    constexpr int TK_WARPS = TK_THREADS / 32;
    const int cw = (ncand + TK_THREADS - 1) / TK_THREADS * 32;
    const int w0 = min(ncand, warp * cw), w1 = min(ncand, w0 + cw);
    int* s_pg = reinterpret_cast<int*>(keys);
#pragma unroll
    for (int j = 0; j < TK_PG_REGS; ++j) {
        const int i = tid + j * TK_THREADS;
        if (i < ncand) s_pg[i] = pg[j];
    }
    for (int i = tid + TK_PG_REGS * TK_THREADS; i < ncand; i += TK_THREADS) s_pg[i] = prow[i];
    int wcnt = 0;
    for (int i0 = w0; i0 < w1; i0 += 32) {
        const int i = i0 + lane;
        wcnt += __popc(__ballot_sync(0xffffffffu, i < w1 && bits[i] != 0u));
    }
    if (lane == 0) s_scan[warp] = wcnt;
    __syncthreads();
    int o = 0, total = 0;
#pragma unroll
    for (int v = 0; v < TK_WARPS; ++v) {
        const int c = s_scan[v];
        o += v < warp ? c : 0;
        total += c;
    }
    const i64 so = (i64)slot * sel_slot_stride + (i64)h * sel_head_stride;
    for (int i0 = w0; i0 < w1; i0 += 32) {
        const int i = i0 + lane;
        const u32 bm = i < w1 ? bits[i] : 0u;
        const u32 bal = __ballot_sync(0xffffffffu, bm != 0u);
        if (bm) {
            const int oi = o + __popc(bal & ((1u << lane) - 1u));
            sel_idx[so + oi] = i;
            sel_page[so + oi] = s_pg[i];
            if (qmode) sel_mask[so + oi] = (int)bm;
        }
        o += __popc(bal);
    }
    if (tid == 0) sel_cnt[(i64)slot * cnt_slot_stride + h] = total;
}
