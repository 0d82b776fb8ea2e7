// Antidiagonal block-mass estimate of a prefill chunk (the part after the score GEMM), one launch
// per group of query rows: lserve.sparsity.prefill_blocks' "antidiagonal" estimator without its
// per-row loop of elementwise torch ops (mask, softmax, block sums, average over query groups).
//
// Input: s [Hq, ng, nkg] (act_t), the raw strided antidiagonal sums q_group . k_group of the
// query groups of rows r0 .. r0 + gridDim.x - 1 (ng = rows x gpr groups, gpr = q_block / S) against
// the first nkg key groups. Query group a has absolute index qg0 + a and sees key groups
// 0 .. min(qg0 + a, nkg_valid - 1) (causal; nkg_valid = ceil(L / S) key groups hold keys).
// Per (query head, row) CTA: for each of the row's query groups that holds a query of the chunk
// (start <= its last position, its first < L), a softmax of s * c over its visible key groups
// (c = scale / S * log2 e, base 2), summed per key block of kpb key groups into shared memory;
// then out[hq, r, kb] = sum / (valid groups) for the row's causal blocks kb < nb_r.
// gridDim.z > 1 splits a row's query groups over that many CTAs (group a goes to CTA a % gridDim.z),
// each adding its share into out (zeroed by the caller) atomically: more CTAs when a launch covers
// few rows.
#include "common.cuh"

#define EST_THREADS 512

__device__ __forceinline__ float block_reduce(float x, float* red, bool is_max) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    x = is_max ? warp_max(x) : warp_sum(x);
    if (lane == 0) red[warp] = x;
    __syncthreads();
    if (warp == 0) {
        float y = lane < EST_THREADS / 32 ? red[lane] : (is_max ? LS_NEG_INF : 0.f);
        y = is_max ? warp_max(y) : warp_sum(y);
        if (lane == 0) red[32] = y;
    }
    __syncthreads();
    const float r = red[32];
    __syncthreads();  // red is reused by the next call
    return r;
}

// Whether query group qg (positions qg * S ..) holds a query of the chunk [start, L).
__device__ __forceinline__ bool holds_query(int qg, int S, int start, int L) {
    return qg * S + S > start && qg * S < L;
}

// One (row, query head, split) CTA of the estimate. PASSES 3: max; sum; block sums normalized.
// PASSES 2: max; each thread sums its own blocks' exponentials (the blocks it owns in the third
// pass) into part[] and their total into l, and once l is reduced adds part[kb] / l to acc[kb]:
// one read of the scores and one exp2 a score fewer. part[] is per-thread in effect (no thread
// reads another's entries), so only the reduction synchronizes; it takes nkb more floats.
template <int PASSES>
__device__ __forceinline__ void antidiag_mass(const act_t* __restrict__ s, int ng, int nkg, int qg0, int gpr,
                                              int kpb, int nkg_valid, int S, int start, int L, int q_block,
                                              int block, float c, float* __restrict__ out, int R, int nkb, int r0,
                                              float* acc, float* red) {
    float* part = acc + nkb;  // PASSES 2 only
    const int rl = blockIdx.x, hq = blockIdx.y, r = r0 + rl;
    const int rs = (qg0 / gpr + rl) * q_block;  // first position of the row (rows align to q_block)
    const int re = min(L, rs + q_block);
    const int nb = (re - 1) / block + 1;  // causal blocks of the row
    for (int i = threadIdx.x; i < nb; i += EST_THREADS) acc[i] = 0.f;
    __syncthreads();
    const int a1 = min(ng, (rl + 1) * gpr);
    int n_valid = 0;  // the row's groups holding a query of the chunk, over every split
    for (int a = rl * gpr; a < a1; ++a) n_valid += holds_query(qg0 + a, S, start, L);
    for (int a = rl * gpr + blockIdx.z; a < a1; a += gridDim.z) {
        const int qg = qg0 + a;
        if (!holds_query(qg, S, start, L)) continue;  // no query of the chunk in this group (uniform)
        const act_t* row = s + ((long long)hq * ng + a) * nkg;
        const int kmax = min(qg, nkg_valid - 1);  // last visible key group
        float m = LS_NEG_INF;
        for (int j = threadIdx.x; j <= kmax; j += EST_THREADS) m = fmaxf(m, act2f(row[j]));
        m = block_reduce(m, red, true);
        float l = 0.f, inv = 0.f;
        if (PASSES == 3) {
            for (int j = threadIdx.x; j <= kmax; j += EST_THREADS) l += exp2f((act2f(row[j]) - m) * c);
            inv = 1.f / block_reduce(l, red, false);
        }
        // Thread t owns blocks t, t + T, ...: kpb adjacent key groups each, no two threads share one.
        for (int kb = threadIdx.x; kb * kpb <= kmax; kb += EST_THREADS) {
            float p = 0.f;
            const int j1 = min(kmax, kb * kpb + kpb - 1);
            for (int j = kb * kpb; j <= j1; ++j) p += exp2f((act2f(row[j]) - m) * c);
            if (PASSES == 3) {
                acc[kb] += p * inv;
            } else {
                part[kb] = p;
                l += p;
            }
        }
        if (PASSES == 2) {
            inv = 1.f / block_reduce(l, red, false);
            for (int kb = threadIdx.x; kb * kpb <= kmax; kb += EST_THREADS) acc[kb] += part[kb] * inv;
        }
    }
    __syncthreads();
    const float w = n_valid ? 1.f / n_valid : 0.f;
    float* o = out + ((long long)hq * R + r) * nkb;
    for (int i = threadIdx.x; i < nb; i += EST_THREADS) {
        if (gridDim.z == 1) o[i] = acc[i] * w;
        else atomicAdd(o + i, acc[i] * w);
    }
}

#define EST_ARGS const act_t* __restrict__ s, int ng, int nkg, int qg0, int gpr, int kpb, int nkg_valid, int S, \
    int start, int L, int q_block, int block, float c, float* __restrict__ out, int R, int nkb, int r0
#define EST_PASS s, ng, nkg, qg0, gpr, kpb, nkg_valid, S, start, L, q_block, block, c, out, R, nkb, r0

// Dynamic shared memory: nkb floats (three passes), 2 * nkb (two).
extern "C" __global__ void __launch_bounds__(EST_THREADS) ls_antidiag_mass(EST_ARGS) {
    extern __shared__ float acc[];
    __shared__ float red[33];
    antidiag_mass<3>(EST_PASS, acc, red);
}

extern "C" __global__ void __launch_bounds__(EST_THREADS) ls_antidiag_mass2(EST_ARGS) {
    extern __shared__ float acc[];
    __shared__ float red[33];
    antidiag_mass<2>(EST_PASS, acc, red);
}
