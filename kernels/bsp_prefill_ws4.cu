// Block-sparse prefill attention over paged KV, warp-specialized for Hopper (sm_90a): v4 of
// bsp_prefill.cu, same tiles, block lists, key sources, masks and launch arguments (bsp_tile.cuh).
// Head dim 128 only. What it changes against v3 (bsp_prefill_ws.cu), and why
// (benchmarks/bsp_prefill/bsp_prefill_notes.md, "v4"):
//   * 128 keys per pipeline step: two consecutive entries of the tile's block list (any two kept
//     64-key blocks, not necessarily adjacent keys) fill rows 0-63 and 64-127 of one K and one V
//     stage, so S = Q K^T is m64n128 (v3: n64) and the per-step costs (barrier waits, fences,
//     commits, O's rescale) are paid once per 128 keys. An odd last entry leaves the step's second
//     half unfilled: its 64 columns are masked and P V runs over the first 64 keys only.
//   * Q in shared memory (128-byte swizzle) and S by the SS form of wgmma: the 32 registers v3
//     spent on Q's fragments hold the wider S instead (consumer live set: O 64 + S 64 + P 32).
//   * Separate K and V rings with their own full/empty mbarriers, the producer running K one step
//     ahead of V (K_j is read by step j's S, V_j by step j + 1's P V): K_j's slot is released as
//     soon as S_j has finished, so even two stages keep about two steps of loads in flight.
//   * Softmax: tree reductions (max, sum) instead of serial chains; O is rescaled only when a
//     row's max moved somewhere in the warp (exact: alpha is then 1.0 for every row skipped).
//   * Producer: one page-table lookup per key row (shift and mask for power-of-two pages).
//
// One CTA = 3 warpgroups over one 128-row query tile: warpgroup 0 the producer (cp.async into the
// rings, completion counted on the "full" mbarriers), warpgroups 1 and 2 the consumers, 64 rows
// each. Per step j a consumer issues S_j and O += P_{j-1} V_{j-1} as two commit groups, waits for
// S_j (wait_group 1), releases K_j, runs mask + online softmax of S_j while P V runs, waits for it
// (wait_group 0), releases V_{j-1}, rescales O and packs P_j.
#include "common.cuh"

#if LS_DTYPE == 2
#error "bsp_prefill_ws4 is bf16/fp16 only"
#endif
#if LS_HEAD_DIM != 128
#error "bsp_prefill_ws4 is head_dim 128 only"
#endif

#define D LS_HEAD_DIM
#ifndef LS_BSP_STAGES
#define LS_BSP_STAGES 2
#endif
#define NSTAGE LS_BSP_STAGES
#define NTHREADS 384  // producer warpgroup + 2 consumer warpgroups
#define BM 128
#define BN 64    // list block (bsp_tile.cuh)
#define SN 128   // keys per pipeline step: two list blocks
#define DK (D / 16)
#define NT (SN / 8)
#define DT (D / 8)
#define DG (D / 8)                  // 16-byte dim groups of a row
#define HALF_BYTES (128 * 128)      // one 64-dim half of a 128-row tile (128 rows x 128 bytes)
#define TILE_BYTES (2 * HALF_BYTES) // a K, V or Q tile: 128 rows x D
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240  // 128 * 24 + 256 * 240 <= 65536

#include "wgmma.cuh"
#include "sm90_pipe.cuh"
#include "bsp_tile.cuh"

// Byte offset of (row t, 16-byte dim group c) in a 128-row K, V or Q tile, 128-byte swizzle:
// two 64-dim halves of [128 rows][128 bytes], chunk c of row t at chunk (c % 8) ^ (t % 8).
__device__ __forceinline__ u32 sw_off(int t, int c) {
    return (u32)((c >> 3) * HALF_BYTES + t * 128 + (((c & 7) ^ (t & 7)) << 4));
}
// k-step kk (dims 16kk .. 16kk + 15) of a K-major operand whose rows start at tile address a
// (Q rows as A, key rows as B): +32 bytes per k-step inside the atom, SBO = next 8 rows.
__device__ __forceinline__ u64 kmajor_desc(u32 a, int kk) {
    return wg_desc_sw128(a + (kk >> 2) * HALF_BYTES + (kk & 3) * 32, 16, 1024);
}
// k-step kk (keys 16kk .. 16kk + 15) of O += P V, B MN-major: LBO = next 64 dims, SBO = next 8 keys.
__device__ __forceinline__ u64 v_desc(u32 tV, int kk) { return wg_desc_sw128(tV + kk * 2048, HALF_BYTES, 1024); }

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) ls_bsp_prefill_ws4(BSP_PARAMS) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    // [pad to 1024][K ring NSTAGE tiles][V ring NSTAGE tiles][Q tile][kfull, kempty, vfull, vempty x NSTAGE]
    const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const u32 k0 = base, v0 = base + NSTAGE * TILE_BYTES, sQ = base + 2 * NSTAGE * TILE_BYTES;
    const u32 bars = sQ + TILE_BYTES;
    auto kfull = [&](int st) { return bars + 8u * st; };
    auto kempty = [&](int st) { return bars + 8u * (NSTAGE + st); };
    auto vfull = [&](int st) { return bars + 8u * (2 * NSTAGE + st); };
    auto vempty = [&](int st) { return bars + 8u * (3 * NSTAGE + st); };

    const int tid = threadIdx.x;
    const BspTile tile(blockIdx.x, q, q_tok_stride, out, out_tok_stride, k, v, kv_tok_stride, pool_k, pool_v, pool_heads,
                       page_size, pages, tiles, seqs, rowptr, indices, n_rows, head0, n_dense, group, sink, local,
                       qscale);
    const int nblk = tile.nblk, nstep = (nblk + 1) / 2;
    if (tid == 0) {
        for (int st = 0; st < NSTAGE; ++st) {
            mbar_init(kfull(st), 128);  // every producer thread's cp.async arrival
            mbar_init(vfull(st), 128);
            mbar_init(kempty(st), 8);  // one arrival per consumer warp
            mbar_init(vempty(st), 8);
        }
    }
    __syncthreads();

    if (tid < 128) {
        // ---- producer: thread p copies dim group p % 16 of rows p / 16 + 8 i of each K / V step ----
        setmaxnreg_dec<PRODUCER_REGS>();
        const act_t* kbase = tile.paged ? pool_k : k;
        const act_t* vbase = tile.paged ? pool_v : v;
        const bool pow2 = (page_size & (page_size - 1)) == 0;
        const int psh = __ffs(page_size) - 1;
        const int c = tid % DG, t_lo = tid / DG;
        // Element offset of key row `key` (< q1) of this head: tile.key_off, with one lookup per row
        // and no division for power-of-two pages.
        auto row_src = [&](int key) -> i64 {
            if (tile.paged) {
                const int pi = pow2 ? key >> psh : key / page_size, pr = pow2 ? key & (page_size - 1) : key % page_size;
                return ((i64)pages[tile.page_off + pi] * pool_heads + tile.kvh) * page_size * D + (i64)pr * D;
            }
            return (i64)(tile.t0 + key - tile.start) * kv_tok_stride + (i64)tile.kvh * D;
        };
        // step j's rows into tile dst: list entries 2j (rows 0-63) and 2j + 1 (rows 64-127, if any)
        auto fill = [&](const act_t* src, u32 dst, int j) {
            const int halves = 2 * j + 1 < nblk ? 2 : 1;
            for (int h = 0; h < halves; ++h) {
                const int kb = tile.block_start(2 * j + h);
#pragma unroll 4
                for (int i = 0; i < BN / 8; ++i) {
                    const int t = t_lo + 8 * i, key = kb + t;
                    const bool ok = key < tile.q1;
                    cp_async16(dst + sw_off(64 * h + t, c), src + row_src(ok ? key : kb) + c * 8, ok ? 16 : 0);
                }
            }
        };
        // order K_0, (K_1, V_0), (K_2, V_1), ...: step j's consumers need K_j and V_{j-1}
        for (int j = 0; j <= nstep; ++j) {
            if (j < nstep) {
                const int st = j % NSTAGE;
                mbar_wait(kempty(st), ((j / NSTAGE) & 1) ^ 1);
                fill(kbase, k0 + (u32)st * TILE_BYTES, j);
                cp_async_mbar_arrive(kfull(st));
            }
            if (j > 0) {
                const int jv = j - 1, st = jv % NSTAGE;
                mbar_wait(vempty(st), ((jv / NSTAGE) & 1) ^ 1);
                fill(vbase, v0 + (u32)st * TILE_BYTES, jv);
                cp_async_mbar_arrive(vfull(st));
            }
        }
        cp_async_wait<0>();
        return;
    }

    // ---- consumers ------------------------------------------------------------------------------
    setmaxnreg_inc<CONSUMER_REGS>();
    const int ctid = tid - 128, wg = ctid >> 7, lane = ctid & 31;
    const int wrow = (ctid >> 5) * 16;  // this warp's 16 rows of the tile
    for (int x = ctid & 127; x < 64 * DG; x += 128) {
        const int m = 64 * wg + x / DG, c = x % DG;
        const bool ok = m < tile.rows_used;
        cp_async16(sQ + sw_off(m, c), q + tile.row_off(ok ? m : 0, q_tok_stride) + c * 8, ok ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_async_smem();  // this thread's Q writes (generic proxy), read by wgmma (async proxy)
    named_bar_sync(1 + wg, 128);
    const u32 qrows = sQ + (u32)wg * 64 * 128;  // this warpgroup's 64 Q rows (1024-aligned)

    const int prow[2] = {tile.row_pos(wrow + (lane >> 2)), tile.row_pos(wrow + (lane >> 2) + 8)};
    const int cq = (lane & 3) * 2;
    float o[DT * 4];
#pragma unroll
    for (int i = 0; i < DT * 4; ++i) o[i] = 0.f;
    float mrow[2] = {LS_NEG_INF, LS_NEG_INF}, lsum[2] = {0.f, 0.f}, alpha[2];
    float s[NT * 4];
    u32 pa[SN / 16][4];

    auto issue_s = [&](int j) {
        const u32 tK = k0 + (u32)(j % NSTAGE) * TILE_BYTES;
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) wg_ss_n128(s, kmajor_desc(qrows, kk), kmajor_desc(tK, kk), kk > 0);
        wg_commit();
    };
    // P V over the step's 128 keys, or its first 64 when the step holds one list block
    auto issue_pv = [&](int j) {
        const u32 tV = v0 + (u32)(j % NSTAGE) * TILE_BYTES;
        // a fence and a commit in each branch: ptxas fences a branch's first wgmma anyway, and a
        // commit after the join costs an extra (empty) group that wait_group 1 would then count
        if (2 * j + 1 < nblk) {
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < SN / 16; ++kk) wg_pv_n128(o, pa[kk], v_desc(tV, kk), 1);
            wg_commit();
        } else {
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) wg_pv_n128(o, pa[kk], v_desc(tV, kk), 1);
            wg_commit();
        }
    };
    auto wait_full = [&](u32 bar, int j) {
        mbar_wait(bar, (j / NSTAGE) & 1);
        fence_async_smem();  // the producer's cp.async writes (generic proxy), read by wgmma (async proxy)
    };
    auto release = [&](u32 bar) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar);
    };
    // mask + online softmax of S (step j) into unnormalized probabilities; sets alpha (O's rescale)
    auto softmax = [&](int j) {
        const bool two = 2 * j + 1 < nblk;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (h == 1 && !two) {
#pragma unroll
                for (int i = 32; i < 64; ++i) s[i] = LS_NEG_INF;  // no second block: its keys are unfilled
                continue;
            }
            const int kb = tile.block_start(2 * j + h);
            if (tile.needs_mask(kb)) {
#pragma unroll
                for (int nt = 8 * h; nt < 8 * h + 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (!tile.visible(kb + (nt - 8 * h) * 8 + cq + (e & 1), prow[e >> 1], sink, local))
                            s[nt * 4 + e] = LS_NEG_INF;
            }
        }
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float m8[8];
#pragma unroll
            for (int i = 0; i < 8; ++i)
                m8[i] = fmaxf(fmaxf(s[(2 * i) * 4 + 2 * hr], s[(2 * i) * 4 + 2 * hr + 1]),
                              fmaxf(s[(2 * i + 1) * 4 + 2 * hr], s[(2 * i + 1) * 4 + 2 * hr + 1]));
            float mx = fmaxf(fmaxf(fmaxf(m8[0], m8[1]), fmaxf(m8[2], m8[3])),
                             fmaxf(fmaxf(m8[4], m8[5]), fmaxf(m8[6], m8[7])));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(mrow[hr], mx * qscale);
            const bool none = mnew == LS_NEG_INF;
            alpha[hr] = none ? 1.f : fast_exp2(mrow[hr] - mnew);
            const float msub = none ? 0.f : mnew;
            float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                    const float pr = fast_exp2(fmaf(s[nt * 4 + e], qscale, -msub));
                    s[nt * 4 + e] = pr;
                    part[(nt & 1) * 2 + (e & 1)] += pr;
                }
            lsum[hr] = lsum[hr] * alpha[hr] + ((part[0] + part[1]) + (part[2] + part[3]));
            mrow[hr] = mnew;
        }
    };
    auto rescale_and_pack = [&]() {
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                o[dt * 4] *= alpha[0]; o[dt * 4 + 1] *= alpha[0];
                o[dt * 4 + 2] *= alpha[1]; o[dt * 4 + 3] *= alpha[1];
            }
        }
#pragma unroll
        for (int kk = 0; kk < SN / 16; ++kk)
#pragma unroll
            for (int x = 0; x < 4; ++x)
                pa[kk][x] = pack2(s[(2 * kk + (x >> 1)) * 4 + 2 * (x & 1)], s[(2 * kk + (x >> 1)) * 4 + 2 * (x & 1) + 1]);
    };

    if (nstep > 0) {
        wait_full(kfull(0), 0);
        wg_fence();
        issue_s(0);
        wg_wait0();
        wg_pin(s);
        release(kempty(0));
        softmax(0);
        rescale_and_pack();
        for (int j = 1; j < nstep; ++j) {
            wait_full(kfull(j % NSTAGE), j);
            wait_full(vfull((j - 1) % NSTAGE), j - 1);
            wg_pin(o);
            wg_fence();
            issue_s(j);       // S_j = Q K_j^T
            issue_pv(j - 1);  // O += P_{j-1} V_{j-1}
            wg_wait1();       // S_j done; P V may still run
            wg_pin(s);
            release(kempty(j % NSTAGE));
            softmax(j);
            wg_wait0();
            wg_pin(o);
            release(vempty((j - 1) % NSTAGE));
            rescale_and_pack();
        }
        wait_full(vfull((nstep - 1) % NSTAGE), nstep - 1);
        wg_pin(o);
        wg_fence();
        issue_pv(nstep - 1);
        wg_wait0();
        wg_pin(o);
        release(vempty((nstep - 1) % NSTAGE));
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
