// Hopper (sm_90a) producer/consumer plumbing of the warp-specialized prefill kernels: shared-memory
// mbarriers (init, arrive, parity wait), cp.async completion counted on an mbarrier, named barriers
// for one warpgroup, setmaxnreg (moving registers between warpgroups), and TMA tensor copies whose
// bytes complete on an mbarrier (PTX ISA 8.0+; the tensormap proxy fence needs 8.3).
#pragma once
#include "common.cuh"

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}
// Blocks until the phase of parity ``parity`` has completed (a fresh barrier is in phase 0, so
// waiting on parity 1 returns at once: producers start that way on their "empty" barriers).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// The barrier's pending count drops by one when every cp.async this thread issued so far has
// landed (.noinc: the init count already counts this arrival).
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }

// Arrive once and add ``bytes`` to the barrier's expected transaction count: its phase completes
// when every arrival came and the TMA copies that name it delivered that many bytes.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// A tensor map written to global memory by the host (cudaMemcpy) is not acquired by the tensormap
// proxy at kernel start: each thread that issues copies through it fences it first (PTX ISA 8.3).
__device__ __forceinline__ void tensormap_acquire(const void* map) {
    asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;" ::"l"(map) : "memory");
}
__device__ __forceinline__ void tensormap_prefetch(const void* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}
// TMA: the box of a 4-D tensor map at coordinates (c0 innermost .. c3) into shared memory at ``dst``,
// its bytes counted on mbarrier ``bar`` (complete_tx). The box lands in the map's swizzle, computed
// from the shared address, so ``dst`` is kept 1024-byte aligned for the 128-byte swizzle.
__device__ __forceinline__ void tma_load_4d(u32 dst, const void* map, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
        ::"r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
