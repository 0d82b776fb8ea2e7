// Block-sparse prefill attention over paged KV, warp-specialized for Hopper (sm_90a): v3 of
// bsp_prefill.cu, same tiles, block lists, key sources, masks and launch arguments (bsp_tile.cuh).
// Head dim 128 only.
//
// One CTA = 3 warpgroups over one 128-row query tile:
//   * warpgroup 0, the producer (setmaxnreg down to PRODUCER_REGS): copies each visited key
//     block's K and V (64 keys x D) into a NSTAGE-deep shared-memory ring with cp.async (pages
//     are shuffled and of any size, and keys past the tile are zero-filled, so row copies rather
//     than TMA); each copy's completion lands on the stage's "full" mbarrier
//     (cp.async.mbarrier.arrive.noinc), then it waits on the stage's "empty" mbarrier before
//     refilling it;
//   * warpgroups 1 and 2, the consumers (setmaxnreg up to CONSUMER_REGS), 64 rows each: Q in
//     registers (wgmma A operand), S = Q K^T by wgmma from a shared-memory descriptor, online
//     softmax in registers, O += P V by wgmma with P (bf16/fp16) in registers. The S of block j
//     is issued together with the P V of block j - 1 and waited on first (wait_group 1), so the
//     softmax of block j runs while the tensor cores finish P V; O is rescaled after that.
//     A stage is released (one arrive per consumer warp) once both of its GEMMs are done.
// LS_BSP_PINGPONG = 1: the two consumer warpgroups take turns issuing their GEMMs (named barriers
// 3 and 4), so that one's softmax runs while the other's GEMMs occupy the tensor cores.
// K/V stage layout (LS_BSP_SWIZZLE): 1 = the 128-byte swizzle (two 64-dim halves of [64 keys]
// [128 bytes], chunk c of key t at chunk c ^ (t % 8)), serving as the K-major B of Q K^T and the
// MN-major B of P V; 0 = the no-swizzle core-matrix layout of bsp_prefill_wg.cu.
// LS_BSP_ABLATE (timing studies only, wrong outputs; never built for the engine): one part left
// out, so that its cost is the difference to the full kernel. 1: the producer copies nothing (it
// still arrives on the "full" barriers, the consumers read stale stages); 2: no softmax (S is
// packed as P, no max, exp, sum or O rescale); 3: no P V GEMM; 4: exp2 replaced by an FMA (MUFU
// left out, the max/sum chains kept).
#include "common.cuh"

#if LS_DTYPE == 2
#error "bsp_prefill_ws is bf16/fp16 only"
#endif
#if LS_HEAD_DIM != 128
#error "bsp_prefill_ws is head_dim 128 only"
#endif

#define D LS_HEAD_DIM
#ifndef LS_BSP_STAGES
#define LS_BSP_STAGES 3
#endif
#define NSTAGE LS_BSP_STAGES
#ifndef LS_BSP_SWIZZLE
#define LS_BSP_SWIZZLE 1
#endif
#ifndef LS_BSP_PINGPONG
#define LS_BSP_PINGPONG 0
#endif
#ifndef LS_BSP_ABLATE
#define LS_BSP_ABLATE 0
#endif
#if LS_BSP_ABLATE == 4
#define BSP_EXP2(x) fmaf((x), 0.0625f, 1.0f)
#else
#define BSP_EXP2(x) fast_exp2(x)
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
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232  // 128 * 40 + 256 * 232 <= 65536

#include "wgmma.cuh"
#include "sm90_pipe.cuh"
#include "bsp_tile.cuh"

// Byte offset of (key row t, 16-byte dim group c) in a K or V stage tile.
__device__ __forceinline__ u32 kv_off(int t, int c) {
#if LS_BSP_SWIZZLE
    return (u32)((c >> 3) * (BN * 128) + t * 128 + (((c & 7) ^ (t & 7)) << 4));
#else
    return (u32)((((t >> 3) * DG + c) << 7) + ((t & 7) << 4));  // core matrix (t / 8, c)
#endif
}
// k-step kk of S = Q K^T (dims 16kk .. 16kk + 15), B K-major.
__device__ __forceinline__ u64 k_desc(u32 tK, int kk) {
#if LS_BSP_SWIZZLE
    return wg_desc_sw128(tK + (kk >> 2) * (BN * 128) + (kk & 3) * 32, 16, 1024);  // SBO: next 8 keys
#else
    return wg_desc(tK + kk * 256, 128, DG * 128);  // LBO: next dim group, SBO: next 8 keys
#endif
}
// k-step kk of O += P V (keys 16kk .. 16kk + 15), B MN-major (transposed).
__device__ __forceinline__ u64 v_desc(u32 tV, int kk) {
#if LS_BSP_SWIZZLE
    return wg_desc_sw128(tV + kk * 2048, BN * 128, 1024);  // LBO: next 64 dims, SBO: next 8 keys
#else
    return wg_desc(tV + kk * 2 * DG * 128, DG * 128, 128);  // LBO: next 8 keys, SBO: next dim group
#endif
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) ls_bsp_prefill_ws(BSP_PARAMS) {
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
    const BspTile tile(blockIdx.x, q, q_tok_stride, out, out_tok_stride, k, v, kv_tok_stride, pool_k, pool_v, pool_heads,
                       page_size, pages, tiles, seqs, rowptr, indices, n_rows, head0, n_dense, group, sink, local,
                       qscale);
    const int nblk = tile.nblk;
    if (tid == 0) {
        for (int st = 0; st < NSTAGE; ++st) {
            mbar_init(full(st), 128);  // every producer thread's cp.async arrival
            mbar_init(empty(st), 8);   // one arrival per consumer warp
        }
    }
    __syncthreads();

    if (tid < 128) {
        // ---- producer: thread p copies 16-byte chunks p, p + 128, ... of each K and V tile ----
        setmaxnreg_dec<PRODUCER_REGS>();
        const act_t* kbase = tile.paged ? pool_k : k;
        const act_t* vbase = tile.paged ? pool_v : v;
        for (int j = 0; j < nblk; ++j) {
            const int st = j % NSTAGE;
            mbar_wait(empty(st), ((j / NSTAGE) & 1) ^ 1);
            const int kb = tile.block_start(j);
            const u32 dK = kv0 + (u32)st * STAGE_BYTES, dV = dK + KV_TILE_BYTES;
#pragma unroll 4
            for (int i = 0; i < BN * DG / 128; ++i) {
                const int x = tid + 128 * i;
#if LS_BSP_SWIZZLE
                const int t = x / DG, c = x % DG;  // a warp: two whole key rows
#else
                const int rest = x >> 5;  // a warp: 8 keys x 4 dim groups = four whole core matrices
                const int t = (rest / (DG / 4)) * 8 + (x & 7), c = (rest % (DG / 4)) * 4 + ((x >> 3) & 3);
#endif
                const int key = kb + t;
                const bool ok = key < tile.q1;
                const i64 off = tile.key_off(ok ? key : kb, pages, pool_heads, page_size, kv_tok_stride) + c * 8;
                const u32 so = kv_off(t, c);
#if LS_BSP_ABLATE != 1
                cp_async16(dK + so, kbase + off, ok ? 16 : 0);
                cp_async16(dV + so, vbase + off, ok ? 16 : 0);
#else
                if (off < 0) cp_async16(dK + so, kbase, 0);  // never: keeps the address math alive
#endif
            }
#if LS_BSP_ABLATE != 1
            cp_async_mbar_arrive(full(st));
#else
            mbar_arrive(full(st));
#endif
        }
        cp_async_wait<0>();
        return;
    }

    // ---- consumers ------------------------------------------------------------------------------
    setmaxnreg_inc<CONSUMER_REGS>();
    const int ctid = tid - 128, wg = ctid >> 7, lane = ctid & 31;
    const int wrow = (ctid >> 5) * 16;  // this warp's 16 rows of the tile
    for (int c = ctid & 127; c < 64 * DG; c += 128) {
        const int m = 64 * wg + c / DG, col = (c % DG) * 8;
        const bool ok = m < tile.rows_used;
        cp_async16(smem_u32(sQ + m * ROWP + col), q + tile.row_off(ok ? m : 0, q_tok_stride) + col, ok ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    named_bar_sync(1 + wg, 128);
    u32 qa[DK][4];
#pragma unroll
    for (int kk = 0; kk < DK; ++kk)
        ldsm_x4(smem_u32(sQ + (wrow + (lane & 15)) * ROWP + kk * 16 + (lane >> 4) * 8), qa[kk][0], qa[kk][1],
                qa[kk][2], qa[kk][3]);

    const int prow[2] = {tile.row_pos(wrow + (lane >> 2)), tile.row_pos(wrow + (lane >> 2) + 8)};
    const int cq = (lane & 3) * 2;
    float o[DT * 4];
#pragma unroll
    for (int i = 0; i < DT * 4; ++i) o[i] = 0.f;
    float mrow[2] = {LS_NEG_INF, LS_NEG_INF}, lsum[2] = {0.f, 0.f}, alpha[2];
    float s[NT * 4];
    u32 pa[BN / 16][4];

    auto issue_s = [&](int j) {
        const u32 tK = kv0 + (u32)(j % NSTAGE) * STAGE_BYTES;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) wg_qk_n64(s, qa[kk], k_desc(tK, kk), kk > 0);
        wg_commit();
    };
    auto issue_pv = [&](int j) {
        const u32 tV = kv0 + (u32)(j % NSTAGE) * STAGE_BYTES + KV_TILE_BYTES;
#pragma unroll
#if LS_BSP_ABLATE != 3
        for (int kk = 0; kk < BN / 16; ++kk) wg_pv_n128(o, pa[kk], v_desc(tV, kk), 1);
#endif
        wg_commit();
    };
    // Ping-pong: warpgroup w issues after the other has issued (barrier 3 + w: its 128 threads wait,
    // the other's arrive). Both issue nblk + 1 times; warpgroup 1 opens the first turn and does not
    // pass its last, so no arrival is left over.
    auto turn_wait = [&]() {
        if (LS_BSP_PINGPONG) named_bar_sync(3 + wg, 256);
    };
    auto turn_pass = [&](bool last) {
        if (LS_BSP_PINGPONG && !(last && wg == 1)) named_bar_arrive(3 + (wg ^ 1), 256);
    };
    auto wait_full = [&](int j) {
        mbar_wait(full(j % NSTAGE), (j / NSTAGE) & 1);
        fence_async_smem();  // the producer's cp.async writes (generic proxy), read by wgmma (async proxy)
    };
    auto release = [&](int j) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(j % NSTAGE));
    };
    // mask + online softmax of S (block j) into unnormalized probabilities; sets alpha (O's rescale)
    auto softmax = [&](int j) {
#if LS_BSP_ABLATE == 2
        alpha[0] = alpha[1] = 1.f;
        return;
#endif
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
            alpha[hr] = none ? 1.f : BSP_EXP2(mrow[hr] - mnew);
            const float msub = none ? 0.f : mnew;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                    const float pr = BSP_EXP2(fmaf(s[nt * 4 + e], qscale, -msub));
                    s[nt * 4 + e] = pr;
                    sum += pr;
                }
            lsum[hr] = lsum[hr] * alpha[hr] + sum;
            mrow[hr] = mnew;
        }
    };
    auto rescale_and_pack = [&]() {
#pragma unroll
        for (int dt = 0; dt < DT && LS_BSP_ABLATE != 2; ++dt) {
            o[dt * 4] *= alpha[0]; o[dt * 4 + 1] *= alpha[0];
            o[dt * 4 + 2] *= alpha[1]; o[dt * 4 + 3] *= alpha[1];
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
            for (int x = 0; x < 4; ++x)
                pa[kk][x] = pack2(s[(2 * kk + (x >> 1)) * 4 + 2 * (x & 1)], s[(2 * kk + (x >> 1)) * 4 + 2 * (x & 1) + 1]);
    };

    if (nblk > 0) {
        if (LS_BSP_PINGPONG && wg == 1) named_bar_arrive(3, 256);
        wait_full(0);
        turn_wait();
        wg_fence();
        issue_s(0);
        turn_pass(false);
        wg_wait0();
        wg_pin(s);
        softmax(0);
        rescale_and_pack();
        for (int j = 1; j < nblk; ++j) {
            wait_full(j);
            wg_pin(o);
            turn_wait();
            wg_fence();
            issue_s(j);       // S_j = Q K_j^T
            issue_pv(j - 1);  // O += P_{j-1} V_{j-1}
            turn_pass(false);
            wg_wait1();       // S_j done; P V may still run
            wg_pin(s);
            softmax(j);
            wg_wait0();
            wg_pin(o);
            release(j - 1);
            rescale_and_pack();
        }
        wg_pin(o);
        turn_wait();
        wg_fence();
        issue_pv(nblk - 1);
        turn_pass(true);
        wg_wait0();
        wg_pin(o);
        release(nblk - 1);
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
}
