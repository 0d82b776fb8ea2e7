// Split-K merge folded into the decode kernels' tail (replaces the ls_decode_merge launch).
//
// Every unit of a work item writes its normalized partial and log2-sum-exp as before, then
// counts itself in merge_cnt[w]; the last one to arrive combines all splits of the work item
// and writes the output rows. The combine is parallel over splits (weights 2^(lse_s - M) / L
// from one pass over the lse values) and over 16-byte chunks of the outputs, so its loads are
// independent (an earlier serial fold waited one L2 round trip per split, see kernels_notes).
// The last unit resets its counter, so the next launch (a CUDA-graph replay) starts at zero.
#pragma once
#include "common.cuh"

// True in every thread of the CTA that completes work item w (after all nsplit units wrote
// their partials). Call from every thread, after this unit's partial stores.
__device__ __forceinline__ bool ls_last_unit(int* merge_cnt, int w, int nsplit, int* s_flag) {
    __threadfence();  // this unit's partials are visible device-wide before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        const int seen = atomicAdd(merge_cnt + w, 1);
        *s_flag = seen == nsplit - 1;
        if (*s_flag) merge_cnt[w] = 0;  // every unit of w has counted: ready for the next launch
    }
    __syncthreads();
    const bool last = *s_flag != 0;
    if (last) __threadfence();  // order the partial loads below after the count
    return last;
}

// out_rows[g * D + d] (the GQ query-head rows of the work item) = sum_s w_sg part_o[u0 + s][g][d]
// with w_sg = 2^(lse_sg - M_g) / L_g. s_wt: shared scratch of ns * GQ floats. Every thread calls.
template <int D_, int GQ_, int NT>
__device__ __forceinline__ void ls_merge_splits(const float* part_o, const float* part_lse, int u0, int ns,
                                                float* s_wt, act_t* out_rows) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int i = tid; i < ns * GQ_; i += NT) s_wt[i] = __ldcg(part_lse + (i64)u0 * GQ_ + i);
    __syncthreads();
    // Warp w owns heads w, w + NT/32, ...: max, sum, then the weights in place.
    for (int g = warp; g < GQ_; g += NT / 32) {
        float m = LS_NEG_INF;
        for (int s = lane; s < ns; s += 32) m = fmaxf(m, s_wt[s * GQ_ + g]);
        m = warp_max(m);
        float l = 0.f;
        if (m != LS_NEG_INF)
            for (int s = lane; s < ns; s += 32) l += exp2f(s_wt[s * GQ_ + g] - m);  // 2^-inf = 0
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        __syncwarp();
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int s = lane; s < ns; s += 32) {
            const float x = s_wt[s * GQ_ + g];
            s_wt[s * GQ_ + g] = x == LS_NEG_INF ? 0.f : exp2f(x - m) * inv;
        }
    }
    __syncthreads();
    // Thread t owns 4 consecutive output floats per chunk: one 16-byte load per split.
    constexpr int NCH = GQ_ * D_ / 4;
    for (int c = tid; c < NCH; c += NT) {
        const int g = (c * 4) / D_;
        const float4* src = reinterpret_cast<const float4*>(part_o + (i64)u0 * GQ_ * D_) + c;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll 8
        for (int s = 0; s < ns; ++s) {
            const float4 x = __ldcg(src + (i64)s * NCH);
            const float wgt = s_wt[s * GQ_ + g];
            a0 = fmaf(wgt, x.x, a0); a1 = fmaf(wgt, x.y, a1);
            a2 = fmaf(wgt, x.z, a2); a3 = fmaf(wgt, x.w, a3);
        }
        act_t* dst = out_rows + c * 4;
        dst[0] = f2act(a0); dst[1] = f2act(a1); dst[2] = f2act(a2); dst[3] = f2act(a3);
    }
}
