// Block-sparse decode attention on tensor cores, bf16/fp16 K/V (unquantized pools).
//
// Same work decomposition, index tables, masks and outputs as ls_decode (decode.cu): one CTA
// per unit = split of a work item (sequence b, KV head h, query sub-group qsub), entries
// [split*chunk, +chunk) resolved once into shared memory (physical page, first position,
// query-head bits); direct output or a normalized partial + log2-sum-exp for ls_decode_merge.
//
// The GQ query heads are the rows of one 16-row mma tile (rows >= GQ are zero and masked).
// The unit's tokens are walked in tiles of BN = 64 (a tile may span several small pages or part
// of a large one); K/V tiles stream through a STAGES-deep cp.async ring in shared memory, and
// warp w computes S = Q K^T and O += P V for keys [16w, 16w + 16) of each tile with its own
// online softmax; the four warps are merged at the end. CUDA cores only do the softmax
// bookkeeping of 8 scores per thread per tile, so the kernel is bound by the K/V stream.
#include "mma.cuh"
#include "decode_meta.cuh"
#include "tier.cuh"

#define D LS_HEAD_DIM
#define GQ LS_GQ
#define NWARPS 4
#define NTHREADS (NWARPS * 32)
#define BN 64
#define ROWP (D + 8)  // shared row pitch (elements): +16 bytes keeps ldmatrix conflict-free
#define DK (D / 16)   // k-steps of Q K^T
#define DT (D / 8)    // 8-dim n-tiles of O
#define STAGES 3
#define MAX_CHUNK 256
#define EPT (MAX_CHUNK / NTHREADS)  // table entries per thread

#if GQ > 8
#error "decode_tc handles at most 8 query heads per CTA"
#endif
#if LS_QUANT != 0
#error "decode_tc reads unquantized pools (quantized ones use decode.cu)"
#endif

extern "C" __global__ void __launch_bounds__(NTHREADS, 2)
ls_decode_tc(const act_t* __restrict__ q, i64 q_tok_stride,          // [T, Hq, D]
             act_t* __restrict__ out, i64 out_tok_stride,             // [T, Hq, D]
             float* __restrict__ part_o, float* __restrict__ part_lse,  // [U, GQ, D], [U, GQ]
             const int* __restrict__ units, int chunk, int direct,    // [U, 2] (work, split)
             const int* __restrict__ meta, int nb,
             const int* __restrict__ pages, int pages_stride,         // [nb, pages_stride]
             const int* __restrict__ ring_pages, const int* __restrict__ ring_pos, int ring_stride,
             const int* __restrict__ sel_idx, const int* __restrict__ sel_mask, const int* __restrict__ sel_cnt,
             const int* __restrict__ sel_page,                        // physical pages of sel_idx
             int sel_slot_stride, int sel_head_stride, int cnt_slot_stride, int qmode, int selects,
             const void* __restrict__ dk, const void* __restrict__ dv,
             const float* __restrict__ dks, const float* __restrict__ dvs,
             const float* __restrict__ dkz, const float* __restrict__ dvz, int hd,
             const void* __restrict__ sk, const void* __restrict__ sv,
             const float* __restrict__ sks, const float* __restrict__ svs,
             const float* __restrict__ skz, const float* __restrict__ svz, int hs,
             int group, int nqs, int page_size, int sink, int local, float qscale, int page_shift,
             int sel_ready,
             const TierLayer* __restrict__ tier) {  // LS_TIER: dense pages through the host tier
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* sK = reinterpret_cast<u16*>(smem_raw);  // [STAGES][BN][ROWP]
    u16* sV = sK + STAGES * BN * ROWP;            // [STAGES][BN][ROWP]
    __shared__ i64 s_row[MAX_CHUNK];  // pool row of the entry's first token: (page * H + head) * N
    __shared__ int s_pos[MAX_CHUNK];
    __shared__ u32 s_bits[MAX_CHUNK];
    __shared__ float s_m[NWARPS][GQ];
    __shared__ float s_l[NWARPS][GQ];

    // Before pdl_wait: host-copied tables (units, meta, page tables) and, when no top-k ran in
    // this step (sel_ready), the stored selection: every kernel here triggers its dependents
    // only after its own wait, so what a kernel two launches back wrote is complete by then.
    // Each level of dependent global loads here costs ~0.3 us before the K/V stream starts, so
    // the chain is kept to units (+ meta of sequence 0) -> selection (+ guessed tail pages).
    const bool early_sel = sel_ready != 0;
    const int u = blockIdx.x;
    const int tid = threadIdx.x;
    const int hkv = hd + hs;
    MetaRow m = load_meta(meta, nb, 0);  // alongside the unit's row: a batch of one needs no other
    const int w = units[2 * u], split = units[2 * u + 1];
    const int qsub = w % nqs;
    const int h = (w / nqs) % hkv;
    const int b = w / (nqs * hkv);
    if (b != 0) m = load_meta(meta, nb, b);
    const int tok = m.tok, len = m.len;
    const bool dense = h < hd;
    const bool dyn = dense && selects && m.dyn != 0;
    const int e0 = split * chunk;
    const int H = dense ? hd : hs;
    const int hh = dense ? h : h - hd;
    const i64 prow = (i64)b * pages_stride;
    // Entry e of a dynamic head: selected page e (e < cnt), else page nsel - 1 + (e - cnt) of the
    // sequence. The top-k keeps min(K - 1, candidates) pages per KV head (at least that per query
    // head), so the tail pages are loaded for that count before cnt arrives, again on a miss.
    const int cguess = dyn ? max(0, min(m.kk - 1, m.nsel - 1)) : 0;
    int tpage[EPT];
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
        const int i = tid + j * NTHREADS, idx = m.nsel - 1 + (e0 + i - cguess);
        tpage[j] = (dyn && i < chunk && idx >= 0 && idx < m.npg) ? pages[prow + idx] : 0;
    }
    if (dyn && !early_sel) pdl_wait();  // the selection comes from the top-k just before
    const i64 soff = (i64)m.slot * sel_slot_stride + (i64)h * sel_head_stride;
    const int cnt = dyn ? sel_cnt[(i64)m.slot * cnt_slot_stride + h] : 0;
    int spg[EPT], sid[EPT];
    u32 smk[EPT];
#pragma unroll
    for (int j = 0; j < EPT; ++j) {  // selected entries, loaded before cnt is known
        const int i = tid + j * NTHREADS, e = e0 + i;
        const bool ok = dyn && i < chunk && e < sel_head_stride;  // a row holds sel_head_stride
        spg[j] = ok ? sel_page[soff + e] : 0;
        sid[j] = ok ? sel_idx[soff + e] : 0;
        smk[j] = ok && qmode ? (u32)sel_mask[soff + e] : 0xffffffffu;
    }
    const int total = !dense ? m.nring : dyn ? cnt + m.npg - m.nsel + 1 : m.npg;
    const int ne = max(0, min(total, e0 + chunk) - e0);
    bool clean = true;  // every token of this thread's entries is read by every query row here
#pragma unroll
    for (int j = 0; j < EPT; ++j) {
        const int i = tid + j * NTHREADS, e = e0 + i;
        if (i >= ne) continue;
        int page, pos;
        u32 bits = 0xffffffffu;
        if (!dense) {
            page = ring_pages[(i64)b * ring_stride + e];
            pos = ring_pos[(i64)b * ring_stride + e];
        } else if (dyn && e < cnt) {
            page = spg[j];
            pos = sid[j] * page_size;
            bits = smk[j];
        } else if (dyn) {
            const int idx = m.nsel - 1 + (e - cnt);
            page = cnt == cguess ? tpage[j] : pages[prow + idx];
            pos = idx * page_size;
        } else {
            page = pages[prow + e];
            pos = e * page_size;
        }
#if LS_TIER
        if (dense) {  // a page on the host: -1 - its row in the host pool, unless a pick staged
            int slot = tier->slot[page];
            if (slot < 0 && dyn && e < cnt && tier->stage != nullptr) {
                const int staged = tier->stage[soff + e];
                if (staged >= 0) slot = staged;
            }
            s_row[i] = slot >= 0 ? ((i64)slot * H + hh) * page_size : -1 - ((i64)(-1 - slot) * H + hh) * page_size;
        } else {
            s_row[i] = ((i64)page * H + hh) * page_size;
        }
#else
        s_row[i] = ((i64)page * H + hh) * page_size;
#endif
        s_pos[i] = pos;
        s_bits[i] = bits >> (qsub * GQ);
        const bool in_len = pos + page_size <= len;
        const bool in_window = dense || pos + page_size <= sink || len - 1 - pos < local;
        clean = clean && in_len && in_window && (s_bits[i] & ((1u << GQ) - 1u)) == (1u << GQ) - 1u;
    }
    if (!dyn || early_sel) pdl_wait();  // before q, K/V (written by earlier kernels) and any write
    pdl_trigger();
    // Units whose tiles are all full and unmasked (most of a long selection: every page but the
    // sequence's last) skip the per-element mask, the largest part of a tile's CUDA-core work.
    const bool unmasked = __syncthreads_and(clean) != 0 && (ne * page_size) % BN == 0;

    const int warp = tid >> 5, lane = tid & 31;
    const int qh0 = h * group + qsub * GQ;
    const act_t* kbase = reinterpret_cast<const act_t*>(dense ? dk : sk);
    const act_t* vbase = reinterpret_cast<const act_t*>(dense ? dv : sv);
    const int qpos = len - 1;
    const int ntok = ne * page_size;
    const int ntiles = (ntok + BN - 1) / BN;

    // Token j of the unit -> (entry, offset); a shift when the page size is a power of two.
    auto entry_of = [&](int j, int& ei, int& off) {
        if (page_shift >= 0) { ei = j >> page_shift; off = j & (page_size - 1); }
        else { ei = j / page_size; off = j - ei * page_size; }
    };
    const TilePairCopy<BN, NTHREADS, D, ROWP> copy(sK, sV);
#if LS_TIER
    const act_t* hkb = reinterpret_cast<const act_t*>(tier->k);
    const act_t* hvb = reinterpret_cast<const act_t*>(tier->v);
    auto load_tile = [&](int t, int stage) {  // K and V rows of tokens [t * BN, + BN) of the unit
        copy.rows(t, stage, ntok, kbase, vbase, [&](int j, const u16*& ka, const u16*& va) {
            int ei, off;
            entry_of(j, ei, off);
            const i64 r = s_row[ei];
            if (r >= 0) {
                ka = kbase + (r + off) * D;
                va = vbase + (r + off) * D;
            } else {  // zero-copy from the host pool
                ka = hkb + (-1 - r + off) * D;
                va = hvb + (-1 - r + off) * D;
            }
        });
    };
#else
    auto load_tile = [&](int t, int stage) {  // K and V rows of tokens [t * BN, + BN) of the unit
        copy(t, stage, ntok, kbase, vbase, [&](int j) {
            int ei, off;
            entry_of(j, ei, off);
            return (s_row[ei] + off) * D;
        });
    };
#endif

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float mrow = LS_NEG_INF, lrow = 0.f;  // row r_lo (rows r_lo + 8 are padding)

    ring_start<STAGES>(ntiles, load_tile);
    // Q as the A operand: row r = query head r of this CTA (rows >= GQ are zero). Loaded after
    // the first K/V copies are issued: only the first mma needs it.
    const int r_lo = lane >> 2, cq = (lane & 3) * 2;
    u32 qa[DK][4];
    {
        const u32* row0 = reinterpret_cast<const u32*>(q + (i64)tok * q_tok_stride + (i64)(qh0 + r_lo) * D);
        const bool ok0 = r_lo < GQ;  // rows r_lo + 8 >= 8 >= GQ: always zero
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            const int c = (kk * 16 + cq) >> 1;
            qa[kk][0] = ok0 ? row0[c] : 0u;
            qa[kk][1] = 0u;
            qa[kk][2] = ok0 ? row0[c + 4] : 0u;
            qa[kk][3] = 0u;
        }
    }

    const int mi = lane >> 3, ri = lane & 7;
    for (int t = 0; t < ntiles; ++t) {
        ring_next<STAGES>(t, ntiles, load_tile);  // tile t landed; stage (t-1) % STAGES refilled
        const u16* Ks = sK + (t % STAGES) * BN * ROWP + warp * 16 * ROWP;
        const u16* Vs = sV + (t % STAGES) * BN * ROWP + warp * 16 * ROWP;

        // S = Q K^T for this warp's 16 keys (two n-tiles of 8).
        // Two accumulator chains (even / odd k-steps): half the dependent mma latency.
        float s[2][4], s2[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            s2[nt][0] = s2[nt][1] = s2[nt][2] = s2[nt][3] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < DK; kk += 2) {
            mma_rows16(s, qa[kk], Ks, ROWP, kk * 16);
            mma_rows16(s2, qa[kk + 1], Ks, ROWP, (kk + 1) * 16);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] += s2[nt][e];
        // Mask: token exists, causal/Λ window, and the query head reads this page.
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {  // c0, c1: row r_lo; c2, c3 (row r_lo + 8) are padding
                const int j = t * BN + warp * 16 + nt * 8 + cq + e;
                bool ok = r_lo < GQ && (unmasked || j < ntok);
                if (ok && !unmasked) {
                    int ei, off;
                    entry_of(j, ei, off);
                    const int p = s_pos[ei] + off;
                    ok = p < len && (dense || p < sink || qpos - p < local) && ((s_bits[ei] >> r_lo) & 1u);
                }
                s[nt][e] = ok ? s[nt][e] * qscale : LS_NEG_INF;
                s[nt][2 + e] = LS_NEG_INF;
            }
        }
        // Online softmax of row r_lo (a quad of lanes shares a row).
        float mx = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmaxf(mrow, mx);
        const bool none = mnew == LS_NEG_INF;
        const float alpha = none ? 1.f : fast_exp2(mrow - mnew);
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = (none || e >= 2) ? 0.f : fast_exp2(s[nt][e] - mnew);
                s[nt][e] = p;
                sum += p;
            }
        }
        lrow = lrow * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) { o[dt][0] *= alpha; o[dt][1] *= alpha; }
        mrow = mnew;
        // O += P V over the 16 keys (one k-step). P is split into a 16-bit head and a 16-bit
        // remainder (two mma each) so the probabilities keep ~16 significant bits, like the
        // fp32 softmax of the reference; Q, K, V are exact in their storage type already.
        u32 ph[4], pl[4];
        ph[1] = ph[3] = pl[1] = pl[3] = 0u;  // rows r_lo + 8: padding
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const float a = s[nt][0], c = s[nt][1];
            const float ah = h2f(f2h(a)), ch = h2f(f2h(c));
            ph[2 * nt] = pack2(ah, ch);
            pl[2 * nt] = pack2(a - ah, c - ch);
        }
#pragma unroll
        for (int dt = 0; dt < DT; dt += 2) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(smem_u32(Vs + (ri + (mi & 1) * 8) * ROWP + (dt + (mi >> 1)) * 8), b0, b1, b2, b3);
            mma16816(o[dt], ph, b0, b1);
            mma16816(o[dt + 1], ph, b2, b3);
            mma16816(o[dt], pl, b0, b1);
            mma16816(o[dt + 1], pl, b2, b3);
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the K/V ring is reused below for the cross-warp merge

    // Merge the four warps: rows r_lo < GQ live in lanes 4*r_lo .. 4*r_lo + 3.
    float* s_o = reinterpret_cast<float*>(smem_raw);  // [NWARPS][GQ][D]
    lrow += __shfl_xor_sync(0xffffffffu, lrow, 1);
    lrow += __shfl_xor_sync(0xffffffffu, lrow, 2);
    if (r_lo < GQ) {
        if ((lane & 3) == 0) { s_m[warp][r_lo] = mrow; s_l[warp][r_lo] = lrow; }
        float* dst = s_o + ((i64)warp * GQ + r_lo) * D;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) { dst[dt * 8 + cq] = o[dt][0]; dst[dt * 8 + cq + 1] = o[dt][1]; }
    }
    __syncthreads();
    // Per query head: each warp's weight in the combined softmax (and the head's log2-sum-exp),
    // once, so each output below is four multiply-adds of independent shared loads.
    __shared__ float s_wt[NWARPS][GQ];
    __shared__ float s_lse[GQ];
    if (tid < GQ) {
        float M = LS_NEG_INF, L = 0.f;
#pragma unroll
        for (int wi = 0; wi < NWARPS; ++wi) M = fmaxf(M, s_m[wi][tid]);
        float a[NWARPS];
#pragma unroll
        for (int wi = 0; wi < NWARPS; ++wi) {
            const float mw = s_m[wi][tid];
            a[wi] = (M == LS_NEG_INF || mw == LS_NEG_INF) ? 0.f : fast_exp2(mw - M);
            L += s_l[wi][tid] * a[wi];
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
        for (int wi = 0; wi < NWARPS; ++wi) s_wt[wi][tid] = a[wi] * inv;
        s_lse[tid] = L > 0.f ? M + __log2f(L) : LS_NEG_INF;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < (GQ * D + NTHREADS - 1) / NTHREADS; ++k) {
        const int i = tid + k * NTHREADS;
        if (GQ * D % NTHREADS != 0 && i >= GQ * D) break;
        const int g = i / D, d = i - g * D;
        float O = 0.f;
#pragma unroll
        for (int wi = 0; wi < NWARPS; ++wi) O += s_wt[wi][g] * s_o[((i64)wi * GQ + g) * D + d];
        if (direct) out[(i64)tok * out_tok_stride + (i64)(qh0 + g) * D + d] = f2act(O);
        else part_o[((i64)u * GQ + g) * D + d] = O;
    }
    if (!direct && tid < GQ) part_lse[(i64)u * GQ + tid] = s_lse[tid];
}
