// The SM90 kernels' tile table. Chosen once, deterministically, from the head-dim tier; no
// runtime tuning. Each row says why.
#pragma once

namespace flash {

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
// +1-3% at 2k.
// d <= 128: three groups on 192 x 128 as well, without `overlap`: S + O (128 floats) fit the
// 160 registers that S + P + O do not, and a group's softmax then runs behind the other two
// groups' GEMMs (per block 3 x 1024 tensor cycles against ~2300 of one group's own S GEMM,
// softmax and PV issue). Against two groups on 128 x 176 with `overlap` (the softmax and its
// own RS PV issue, ~2550 cycles per block, had left the tensor cores idle ~20% of the time):
// non-causal +8-10% from 2048, causal +3-8%.
// d > 128: two groups with `overlap`; block_n shrinks as d grows so that Q and two stages fit
// (the d=256 tile, with the pipelines' barriers and the lazy softmax's rounding terms, uses
// all of it). Three groups would leave O alone (d / 2 floats) most of the 160 registers.
// cluster_m = 2 from d = 128 without a band: K and V then come from L2 at 128 FLOP per byte
// or less, and the loads, not the GEMMs, set the pace (d=128 8k: 577 TFLOP/s as is, 664 with
// the K/V loads of all but two blocks skipped). Two query tiles sharing each load halve that
// traffic (d=128 8k 596 -> 610, d=256 8k 647 -> 720). The cluster kernel needs an even number
// of query tiles in all and no varlen; the band kernel (cluster_m = 1) runs the rest.
// short_keys (the unpacked band kernel at d > 192, for keys up to sm90_short_keys_max): 64-key
// blocks. A short causal tile has few blocks, and the one the diagonal crosses is a larger
// share of them the larger the block: with every d256 band kernel on 64-key blocks, bf16 causal
// +5.3 / +6.2 / +3.8 / +0.8% at 512 / 1k / 2k / 4k against 80, -1.1% at 16k. As a kernel of its
// own up to 2k keys: causal +5.0 / +3.1 / +0.4% at 512 / 1k / 2k, 4k-16k unchanged; non-causal
// varlen 1k +3.7% (H200, 2026-11-28).
constexpr Sm90FwdTile sm90_fwd_tile(int d, bool band, bool short_keys = false) {
    return d <= 64    ? Sm90FwdTile{192, 128, 4, 3, true, 1}  // O small: 3 groups x 64 rows
           : d <= 128 ? Sm90FwdTile{192, 128, 2, 3, true, band ? 1 : 2, false}  // 176 KiB
           : d <= 192 ? Sm90FwdTile{128, 96, 2, 2, true, band ? 1 : 2}    // 192 KiB at d=192
           : short_keys ? Sm90FwdTile{128, 64, 2, 2, false, 1}
                        : Sm90FwdTile{128, 80, 2, 2, false, band ? 1 : 2};  // 224 KiB; O 128
}

// The e4m3 forward (inputs in one byte, the output in bf16): the PV GEMM's K dimension (block_n)
// must be a multiple of 32, an e4m3 WGMMA's K, and V is read K-major, so each V stage is
// transposed into a stage of its own (Traits::SmemLayoutVt, Traits::kVtStages stages) by the
// producer group's idle warps. d <= 128 keep the 16-bit tiles (152 KiB at d = 128 with four
// transposed stages): against them (H100, 2026-11-28) d64 192 x 160 lost 1-12% at 1k-2k
// (level at 8k), and d128 on two groups with overlap, 128 x 192 or 128 x 224, lost 9-26%.
// d = 160-192 take block_n 128 (216 KiB at d = 192), d = 224-256 block_n 96, not 80 (200 KiB
// at d = 256 with three transposed stages; 128 does not fit beside them), without overlap
// (with it -4..+1%).
// No clusters: the transposing warps, not the consumers, release V's stages, and a release to
// the other CTA of a pair would have to wait for both CTAs' transposes.
// d <= 64 without a band: the groups do not take turns. The softmax, not the tensor cores, sets
// the pace there (e4m3 GEMMs of 64 x 128 x 64 take a quarter of a block's issue time), and
// turns only made a group wait for the previous one's softmax: +4-8% at 1k-16k (H100,
// 2026-11-28). Causal lost 0-5% without them, so the band kernel keeps them.
// short_keys as above: e4m3 causal +11% at 512 and +2% at 1k against 96, -3.6..-7% from 2k
// (every band kernel); as its own kernel up to 1k keys +10.9% / +2.2% (512 / 1k). 128 keys
// (n128) spilled in the loop and lost 7-11% at every point from 512 to 16k.
constexpr Sm90FwdTile sm90_fwd_tile_fp8(int d, bool band, bool short_keys = false) {
    return d <= 64    ? Sm90FwdTile{192, 128, 4, 3, band, 1}
           : d <= 128 ? Sm90FwdTile{192, 128, 2, 3, true, 1, false}
           : d <= 192 ? Sm90FwdTile{128, 128, 2, 2, true, 1}
                      : Sm90FwdTile{128, short_keys ? 64 : 96, 2, 2, false, 1};
}

// The longest keys (seqlen_k, or max_seqlen_k for varlen) that the d > 192 band kernel runs on
// its short_keys tile: up to 2k in bf16/fp16, 1k in e4m3 (the measurements above).
constexpr int sm90_short_keys_max(bool fp8) { return fp8 ? 1024 : 2048; }

struct Sm90BwdTile {
    int block_m;  // query rows per step of the query loop
    int block_n;  // key rows per CTA: 64 per consumer warp group
    int stages;   // Q and dO buffers
    // The mask as a pass of its own before the exp2 loop (outside softcap), rather than a second
    // copy of the loop without the mask's test for the tiles that need none.
    bool mask_pass;
    // Two consumer groups on one 64-row K/V tile, each holding a part of d's columns of dK and
    // dV (the consumer mainloop's kWide branch), where a group's 64 rows of dK and dV would not fit
    // its registers.
    bool wide = false;
};

// SM90 backward: a CTA keeps a block_n-row K/V tile and its dK, dV accumulators in registers
// (block_n / 64 consumer warp groups of 64 key rows each) and walks the query tiles that see it.
// A group computes S^T and dP^T (64 x block_m), so P^T and dS^T are the register A operands of
// dV += P^T dO and dK += dS^T Q; dQ = dS K reads dS from shared memory. Registers per consumer
// thread: dK and dV d / 2 floats each, S^T and dP^T block_m / 2 each.
// d <= 64: block_m = 128 (S^T, dP^T 64 floats each beside dK, dV 32 each): more work per Q/dO
// load and per dQ atomic. d = 96, 128: block_m = 64, since dK and dV take 96-128 floats
// (at d = 128, 80 with dQ^T spilled 144 bytes and ran at 0.97-1.02 of 64, 2026-11-25).
// Two Q/dO stages let the next query tile load while this one computes.
// mask_pass: with block_m = 128 the loop's second copy spilled 172-228 bytes and the pass ran
// at 1.006-1.040 of it; with 64 the copy spills nothing and the pass ran at 0.970-1.004 (H100,
// bf16, 1k-16k, 2026-11-27). A branch-free pass (each key row's query range) then ran at
// 1.018-1.148 of the branchy one causal at d = 64, but 0.945-1.013 of the copy at d = 128
// (H100, 2026-12-07).
// d = 160-256 (wide): dK and dV of 64 rows would take d / 2 floats each per thread of one group, d
// together, so the two groups split their columns and S^T's query columns (64 x 32 each); P^T and
// dS^T go through shared memory to both groups' dV and dK GEMMs. d = 256: halves (64 + 64 floats).
// d = 160, 192, 224: halves would cut K's and Q's swizzle atoms (32 columns where d % 64 = 32,
// else 64), where a WGMMA operand must start, so group 0 takes half rounded up to whole atoms
// (96 + 64, 128 + 64, 128 + 96 columns): never more than d = 256's 128 columns, its registers.
// Shared memory: K, V, one Q and one dO stage 4 x 64 x d x 2 bytes, P^T and dS^T
// double-buffered 32 KiB, dQ 64 x d x 4 bytes: 224 KiB of the 227 at d = 256, 201 at 224.
// d = 256 ran at 1.30-1.80x the SM80 backward (H100, bf16, 1k-16k, 2026-11-27).
constexpr Sm90BwdTile sm90_bwd_tile(int d) {
    return d <= 64    ? Sm90BwdTile{128, 128, 2, true}
           : d <= 128 ? Sm90BwdTile{64, 128, 2, false}
                      : Sm90BwdTile{64, 64, 1, false, true};
}

// Head-dim tiers with an SM90 backward: all of them (32-256); the binding still sends any tier
// without a registered kernel to the SM80 backward.
constexpr bool sm90_bwd_supported(int d) { return d <= 256; }

}  // namespace flash
