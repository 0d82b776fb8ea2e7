// Cache writes: append new K/V rows into the dense pool and the streaming ring pool (quantizing
// to INT8/INT4 when configured) and fold the keys into the dense heads' key statistics.
//
// One warp per (token, head). Semantics match PagedPool.write + KeyStats.update:
//   INT8:  scale = max(|x|max, 1e-8) * (1/127), q = clamp(rint(x / scale), -127, 127)
//   INT4:  lo = min x, scale = max(max x - lo, 1e-8) * (1/15), q = clamp(rint((x - lo) / scale), 0, 15)
//   stats: a logical slot (page * g + offset / N_L) is reset when this write holds its first
//          token (offset % N_L == 0), otherwise new keys are max/min-folded into it.
// The arithmetic is torch's, operation for operation, so the codes are equal bit for bit:
// torch divides by a Python scalar as a multiplication by its float reciprocal, and divides
// tensor by tensor exactly (__fdiv_rn). With 8-bit-mantissa inputs, quotients land exactly on
// .5 often enough that a one-ulp difference in the scale flips codes.
#include "common.cuh"
#include "tier.cuh"

#define D LS_HEAD_DIM
#define EPL (D / 32)  // elements per lane
#if EPL < 2 || (EPL & (EPL - 1))
#error "kv_write needs head_dim in {64, 128, 256}"
#endif

__device__ __forceinline__ void load_lane(const act_t* p, float (&f)[EPL]) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) f[i] = act2f(p[i]);
}

__device__ __forceinline__ void store_lane(act_t* p, const float (&f)[EPL]) {
#pragma unroll
    for (int i = 0; i < EPL; ++i) p[i] = f2act(f[i]);
}

// Store one row (this lane's EPL elements) into a pool, quantizing as configured.
__device__ __forceinline__ void store_pool_row(void* data, float* scale, float* zero, i64 row, int lane,
                                               const float (&x)[EPL]) {
#if LS_QUANT == 0
    store_lane(reinterpret_cast<act_t*>(data) + row * D + lane * EPL, x);
#elif LS_QUANT == 1
    float am = 0.f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) am = fmaxf(am, fabsf(x[i]));
    am = warp_max(am);
    const float s = __fmul_rn(fmaxf(am, 1e-8f), 1.0f / 127.0f);
    signed char* out = reinterpret_cast<signed char*>(data) + row * D + lane * EPL;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const float qv = fminf(fmaxf(rintf(__fdiv_rn(x[i], s)), -127.0f), 127.0f);
        out[i] = (signed char)(int)qv;
    }
    if (lane == 0) scale[row] = s;
#else
    float lo = x[0], hi = x[0];
#pragma unroll
    for (int i = 1; i < EPL; ++i) { lo = fminf(lo, x[i]); hi = fmaxf(hi, x[i]); }
    lo = warp_min(lo);
    hi = warp_max(hi);
    const float s = __fmul_rn(fmaxf(__fsub_rn(hi, lo), 1e-8f), 1.0f / 15.0f);
    unsigned char* out = reinterpret_cast<unsigned char*>(data) + row * (D / 2) + lane * (EPL / 2);
#pragma unroll
    for (int i = 0; i < EPL / 2; ++i) {
        const float a = fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(x[2 * i], lo), s)), 0.0f), 15.0f);
        const float b = fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(x[2 * i + 1], lo), s)), 0.0f), 15.0f);
        out[i] = (unsigned char)((u32)a | ((u32)b << 4));
    }
    if (lane == 0) { scale[row] = s; zero[row] = lo; }
#endif
}

extern "C" __global__ void __launch_bounds__(128)
ls_kv_write(const act_t* __restrict__ k, i64 k_tok_stride,      // [T, H_kv, D] rows of new keys
            const act_t* __restrict__ v, i64 v_tok_stride,      // [T, H_kv, D] rows of new values
            // dense pool: W_d tokens x hd heads (KV heads [0, hd))
            const i64* __restrict__ d_tok, const i64* __restrict__ d_page, const i64* __restrict__ d_off,
            int nwd, int hd,
            void* dk, void* dv, float* dks, float* dvs, float* dkz, float* dvz,
            act_t* kmax, act_t* kmin, int g, int logical,     // stats [P, g, hd, D]
            // ring pool: W_s tokens x hs heads (KV heads [hd, hd + hs))
            const i64* __restrict__ s_tok, const i64* __restrict__ s_page, const i64* __restrict__ s_off,
            int nws, int hs,
            void* sk, void* sv, float* sks, float* svs, float* skz, float* svz,
            int page_size,
            const TierLayer* __restrict__ tier) {  // LS_TIER: dense page -> resident slot (ignored otherwise)
    pdl_wait();  // the write tables may come from device ops: nothing is read before the wait
    pdl_trigger();
    const int lane = threadIdx.x & 31;
    const i64 item = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const i64 n_dense = (i64)nwd * hd;
    if (item >= n_dense + (i64)nws * hs) return;
    const bool dense = item < n_dense;
    int t, h, H;
    i64 tok, page, off;
    if (dense) {
        t = (int)(item / hd); h = (int)(item % hd); H = hd;
        tok = d_tok[t]; page = d_page[t]; off = d_off[t];
    } else {
        const i64 j = item - n_dense;
        t = (int)(j / hs); h = (int)(j % hs); H = hs;
        tok = s_tok[t]; page = s_page[t]; off = s_off[t];
    }
    const int kvh = dense ? h : hd + h;
    float kx[EPL], vx[EPL];
    load_lane(k + tok * k_tok_stride + (i64)kvh * D + lane * EPL, kx);
    load_lane(v + tok * v_tok_stride + (i64)kvh * D + lane * EPL, vx);
#if LS_TIER
    // A written page is pinned resident for the step; statistics stay indexed by the virtual page.
    const i64 prow = dense ? (i64)tier->slot[page] : page;
#else
    const i64 prow = page;
#endif
    const i64 row = (prow * H + h) * page_size + off;
    if (dense) {
        store_pool_row(dk, dks, dkz, row, lane, kx);
        store_pool_row(dv, dvs, dvz, row, lane, vx);
    } else {
        store_pool_row(sk, sks, skz, row, lane, kx);
        store_pool_row(sv, svs, svz, row, lane, vx);
        return;
    }
    // Key statistics: the first token of each run of tokens sharing a logical slot folds the run.
    const i64 slot = page * g + off / logical;
    if (t > 0 && d_page[t - 1] * g + d_off[t - 1] / logical == slot) return;
    float mx[EPL], mn[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) { mx[i] = kx[i]; mn[i] = kx[i]; }
    bool reset = (off % logical) == 0;
    for (int j = t + 1; j < nwd; ++j) {
        const i64 pj = d_page[j], oj = d_off[j];
        if (pj * g + oj / logical != slot) break;
        reset = reset || (oj % logical) == 0;
        float x[EPL];
        load_lane(k + d_tok[j] * k_tok_stride + (i64)h * D + lane * EPL, x);
#pragma unroll
        for (int i = 0; i < EPL; ++i) { mx[i] = fmaxf(mx[i], x[i]); mn[i] = fminf(mn[i], x[i]); }
    }
    act_t* pmx = kmax + (slot * hd + h) * D + lane * EPL;
    act_t* pmn = kmin + (slot * hd + h) * D + lane * EPL;
    if (!reset) {
        float ox[EPL], on[EPL];
        load_lane(pmx, ox);
        load_lane(pmn, on);
#pragma unroll
        for (int i = 0; i < EPL; ++i) { mx[i] = fmaxf(mx[i], ox[i]); mn[i] = fminf(mn[i], on[i]); }
    }
    store_lane(pmx, mx);
    store_lane(pmn, mn);
}
