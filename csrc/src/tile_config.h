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
    int cluster_m;            // CTAs of a cluster, on neighbouring query tiles of one head,
                              // that share each K/V tile through TMA multicast

    constexpr bool operator==(Sm90FwdTile const& o) const {
        return block_m == o.block_m && block_n == o.block_n && stages == o.stages &&
               consumer_warpgroups == o.consumer_warpgroups && pingpong == o.pingpong &&
               cluster_m == o.cluster_m;
    }
};

// SM90 forward: a producer warp group feeds K and V through TMA pipelines; two consumer warp
// groups of 64 rows each run WGMMA. The per-thread registers (consumers raise theirs to 240) hold
// S (block_n / 2 floats), P (block_n / 4) and O (d / 2 floats), twice over S/P while the next
// block's S GEMM overlaps this block's softmax. Shared memory (227 KiB) holds Q and `stages`
// K and V tiles: block_n shrinks as d grows so that both fit (the d=128 band and d=256 tiles,
// with the pipelines' barriers and the lazy softmax's 2 KiB of rounding terms, use all of it).
// Every kernel is persistent (hopper/tile_scheduler.h). `band` (causal or window mask, and the
// shapes the cluster kernel cannot pair): tiles differ in length, so they are handed out longest
// first through a global counter, and block_n = 128 at d = 128 wastes less on the diagonal.
// Its three K/V stages: the next tile's Q loads while this tile's last blocks run (the
// epilogue writes O from registers); with two stages that early load cost 3-4% at causal
// 512-2k, with three it is within 1.5% of the shared-buffer epilogue at 512-8k.
// Without a band the tiles are uniform and walked statically; block_n = 176 (+5% at d=128, 8k
// when chosen; since the lazy rescale 128 x 128 with two stages measures the same).
// `short_keys` (seqlen_k <= kSm90ShortKeys, plain kernel only): at d=128, 128 x 128 with three
// stages instead, whose producer runs further ahead across the tile boundaries: non-causal
// 512 +4.4..+5.0%, 1024 -0.5..+2.1%, 2048 -0.3..+1.0%, 8k -1.7..+0.6%, 16k -1.2..-1.9% in
// three in-process A/Bs (NOTES SM90 item 55), so it stops where it stops gaining.
// d <= 64: three consumer groups (160 registers each) on a 192-row tile give each softmax
// more GEMM work to hide behind: +19% at 8k (396 -> 472), +20% at 16k causal. Four K/V
// stages (152 KiB; the tiles are small) let the next tile's first blocks load further ahead:
// +6-9% at 512, +3-7% at 1024, +1-3% at 2k (NOTES SM90 item 28).
// cluster_m = 2 from d = 128 without a band: K and V then come from L2 at 128 FLOP per byte
// or less, and the loads, not the GEMMs, set the pace (d=128 8k: 577 TFLOP/s as is, 664 with
// the K/V loads of all but two blocks skipped). Two query tiles sharing each load halve that
// traffic (d=128 8k 596 -> 610, d=256 8k 647 -> 720). The cluster kernel needs an even number
// of query tiles per head and no varlen; the band kernel (cluster_m = 1) runs the rest.
constexpr int kSm90ShortKeys = 1024;
constexpr Sm90FwdTile sm90_fwd_tile(int d, bool band, bool short_keys = false) {
    return d <= 64    ? Sm90FwdTile{192, 128, 4, 3, true, 1}  // O small: 3 groups x 64 rows
           : d <= 128 ? (band         ? Sm90FwdTile{128, 128, 3, 2, true, 1}   // 224 KiB
                         : short_keys ? Sm90FwdTile{128, 128, 3, 2, true, 2}   // 224 KiB
                                      : Sm90FwdTile{128, 176, 2, 2, true, 2})  // 208 KiB
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
