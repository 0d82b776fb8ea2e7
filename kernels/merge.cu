// Split-K merge of the decode kernels' partial results (see decode.cu / decode_tc.cu).
#include "common.cuh"
#include "decode_meta.cuh"

#define D LS_HEAD_DIM
#define GQ LS_GQ

// Combine the splits of each work item: out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M).
// One CTA per (work item, query head); warp w folds splits w, w+8, ... with an online rescale
// (its loads are independent, so a warp keeps several in flight), then the 8 warps combine.
#define MERGE_WARPS 8
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
#pragma unroll 4
    for (int u = u0 + warp; u < u1; u += MERGE_WARPS) {
        const float lse = part_lse[(i64)u * GQ + g];
        float x[DPL];
#pragma unroll
        for (int i = 0; i < DPL; ++i) x[i] = part_o[((i64)u * GQ + g) * D + lane + 32 * i];
        if (lse == LS_NEG_INF) continue;
        const float mn = fmaxf(m, lse);
        const float a = exp2f(m - mn), c = exp2f(lse - mn);  // m = -inf -> a = 0
        l = l * a + c;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] = acc[i] * a + c * x[i];
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
