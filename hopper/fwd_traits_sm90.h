// Types of the SM90 forward for one (dtype, head-dim tier): tile sizes (from tile_size.h),
// WGMMA tiles, swizzled shared-memory layouts, TMA copies, pipelines and the shared storage.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <type_traits>
#include <utility>

#include "common/params.h"
#include "fp8_sm90.h"
#include "pipelines.h"
#include "sm90_utils.h"
#include "tile_size.h"
#include "tile_scheduler.h"

namespace flash {

// kBand: a causal or window mask may cut blocks anywhere, and sequences may end before their
// tensors do (varlen, seqused_k); without it only the key-length bound can cut a block, and
// only in the first key block the consumers process (the last one in the sequence).
// kPackGQA: tiles hold packed rows of a KV head's query heads (FwdParams::pack_gqa); its own
// instantiation, so the unpacked kernels keep their registers (the packed row mapping costs
// two in the key loop).
// kAlibi: the plain or band kernel with ALiBi's bias added to the scores, an instantiation of
// its own so that the others keep their registers. Not packed: a packed tile's rows are of
// several heads, each with its slope. Non-causal batched calls run it on the plain kernel, like
// calls without ALiBi: d = 64/128 at 4k/16k 1.07x the band kernel (H200, 2026-11-28).
// kValueWarp: the band kernel (packed or not) for paged K/V whose pages do not hold whole key
// blocks, loaded in boxes of a page each: the producer group's warp 1 loads V, warp 0 Q and K.
// One warp issuing every box set the pace of small pages (decode with pages of 16 at
// 0.67-0.79 of pages of 256; with the split, 0.93-0.96). An instantiation of its own: the
// split's code in the band kernel cost other runs 1-2% (d128 causal 8k). bf16/fp16; with two
// consumer groups (d > 128) its producer takes 40 registers and the consumers 232 (below). At
// d256 power-of-two pages never hold whole 80-key blocks, so all take boxes: decode with pages
// of 16 / 256 took 576 / 526 us with one loading warp, 386 / 391 with two (16k keys, H200).
// kShortKeys: the unpacked band kernel at d > 192 on 64-key blocks, for keys up to
// sm90_short_keys_max (hopper/tile_size.h), an instantiation of its own: longer keys run faster
// on the wider blocks.
// T = cutlass::float_e4m3_t: the FP8 forward (q, k, v in e4m3, O in bf16, per-(batch, KV head)
// descales in FwdParams), plain, band and packed kernels (no ALiBi), without clusters; V is
// transposed in shared memory by the producer group's other warps (hopper/fp8_sm90.h).
template <class T, int kHeadDim, bool kBand_, bool kPackGQA_ = false, bool kAlibi_ = false,
          bool kValueWarp_ = false, bool kShortKeys_ = false>
struct Sm90FwdTraits {
    using Element = T;
    static constexpr bool kFp8 = std::is_same_v<T, cutlass::float_e4m3_t>;
    using OutElement = std::conditional_t<kFp8, cutlass::bfloat16_t, T>;
    static constexpr bool kBand = kBand_;
    static constexpr bool kPackGQA = kPackGQA_;
    static constexpr bool kAlibi = kAlibi_;
    static_assert(!kPackGQA || kBand, "packed tiles run on the dynamic schedule");
    static_assert(!kAlibi || !kPackGQA, "ALiBi runs on the unpacked kernels");
    static_assert(!kFp8 || !kAlibi, "e4m3: no ALiBi");
    static constexpr bool kValueWarp = kValueWarp_;
    static_assert(!kValueWarp || (kBand && !kAlibi && !kFp8),
                  "V's own warp: the bf16/fp16 band kernels");
    static constexpr bool kShortKeys = kShortKeys_;
    static_assert(!kShortKeys || (kBand && !kPackGQA && !kAlibi && kHeadDim > 192),
                  "64-key blocks: the unpacked band kernel of d > 192");
    static constexpr Sm90FwdTile kTile = kFp8 ? sm90_fwd_tile_fp8(kHeadDim, kBand, kShortKeys)
                                              : sm90_fwd_tile(kHeadDim, kBand, kShortKeys);
    static constexpr int kBlockM = kTile.block_m;
    static constexpr int kBlockN = kTile.block_n;
    static constexpr int kStages = kTile.stages;
    // e4m3: stages of transposed V, as many as fit up to 4: the transposing warps may write a
    // stage only once every consumer group's PV GEMM has read it, and more stages let them run
    // ahead of the slowest group.
    static constexpr int kVtStages = kFp8 ? (kHeadDim <= 192 ? 4 : 3) : kStages;
    static constexpr int kConsumerWarpGroups = kTile.consumer_warpgroups;
    static constexpr bool kPingPong = kTile.pingpong;
    static constexpr int kClusterM = kTile.cluster_m;
    static_assert(kClusterM == 1 || !kBand, "band tiles differ in length: no lockstep pairs");
    // Tiles split by keys, their pieces merged by the last to finish: the plain kernel's last
    // round, and the packed kernel's few tiles against many keys (decode; run_fwd_sm90 sends
    // such grids there also without GQA). Not the unpacked band kernel: the merge in its tile
    // loop cost 5.6% at d=64 causal 512.
    static constexpr bool kSplitTiles = !kBand || kPackGQA;
    using Scheduler = std::conditional_t<kBand, DynamicTileScheduler<kSplitTiles>,
                                         StaticTileScheduler<kClusterM>>;
    // A consumer group whose rows all lie outside the sequence skips its GEMMs (the mainloop's
    // `idle`). Only for 192-row tiles, which often overhang (512 rows are 2.67 tiles): d=64
    // causal +2.4..+5.8% at 512-2048. The second copy of the tile loop made the d=256 kernels
    // spill 800 bytes and cost them up to 24% at 512.
    static constexpr bool kSkipIdleGroups = kTile.consumer_warpgroups == 3;
    static constexpr int kConsumerThreads = 128 * kConsumerWarpGroups;
    static constexpr int kThreads = 128 + kConsumerThreads;
    // e4m3: the producer group's warps other than the TMA issuer transpose V's stages; they,
    // not the consumers, read (and release) the TMA's V stages.
    static constexpr int kTransposeWarps = kFp8 ? 3 : 0;
    static constexpr int kValueReaderWarps = kFp8 ? kTransposeWarps : kConsumerThreads / 32;
    // setmaxnreg: the producer issues TMA, and e4m3's transposes V. With three consumer groups
    // at 160 the 512 threads' 65536 registers leave the producer 32: at d = 65-128, in e4m3 and
    // in kValueWarp kernels it takes them, as at 24 it spilled its tile setup and paged box
    // arithmetic (d128 band kernel 260 bytes against 100 at 32); the other d <= 64 kernels keep
    // 24, as 32 cost their decode 3-4.5% (16k keys). With two groups, e4m3's producer takes 40
    // and the consumers 232 (its transposes spilled at 24: d256 +16-19% against 24 and 240),
    // as do the kValueWarp kernels (two loading warps), while the other bf16/fp16 kernels keep
    // 24 and 240: their consumers at 232 lost 3-8% at d256 causal 512-2k and non-causal varlen.
    // setmaxnreg only moves registers within the CTA's launch allocation (65536 per SM over
    // kThreads, in steps of 8 per thread: 168 at 384 threads). A split that needs more makes
    // the consumers' increase wait forever: a producer at 32 beside two groups at 240 hung the
    // d=128 kernels.
    static constexpr int kProducerRegs =
        kConsumerWarpGroups == 3 ? (kFp8 || kValueWarp || kHeadDim > 64 ? 32 : 24)
                                 : (kFp8 || kValueWarp ? 40 : 24);
    static constexpr int kConsumerRegs =
        kConsumerWarpGroups == 3 ? 160 : (kFp8 || kValueWarp ? 232 : 240);
    static_assert(kBlockM == 64 * kConsumerWarpGroups);
    static_assert(kConsumerWarpGroups == 2 || kConsumerWarpGroups == 3);
    static_assert(128 * (kProducerRegs + kConsumerWarpGroups * kConsumerRegs) <=
                  kThreads * (65536 / kThreads / 8 * 8));

    using BM = Int<kBlockM>;
    using BN = Int<kBlockN>;
    using D = Int<kHeadDim>;
    using Stages = Int<kStages>;

    // Each consumer warp group takes 64 rows: S = Q K^T with both operands in shared memory,
    // O += P V with P from registers and V read MN-major (V's rows are its K dimension); e4m3
    // reads the transposed stage K-major.
    static constexpr GMMA::Major kMajorV = kFp8 ? GMMA::Major::K : GMMA::Major::MN;
    using MmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<T, T, float, Shape<_64, BN, D>>(),
                                          Layout<Shape<Int<kConsumerWarpGroups>, _1, _1>>{}));
    using MmaPV = decltype(make_tiled_mma(
        GMMA::rs_op_selector<T, T, float, Shape<_64, D, BN>, GMMA::Major::K, kMajorV>(),
        Layout<Shape<Int<kConsumerWarpGroups>, _1, _1>>{}));

    // Rows of d elements, swizzled in 128-byte (64-byte for odd multiples of 32) atoms, the form
    // both TMA and WGMMA read without bank conflicts.
    using SmemAtom =
        decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, T, BM, D>());
    using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<BM, D>{}));
    using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<BN, D, Stages>{}));
    // V as the PV GEMM's B operand, (d, block_n, stages): the same bytes, transposed view; e4m3:
    // stages of their own, block_n contiguous (keys in key_of_column order).
    using SmemLayoutVtView = decltype(composition(
        SmemLayoutKV{}, make_ordered_layout(Shape<D, BN, Stages>{}, Step<_2, _1, _3>{})));
    using SmemLayoutVtFp8 = decltype(tile_to_shape(
        cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, T, D, BN>(),
        Shape<D, BN, Int<kVtStages>>{}));
    using SmemLayoutVt = std::conditional_t<kFp8, SmemLayoutVtFp8, SmemLayoutVtView>;

    // Global tensors as TMA sees them: (rows, d, heads, batch). Batched: rows = seqlen and the
    // batch is a mode; varlen: rows = all packed rows and one batch, sequences found by offset.
    using GmemShape = Shape<int, int, int, int>;
    using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
    using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<T const*>(nullptr)),
                                            std::declval<GmemShape>(), std::declval<GmemStride>()));
    using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GmemTensor>(),
                                        SmemLayoutQ{}, Shape<BM, D>{}, _1{}));
    // In a cluster each CTA loads 1/kClusterM of every K and V tile and multicasts it to all
    // (where the unit spans two heads, every slice for itself: Tile::shared_kv).
    using TmaKVOp = std::conditional_t<(kClusterM > 1), SM90_TMA_LOAD_MULTICAST, SM90_TMA_LOAD>;
    template <class Gmem>
    static auto make_tma_kv(Gmem const& gmem) {
        return make_tma_copy(TmaKVOp{}, gmem, take<0, 2>(SmemLayoutKV{}), Shape<BN, D>{},
                             Int<kClusterM>{});
    }
    using TmaKV = decltype(make_tma_kv(std::declval<GmemTensor>()));
    // A paged K/V whose pages do not hold whole key blocks: each key block in boxes of kRows
    // rows, each box from its own page. kRows is a multiple of 8, a swizzle atom's height, so a
    // box lands on whole atoms of the stage, at the same swizzle phase as the stage's first rows.
    template <int kRows>
    using SmemLayoutKVRows = decltype(composition(
        take<0, 2>(SmemLayoutKV{}),
        make_layout(Shape<Int<kRows>, D>{}, make_stride(_1{}, BN{}))));
    template <int kRows, class Gmem>
    static auto make_tma_kv_rows(Gmem const& gmem) {
        return make_tma_copy(SM90_TMA_LOAD{}, gmem, SmemLayoutKVRows<kRows>{},
                             Shape<Int<kRows>, D>{}, _1{});
    }
    template <int kRows>
    using TmaKVRows = decltype(make_tma_kv_rows<kRows>(std::declval<GmemTensor>()));
    // The box height for pages of page_size rows (a multiple of 8): the tallest of 64, 32, 16
    // and 8 rows that divides both the page and the key block, since a paged block costs about
    // in proportion to its boxes. H100, 2026-11-27, decode at 4k / 16k keys, d=128 (blocks of
    // 128 rows), speed against pages of whole blocks: pages of 16, 32, 64 in 8-row boxes
    // 0.50-0.67; in boxes of the page's height 0.67-0.79, 0.87-0.94, 0.96-0.97.
    __host__ __device__ static constexpr int box_rows(int page_size) {
        return kBlockN % 64 == 0 && page_size % 64 == 0   ? 64
               : kBlockN % 32 == 0 && page_size % 32 == 0 ? 32
               : kBlockN % 16 == 0 && page_size % 16 == 0 ? 16
                                                          : 8;
    }
    // One pair of descriptors per box height; a height that does not divide the key block is
    // never chosen, and its pair takes 8-row boxes' types so that the struct stays the same.
    template <int kRows>
    struct KVRowsTma {
        TmaKVRows<(kBlockN % kRows == 0 ? kRows : 8)> k, v;
    };
    struct PagedRowsTma {
        KVRowsTma<8> r8;
        KVRowsTma<16> r16;
        KVRowsTma<32> r32;
        KVRowsTma<64> r64;

    };
    // t's pair of descriptors for boxes of kRows rows (t: a PagedRowsTma, const or not).
    template <int kRows, class Rows>
    __host__ __device__ static auto& paged_pair(Rows& t) {
        if constexpr (kRows == 64) return t.r64;
        else if constexpr (kRows == 32) return t.r32;
        else if constexpr (kRows == 16) return t.r16;
        else return t.r8;
    }
    // fn(Int<box_rows(page_size)>{}), the one place that turns the run-time height into a type
    // (heights that do not divide the key block are never chosen, and get no call).
    template <class Fn>
    __host__ __device__ static void with_box_rows(int page_size, Fn&& fn) {
        auto call = [&](auto rows) {
            if constexpr (kBlockN % decltype(rows)::value == 0) fn(rows);
        };
        switch (box_rows(page_size)) {
            case 64: call(_64{}); break;
            case 32: call(_32{}); break;
            case 16: call(_16{}); break;
            default: call(_8{}); break;
        }
    }
    // Fills in the pair of the box height for pages of page_size rows; the launch leaves the
    // others empty, so that an unpaged call encodes no descriptor for them.
    template <class Gmem>
    static void make_paged_rows(PagedRowsTma& t, int page_size, Gmem const& k, Gmem const& v) {
        with_box_rows(page_size, [&](auto rows) {
            constexpr int kRows = decltype(rows)::value;
            paged_pair<kRows>(t).k = make_tma_kv_rows<kRows>(k);
            paged_pair<kRows>(t).v = make_tma_kv_rows<kRows>(v);
        });
    }

    // The output leaves through shared memory and a TMA store (batched tiles, d >= 128; the
    // others write from registers). Each consumer group stages its 64 x d slice of O in
    // the K or V stage its tile read last: no shared memory is free for a buffer of its own at
    // d >= 128. Slices go into K's stage while they fit, the rest into V's.
    static constexpr bool kStagedOutput = kHeadDim >= 128 && !kPackGQA && !kFp8;
    // Below d = 128 a buffer of its own fits (24 KiB beside d=64's 152): each group stages its
    // slice there and leaves without waiting for the TMA, which reads it while the next tile
    // runs; the group waits for that read only before its next store. Packed tiles scatter
    // their rows over heads and write from registers. e4m3 at d = 128: its one-byte K/V leave
    // room for the buffer (48 KiB beside 152): +0.5-8% at 512-16k (H100, 2026-11-28; causal
    // 16k 0.99). At d = 64 e4m3 ran 0.95-0.99 with it, so it keeps the register stores.
    static constexpr bool kBufferedOutput =
        (kFp8 ? kHeadDim == 128 : kHeadDim <= 64) && !kPackGQA;
    // Band tiles end at the sequence's last row, so that a partial tile (a sequence length not
    // a multiple of block_m) is the top one, which under a causal mask sees the fewest keys:
    // at d=64, causal 1024, 27 instead of 32 tile-blocks per head (+5.5%; 512 +3.4%). Not
    // where O is staged (its stages are released per 64-row slice of whole tiles) or packed
    // (the row mapping divides rows by the group size). Such a top tile's slice across the
    // sequence's first row would start a TMA store at a negative row (a fault, where a load
    // zero-fills): store_buffered writes that one from registers.
    static constexpr bool kEndAligned = kBand && !kPackGQA && !kStagedOutput;
    static constexpr int kSlicesPerStage = kBlockN / 64;
    static_assert(2 * kSlicesPerStage >= kConsumerWarpGroups, "O slices do not fit a K + V stage");
    static constexpr bool slice_in_values(int group) { return group >= kSlicesPerStage; }
    static constexpr bool kAnySliceInValues = kConsumerWarpGroups > kSlicesPerStage;
    using Out = OutElement;
    using SmemLayoutOSlice = decltype(tile_to_shape(
        cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Out, BM, D>(),
        Shape<_64, D>{}));
    // One group's share of MmaPV: its accumulator registers (the same arrangement for every
    // input type), written to the slice with stmatrix (8 x 8 blocks of 16-bit pairs).
    using MmaPVGroup = decltype(make_tiled_mma(
        GMMA::rs_op_selector<Out, Out, float, Shape<_64, D, BN>, GMMA::Major::K,
                             GMMA::Major::MN>()));
    using StoreOSlice =
        decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Out>{}, MmaPVGroup{}));
    using GmemOutTensor =
        decltype(make_tensor(make_gmem_ptr(static_cast<Out const*>(nullptr)),
                             std::declval<GmemShape>(), std::declval<GmemStride>()));
    using TmaO = decltype(make_tma_copy(SM90_TMA_STORE{}, std::declval<GmemOutTensor>(),
                                        SmemLayoutOSlice{}, Shape<_64, D>{}, _1{}));

    // Q buffers. Two at d <= 64, where tiles are a few key blocks long: the next tile's Q loads
    // while this one runs instead of after its last S GEMM, so no group waits for it at the
    // tile boundary. Packed tiles gather Q in the consumers: one buffer (the producer's
    // acquire only hands it over, with no bytes to count).
    static constexpr int kQStages = kHeadDim <= 64 && !kPackGQA ? 2 : 1;
    using QPipe = QPipeline<kQStages>;
    using QState = cutlass::PipelineState<kQStages>;
    static constexpr int kQElems = cosize_v<SmemLayoutQ>;
    using KPipe = KPipeline<kStages, kClusterM>;
    using VPipe = VPipeline<kStages, kClusterM>;
    using PipeState = cutlass::PipelineState<kStages>;
    // The state of the stages the PV GEMMs read (ValuesPipe's).
    using ValuesState = cutlass::PipelineState<kVtStages>;

    static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(T);
    static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(T);

    // The consumer groups' O slices (kBufferedOutput), one SmemLayoutOSlice each; a base of
    // SharedStorage, so that kernels without it spend no bytes (d=256 has none to spare).
    struct OBuffer {
        alignas(1024) cute::array_aligned<Out, kConsumerWarpGroups * cosize_v<SmemLayoutOSlice>> o;
    };
    struct NoOBuffer {};
    // e4m3: the transposed V stages and their pipeline.
    using VtPipe = TransposedVPipeline<kVtStages>;
    struct VtBuffer {
        alignas(1024) cute::array_aligned<T, cosize_v<SmemLayoutVtFp8>> vt;
        typename VtPipe::SharedStorage vt_pipe;
    };
    struct NoVtBuffer {};
    // The pipeline whose stages the consumers' PV GEMMs read.
    using ValuesPipe = std::conditional_t<kFp8, VtPipe, VPipe>;
    struct SharedStorage : std::conditional_t<kBufferedOutput, OBuffer, NoOBuffer>,
                           std::conditional_t<kFp8, VtBuffer, NoVtBuffer> {
        alignas(1024) cute::array_aligned<T, kQStages * kQElems> q;
        alignas(1024) cute::array_aligned<T, cosize_v<SmemLayoutKV>> k;
        alignas(1024) cute::array_aligned<T, cosize_v<SmemLayoutKV>> v;
        typename QPipe::SharedStorage q_pipe;
        typename KPipe::SharedStorage k_pipe;
        typename VPipe::SharedStorage v_pipe;
        // Every consumer warp arrives once its tile's last S (PV) GEMM is done: a slice may
        // then overwrite the last K (V) stage.
        cutlass::arch::ClusterBarrier keys_read;
        cutlass::arch::ClusterBarrier values_read;
        TileQueue tiles;
        // Each consumer thread's rounding terms of the lazy softmax (OnlineSoftmax::
        // update_scores_lazy), two rows each: shared memory, not registers (see there).
        float row_err[kConsumerThreads * 2];
    };
    static constexpr int kSmemBytes = int(sizeof(SharedStorage));
    static_assert(kSmemBytes <= 227 * 1024, "tile does not fit shared memory");
};

// Everything the kernel reads, passed by value as a __grid_constant__ (TMA descriptors must live
// in parameter or constant memory).
template <class Traits>
struct Sm90FwdArgs {
    FwdParams p;
    typename Traits::TmaQ tma_q;
    typename Traits::TmaKV tma_k;
    typename Traits::TmaKV tma_v;
    typename Traits::PagedRowsTma paged_rows;  // paged K/V in pages that are not whole blocks
    typename Traits::TmaO tma_o;
    // Extents of the TMA views (see GmemShape): varlen has rows = total and batch = 1.
    int rows_q, rows_k, batch_q, batch_k;
    TileSchedulerParams sched;
};

}  // namespace flash
