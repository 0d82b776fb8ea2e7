// The host KV tier's page moves (lserve/cache/host_tier.py, HostTier.flush): a batch of contiguous
// byte ranges copied in one launch, one CTA a range, in 16-byte words. Sources and targets are
// device memory or mapped pinned host memory (read or written over PCIe); the many CTAs keep many
// loads in flight, where torch's index copies read a mapped pool a few bytes a thread. No range
// of a batch is read and written by two of its entries, so their order does not matter.
//
// ranges: int64 [3, n]: source address, target address, length in 16-byte words (both addresses
// 16-byte aligned).
typedef long long i64;

#define PC_THREADS 256
#define PC_UNROLL 4

extern "C" __global__ void __launch_bounds__(PC_THREADS)
ls_page_copy(const i64* __restrict__ ranges, int n) {
    const int r = blockIdx.x;
    if (r >= n) return;
    const uint4* __restrict__ src = reinterpret_cast<const uint4*>(ranges[r]);
    uint4* __restrict__ dst = reinterpret_cast<uint4*>(ranges[n + r]);
    const i64 words = ranges[2 * n + r];
    // PC_UNROLL loads issued before their stores: over PCIe a load takes microseconds
    for (i64 w0 = threadIdx.x; w0 < words; w0 += (i64)PC_THREADS * PC_UNROLL) {
        uint4 v[PC_UNROLL];
#pragma unroll
        for (int k = 0; k < PC_UNROLL; ++k) {
            const i64 w = w0 + (i64)k * PC_THREADS;
            if (w < words) v[k] = src[w];
        }
#pragma unroll
        for (int k = 0; k < PC_UNROLL; ++k) {
            const i64 w = w0 + (i64)k * PC_THREADS;
            if (w < words) dst[w] = v[k];
        }
    }
}
