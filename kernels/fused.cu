// Fused elementwise steps of the Llama layer (decode is launch-bound without them: ~40 small
// torch kernels per layer become 3). Each rounds exactly where the torch code it replaces
// rounds (lserve/models/llama.py, rope.py), so results match it up to float32 summation order
// in the RMS statistic:
//   ls_add_rmsnorm  h += delta (rounded to the activation type); out = w * round(h * rsqrt(mean(h^2) + eps))
//   ls_rope         q and k heads rotated in place (rotate-half form, float32, no FMA contraction)
//   ls_silu_mul     out = round(round(silu(gate)) * up) from the fused [gate | up] projection
#include "common.cuh"

#define NORM_THREADS 512

__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = 0.f;
    if (warp == 0) {
        t = lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (lane == 0) scratch[0] = t;
    }
    __syncthreads();
    return scratch[0];
}

// One CTA per row. h, delta, out: [T, H] rows of ``row_stride`` elements; w: [H].
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
ls_add_rmsnorm(act_t* __restrict__ h, const act_t* __restrict__ delta, act_t* __restrict__ out,
               const act_t* __restrict__ w, int H, i64 row_stride, float eps, int has_delta) {
    __shared__ float scratch[32];
    const i64 base = (i64)blockIdx.x * row_stride;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float x = act2f(h[base + i]);
        if (has_delta) {
            x = act2f(f2act(__fadd_rn(x, act2f(delta[base + i]))));
            h[base + i] = f2act(x);
        }
        ss = __fadd_rn(ss, __fmul_rn(x, x));
    }
    const float r = rsqrtf(__fadd_rn(__fdiv_rn(block_sum(ss, scratch), (float)H), eps));
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float n = act2f(f2act(__fmul_rn(act2f(h[base + i]), r)));
        out[base + i] = f2act(__fmul_rn(act2f(w[i]), n));
    }
}

// grid (T, heads); thread i < D/2 rotates the pair (i, i + D/2) of head ``blockIdx.y`` of row t.
// qkv: [T, ...] with row stride ``row_stride``; heads [0, n_heads) start at column 0 (q then k).
extern "C" __global__ void
ls_rope(act_t* __restrict__ qkv, i64 row_stride, const long long* __restrict__ pos,
        const float* __restrict__ cos_t, const float* __restrict__ sin_t, int half) {
    const int t = blockIdx.x, hd = blockIdx.y;
    const long long p = pos[t];
    act_t* x = qkv + (i64)t * row_stride + (i64)hd * 2 * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float c = cos_t[p * half + i], s = sin_t[p * half + i];
        const float x1 = act2f(x[i]), x2 = act2f(x[i + half]);
        x[i] = f2act(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
        x[i + half] = f2act(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
}

// gu: [T, 2I] = [gate | up]; out: [T, I]. One thread per output element.
extern "C" __global__ void
ls_silu_mul(const act_t* __restrict__ gu, act_t* __restrict__ out, int I, i64 total) {
    const i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= total) return;
    const i64 t = e / I;
    const int i = (int)(e - t * I);
    const float g = act2f(gu[t * 2 * I + i]);
    const float u = act2f(gu[t * 2 * I + I + i]);
    const float s = act2f(f2act(__fdiv_rn(g, __fadd_rn(1.f, expf(-g)))));
    out[e] = f2act(__fmul_rn(s, u));
}
