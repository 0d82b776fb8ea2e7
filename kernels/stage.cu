// The host KV tier's staging of a selection (docs/host_kv_tier.md): right after a layer's top-k,
// each pick whose page is on the host has its head's part copied into the staging area (resident
// slots the tier sets aside: selection slot s, entry e -> stage_base + s * stage_entries + e), and
// the staged slot is written into the staging map (laid out as the selection; -1: not staged).
// The decode kernels read a pick on the host from its staged copy, so the steps that reuse the
// selection read it from device memory, and the selecting step reads it once, in bulk, instead of
// each step fetching it over PCIe a few bytes a thread. A page's bytes never change once it is on
// the host, so the copy stays valid for the whole selection.
#include "common.cuh"
#include "decode_meta.cuh"
#include "tier.cuh"

// The launch's block size must equal ST_THREADS (Variant tuning may set both).
#ifndef ST_THREADS
#define ST_THREADS 128
#endif
#ifndef ST_UNROLL
#define ST_UNROLL 8  // 16-byte loads in flight per thread: over PCIe a load takes microseconds
#endif

// One CTA a pick: grid (selecting rows, dense heads, selection entries).
// bases: int64 [3, nt]: per storage tensor of the pool (K, V, scales, zero points) its host base
// address, resident base address and bytes a page; a head's part of a page is the page's bytes
// over hd, at h times that (pool rows are (page * hd + h) * page_size + token), in 16-byte words.
extern "C" __global__ void __launch_bounds__(ST_THREADS)
ls_stage_picks(const int* __restrict__ meta, int nb, const int* __restrict__ rows, int hd,
               const int* __restrict__ sel_page, const int* __restrict__ sel_cnt, int* __restrict__ stage,
               int sel_slot_stride, int sel_head_stride, int cnt_slot_stride,
               const TierLayer* __restrict__ tier, const i64* __restrict__ bases, int nt,
               int stage_base, int stage_slots, int stage_entries,
               unsigned long long* __restrict__ staged_parts) {  // this layer's count of parts staged
    const int r = blockIdx.x, h = blockIdx.y, e = blockIdx.z;
    const int slot = meta[META_SLOT * nb + rows[r]];  // host-copied tables: before the wait
    pdl_wait();  // the picks come from the top-k just before
    // No early pdl_trigger: the decode kernel that follows would launch while this grid's last
    // wave copies, and its CTAs would sit on SM slots waiting for it to finish (a CTA's exit
    // triggers; every CTA here exits right after its copies).
    const i64 off = (i64)slot * sel_slot_stride + (i64)h * sel_head_stride + e;
    if (e >= sel_cnt[(i64)slot * cnt_slot_stride + h]) return;
    const int where = tier->slot[sel_page[off]];
    const bool staged = where < 0 && slot < stage_slots && e < stage_entries;
    const i64 dst_page = stage_base + (i64)slot * stage_entries + e;
    if (threadIdx.x == 0) stage[off] = staged ? (int)dst_page : -1;
    if (!staged) return;
    if (threadIdx.x == 0) atomicAdd(staged_parts, 1ull);
    const i64 src_page = -1 - (i64)where;
    for (int t = 0; t < nt; ++t) {
        const i64 pb = bases[2 * nt + t], part = pb / hd;
        const uint4* __restrict__ src = reinterpret_cast<const uint4*>(bases[t] + src_page * pb + h * part);
        uint4* __restrict__ dst = reinterpret_cast<uint4*>(bases[nt + t] + dst_page * pb + h * part);
        const int words = (int)(part / 16);
        for (int w0 = threadIdx.x; w0 < words; w0 += ST_THREADS * ST_UNROLL) {
            uint4 v[ST_UNROLL];
#pragma unroll
            for (int k = 0; k < ST_UNROLL; ++k) {
                const int w = w0 + k * ST_THREADS;
                if (w < words) v[k] = src[w];
            }
#pragma unroll
            for (int k = 0; k < ST_UNROLL; ++k) {
                const int w = w0 + k * ST_THREADS;
                if (w < words) dst[w] = v[k];
            }
        }
    }
}
