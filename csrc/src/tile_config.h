// The one table of SM80-path tile sizes. Chosen once, deterministically, from the head-dim tier;
// no runtime tuning. Each row says why.
#pragma once

namespace flash {

struct Sm80FwdTile {
    int block_m, block_n, warps;
};

// Forward: 4 warps own 32-row slices of a 128-row Q tile while K/V stream through shared
// memory, until the O accumulator (block_m x d / threads floats) crowds the register file;
// past d=128 8 warps keep it at <= 128 floats per thread. Taller warp slices read fewer
// ldmatrix bytes per FLOP (the K and V fragments serve 32 rows, not 16).
constexpr Sm80FwdTile sm80_fwd_tile(int d) {
    // Measured on the device (benchmarks/NOTES.md, SM80 items 8 and 12): block_n = 128 at d=64
    // spills the S tile (128 floats per thread); at d=128 a 128x64 tile beats 64x128 by 4-8%
    // without a mask and is within 2.5% causal; 8 warps on a 128-row tile lose at d <= 128.
    return d <= 128 ? Sm80FwdTile{128, 64, 4}   // S 64 + O <= 128 floats per thread
                    : Sm80FwdTile{128, 64, 8};  // O stays at <= 128 floats per thread
}

struct Sm80BwdTile {
    int block_m, block_n, warps;
    // Warps along the first GEMM dimension for S/dP (block_m x block_n), dK/dV (block_n x d) and
    // dQ (block_m x d); the rest of the 8 warps split the second dimension. Squarer warp tiles
    // need fewer ldmatrix bytes per MMA, and shared-memory bandwidth bounds these GEMMs.
    int sdp_warps_m, dkv_warps_n, dq_warps_m;
};

// Backward: one CTA owns a K/V block and keeps dK, dV accumulators; 8 warps split them.
// block_n = 128 halves the dQ atomics per key; past d=128 the K, V, Q, dO tiles no longer fit
// shared memory at block_n = 128, so it drops to 64. The GEMMs are bound by shared-memory
// reads (ldmatrix): at d <= 64 a 128-row Q tile gives each warp a larger, squarer share of
// every GEMM (by count, 16% fewer bytes per FLOP than 64 rows); at d=128 the accumulators
// leave no registers for it. Past d=128 the dK/dV and dQ outputs (64 x d) are split 2 x 4
// (32 x d/4 per warp) where d % 64 == 0, squarer than 4 x 2. Measured: benchmarks/NOTES.md
// (SM80 items 8, 10, 14).
constexpr Sm80BwdTile sm80_bwd_tile(int d) {
    // A first-dimension split of 2 puts 16 * 8 / 2 = 64 columns in one MMA tile: d % 64 == 0.
    const int w = d % 64 == 0 ? 2 : 4;
    return d <= 64    ? Sm80BwdTile{128, 128, 8, 2, 4, 4}  // 128 KiB
           : d <= 128 ? Sm80BwdTile{64, 128, 8, 2, 4, w}   // 128 KiB
                      : Sm80BwdTile{64, 64, 8, 4, w, w};   // 144 KiB at d=256
}

struct Sm90FwdTile {
    int block_m, block_n, stages;
    int consumer_warpgroups;  // each owns 64 rows of the block_m-row Q tile
    bool pingpong;            // consumer warp groups take turns issuing their GEMMs
    int cluster_m;            // CTAs of a cluster, on neighbouring query tiles, that share each
                              // K/V tile through TMA multicast
    bool overlap = true;      // a group issues block n's S GEMM with block n + 1's PV GEMM and
                              // runs block n's softmax while that PV GEMM runs: S, P and O are
                              // live together. Without it the PV GEMM is done before the S GEMM
                              // is issued, and the other groups' GEMMs fill the softmax.
};

// SM90 forward: a producer warp group feeds K and V through TMA pipelines; consumer warp groups
// of 64 rows each run WGMMA and the softmax, taking turns on the tensor cores. Their registers
// (240 each with two groups, 160 with three) hold S (block_n / 2 floats), P (block_n / 4) and O
// (d / 2 floats). Shared memory (227 KiB) holds Q and `stages` K and V tiles.
// Every kernel is persistent (hopper/tile_scheduler.h). `band` (causal or window mask, and the
// shapes the cluster kernel cannot pair): tiles differ in length, so they are handed out longest
// first through a global counter. Without a band the tiles are uniform and walked statically.
// d <= 64: three consumer groups on a 192-row tile give each softmax more GEMM work to hide
// behind: +19% at 8k (396 -> 472), +20% at 16k causal. Four K/V stages (152 KiB; the tiles are
// small) let the next tile's first blocks load further ahead: +6-9% at 512, +3-7% at 1024,
// +1-3% at 2k (NOTES SM90 item 28).
// d <= 128: three groups on 192 x 128 as well, without `overlap`: S + O (128 floats) fit the
// 160 registers that S + P + O do not, and a group's softmax then runs behind the other two
// groups' GEMMs (per block 3 x 1024 tensor cycles against ~2300 of one group's own S GEMM,
// softmax and PV issue). Against two groups on 128 x 176 with `overlap` (the softmax and its
// own RS PV issue, ~2550 cycles per block, had left the tensor cores idle ~20% of the time):
// non-causal +8-10% from 2048, causal +3-8% (NOTES SM90 item 65).
// d > 128: two groups with `overlap`; block_n shrinks as d grows so that Q and two stages fit
// (the d=256 tile, with the pipelines' barriers and the lazy softmax's rounding terms, uses
// all of it). Three groups would leave O alone (d / 2 floats) most of the 160 registers.
// cluster_m = 2 from d = 128 without a band: K and V then come from L2 at 128 FLOP per byte
// or less, and the loads, not the GEMMs, set the pace (d=128 8k: 577 TFLOP/s as is, 664 with
// the K/V loads of all but two blocks skipped). Two query tiles sharing each load halve that
// traffic (d=128 8k 596 -> 610, d=256 8k 647 -> 720). The cluster kernel needs an even number
// of query tiles in all and no varlen; the band kernel (cluster_m = 1) runs the rest.
constexpr Sm90FwdTile sm90_fwd_tile(int d, bool band) {
    return d <= 64    ? Sm90FwdTile{192, 128, 4, 3, true, 1}  // O small: 3 groups x 64 rows
           : d <= 128 ? Sm90FwdTile{192, 128, 2, 3, true, band ? 1 : 2, false}  // 176 KiB
           : d <= 192 ? Sm90FwdTile{128, 96, 2, 2, true, band ? 1 : 2}    // 192 KiB at d=192
                      : Sm90FwdTile{128, 80, 2, 2, false, band ? 1 : 2};  // 224 KiB; O 128
}

// Head-dim tiers that kernels are compiled for; a head dim runs on the smallest tier holding it.
constexpr int kHeadDimTiers[] = {32, 64, 96, 128, 160, 192, 224, 256};

constexpr int headdim_tier(int d) {
    for (int t : kHeadDimTiers) {
        if (d <= t) return t;
    }
    return 0;
}

}  // namespace flash
