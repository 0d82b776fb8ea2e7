// Host KV tier (docs/host_kv_tier.md): where a dense page of one layer lives.
//
// Kernels built with -DLS_TIER=1 take one extra pointer to a TierLayer (fixed device memory, one
// per layer, filled by lserve/cache/host_tier.py) and turn a virtual dense page into an address
// through slot[page]: >= 0 a resident slot of the device pool, < 0 host slot -1 - slot of the
// host pool (mapped pinned memory, read over PCIe). Without LS_TIER the pointer is ignored and
// the code is unchanged. The Python mirror of this layout is host_tier.TIER_LAYER_FIELDS.
// A selected page on the host is read from its staged copy where there is one (stage below).
#pragma once

struct TierLayer {
    const int* slot;                 // [virtual pages]: resident slot, or -1 - host slot
    const void* k;                   // host pool, laid out as the device pool
    const void* v;
    const float* ks;                 // scales / zero points (quantized pools, else null)
    const float* vs;
    const float* kz;
    const float* vz;
    // Staging (null: none): laid out as the selection (sel_idx), the resident slot holding a
    // copy of this head's part of a selected page that was on the host when it was selected
    // (written by ls_stage_picks, kernels/stage.cu), or -1. Read only where slot[] says
    // "host": a page installed since is read where it is now.
    const int* stage;                // 8 pointers: one 64-byte row per layer
};

#ifndef LS_TIER
#define LS_TIER 0
#endif
