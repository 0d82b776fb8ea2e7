// Block-sparse prefill attention over paged KV, warp-specialized for Hopper (sm_90a), v5: v3
// (bsp_prefill_ws.cu with the 128-byte swizzle, no ping-pong) with the producer's K/V loads from the
// paged pool done by TMA. Consumers, tiles, block lists, key sources, masks and BSP_PARAMS are v3's
// (bsp_tile.cuh); one parameter is added after them, ``tmaps``. Head dim 128 only.
//
// One CTA = 3 warpgroups over one 128-row query tile; warpgroups 1 and 2 (the consumers) are v3's
// to the instruction: Q in registers, S = Q K^T by wgmma, online softmax, O += P V, the S of block j
// issued with the P V of block j - 1, a stage released by one arrive per consumer warp on its
// "empty" mbarrier. What changes is how warpgroup 0, the producer, fills the NSTAGE-deep K/V ring:
//
// * Tensor maps. ``tmaps`` points at two CUtensorMaps (128 bytes each, K's then V's) in global
//   memory, encoded on the host (lserve/kernels/tensor_map.py, cuTensorMapEncodeTiled through
//   ctypes; cached per pool) over the pool [P, pool_heads, page_size, D] as a 4-D tensor (D,
//   page_size, pool_heads, P innermost first), box = 64 dims x R keys x 1 x 1 with
//   R = min(page_size, 64), SWIZZLE_128B. The host passes tmaps only for a page size whose boxes
//   tile a 64-key block at 1024-byte aligned offsets (a power of two from 8 to 64, or a multiple of
//   64); else null, and every block goes the v3 way. Maps written by cudaMemcpy are not seen by the
//   tensormap proxy at kernel start: the issuing thread runs fence.proxy.tensormap::generic.acquire
//   .sys on both, then prefetch.tensormap.
// * Full pool blocks (every key < q1, the tile's end): lane 0 of producer warp 0 alone waits on the
//   stage's "empty" barrier, arms the "full" barrier with mbarrier.arrive.expect_tx(32 KiB) and
//   issues 4 x 64 / R copies (K and V, two 64-dim halves each, one box per R keys: page
//   pages[page_off + t / page_size], row t % page_size, head kvh). A box lands at
//   half * 8 KiB + r * 128 of the stage, rows of 128 bytes with 16-byte chunk c at c ^ (row % 8):
//   TMA's 128-byte swizzle is computed from the shared address bits, so with the stage 1024-aligned
//   and R a multiple of 8 it is exactly v3's kv_off layout, which the consumers' descriptors read.
//   No per-chunk address math, no 32 cp.async per thread: one lookup and 4 instructions per box.
// * The last block of a paged tile when it is partial (keys past q1: stale or poisoned pool rows,
//   and 0 * NaN in P V is NaN, so they must be zeros): all 128 producer threads copy it the v3 way
//   (cp.async with zero fill), after lane 0 saw its stage empty (named barrier 5). Only the last
//   visited block can be partial (lists ascend; causal ends at q1). Its copies are waited for
//   (cp.async.wait_group 0), then named barrier 5 again and one plain arrive by thread 0: the same
//   single arrival the TMA blocks make, so both complete the same barrier of count 1 (plus the
//   tx-count for TMA). The producer has nothing left to overlap with by then.
// * Non-pool sources (streaming heads read the step's own K/V rows; dense heads without a pool) and
//   tmaps == null: exactly v3's producer, all 128 threads per block, each landing on the "full"
//   barrier by cp.async.mbarrier.arrive.noinc. The count of the "full" barriers is chosen per CTA
//   at init (one tile, one head per CTA): 1 for the TMA path, 128 for this one.
// Arrival order and parity: only lane 0 waits on the "empty" barriers in the TMA path, every block
// in order, so a parity wait there never sees a barrier two phases ahead (the release of block
// j + NSTAGE needs lane 0's own copy of it); the other producer threads touch the ring only for the
// last block, whose phase lane 0 has already waited for before it releases them.
#include "common.cuh"

#if LS_DTYPE == 2
#error "bsp_prefill_v5 is bf16/fp16 only"
#endif
#if LS_HEAD_DIM != 128
#error "bsp_prefill_v5 is head_dim 128 only"
#endif

#define D LS_HEAD_DIM
#ifndef LS_BSP_STAGES
#define LS_BSP_STAGES 3
#endif
#define NSTAGE LS_BSP_STAGES
// 1: a persistent grid (the host launches about one wave; each CTA loops over tiles of its head,
// its producer loading the next tile's K/V while the consumers finish a tile), 0: a CTA per tile
#ifndef LS_BSP_PERSIST
#define LS_BSP_PERSIST 0
#endif
#define NTHREADS 384  // producer warpgroup + 2 consumer warpgroups
#define BM 128
#define BN 64
#define ROWP (D + 8)  // Q staging row pitch (elements): ldmatrix conflict-free
#define DK (D / 16)
#define NT (BN / 8)
#define DT (D / 8)
#define DG (D / 8)  // 16-byte dim groups of a key row
#define KV_TILE_BYTES (BN * D * 2)
#define STAGE_BYTES (2 * KV_TILE_BYTES)
#define HALF_BYTES (BN * 128)  // one 64-dim half of a K or V tile: [64 keys][128 bytes]
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232  // 128 * 40 + 256 * 232 <= 65536
#define PRODUCER_BAR 5     // named barrier of the producer warpgroup (1, 2: consumers' Q staging)

#include "wgmma.cuh"
#include "sm90_pipe.cuh"
#include "bsp_tile.cuh"

// Byte offset of (key row t, 16-byte dim group c) in a K or V stage tile: the 128-byte swizzle
// (two 64-dim halves of [64 keys][128 bytes], chunk c of key t at c ^ (t % 8)), v3's layout.
__device__ __forceinline__ u32 kv_off(int t, int c) {
    return (u32)((c >> 3) * HALF_BYTES + t * 128 + (((c & 7) ^ (t & 7)) << 4));
}
// k-step kk of S = Q K^T (dims 16kk .. 16kk + 15), B K-major.
__device__ __forceinline__ u64 k_desc(u32 tK, int kk) {
    return wg_desc_sw128(tK + (kk >> 2) * HALF_BYTES + (kk & 3) * 32, 16, 1024);  // SBO: next 8 keys
}
// k-step kk of O += P V (keys 16kk .. 16kk + 15), B MN-major (transposed).
__device__ __forceinline__ u64 v_desc(u32 tV, int kk) {
    return wg_desc_sw128(tV + kk * 2048, HALF_BYTES, 1024);  // LBO: next 64 dims, SBO: next 8 keys
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) ls_bsp_prefill_v5(BSP_PARAMS, const unsigned char* tmaps,
                                                                             int n_tiles) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    // [pad to 1024][NSTAGE x (K tile, V tile)][Q staging BM x ROWP][full[NSTAGE], empty[NSTAGE]]
    const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const u32 kv0 = base;
    unsigned char* sQb = smem_raw + (base - smem_u32(smem_raw)) + NSTAGE * STAGE_BYTES;
    u16* sQ = reinterpret_cast<u16*>(sQb);
    const u32 bars = smem_u32(sQb + BM * ROWP * 2);
    auto full = [&](int st) { return bars + 8u * st; };
    auto empty = [&](int st) { return bars + 8u * (NSTAGE + st); };

    const int tid = threadIdx.x;
    // This CTA's tiles: its own, or (persistent) tiles blockIdx.x, + gridDim.x, ... of its head. The
    // ring runs on across them: block j of a tile is ring block jb + j, jb the blocks of the CTA's
    // earlier tiles, whose stage and phase producer and consumers both derive from it.
    const int tile_end = LS_BSP_PERSIST ? n_tiles : (int)blockIdx.x + 1;
    const int tile_step = LS_BSP_PERSIST ? (int)gridDim.x : 1;
    auto tile_at = [&](int ti) {
        return BspTile(ti, q, q_tok_stride, out, out_tok_stride, k, v, kv_tok_stride, pool_k, pool_v, pool_heads,
                       page_size, pages, tiles, seqs, rowptr, indices, n_rows, head0, n_dense, group, sink, local,
                       qscale);
    };
    // the key source is the head's (BspTile::paged), the same for every tile of the CTA; the host's
    // rule for a map (tensor_map.box_rows) is checked again so that a map can never be read with
    // boxes that do not tile a block
    const bool paged = (int)(head0 + blockIdx.y) < n_dense && pool_k != nullptr;
    const bool use_tma = paged && tmaps != nullptr && page_size % 8 == 0 && (page_size % BN == 0 || BN % page_size == 0);
    if (tid == 0) {
        for (int st = 0; st < NSTAGE; ++st) {
            mbar_init(full(st), use_tma ? 1 : 128);  // lane 0's arrive(.expect_tx) / every producer thread's cp.async
            mbar_init(empty(st), 8);                 // one arrival per consumer warp
        }
        fence_async_smem();  // the initialized barriers, visible to the async proxy (TMA's complete_tx)
    }
    __syncthreads();

    if (tid < 128) {
        setmaxnreg_dec<PRODUCER_REGS>();
        int jb = 0;
        if (use_tma) {
            // ---- producer, pool blocks by TMA; a partial last block by cp.async ----
            const unsigned char* tmk = tmaps;
            const unsigned char* tmv = tmaps + 128;
            if (tid == 0) {
                tensormap_acquire(tmk);
                tensormap_acquire(tmv);
                tensormap_prefetch(tmk);
                tensormap_prefetch(tmv);
            }
            const int rows = min(page_size, BN);  // keys per box (the host's box_rows)
            for (int ti = blockIdx.x; ti < tile_end; ti += tile_step) {
                const BspTile tile = tile_at(ti);
                const int nblk = tile.nblk;
                const int n_tma = nblk > 0 && tile.block_start(nblk - 1) + BN > tile.q1 ? nblk - 1 : nblk;
                if (tid == 0) {
                    for (int j = 0; j < n_tma; ++j) {
                        const int g = jb + j, st = g % NSTAGE;
                        mbar_wait(empty(st), ((g / NSTAGE) & 1) ^ 1);
                        const int kb = tile.block_start(j);
                        const u32 dK = kv0 + (u32)st * STAGE_BYTES, dV = dK + KV_TILE_BYTES;
                        mbar_arrive_expect_tx(full(st), STAGE_BYTES);
                        for (int r = 0; r < BN; r += rows) {
                            const int t = kb + r;
                            const int pg = pages[tile.page_off + t / page_size], row = t % page_size;
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const u32 so = (u32)(h * HALF_BYTES + r * 128);
                                tma_load_4d(dK + so, tmk, full(st), 64 * h, row, tile.kvh, pg);
                                tma_load_4d(dV + so, tmv, full(st), 64 * h, row, tile.kvh, pg);
                            }
                        }
                    }
                }
                if (n_tma < nblk) {
                    __syncwarp();
                    const int j = nblk - 1, g = jb + j, st = g % NSTAGE, kb = tile.block_start(j);
                    if (tid == 0) mbar_wait(empty(st), ((g / NSTAGE) & 1) ^ 1);
                    __syncwarp();
                    named_bar_sync(PRODUCER_BAR, 128);  // the stage is free for every producer thread
                    const u32 dK = kv0 + (u32)st * STAGE_BYTES, dV = dK + KV_TILE_BYTES;
#pragma unroll 4
                    for (int i = 0; i < BN * DG / 128; ++i) {
                        const int x = tid + 128 * i;
                        const int t = x / DG, c = x % DG;
                        const int key = kb + t;
                        const bool ok = key < tile.q1;
                        const i64 off = tile.key_off(ok ? key : kb, pages, pool_heads, page_size, kv_tok_stride) + c * 8;
                        cp_async16(dK + kv_off(t, c), pool_k + off, ok ? 16 : 0);
                        cp_async16(dV + kv_off(t, c), pool_v + off, ok ? 16 : 0);
                    }
                    cp_async_commit();
                    cp_async_wait<0>();
                    named_bar_sync(PRODUCER_BAR, 128);  // every thread's rows landed
                    if (tid == 0) mbar_arrive(full(st));
                }
                jb += nblk;
            }
            return;
        }
        // ---- producer, v3's way: thread p copies 16-byte chunks p, p + 128, ... of each K and V tile ----
        const act_t* kbase = paged ? pool_k : k;
        const act_t* vbase = paged ? pool_v : v;
        for (int ti = blockIdx.x; ti < tile_end; ti += tile_step) {
            const BspTile tile = tile_at(ti);
            for (int j = 0; j < tile.nblk; ++j) {
                const int g = jb + j, st = g % NSTAGE;
                mbar_wait(empty(st), ((g / NSTAGE) & 1) ^ 1);
                const int kb = tile.block_start(j);
                const u32 dK = kv0 + (u32)st * STAGE_BYTES, dV = dK + KV_TILE_BYTES;
#pragma unroll 4
                for (int i = 0; i < BN * DG / 128; ++i) {
                    const int x = tid + 128 * i;
                    const int t = x / DG, c = x % DG;  // a warp: two whole key rows
                    const int key = kb + t;
                    const bool ok = key < tile.q1;
                    const i64 off = tile.key_off(ok ? key : kb, pages, pool_heads, page_size, kv_tok_stride) + c * 8;
                    cp_async16(dK + kv_off(t, c), kbase + off, ok ? 16 : 0);
                    cp_async16(dV + kv_off(t, c), vbase + off, ok ? 16 : 0);
                }
                cp_async_mbar_arrive(full(st));
            }
            jb += tile.nblk;
        }
        cp_async_wait<0>();
        return;
    }

    // ---- consumers ------------------------------------------------------------------------------
    setmaxnreg_inc<CONSUMER_REGS>();
    const int ctid = tid - 128, wg = ctid >> 7, lane = ctid & 31;
    const int wrow = (ctid >> 5) * 16;  // this warp's 16 rows of the tile
    const int cq = (lane & 3) * 2;
    u32 qa[DK][4];
    float o[DT * 4];
    float mrow[2], lsum[2], alpha[2];
    float s[NT * 4];
    u32 pa[BN / 16][4];

    // ring block g: its stage's K / V tiles, full barrier, release
    auto issue_s = [&](int g) {
        const u32 tK = kv0 + (u32)(g % NSTAGE) * STAGE_BYTES;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) wg_qk_n64(s, qa[kk], k_desc(tK, kk), kk > 0);
        wg_commit();
    };
    auto issue_pv = [&](int g) {
        const u32 tV = kv0 + (u32)(g % NSTAGE) * STAGE_BYTES + KV_TILE_BYTES;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) wg_pv_n128(o, pa[kk], v_desc(tV, kk), 1);
        wg_commit();
    };
    auto wait_full = [&](int g) {
        mbar_wait(full(g % NSTAGE), (g / NSTAGE) & 1);
        fence_async_smem();  // cp.async writes (generic proxy), read by wgmma (async proxy); TMA's are async already
    };
    auto release = [&](int g) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(g % NSTAGE));
    };
    auto rescale_and_pack = [&]() {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[dt * 4] *= alpha[0]; o[dt * 4 + 1] *= alpha[0];
            o[dt * 4 + 2] *= alpha[1]; o[dt * 4 + 3] *= alpha[1];
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int x = 0; x < 4; ++x)
                pa[kk][x] = pack2(s[(2 * kk + (x >> 1)) * 4 + 2 * (x & 1)], s[(2 * kk + (x >> 1)) * 4 + 2 * (x & 1) + 1]);
    };

    int jb = 0;
    for (int ti = blockIdx.x; ti < tile_end; ti += tile_step) {
        const BspTile tile = tile_at(ti);
        const int nblk = tile.nblk;
        // Q of the tile into registers, through this warpgroup's rows of the staging buffer (after
        // every warp of the warpgroup read the previous tile's from it)
        if (ti != (int)blockIdx.x) named_bar_sync(1 + wg, 128);
        for (int c = ctid & 127; c < 64 * DG; c += 128) {
            const int m = 64 * wg + c / DG, col = (c % DG) * 8;
            const bool ok = m < tile.rows_used;
            cp_async16(smem_u32(sQ + m * ROWP + col), q + tile.row_off(ok ? m : 0, q_tok_stride) + col, ok ? 16 : 0);
        }
        cp_async_commit();
        cp_async_wait<0>();
        named_bar_sync(1 + wg, 128);
#pragma unroll
        for (int kk = 0; kk < DK; ++kk)
            ldsm_x4(smem_u32(sQ + (wrow + (lane & 15)) * ROWP + kk * 16 + (lane >> 4) * 8), qa[kk][0], qa[kk][1],
                    qa[kk][2], qa[kk][3]);

        const int prow[2] = {tile.row_pos(wrow + (lane >> 2)), tile.row_pos(wrow + (lane >> 2) + 8)};
#pragma unroll
        for (int i = 0; i < DT * 4; ++i) o[i] = 0.f;
        mrow[0] = mrow[1] = LS_NEG_INF;
        lsum[0] = lsum[1] = 0.f;
        // mask + online softmax of S (block j of the tile) into unnormalized probabilities; sets alpha (O's rescale)
        auto softmax = [&](int j) {
            const int kb = tile.block_start(j);
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
                alpha[hr] = none ? 1.f : fast_exp2(mrow[hr] - mnew);
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
                lsum[hr] = lsum[hr] * alpha[hr] + sum;
                mrow[hr] = mnew;
            }
        };

        if (nblk > 0) {
            wait_full(jb);
            wg_fence();
            issue_s(jb);
            wg_wait0();
            wg_pin(s);
            softmax(0);
            rescale_and_pack();
            for (int j = 1; j < nblk; ++j) {
                wait_full(jb + j);
                wg_pin(o);
                wg_fence();
                issue_s(jb + j);       // S_j = Q K_j^T
                issue_pv(jb + j - 1);  // O += P_{j-1} V_{j-1}
                wg_wait1();            // S_j done; P V may still run
                wg_pin(s);
                softmax(j);
                wg_wait0();
                wg_pin(o);
                release(jb + j - 1);
                rescale_and_pack();
            }
            wg_pin(o);
            wg_fence();
            issue_pv(jb + nblk - 1);
            wg_wait0();
            wg_pin(o);
            release(jb + nblk - 1);
        }

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
        jb += nblk;
    }
}
