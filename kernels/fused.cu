// Fused elementwise steps of the Llama layer (decode is launch-bound without them: ~40 small
// torch kernels per layer become 3). Each rounds exactly where the torch code it replaces
// rounds (lserve/models/llama.py, rope.py), so results match it up to float32 summation order
// in the RMS statistic:
//   ls_add_rmsnorm  h += delta (rounded to the activation type); out = w * round(h * rsqrt(mean(h^2) + eps))
//                   (ls_add_rmsnorm_v8: the same with 16-byte accesses, for aligned rows)
//   ls_rope         q and k heads rotated in place (rotate-half form, float32, no FMA contraction) by
//                   the step's cos/sin rows (rope.py computes them once a forward, for every layer)
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

// ls_add_rmsnorm with 16-byte accesses and the row kept in registers (one load of h, delta
// and w per element; the scalar kernel's strided loops were a chain of dependent global loads,
// ~8 us per call at H = 4096). Needs H % 8 == 0, H <= 8 * NV8 * NORM_THREADS and 16-byte
// aligned rows; the same arithmetic per element as ls_add_rmsnorm.
#define NV8 2
#if LS_DTYPE == 2
struct V8 { float4 a, b; };
#else
struct V8 { uint4 a; };
#endif

__device__ __forceinline__ V8 v8_load(const act_t* p) {
    V8 v;
#if LS_DTYPE == 2
    v.a = *reinterpret_cast<const float4*>(p);
    v.b = *reinterpret_cast<const float4*>(p + 4);
#else
    v.a = *reinterpret_cast<const uint4*>(p);
#endif
    return v;
}

__device__ __forceinline__ void v8_store(act_t* p, const V8& v) {
#if LS_DTYPE == 2
    *reinterpret_cast<float4*>(p) = v.a;
    *reinterpret_cast<float4*>(p + 4) = v.b;
#else
    *reinterpret_cast<uint4*>(p) = v.a;
#endif
}

__device__ __forceinline__ void v8_get(const V8& v, float (&f)[8]) {
#if LS_DTYPE == 2
    f[0] = v.a.x; f[1] = v.a.y; f[2] = v.a.z; f[3] = v.a.w;
    f[4] = v.b.x; f[5] = v.b.y; f[6] = v.b.z; f[7] = v.b.w;
#else
    unpack2(v.a.x, f[0], f[1]); unpack2(v.a.y, f[2], f[3]);
    unpack2(v.a.z, f[4], f[5]); unpack2(v.a.w, f[6], f[7]);
#endif
}

__device__ __forceinline__ V8 v8_put(const float (&f)[8]) {
    V8 v;
#if LS_DTYPE == 2
    v.a = make_float4(f[0], f[1], f[2], f[3]);
    v.b = make_float4(f[4], f[5], f[6], f[7]);
#else
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = (u32)f2act(f[2 * i]) | ((u32)f2act(f[2 * i + 1]) << 16);
    v.a = make_uint4(w[0], w[1], w[2], w[3]);
#endif
    return v;
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
ls_add_rmsnorm_v8(act_t* __restrict__ h, const act_t* __restrict__ delta, act_t* __restrict__ out,
                  const act_t* __restrict__ w, int H, i64 row_stride, float eps, int has_delta) {
    __shared__ float scratch[32];
    const i64 base = (i64)blockIdx.x * row_stride;
    const int nchunk = H / 8;
    float x[NV8][8];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NV8; ++k) {
        const int c = threadIdx.x + k * NORM_THREADS;
        if (c >= nchunk) break;
        v8_get(v8_load(h + base + 8 * c), x[k]);
        if (has_delta) {
            float d[8];
            v8_get(v8_load(delta + base + 8 * c), d);
#pragma unroll
            for (int i = 0; i < 8; ++i) x[k][i] = act2f(f2act(__fadd_rn(x[k][i], d[i])));
            v8_store(h + base + 8 * c, v8_put(x[k]));
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) ss = __fadd_rn(ss, __fmul_rn(x[k][i], x[k][i]));
    }
    const float r = rsqrtf(__fadd_rn(__fdiv_rn(block_sum(ss, scratch), (float)H), eps));
#pragma unroll
    for (int k = 0; k < NV8; ++k) {
        const int c = threadIdx.x + k * NORM_THREADS;
        if (c >= nchunk) break;
        float wf[8], o[8];
        v8_get(v8_load(w + 8 * c), wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = __fmul_rn(wf[i], act2f(f2act(__fmul_rn(x[k][i], r))));
        v8_store(out + base + 8 * c, v8_put(o));
    }
}

// grid (T, heads); thread i < D/2 rotates the pair (i, i + D/2) of head ``blockIdx.y`` of row t.
// qkv: [T, ...] with row stride ``row_stride``; heads [0, n_heads) start at column 0 (q then k);
// cos_t, sin_t: [T, D/2], row t's.
extern "C" __global__ void
ls_rope(act_t* __restrict__ qkv, i64 row_stride, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
        int half) {
    const int t = blockIdx.x, hd = blockIdx.y;
    act_t* x = qkv + (i64)t * row_stride + (i64)hd * 2 * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float c = cos_t[(i64)t * half + i], s = sin_t[(i64)t * half + i];
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

// ls_silu_mul / ls_rope with 16-byte accesses (the scalar kernels moved 0.8-1.3 TB/s at prefill).
// Same arithmetic per element. silu_mul_v8: one thread per 8 outputs; needs I % 8 == 0 and
// 16-byte aligned rows.
extern "C" __global__ void
ls_silu_mul_v8(const act_t* __restrict__ gu, act_t* __restrict__ out, int I, i64 total8) {
    const i64 e8 = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e8 >= total8) return;
    const int per_row = I / 8;
    const i64 t = e8 / per_row;
    const int i = (int)(e8 - t * per_row) * 8;
    float g[8], u[8], o[8];
    v8_get(v8_load(gu + t * 2 * I + i), g);
    v8_get(v8_load(gu + t * 2 * I + I + i), u);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float sg = act2f(f2act(__fdiv_rn(g[j], __fadd_rn(1.f, expf(-g[j])))));
        o[j] = __fmul_rn(sg, u[j]);
    }
    v8_store(out + t * I + i, v8_put(o));
}

// One CTA per token row, thread = (head, 8-pair chunk): heads [0, n_heads) rotated in place.
// Needs half % 8 == 0 and 16-byte aligned rows.
extern "C" __global__ void
ls_rope_v8(act_t* __restrict__ qkv, i64 row_stride, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
           int half, int n_heads) {
    const int t = blockIdx.x;
    const int cpr = half / 8;  // chunks per head
    for (int w = threadIdx.x; w < n_heads * cpr; w += blockDim.x) {
        const int hd = w / cpr, i = (w - hd * cpr) * 8;
        act_t* x = qkv + (i64)t * row_stride + (i64)hd * 2 * half;
        float x1[8], x2[8], c[8], sn[8], o1[8], o2[8];
        v8_get(v8_load(x + i), x1);
        v8_get(v8_load(x + i + half), x2);
        const float4* cp = reinterpret_cast<const float4*>(cos_t + (i64)t * half + i);
        const float4* sp = reinterpret_cast<const float4*>(sin_t + (i64)t * half + i);
        const float4 c0 = cp[0], c1 = cp[1], s0 = sp[0], s1 = sp[1];
        c[0] = c0.x; c[1] = c0.y; c[2] = c0.z; c[3] = c0.w; c[4] = c1.x; c[5] = c1.y; c[6] = c1.z; c[7] = c1.w;
        sn[0] = s0.x; sn[1] = s0.y; sn[2] = s0.z; sn[3] = s0.w; sn[4] = s1.x; sn[5] = s1.y; sn[6] = s1.z; sn[7] = s1.w;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            o1[j] = __fsub_rn(__fmul_rn(x1[j], c[j]), __fmul_rn(x2[j], sn[j]));
            o2[j] = __fadd_rn(__fmul_rn(x2[j], c[j]), __fmul_rn(x1[j], sn[j]));
        }
        v8_store(x + i, v8_put(o1));
        v8_store(x + i + half, v8_put(o2));
    }
}


// Greedy token of each row of float32 logits [rows, n]: the index of the largest value, the
// lowest such index on ties, NaN above everything (torch.argmax's answer). One CTA per row;
// values and indices travel packed as (order key << 32 | ~index), so one max is the answer.
#define ARGMAX_THREADS 1024
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
ls_argmax(const float* __restrict__ x, i64 row_stride, int n, long long* __restrict__ out) {
    __shared__ u64 s_best[ARGMAX_THREADS / 32];
    const float* r = x + (i64)blockIdx.x * row_stride;
    u64 best = 0ull;
    auto take = [&](float v, int i) {
        const u32 u = v != v ? 0xffffffffu : order_key(v);
        const u64 p = ((u64)u << 32) | (u64)(~(u32)i);
        best = p > best ? p : best;
    };
    int i0 = 0;
    if ((reinterpret_cast<size_t>(r) & 15) == 0) {  // 16-byte loads over the aligned body
        const float4* r4 = reinterpret_cast<const float4*>(r);
        const int n4 = n / 4;
#pragma unroll 4
        for (int i = threadIdx.x; i < n4; i += ARGMAX_THREADS) {
            const float4 v = __ldg(r4 + i);
            take(v.x, 4 * i); take(v.y, 4 * i + 1); take(v.z, 4 * i + 2); take(v.w, 4 * i + 3);
        }
        i0 = n4 * 4;
    }
    for (int i = i0 + threadIdx.x; i < n; i += ARGMAX_THREADS) take(r[i], i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 y = __shfl_xor_sync(0xffffffffu, best, o);
        best = y > best ? y : best;
    }
    if ((threadIdx.x & 31) == 0) s_best[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x < 32) {
        best = s_best[threadIdx.x];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const u64 y = __shfl_xor_sync(0xffffffffu, best, o);
            best = y > best ? y : best;
        }
        if (threadIdx.x == 0) out[blockIdx.x] = (long long)(~(u32)(best & 0xffffffffull));
    }
}

// Decode-sized matrix-vector products: y[t, n] = sum_k x[t, k] W[n, k] for T <= GEMV_TMAX rows,
// W [N, K] row-major 16-bit with K % 8 == 0 and 16-byte aligned rows; float32 accumulation,
// rounded once to the activation type (as F.linear). cuBLAS runs the attention projections at
// batch 1 with split-K (a second reduce kernel) at ~3.1 TB/s; here a warp streams GEMV_R rows,
// each lane GEMV_U 16-byte chunks per row in flight, and x (a few KB) stays in L1.
#define GEMV_WARPS 8
#define GEMV_R 2
#define GEMV_TMAX 4
#define GEMV_U 4
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
ls_gemv(const act_t* __restrict__ x, i64 x_stride, const act_t* __restrict__ w, int N, int K, int T,
        act_t* __restrict__ y, i64 y_stride) {
#if LS_DTYPE != 2
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_R;
    if (n0 >= N) return;  // whole warp
    const int nch = K / 8;
    float acc[GEMV_R][GEMV_TMAX];
#pragma unroll
    for (int r = 0; r < GEMV_R; ++r)
#pragma unroll
        for (int t = 0; t < GEMV_TMAX; ++t) acc[r][t] = 0.f;
    for (int c0 = lane; c0 < nch; c0 += 32 * GEMV_U) {
        V8 wr[GEMV_R][GEMV_U];
#pragma unroll
        for (int r = 0; r < GEMV_R; ++r)
#pragma unroll
            for (int u = 0; u < GEMV_U; ++u) {
                const int c = c0 + 32 * u;
                wr[r][u].a = make_uint4(0u, 0u, 0u, 0u);
                if (n0 + r < N && c < nch) wr[r][u].a = ldg_stream16(w + (i64)(n0 + r) * K + 8 * c);
            }
#pragma unroll
        for (int u = 0; u < GEMV_U; ++u) {
            const int c = c0 + 32 * u;
            if (c >= nch) break;
#pragma unroll
            for (int t = 0; t < GEMV_TMAX; ++t) {
                if (t >= T) break;
                float xf[8];
                load8_act(x + (i64)t * x_stride + 8 * c, xf);
#pragma unroll
                for (int r = 0; r < GEMV_R; ++r) {
                    float wf[8];
                    v8_get(wr[r][u], wf);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][t] = fmaf(xf[i], wf[i], acc[r][t]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_R; ++r)
#pragma unroll
        for (int t = 0; t < GEMV_TMAX; ++t) {
            float s = acc[r][t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0 && t < T && n0 + r < N) y[(i64)t * y_stride + n0 + r] = f2act(s);
        }
#endif
}
