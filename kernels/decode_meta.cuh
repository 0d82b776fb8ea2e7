// Per-decode-sequence metadata rows shared by the decode kernels (see CupyBackend._tables).
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
