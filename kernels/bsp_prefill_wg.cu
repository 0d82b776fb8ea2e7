// Block-sparse prefill attention over paged KV on Hopper warpgroup MMA (sm_90a; wgmma.mma_async,
// bf16/fp16 in, fp32 accumulate). Same tiles, block lists, key sources and masks as
// bsp_prefill.cu (see bsp_tile.cuh); what differs is the math:
//   * NWG warpgroups of 4 warps, each owning 64 tile rows; Q is read once into registers (the
//     A operand of every S = Q K^T);
//   * K and V blocks land in shared memory by cp.async in the no-swizzle core-matrix layout
//     (8 keys x 8 dims = 128 contiguous bytes, blocks of 8 keys, dim groups inner), which serves
//     both as the K-major B of Q K^T and, with the transpose flag, as the N-major B of P V;
//   * S (64 x 64 per warpgroup) and O (64 x D) accumulate in registers through wgmma; P is
//     re-packed from S as the A operand of P V (the accumulator and A layouts agree per 8 columns).
// Each block: wait for its copies, S by D/16 wgmmas, mask + online softmax, O by BN/16 wgmmas;
// the next block's copies are in flight meanwhile (two stages).
#include "common.cuh"

#if LS_DTYPE == 2
#error "bsp_prefill_wg is bf16/fp16 only"
#endif

#define D LS_HEAD_DIM
#ifndef LS_BSP_WG
#define LS_BSP_WG 2  // warpgroups per CTA (64 rows each)
#endif
#define NWG LS_BSP_WG
#define NTHREADS (NWG * 128)
#define BM (NWG * 64)
#define BN 64
#define ROWP (D + 8)  // Q staging row pitch (elements), as bsp_prefill.cu
#define DK (D / 16)
#define NT (BN / 8)
#define DT (D / 8)
#define DG (D / 8)  // 16-byte dim groups of a key row
#define KV_TILE_BYTES (BN * D * 2)

#include "wgmma.cuh"
#include "bsp_tile.cuh"

// Byte offset of (key row t, dim group c) in a K/V tile: core matrix (t / 8, c) of 128 bytes.
__device__ __forceinline__ u32 core_off(int t, int c) { return (u32)((((t >> 3) * DG + c) << 7) + ((t & 7) << 4)); }

extern "C" __global__ void __launch_bounds__(NTHREADS) ls_bsp_prefill_wg(BSP_PARAMS) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* sKV = smem_raw;                            // [2 stages][K tile, V tile]
    u16* sQ = reinterpret_cast<u16*>(smem_raw + 4 * KV_TILE_BYTES);  // [BM][ROWP]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const BspTile tile(blockIdx.x, q, q_tok_stride, out, out_tok_stride, k, v, kv_tok_stride, pool_k, pool_v, pool_heads,
                       page_size, pages, tiles, seqs, rowptr, indices, n_rows, head0, n_dense, group, sink, local,
                       qscale);
    const int nblk = tile.nblk;
    const u32 kv0 = smem_u32(sKV);

    for (int c = tid; c < BM * DG; c += NTHREADS) {
        const int m = c / DG, col = (c % DG) * 8;
        const bool ok = m < tile.rows_used;
        cp_async16(smem_u32(sQ + m * ROWP + col), q + tile.row_off(ok ? m : 0, q_tok_stride) + col, ok ? 16 : 0);
    }
    // A warp copies 8 keys x 4 dim groups per pass: 64 contiguous bytes of each key row read,
    // four whole core matrices (512 contiguous bytes) written.
    auto load_block = [&](int j, int stage) {
        const int kb = tile.block_start(j);
        const u32 dK = kv0 + (u32)(2 * stage) * KV_TILE_BYTES, dV = dK + KV_TILE_BYTES;
        for (int x = tid; x < BN * DG; x += NTHREADS) {
            const int rest = x >> 5;
            const int t = (rest / (DG / 4)) * 8 + (x & 7);
            const int c = (rest % (DG / 4)) * 4 + ((x >> 3) & 3);
            const int key = kb + t;
            const bool ok = key < tile.q1;
            const i64 off = tile.key_off(ok ? key : kb, pages, pool_heads, page_size, kv_tok_stride) + c * 8;
            const u32 so = core_off(t, c);
            cp_async16(dK + so, (tile.paged ? pool_k : k) + off, ok ? 16 : 0);
            cp_async16(dV + so, (tile.paged ? pool_v : v) + off, ok ? 16 : 0);
        }
    };
    if (nblk > 0) load_block(0, 0);
    cp_async_commit();  // Q and block 0 in one group

    // this thread's rows (accumulator layout): wrow + (lane >> 2) and + 8
    const int wrow = warp * 16;
    const int prow[2] = {tile.row_pos(wrow + (lane >> 2)), tile.row_pos(wrow + (lane >> 2) + 8)};
    const int cq = (lane & 3) * 2;
    u32 qa[DK][4];
    float o[DT * 4];
#pragma unroll
    for (int i = 0; i < DT * 4; ++i) o[i] = 0.f;
    float mrow[2] = {LS_NEG_INF, LS_NEG_INF}, lsum[2] = {0.f, 0.f};

    for (int j = 0; j < nblk; ++j) {
        if (j + 1 < nblk) {
            load_block(j + 1, (j + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        fence_async_smem();
        __syncthreads();
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < DK; ++kk)
                ldsm_x4(smem_u32(sQ + (wrow + (lane & 15)) * ROWP + kk * 16 + (lane >> 4) * 8), qa[kk][0], qa[kk][1],
                        qa[kk][2], qa[kk][3]);
        }
        const u32 tK = kv0 + (u32)(2 * (j & 1)) * KV_TILE_BYTES, tV = tK + KV_TILE_BYTES;
        const int kb = tile.block_start(j);

        // S = Q K^T: K-major B, k-step kk = dim groups 2kk, 2kk + 1 (LBO: next dim group, SBO: next 8 keys)
        float s[NT * 4];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) wg_qk_n64(s, qa[kk], wg_desc(tK + kk * 256, 128, DG * 128), kk > 0);
        wg_commit();
        wg_wait0();
        wg_pin(s);

        if (tile.needs_mask(kb)) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!tile.visible(kb + nt * 8 + cq + (e & 1), prow[e >> 1], sink, local)) s[nt * 4 + e] = LS_NEG_INF;
        }
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float mx = LS_NEG_INF;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt * 4 + 2 * hr], s[nt * 4 + 2 * hr + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(mrow[hr], mx * qscale);
            const bool none = mnew == LS_NEG_INF;
            const float alpha = none ? 1.f : fast_exp2(mrow[hr] - mnew);
            const float msub = none ? 0.f : mnew;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                    const float pr = fast_exp2(fmaf(s[nt * 4 + e], qscale, -msub));
                    s[nt * 4 + e] = pr;
                    sum += pr;
                }
            lsum[hr] = lsum[hr] * alpha + sum;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) { o[dt * 4 + 2 * hr] *= alpha; o[dt * 4 + 2 * hr + 1] *= alpha; }
            mrow[hr] = mnew;
        }
        // O += P V: N-major B (transposed), k-step kk = key blocks 2kk, 2kk + 1 (LBO: next 8 keys,
        // SBO: next dim group)
        u32 pa[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int x = 0; x < 4; ++x)
                pa[kk][x] = pack2(s[(2 * kk + (x >> 1)) * 4 + 2 * (x & 1)], s[(2 * kk + (x >> 1)) * 4 + 2 * (x & 1) + 1]);
        wg_pin(o);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#if LS_HEAD_DIM == 128
            wg_pv_n128(o, pa[kk], wg_desc(tV + kk * 2 * DG * 128, DG * 128, 128), 1);
#else
            wg_pv_n64(o, pa[kk], wg_desc(tV + kk * 2 * DG * 128, DG * 128, 128), 1);
#endif
        }
        wg_commit();
        wg_wait0();
        wg_pin(o);
        __syncthreads();  // this stage is overwritten by the load issued next iteration
    }
    cp_async_wait<0>();  // a tile with no block still has its Q copies in flight

#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float l = lsum[hr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int m = wrow + (lane >> 2) + 8 * hr;
        if (m >= tile.rows_used) continue;
        const float inv = l > 0.f ? 1.f / l : 0.f;
        u32* dst = reinterpret_cast<u32*>(out + tile.row_off(m, out_tok_stride));
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) dst[(dt * 8 + cq) >> 1] = pack2(o[dt * 4 + 2 * hr] * inv, o[dt * 4 + 2 * hr + 1] * inv);
    }
}
