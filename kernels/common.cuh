// Shared helpers of the LServe kernels: element types, conversions, vector loads of K/V rows
// (plain, INT8, INT4), warp and block reductions.
//
// Compiled by NVRTC through lserve/kernels/loader.py, which prepends the variant macros:
//   LS_DTYPE     0 = bf16, 1 = fp16, 2 = fp32 (activations, plain KV, key statistics)
//   LS_HEAD_DIM  head dimension D
//   LS_QUANT     0 = none, 1 = int8, 2 = int4 (KV storage; only kernels that read/write pools)
//   LS_GQ        query heads handled per CTA (decode, selector)
// No system header is included: conversions use PTX so NVRTC needs no include path.
#pragma once

#ifndef LS_DTYPE
#error "LS_DTYPE must be defined by the loader"
#endif
#ifndef LS_HEAD_DIM
#error "LS_HEAD_DIM must be defined by the loader"
#endif

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define LS_INF __uint_as_float(0x7f800000u)
#define LS_NEG_INF __uint_as_float(0xff800000u)

// ---- activation element type ---------------------------------------------------------------
#if LS_DTYPE == 2
typedef float act_t;
#else
typedef u16 act_t;  // raw bits of a bf16 or fp16 value
#endif

__device__ __forceinline__ float h2f(u16 x) {
#if LS_DTYPE == 0
    return __uint_as_float(((u32)x) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#endif
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 r;
#if LS_DTYPE == 0
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
}

#if LS_DTYPE == 2
__device__ __forceinline__ float act2f(float x) { return x; }
__device__ __forceinline__ float f2act(float x) { return x; }
#else
__device__ __forceinline__ float act2f(u16 x) { return h2f(x); }
__device__ __forceinline__ u16 f2act(float x) { return f2h(x); }
#endif

// Two packed 16-bit values -> floats (element with the lower address in the low half).
__device__ __forceinline__ void unpack2(u32 w, float& a, float& b) {
    a = h2f((u16)(w & 0xffffu));
    b = h2f((u16)(w >> 16));
}

// ---- 8 consecutive activations as floats (16-byte aligned for 16-bit types) ---------------
__device__ __forceinline__ void load8_act(const act_t* p, float (&f)[8]) {
#if LS_DTYPE == 2
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
#else
    const uint4 r = *reinterpret_cast<const uint4*>(p);
    unpack2(r.x, f[0], f[1]); unpack2(r.y, f[2], f[3]);
    unpack2(r.z, f[4], f[5]); unpack2(r.w, f[6], f[7]);
#endif
}

// ---- streaming (read-once) global loads -----------------------------------------------------
__device__ __forceinline__ uint4 ldg_stream16(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ uint2 ldg_stream8(const void* p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 ldg_stream4(const void* p) {
    u32 r;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

// ---- a lane's 8 elements of one stored K or V row, raw then dequantized ---------------------
// Row ``row`` of a pool tensor [P, H, N, D] (row = (page*H + head)*N + offset); the lane owns
// dims [d0, d0+8).
#ifdef LS_QUANT
#if LS_QUANT == 0 && LS_DTYPE == 2
struct KVRaw { uint4 a, b; };
#elif LS_QUANT == 0
struct KVRaw { uint4 a; };
#elif LS_QUANT == 1
struct KVRaw { uint2 a; };
#else
struct KVRaw { u32 a; };
#endif

__device__ __forceinline__ void kv_zero(KVRaw& r) {
#if LS_QUANT == 0 && LS_DTYPE == 2
    r.a.x = r.a.y = r.a.z = r.a.w = 0u;
    r.b.x = r.b.y = r.b.z = r.b.w = 0u;
#elif LS_QUANT == 0
    r.a.x = r.a.y = r.a.z = r.a.w = 0u;
#elif LS_QUANT == 1
    r.a.x = r.a.y = 0u;
#else
    r.a = 0;
#endif
}

__device__ __forceinline__ KVRaw kv_load(const void* base, i64 row, int d0) {
    KVRaw r;
#if LS_QUANT == 0 && LS_DTYPE == 2
    const float* p = reinterpret_cast<const float*>(base) + row * LS_HEAD_DIM + d0;
    r.a = ldg_stream16(p); r.b = ldg_stream16(p + 4);
#elif LS_QUANT == 0
    const u16* p = reinterpret_cast<const u16*>(base) + row * LS_HEAD_DIM + d0;
    r.a = ldg_stream16(p);
#elif LS_QUANT == 1
    const signed char* p = reinterpret_cast<const signed char*>(base) + row * LS_HEAD_DIM + d0;
    r.a = ldg_stream8(p);
#else
    const unsigned char* p = reinterpret_cast<const unsigned char*>(base) + row * (LS_HEAD_DIM / 2) + d0 / 2;
    r.a = ldg_stream4(p);
#endif
    return r;
}

__device__ __forceinline__ float s8f(u32 w, int i) { return (float)(int)(signed char)((w >> (8 * i)) & 0xffu); }

// Round to the activation dtype and back: dequantized K/V are materialized in the model dtype by
// the reference (quant.dequantize_*), so the kernels round exactly where it does.
__device__ __forceinline__ float round_act(float x) {
#if LS_DTYPE == 2
    return x;
#else
    return h2f(f2h(x));
#endif
}

// x = raw (none), q * scale (int8), nibble * scale + zero (int4); quantized values are computed
// as the reference does (fp32 multiply, then add, then rounding to the model dtype).
__device__ __forceinline__ void kv_dequant(const KVRaw& r, float scale, float zero, float (&f)[8]) {
#if LS_QUANT == 0 && LS_DTYPE == 2
    f[0] = __uint_as_float(r.a.x); f[1] = __uint_as_float(r.a.y);
    f[2] = __uint_as_float(r.a.z); f[3] = __uint_as_float(r.a.w);
    f[4] = __uint_as_float(r.b.x); f[5] = __uint_as_float(r.b.y);
    f[6] = __uint_as_float(r.b.z); f[7] = __uint_as_float(r.b.w);
#elif LS_QUANT == 0
    unpack2(r.a.x, f[0], f[1]); unpack2(r.a.y, f[2], f[3]);
    unpack2(r.a.z, f[4], f[5]); unpack2(r.a.w, f[6], f[7]);
#elif LS_QUANT == 1
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[i] = round_act(__fmul_rn(s8f(r.a.x, i), scale));
        f[4 + i] = round_act(__fmul_rn(s8f(r.a.y, i), scale));
    }
#else
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = round_act(__fadd_rn(__fmul_rn((float)((r.a >> (4 * i)) & 0xfu), scale), zero));
#endif
}
#endif  // LS_QUANT

// ---- programmatic dependent launch (sm_90+; no-ops elsewhere) -------------------------------
// A kernel launched with the programmatic-serialization attribute (loader.launch(pdl=True)) may
// start while the previous kernel in the stream is still running: it must call pdl_wait()
// before touching anything that kernel (or an earlier one) writes, and before any write of its
// own. Every CTA calls it (also those that exit early), so the grid completes only after its
// predecessor. pdl_trigger() lets the next kernel launch early; kernels here call it only after
// their own pdl_wait(), so when a kernel starts, the kernel two launches back has completed:
// before its wait it may read host-copied tables and what that older kernel (or earlier) wrote.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// 2^x on the special-function unit (relative error ~2^-22; 2^-inf = 0).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Float -> unsigned key with the same order (larger float, larger key).
__device__ __forceinline__ u32 order_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// ---- reductions -----------------------------------------------------------------------------
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_min(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Inclusive prefix sum over the block (blockDim.x a multiple of 32, at most 1024), of ints or floats.
// ``warp_sums`` is shared scratch of 32 T. Contains barriers: call from every thread.
template <typename T>
__device__ __forceinline__ T block_inclusive_scan(T x, T* warp_sums) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        T s = lane < nwarps ? warp_sums[lane] : T(0);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        if (lane < nwarps) warp_sums[lane] = s;  // inclusive totals per warp
    }
    __syncthreads();
    const T r = x + (warp > 0 ? warp_sums[warp - 1] : T(0));
    __syncthreads();  // warp_sums may be reused right after
    return r;
}
