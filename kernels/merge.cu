// Split-K merge of the decode kernels' partial results (see decode.cu / decode_tc.cu).
#include "common.cuh"
#include "decode_meta.cuh"

#define D LS_HEAD_DIM
#define GQ LS_GQ

// Combine the splits of each work item: out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M).
// One CTA per (work item, query head); warp w folds splits w, w + 8, ... in batches of
// MERGE_BATCH whose loads are all issued before any is used (one L2 round trip per batch:
// up to 64 splits in one), rescaling once per batch, then the 8 warps combine.
#define MERGE_WARPS 8
#define MERGE_BATCH 8
#define DPL (D / 32)  // dims per lane

extern "C" __global__ void __launch_bounds__(MERGE_WARPS * 32)
ls_decode_merge(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                const int* __restrict__ work_start,  // [W + 1] first unit of each work item
                act_t* __restrict__ out, i64 out_tok_stride,
                const int* __restrict__ meta, int nb, int hkv, int group, int nqs) {
    __shared__ float s_m[MERGE_WARPS], s_l[MERGE_WARPS];
    __shared__ float s_o[MERGE_WARPS][D];
    pdl_wait();  // the partials come from the decode kernel just before
    pdl_trigger();
    const int w = blockIdx.x, g = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int qsub = w % nqs;
    const int h = (w / nqs) % hkv;
    const int b = w / (nqs * hkv);
    const int tok = meta[META_TOK * nb + b];
    const int u0 = work_start[w], u1 = work_start[w + 1];
    float m = LS_NEG_INF, l = 0.f, acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] = 0.f;
    for (int ub = u0 + warp; ub < u1; ub += MERGE_WARPS * MERGE_BATCH) {
        float lse[MERGE_BATCH], x[MERGE_BATCH][DPL];
#pragma unroll
        for (int k = 0; k < MERGE_BATCH; ++k) {
            const int u = ub + k * MERGE_WARPS;
            const bool ok = u < u1;
            lse[k] = ok ? part_lse[(i64)u * GQ + g] : LS_NEG_INF;
#pragma unroll
            for (int i = 0; i < DPL; ++i) x[k][i] = ok ? part_o[((i64)u * GQ + g) * D + lane + 32 * i] : 0.f;
        }
        float mb = LS_NEG_INF;
#pragma unroll
        for (int k = 0; k < MERGE_BATCH; ++k) mb = fmaxf(mb, lse[k]);
        if (mb == LS_NEG_INF) continue;  // nothing attended in this batch
        const float mn = fmaxf(m, mb);
        const float a = exp2f(m - mn);  // m = -inf -> a = 0
        l *= a;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] *= a;
#pragma unroll
        for (int k = 0; k < MERGE_BATCH; ++k) {
            const float c = exp2f(lse[k] - mn);  // lse = -inf -> 0
            l += c;
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[i] += c * x[k][i];
        }
        m = mn;
    }
    if (lane == 0) { s_m[warp] = m; s_l[warp] = l; }
#pragma unroll
    for (int i = 0; i < DPL; ++i) s_o[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    float M = LS_NEG_INF;
#pragma unroll
    for (int wi = 0; wi < MERGE_WARPS; ++wi) M = fmaxf(M, s_m[wi]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float L = 0.f, O = 0.f;
#pragma unroll
        for (int wi = 0; wi < MERGE_WARPS; ++wi) {
            const float mw = s_m[wi];
            const float a = mw == LS_NEG_INF ? 0.f : exp2f(mw - M);
            L += s_l[wi] * a;
            O += s_o[wi][d] * a;
        }
        out[(i64)tok * out_tok_stride + (i64)(h * group + qsub * GQ + g) * D + d] = f2act(O / L);
    }
}
