// Block-sparse decode attention over the two-way paged cache (one launch per layer) and the
// split-K merge.
//
// Work item w = (sequence b, KV head h, query sub-group qsub): the GQ query heads
// [h*G + qsub*GQ, +GQ) share every K/V row loaded for KV head h. Its index table (two-level:
// loop index e -> entry -> physical page) is
//   streaming head (h >= hd):   ring page e, first token position ring_pos[e];
//                               token t kept iff t < len and (t < sink or len-1-t < local)
//   dense head, no selection:   logical page e of the sequence (all pages)
//   dense head, selection:      e < cnt: stored selected logical page sel_idx[e] (query mode:
//                               with a bitmask of the query heads that selected it), then every
//                               page from the one that was last at selection time (nsel-1) on.
// A unit (one CTA) is one split of one work item: entries [split*chunk, +chunk). In direct mode
// (every work item has one split) the CTA writes the output rows; otherwise it writes a
// normalized partial and its log2-sum-exp, and ls_decode_merge combines the splits.
//
// Inside a CTA, each group of LPT = D/8 lanes is a "stream" owning 8 dims per lane; a stream
// walks TPI consecutive tokens per step (loads of all TPI K and V rows are issued before use),
// keeps an online softmax per query head, and streams are merged through shuffles and shared
// memory at the end.
#include "common.cuh"

#define D LS_HEAD_DIM
#define GQ LS_GQ
#define LPT (D / 8)
#define SPW (32 / LPT)
#define NWARPS 4
#define NTHREADS (NWARPS * 32)
#define NSTREAMS (NWARPS * SPW)
#define TPI 4  // tokens in flight per lane group (probes edit this text: scripts/probes/kernel_edits.py)
#define MAX_CHUNK 256
// CTAs per SM the register allocation must allow: 3 keeps ~12 warps of loads in flight.
#if GQ <= 4 && LS_DTYPE != 2
#define MIN_BLOCKS 3
#else
#define MIN_BLOCKS 2
#endif

#if (32 % LPT) != 0
#error "decode needs head_dim in {64, 128, 256}"
#endif

#include "decode_meta.cuh"
#include "tier.cuh"


extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_BLOCKS)
ls_decode(const act_t* __restrict__ q, i64 q_tok_stride,          // [T, Hq, D]
          act_t* __restrict__ out, i64 out_tok_stride,             // [T, Hq, D]
          float* __restrict__ part_o, float* __restrict__ part_lse,  // [U, GQ, D], [U, GQ]
          const int* __restrict__ units, int chunk, int direct,    // [U, 2] (work, split)
          const int* __restrict__ meta, int nb,
          const int* __restrict__ pages, int pages_stride,         // [nb, pages_stride]
          const int* __restrict__ ring_pages, const int* __restrict__ ring_pos, int ring_stride,
          const int* __restrict__ sel_idx, const int* __restrict__ sel_mask, const int* __restrict__ sel_cnt,
          int sel_slot_stride, int sel_head_stride, int cnt_slot_stride, int qmode, int selects,
          const void* __restrict__ dk, const void* __restrict__ dv,
          const float* __restrict__ dks, const float* __restrict__ dvs,
          const float* __restrict__ dkz, const float* __restrict__ dvz, int hd,
          const void* __restrict__ sk, const void* __restrict__ sv,
          const float* __restrict__ sks, const float* __restrict__ svs,
          const float* __restrict__ skz, const float* __restrict__ svz, int hs,
          int group, int nqs, int page_size, int sink, int local, float qscale, int sel_ready,
          const TierLayer* __restrict__ tier) {  // LS_TIER: dense pages through the host tier
    __shared__ int s_page[MAX_CHUNK];  // LS_TIER, dense heads: resident slot, or -1 - host slot
    __shared__ int s_pos[MAX_CHUNK];
    __shared__ u32 s_bits[MAX_CHUNK];
    __shared__ float s_m[NWARPS][GQ];
    __shared__ float s_l[NWARPS][GQ];
    __shared__ __align__(16) float s_o[NWARPS][GQ][D];

    // Before pdl_wait: host-copied tables (units, meta, page tables) and, when no top-k ran in
    // this step (sel_ready), the stored selection: every kernel here triggers its dependents
    // only after its own wait, so what a kernel two launches back wrote is complete by then.
    const bool early_sel = sel_ready != 0;
    const int u = blockIdx.x;
    const int w = units[2 * u], split = units[2 * u + 1];
    const int hkv = hd + hs;
    const int qsub = w % nqs;
    const int h = (w / nqs) % hkv;
    const int b = w / (nqs * hkv);
    const int tok = meta[META_TOK * nb + b];
    const int len = meta[META_LEN * nb + b];
    const int npg = meta[META_NPAGES * nb + b];
    const bool dense = h < hd;
    const bool dyn = dense && selects && meta[META_DYN * nb + b] != 0;
    int total, cnt = 0, nsel = 0;
    const int* sidx = nullptr;
    const int* smsk = nullptr;
    i64 soff = 0;  // this (slot, head)'s row of the selection (and of the tier's staging map)
    if (!dense) {
        total = meta[META_NRING * nb + b];
    } else if (dyn) {
        const int slot = meta[META_SLOT * nb + b];
        nsel = meta[META_NSEL * nb + b];
        soff = (i64)slot * sel_slot_stride + (i64)h * sel_head_stride;
        sidx = sel_idx + soff;
        smsk = sel_mask + soff;
        if (!early_sel) pdl_wait();  // the selection comes from the top-k just before
        cnt = sel_cnt[(i64)slot * cnt_slot_stride + h];
        total = cnt + npg - nsel + 1;
    } else {
        total = npg;
    }
    const int e0 = split * chunk;
    const int ne = max(0, min(total, e0 + chunk) - e0);

    // Resolve this unit's entries once: physical page, position of its first token, head bits.
    for (int i = threadIdx.x; i < ne; i += NTHREADS) {
        const int e = e0 + i;
        int page, pos;
        u32 bits = 0xffffffffu;
        if (!dense) {
            page = ring_pages[(i64)b * ring_stride + e];
            pos = ring_pos[(i64)b * ring_stride + e];
        } else {
            int idx = e;
            if (dyn) {
                if (e < cnt) {
                    idx = sidx[e];
                    if (qmode) bits = (u32)smsk[e];
                } else {
                    idx = nsel - 1 + (e - cnt);
                }
            }
            page = pages[(i64)b * pages_stride + idx];
#if LS_TIER
            page = tier->slot[page];
            if (page < 0 && dyn && e < cnt && tier->stage != nullptr) {  // a pick on the host: staged?
                const int staged = tier->stage[soff + e];
                if (staged >= 0) page = staged;
            }
#endif
            pos = idx * page_size;
        }
        s_page[i] = page;
        s_pos[i] = pos;
        s_bits[i] = (bits >> (qsub * GQ));
    }
    if (!dyn || early_sel) pdl_wait();  // before q, K/V (written by earlier kernels) and any write
    pdl_trigger();
    __syncthreads();

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sw = lane / LPT;  // stream within the warp
    const int d0 = (lane % LPT) * 8;
    const int qh0 = h * group + qsub * GQ;  // first query head of this CTA

    float qv[GQ][8];
#pragma unroll
    for (int g = 0; g < GQ; ++g) {
        load8_act(q + (i64)tok * q_tok_stride + (i64)(qh0 + g) * D + d0, qv[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) qv[g][i] *= qscale;  // scale * log2(e): softmax in base 2
    }
    float m[GQ], l[GQ], o[GQ][8];
#pragma unroll
    for (int g = 0; g < GQ; ++g) {
        m[g] = LS_NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) o[g][i] = 0.f;
    }

    const void* kbase = dense ? dk : sk;
    const void* vbase = dense ? dv : sv;
#if LS_QUANT != 0
    const float* ksb = dense ? dks : sks;
    const float* vsb = dense ? dvs : svs;
#endif
#if LS_QUANT == 2
    const float* kzb = dense ? dkz : skz;
    const float* vzb = dense ? dvz : svz;
#endif
    const int H = dense ? hd : hs;
    const int hh = dense ? h : h - hd;
    const int qpos = len - 1;
    const int ntok = ne * page_size;

    // One step of a stream: TPI consecutive tokens of one page. Steps are double-buffered in
    // registers: the loads of step i+1 are issued before step i is consumed, so every warp keeps
    // a tile of K/V rows in flight while it computes. The trip count is uniform per warp (the
    // shuffles need every lane); a stream past the unit's last token runs fully masked.
    struct Tile {
        KVRaw k[TPI], v[TPI];
        float ks[TPI], vs[TPI], kz[TPI], vz[TPI];
        u32 valid;  // bit t: token t is attended
        u32 bits;   // query heads (bit g) that read this page
    };
    auto load_tile = [&](Tile& T, int wbase) {
        const int base = wbase + sw * TPI;
        const bool active = base < ntok;
        const int ei = active ? base / page_size : 0;
        const int off0 = base - ei * page_size;  // page_size % TPI == 0: the TPI tokens share a page
        const int pos0 = s_pos[ei] + off0;
#if LS_TIER
        // A dense page on the host: the same row of the host pool (zero-copy over PCIe).
        const bool on_host = dense && s_page[ei] < 0;
        const void* kb = on_host ? tier->k : kbase;
        const void* vb = on_host ? tier->v : vbase;
        const i64 row0 = ((i64)(on_host ? -1 - s_page[ei] : s_page[ei]) * H + hh) * page_size + off0;
#if LS_QUANT != 0
        const float* ksp = on_host ? tier->ks : ksb;
        const float* vsp = on_host ? tier->vs : vsb;
#endif
#if LS_QUANT == 2
        const float* kzp = on_host ? tier->kz : kzb;
        const float* vzp = on_host ? tier->vz : vzb;
#endif
#else
        const i64 row0 = ((i64)s_page[ei] * H + hh) * page_size + off0;
        const void* kb = kbase;
        const void* vb = vbase;
#if LS_QUANT != 0
        const float* ksp = ksb;
        const float* vsp = vsb;
#endif
#if LS_QUANT == 2
        const float* kzp = kzb;
        const float* vzp = vzb;
#endif
#endif
        T.bits = s_bits[ei];
        T.valid = 0u;
#pragma unroll
        for (int t = 0; t < TPI; ++t) {
            const int p = pos0 + t;
            const bool ok = active && p < len && (dense || p < sink || qpos - p < local);
            T.ks[t] = T.vs[t] = 1.f;
            T.kz[t] = T.vz[t] = 0.f;
            if (ok) {
                T.valid |= 1u << t;
                T.k[t] = kv_load(kb, row0 + t, d0);
                T.v[t] = kv_load(vb, row0 + t, d0);
#if LS_QUANT != 0
                T.ks[t] = ksp[row0 + t];
                T.vs[t] = vsp[row0 + t];
#endif
#if LS_QUANT == 2
                T.kz[t] = kzp[row0 + t];
                T.vz[t] = vzp[row0 + t];
#endif
            } else {
                kv_zero(T.k[t]);
                kv_zero(T.v[t]);
            }
        }
    };
    auto consume = [&](const Tile& T) {
        float s[TPI][GQ];
#pragma unroll
        for (int t = 0; t < TPI; ++t) {
            float kf[8];
            kv_dequant(T.k[t], T.ks[t], T.kz[t], kf);
#pragma unroll
            for (int g = 0; g < GQ; ++g) {
                float acc = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc = fmaf(qv[g][i], kf[i], acc);
                s[t][g] = acc;
            }
        }
#pragma unroll
        for (int off = LPT / 2; off > 0; off >>= 1) {
#pragma unroll
            for (int t = 0; t < TPI; ++t)
#pragma unroll
                for (int g = 0; g < GQ; ++g) s[t][g] += __shfl_xor_sync(0xffffffffu, s[t][g], off);
        }
        float mnew[GQ];
#pragma unroll
        for (int g = 0; g < GQ; ++g) {
            float mx = m[g];
#pragma unroll
            for (int t = 0; t < TPI; ++t) {
                if (!((T.valid >> t) & 1u) || !((T.bits >> g) & 1u)) s[t][g] = LS_NEG_INF;
                mx = fmaxf(mx, s[t][g]);
            }
            mnew[g] = mx;
            const float alpha = mx == LS_NEG_INF ? 1.f : fast_exp2(m[g] - mx);  // m = -inf -> 0
            l[g] *= alpha;
#pragma unroll
            for (int i = 0; i < 8; ++i) o[g][i] *= alpha;
            m[g] = mx;
        }
#pragma unroll
        for (int t = 0; t < TPI; ++t) {
            float vf[8];
            kv_dequant(T.v[t], T.vs[t], T.vz[t], vf);
#pragma unroll
            for (int g = 0; g < GQ; ++g) {
                const float p = mnew[g] == LS_NEG_INF ? 0.f : fast_exp2(s[t][g] - mnew[g]);  // masked -> 0
                l[g] += p;
#pragma unroll
                for (int i = 0; i < 8; ++i) o[g][i] = fmaf(p, vf[i], o[g][i]);
            }
        }
    };

    constexpr int STEP = NSTREAMS * TPI;
    Tile ta, tb;
    int wbase = warp * SPW * TPI;
    if (wbase < ntok) load_tile(ta, wbase);
    while (wbase < ntok) {  // unrolled by two so the buffers swap roles without copies
        if (wbase + STEP < ntok) load_tile(tb, wbase + STEP);
        consume(ta);
        wbase += STEP;
        if (wbase >= ntok) break;
        if (wbase + STEP < ntok) load_tile(ta, wbase + STEP);
        consume(tb);
        wbase += STEP;
    }

    // Merge the SPW streams of each warp (lanes that differ only in the stream bits).
#pragma unroll
    for (int off = LPT; off < 32; off <<= 1) {
#pragma unroll
        for (int g = 0; g < GQ; ++g) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m[g], off);
            const float l2 = __shfl_xor_sync(0xffffffffu, l[g], off);
            const float mn = fmaxf(m[g], m2);
            const float a1 = m[g] == LS_NEG_INF ? 0.f : fast_exp2(m[g] - mn);
            const float a2 = m2 == LS_NEG_INF ? 0.f : fast_exp2(m2 - mn);
            l[g] = l[g] * a1 + l2 * a2;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float o2 = __shfl_xor_sync(0xffffffffu, o[g][i], off);
                o[g][i] = o[g][i] * a1 + o2 * a2;
            }
            m[g] = mn;
        }
    }
    if (sw == 0) {
#pragma unroll
        for (int g = 0; g < GQ; ++g) {
            if (lane == 0) { s_m[warp][g] = m[g]; s_l[warp][g] = l[g]; }
#pragma unroll
            for (int i = 0; i < 8; ++i) s_o[warp][g][d0 + i] = o[g][i];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < GQ * D; i += NTHREADS) {
        const int g = i / D, d = i - g * D;
        float M = LS_NEG_INF;
#pragma unroll
        for (int wi = 0; wi < NWARPS; ++wi) M = fmaxf(M, s_m[wi][g]);
        float L = 0.f, O = 0.f;
        if (M != LS_NEG_INF) {
#pragma unroll
            for (int wi = 0; wi < NWARPS; ++wi) {
                const float mw = s_m[wi][g];
                const float a = mw == LS_NEG_INF ? 0.f : fast_exp2(mw - M);
                L += s_l[wi][g] * a;
                O += s_o[wi][g][d] * a;
            }
        }
        if (direct) {
            out[(i64)tok * out_tok_stride + (i64)(qh0 + g) * D + d] = f2act(O / L);
        } else {
            part_o[((i64)u * GQ + g) * D + d] = L > 0.f ? O / L : 0.f;
            if (d == 0) part_lse[(i64)u * GQ + g] = L > 0.f ? M + __log2f(L) : LS_NEG_INF;
        }
    }
}
