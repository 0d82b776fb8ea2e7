// Per-decode-sequence metadata rows: the one definition of the layout. Every kernel that reads META
// includes this file, and the Python side reads these defines (kernels/decode_args.py: META_FIELDS).
#pragma once

// meta[f * nb + b]: per decode sequence
#define META_TOK 0     // row of the token in the step's [T, ...] tensors
#define META_LEN 1     // tokens in cache (the new one included)
#define META_NPAGES 2  // dense pages of the sequence
#define META_NRING 3   // ring pages holding data
#define META_NSEL 4    // pages at the last selection
#define META_SLOT 5    // selection-state slot
#define META_DYN 6     // 1: dense heads read the selection
#define META_KK 7      // K (budget pages)

// One sequence's metadata row.
struct MetaRow {
    int tok, len, npg, nring, nsel, slot, dyn, kk;
};
__device__ __forceinline__ MetaRow load_meta(const int* __restrict__ meta, int nb, int b) {
    MetaRow m;
    m.tok = meta[META_TOK * nb + b];
    m.len = meta[META_LEN * nb + b];
    m.npg = meta[META_NPAGES * nb + b];
    m.nring = meta[META_NRING * nb + b];
    m.nsel = meta[META_NSEL * nb + b];
    m.slot = meta[META_SLOT * nb + b];
    m.dyn = meta[META_DYN * nb + b];
    m.kk = meta[META_KK * nb + b];
    return m;
}
