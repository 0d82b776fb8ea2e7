// The mass cut of a prefill chunk's block list: lserve.sparsity.prefill_blocks.select_blocks (after
// combine_group) in two launches instead of ~30 small torch ops and a sort over every tile.
//
// Input: mass [Hq, R, nkb] float32, the estimate's per-query-head shares of each causal tile
// (row r covers positions (b0 + r) * q_block .. + q_block, capped at length; its causal tiles are
// 0 .. nb_r - 1, entries past them are 0). Query heads h * G .. h * G + G - 1 share KV head h.
//
// ls_mass_rank, one CTA per (row, KV head): the group's max per tile, normalized by its row total;
// the tiles sorted by priority (the row's mandatory tiles first: tile 0, the row's own tiles and the
// one before them; then by mass, descending; ties by lower tile id, select_blocks' stable sort);
// need[h, r] = how many sorted tiles have less than tau of mass before them (at least the mandatory
// ones), and rank[h, r, tile] = the tile's sorted position. Rows ending after dense_from (the
// prompt's tail) skip all of it: they keep every causal tile.
//
// ls_mass_keep, one CTA per (row, KV head): the row's count n_r = the heads' largest need rounded
// up to whole query rows of tiles (q_block / block), at most nb_r (every causal tile in tail rows);
// every head keeps the n_r tiles of lowest rank, written in ascending tile order as a BSR list:
// indptr [H, R + 1] (row-major over heads: head h's rows follow head h - 1's) and indices.
#include "common.cuh"

#define CUT_THREADS 512

// Sorted order: higher priority first, ties by lower tile id.
__device__ __forceinline__ bool cut_before(float pa, int ia, float pb, int ib) {
    return pa > pb || (pa == pb && ia < ib);
}

__device__ __forceinline__ float cut_block_sum(float x, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    x = warp_sum(x);
    if (lane == 0) red[warp] = x;
    __syncthreads();
    if (warp == 0) {
        float y = lane < CUT_THREADS / 32 ? red[lane] : 0.f;
        y = warp_sum(y);
        if (lane == 0) red[32] = y;
    }
    __syncthreads();
    const float r = red[32];
    __syncthreads();
    return r;
}

// The row's geometry: first position, causal tiles, first own tile, whether it is a tail row.
struct CutRow {
    int nb, first;
    bool tail;
    __device__ CutRow(int r, int b0, int q_block, int block, int length, int dense_from) {
        const int rs = (b0 + r) * q_block, re = min(length, rs + q_block);
        nb = (re - 1) / block + 1;
        first = rs / block;
        tail = re > dense_from;
    }
    __device__ int mandatory() const { return first <= 1 ? nb : 1 + nb - (first - 1); }
};

// Dynamic shared memory: 2 * p2 + nkb words (p2: a power of two >= every row's nb).
extern "C" __global__ void __launch_bounds__(CUT_THREADS)
ls_mass_rank(const float* __restrict__ mass, int G, int R, int nkb, int b0, int q_block, int block, int length,
             int dense_from, float tau, int p2, int* __restrict__ need, int* __restrict__ rank) {
    extern __shared__ float sm[];
    float* pr = sm;                                   // [p2] priorities, sorted in place
    int* id = reinterpret_cast<int*>(sm + p2);        // [p2] tile ids, sorted with them
    float* ms = sm + 2 * p2;                          // [nkb] normalized masses by tile id
    __shared__ float red[33];
    const int r = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const CutRow row(r, b0, q_block, block, length, dense_from);
    if (row.tail) return;  // keeps every causal tile: ls_mass_keep does not read its need or ranks
    const int nb = row.nb;
    // combine_group: max over the group's query heads, then divided by the row's total
    float t = 0.f;
    for (int j = tid; j < nkb; j += CUT_THREADS) {
        float m = 0.f;
        for (int g = 0; g < G; ++g) m = fmaxf(m, mass[((long long)(h * G + g) * R + r) * nkb + j]);
        if (j < nb) ms[j] = m;
        t += m;
    }
    t = fmaxf(cut_block_sum(t, red), 1e-30f);
    int P = 1;
    while (P < nb) P <<= 1;
    for (int j = tid; j < P; j += CUT_THREADS) {
        float p = -2.f;  // padding: after every causal tile
        if (j < nb) {
            const float m = ms[j] / t;
            ms[j] = m;
            p = (j == 0 || j >= row.first - 1) ? 2.f : m;  // mandatory tiles first
        }
        pr[j] = p;
        id[j] = j;
    }
    __syncthreads();
    for (int k = 2; k <= P; k <<= 1) {  // bitonic sort into cut_before order
        for (int s = k >> 1; s > 0; s >>= 1) {
            for (int i = tid; i < P; i += CUT_THREADS) {
                const int l = i ^ s;
                if (l > i && cut_before(pr[l], id[l], pr[i], id[i]) == ((i & k) == 0)) {
                    const float tp = pr[i];
                    pr[i] = pr[l];
                    pr[l] = tp;
                    const int ti = id[i];
                    id[i] = id[l];
                    id[l] = ti;
                }
            }
            __syncthreads();
        }
    }
    // mass before each sorted tile: each thread a contiguous run, then one block scan
    const int seg = (P + CUT_THREADS - 1) / CUT_THREADS, a = min(P, tid * seg), e = min(P, a + seg);
    float own = 0.f;
    for (int i = a; i < e; ++i) own += i < nb ? ms[id[i]] : 0.f;
    float before = block_inclusive_scan(own, red) - own;  // mass of the sorted tiles before this run
    int* rk = rank + ((long long)h * R + r) * nkb;
    float cnt = 0.f;
    for (int i = a; i < min(e, nb); ++i) {
        cnt += before < tau ? 1.f : 0.f;
        rk[id[i]] = i;
        before += ms[id[i]];
    }
    cnt = cut_block_sum(cnt, red);  // exact: counts below 2^24
    if (tid == 0) need[h * R + r] = max((int)cnt, row.mandatory());
}

// Tiles every head keeps in row r (the same for all heads of the row).
__device__ __forceinline__ int cut_count(const int* __restrict__ need, int H, int R, int r, int b0, int q_block,
                                         int block, int length, int dense_from) {
    const CutRow row(r, b0, q_block, block, length, dense_from);
    if (row.tail) return row.nb;
    int n = 0;
    for (int h = 0; h < H; ++h) n = max(n, need[h * R + r]);
    const int quantum = q_block / block;
    return min(row.nb, (n + quantum - 1) / quantum * quantum);
}

extern "C" __global__ void __launch_bounds__(CUT_THREADS)
ls_mass_keep(const int* __restrict__ need, const int* __restrict__ rank, int H, int R, int nkb, int b0, int q_block,
             int block, int length, int dense_from, int* __restrict__ indptr, int* __restrict__ indices) {
    __shared__ float red[33];
    __shared__ int sums[32];
    const int r = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    // the rows before r and all rows: this list's offset (head h follows heads 0 .. h - 1)
    float before = 0.f, total = 0.f;  // exact: counts below 2^24
    for (int i = tid; i < R; i += CUT_THREADS) {
        const float n = (float)cut_count(need, H, R, i, b0, q_block, block, length, dense_from);
        total += n;
        before += i < r ? n : 0.f;
    }
    const int off = h * (int)cut_block_sum(total, red) + (int)cut_block_sum(before, red);
    const int n = cut_count(need, H, R, r, b0, q_block, block, length, dense_from);
    if (tid == 0) {
        indptr[h * (R + 1) + r] = off;
        if (r == R - 1) indptr[h * (R + 1) + R] = off + n;
    }
    const CutRow row(r, b0, q_block, block, length, dense_from);
    const int* rk = rank + ((long long)h * R + r) * nkb;
    int base = off;
    for (int j0 = 0; j0 < row.nb; j0 += CUT_THREADS) {  // compact in ascending tile order
        const int j = j0 + tid;
        const int keep = j < row.nb && (row.tail || rk[j] < n);
        const int inc = block_inclusive_scan(keep, sums);
        if (keep) indices[base + inc - 1] = j;
        base += sums[CUT_THREADS / 32 - 1];  // the block's total (kept until the next scan's barrier)
        __syncthreads();
    }
}
