// What one CTA of a block-sparse prefill kernel (bsp_prefill.cu, bsp_prefill_wg.cu) works on:
// its query tile (sequence, positions [q0, q1), rows = (position, query head) pairs with the GQA
// group folded in position-major), the key blocks it visits, and where their K/V rows live.
// Including kernels define D, BM (tile rows) and BN (keys per block) first.
#pragma once
#include "common.cuh"

// The kernels' common parameter list (host: lserve/attention/paged_prefill.py::run).
#define BSP_PARAMS                                                                                        \
    const act_t *__restrict__ q, i64 q_tok_stride, /* [T, Hq, D] */                                      \
        act_t *__restrict__ out, i64 out_tok_stride, /* [T, Hq, D] */                                    \
        const act_t *__restrict__ k, const act_t *__restrict__ v, i64 kv_tok_stride, /* [T, Hkv, D] */   \
        const act_t *__restrict__ pool_k, const act_t *__restrict__ pool_v, /* [P, pool_heads, NP, D] */ \
        int pool_heads, int page_size, const int *__restrict__ pages,                                    \
        const int *__restrict__ tiles,   /* [n_tiles, 4]: sequence, q0, q1 (absolute), list row or -1 */ \
        const int *__restrict__ seqs,    /* [n_seq, 4]: t0 (first step row), start, n_new, page_off */   \
        const int *__restrict__ rowptr,  /* [n_dense, n_rows, 2]: (first, end) into indices, or null */  \
        const int *__restrict__ indices, /* kept KV block ids, ascending within a row */                 \
        int n_rows, int head0, int n_dense, int group, int sink, int local, float qscale

struct BspTile {
    int q0, q1, t0, start, page_off, kvh, G, rows_used, nblk, nb0, rs1;
    bool dense, paged;
    const int* list;

    // Tile ``ti`` of the launch (the CTA's blockIdx.x, or one of a persistent CTA's tiles), KV head
    // head0 + blockIdx.y. Key blocks: a dense head's listed blocks (those past the tile's last
    // position dropped), or every causal block; a streaming head's [0, sink) and [q0 - local + 1, q1) blocks.
    __device__ __forceinline__ BspTile(int ti, BSP_PARAMS) {
        (void)q; (void)q_tok_stride; (void)out; (void)out_tok_stride; (void)qscale;
        const int* tl = tiles + 4 * ti;
        const int si = tl[0], lrow = tl[3];
        q0 = tl[1]; q1 = tl[2];
        t0 = seqs[4 * si]; start = seqs[4 * si + 1]; page_off = seqs[4 * si + 3];
        kvh = head0 + blockIdx.y;
        dense = kvh < n_dense;
        paged = dense && pool_k != nullptr;
        G = group;
        rows_used = min(BM / G, q1 - q0) * G;  // rows of whole positions inside [q0, q1)
        (void)k; (void)v; (void)pool_v; (void)pool_heads; (void)page_size; (void)pages; (void)kv_tok_stride;
        list = nullptr; nb0 = 0; rs1 = 0;
        if (dense && lrow >= 0) {
            const int* ip = rowptr + ((i64)kvh * n_rows + lrow) * 2;
            list = indices + ip[0];
            nblk = ip[1] - ip[0];
            while (nblk > 0 && list[nblk - 1] * BN >= q1) --nblk;
        } else if (dense) {
            nblk = (q1 + BN - 1) / BN;
        } else {
            const int a_end = min(sink, q1);
            const int b_start = max(a_end, q0 - local + 1);
            nb0 = (a_end + BN - 1) / BN;
            rs1 = max(b_start / BN * BN, nb0 * BN);
            nblk = nb0 + (q1 > rs1 ? (q1 - rs1 + BN - 1) / BN : 0);
        }
    }
    __device__ __forceinline__ int block_start(int j) const {
        if (list) return list[j] * BN;
        if (dense) return j * BN;
        return j < nb0 ? j * BN : rs1 + (j - nb0) * BN;
    }
    // Element offset of key t's row for this head (t < q1) in the pool (paged) or the step's rows;
    // the kernel's parameters are passed through so that they stay in the constant bank.
    __device__ __forceinline__ i64 key_off(int t, const int* pages, int pool_heads, int page_size,
                                           i64 kv_tok_stride) const {
        if (paged) {
            const int pg = pages[page_off + t / page_size];
            return ((i64)pg * pool_heads + kvh) * page_size * D + (i64)(t % page_size) * D;
        }
        return (i64)(t0 + t - start) * kv_tok_stride + (i64)kvh * D;
    }
    // Position of tile row m, -1 for rows past the tile (every key is then masked).
    __device__ __forceinline__ int row_pos(int m) const { return m < rows_used ? q0 + m / G : -1; }
    // Does the query at position p see key t? Only blocks where this can be false need the mask.
    __device__ __forceinline__ bool needs_mask(int kb) const { return !dense || kb + BN - 1 > q0; }
    __device__ __forceinline__ bool visible(int t, int p, int sink, int local) const {
        return t <= p && (dense || t < sink || p - t < local);
    }
    // Element offset of tile row m's query / output vector.
    __device__ __forceinline__ i64 row_off(int m, i64 tok_stride) const {
        return (i64)(t0 + q0 + m / G - start) * tok_stride + (i64)(kvh * G + m % G) * D;
    }
};
