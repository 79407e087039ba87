// The SM80 kernels' tile table. Chosen once, deterministically, from the head-dim tier;
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
    // Measured on the device: block_n = 128 at d=64 spills the S tile (128 floats per thread;
    // -3..-7%); at d=128 a 128x64 tile beats 64x128 by 4-8% without a mask and is within 2.5%
    // causal; 8 warps on a 128-row tile lose at d <= 128 (-5% at 128x128, -17% at 128x64).
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
// (32 x d/4 per warp) where d % 64 == 0, squarer than 4 x 2. Measured: 128 rows at d=64
// +0.5..+3.6% over 64 rows; the 2 x 4 split at d=256 +6.5..+8.3% over 4 x 2.
constexpr Sm80BwdTile sm80_bwd_tile(int d) {
    // A first-dimension split of 2 puts 16 * 8 / 2 = 64 columns in one MMA tile: d % 64 == 0.
    const int w = d % 64 == 0 ? 2 : 4;
    return d <= 64    ? Sm80BwdTile{128, 128, 8, 2, 4, 4}  // 128 KiB
           : d <= 128 ? Sm80BwdTile{64, 128, 8, 2, 4, w}   // 128 KiB
                      : Sm80BwdTile{64, 64, 8, 4, w, w};   // 144 KiB at d=256
}

}  // namespace flash
