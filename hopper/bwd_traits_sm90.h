// Types of the SM90 backward for one (dtype, head-dim tier): tile sizes (tile_size.h), WGMMA
// tiles, swizzled shared-memory layouts, TMA copies, pipelines and the shared storage.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <type_traits>
#include <utility>

#include "common/params.h"
#include "pipelines.h"
#include "sm90_utils.h"
#include "tile_size.h"

namespace flash {

struct DoOperand {};

// The backward kernel's named barriers (0 is __syncthreads).
enum class BwdBarrier : int {
    // Wide tile: both groups wrote their query columns of P^T and dS^T for this step.
    kPdsFull = 1,
    // Group g wrote its rows of dS^T into buffer b (id + 4 g + b): group g arrives, the other
    // group syncs before its dQ GEMM reads the buffer. One way, so the groups never meet.
    kDsFull = 2,
    // Wide tile, all consumer threads, in the epilogue: every group's last GEMM has read K and
    // V (their buffers then hold dK and dV), and later every thread has written its part of
    // them. It shares kPdsFull's id: the same threads, each past its last kPdsFull sync by
    // then.
    kEpilogue = kPdsFull,
    // Per consumer group g (ids + g), between that group and the dQ warp only, so that neither
    // group waits for the other's dQ:
    kDqFull = 10,   // the group wrote its part of a tile's dQ into shared memory
    kDqEmpty = 12,  // the dQ warp's reduction has read that part: the group may write the next
    // The groups take turns to issue their S^T and dP^T GEMMs (id + g: group g's turn), which
    // keeps them half a step apart: one group's exp2 and dS^T work runs under the other's GEMMs.
    kTurn = 14,
};

__forceinline__ __device__ BwdBarrier ds_full(int group, int buffer) {
    return BwdBarrier(int(BwdBarrier::kDsFull) + 4 * group + buffer);
}
__forceinline__ __device__ BwdBarrier group_turn(int group) {
    return BwdBarrier(int(BwdBarrier::kTurn) + group);
}

__forceinline__ __device__ BwdBarrier dq_full(int group) {
    return BwdBarrier(int(BwdBarrier::kDqFull) + group);
}
__forceinline__ __device__ BwdBarrier dq_empty(int group) {
    return BwdBarrier(int(BwdBarrier::kDqEmpty) + group);
}

// Warps of the producer warp group.
enum class BwdProducerWarp : int {
    kLoad = 0,      // TMA loads of K, V, Q, dO and the row values
    kDqReduce = 1,  // bulk reductions of each tile's dQ into the fp32 accumulator
};

// Columns [kCol0, kCol0 + kCols) of a shared-memory tensor whose mode 0 is d's columns (K^T, Q^T,
// dO^T), its other modes whole: a consumer group's block of a WGMMA's MN-major B operand. The
// swizzle stays with the layout (the offset joins the composed layout's), so the block must
// start on a whole swizzle atom.
template <int kCol0, int kCols, class Engine, class Layout>
__device__ auto smem_cols(Tensor<Engine, Layout> const& t) {
    if constexpr (rank_v<Layout> == 2) {
        return domain_offset(make_coord(Int<kCol0>{}, _0{}), t).compose(Int<kCols>{}, _);
    } else {
        static_assert(rank_v<Layout> == 3);
        return domain_offset(make_coord(Int<kCol0>{}, _0{}, _0{}), t).compose(Int<kCols>{}, _, _);
    }
}

// kAlibi: its own instantiation, so kernels without ALiBi keep their registers.
template <class T, int kHeadDim, bool kAlibi_>
struct Sm90BwdTraits {
    using Element = T;
    static constexpr bool kAlibi = kAlibi_;
    static constexpr Sm90BwdTile kTile = sm90_bwd_tile(kHeadDim);
    static constexpr int kBlockM = kTile.block_m;
    static constexpr int kBlockN = kTile.block_n;
    static constexpr int kStages = kTile.stages;
    static constexpr bool kMaskPass = kTile.mask_pass;
    static constexpr bool kWide = kTile.wide;
    static constexpr int kConsumerWarpGroups = kWide ? 2 : kBlockN / kWarpGroupRows;
    static constexpr int kConsumerThreads = kWarpGroupThreads * kConsumerWarpGroups;
    static constexpr int kThreads = kWarpGroupThreads + kConsumerThreads;
    // setmaxnreg: the producer only issues copies; the consumers hold dK, dV, S^T and dP^T.
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = 240;
    static_assert(kConsumerWarpGroups == 2, "register split below assumes 384 threads");
    static_assert(kWarpGroupThreads * (kProducerRegs + kConsumerWarpGroups * kConsumerRegs) <=
                  kThreads * (65536 / kThreads / 8 * 8));
    static_assert(kBlockM == 64 || kBlockM == 128);

    using BM = Int<kBlockM>;
    using BN = Int<kBlockN>;
    using D = Int<kHeadDim>;
    using Stages = Int<kStages>;
    using WarpGroupsAlongM = Layout<Shape<Int<kConsumerWarpGroups>, _1, _1>>;
    using WarpGroupsAlongN = Layout<Shape<_1, Int<kConsumerWarpGroups>, _1>>;

    // S^T = K Q^T and dP^T = V dO^T, (block_n x block_m): a warp group per 64 key rows (wide: per
    // half of the query columns), both operands K-major in shared memory.
    using SdPColumns = Int<kWide ? kBlockM / kConsumerWarpGroups : kBlockM>;
    using MmaSdP = decltype(make_tiled_mma(
        GMMA::ss_op_selector<T, T, float, Shape<_64, SdPColumns, D>>(),
        std::conditional_t<kWide, WarpGroupsAlongN, WarpGroupsAlongM>{}));
    // dV += P^T dO and dK += dS^T Q, (block_n x d): A is the previous GEMMs' accumulator in
    // registers (wide: P^T and dS^T from shared memory, K-major, each group half of d's columns
    // where the halves are whole swizzle atoms, else KvPart below), B is dO or Q read MN-major
    // (their rows are the K dimension).
    using MmaKV = std::conditional_t<
        kWide,
        decltype(make_tiled_mma(
            GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kHeadDim / kConsumerWarpGroups>, BM>,
                                 GMMA::Major::K, GMMA::Major::MN>(),
            WarpGroupsAlongN{})),
        decltype(make_tiled_mma(
            GMMA::rs_op_selector<T, T, float, Shape<_64, D, BM>, GMMA::Major::K, GMMA::Major::MN>(),
            WarpGroupsAlongM{}))>;

    // Rows of d elements (K, V, Q, dO) and dS^T's rows of block_m, swizzled in the atoms that
    // TMA and WGMMA both read without bank conflicts.
    using SmemAtomQ =
        decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, T, BM, D>());
    using SmemAtomK =
        decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, T, BN, D>());
    using SmemAtomDs =
        decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, T, BN, BM>());
    // dQ = dS K, (block_m x d), both operands MN-major in shared memory, each consumer group a
    // block of it. With 128 query rows the groups take 64 rows each. With 64 they split d's
    // columns where K's swizzle atoms allow (a WGMMA's B operand starts on a whole atom): halves
    // at d = 128 and 256; group 0 half rounded up to whole atoms elsewhere: 64 + 32 at d = 96,
    // whose 32-column atoms 48 would cut, 96 + 64, 128 + 64, 128 + 96 at d = 160, 192, 224.
    // Equal blocks are one tiled MMA over both groups (DqWhole); unequal ones a WGMMA per group
    // (DqPart<g>). The wide tile splits dK's and dV's columns the same way (KvWhole, KvPart<g>).
    static constexpr bool kDqSplitRows = kBlockM == kWarpGroupRows * kConsumerWarpGroups;
    static constexpr int kKAtomCols = decltype(size<1>(SmemAtomK{}))::value;
    // Q^T and dO^T are split where K^T is: the same atoms.
    static_assert(decltype(size<1>(SmemAtomQ{}))::value == kKAtomCols);
    static constexpr int kDqCols0 =
        kDqSplitRows ? kHeadDim : (kHeadDim / 2 + kKAtomCols - 1) / kKAtomCols * kKAtomCols;
    static constexpr bool kDqPartsAlike = kDqSplitRows || 2 * kDqCols0 == kHeadDim;
    struct DqWhole {
        using TileShape = Shape<BM, D>;
        using Mma = decltype(make_tiled_mma(
            GMMA::ss_op_selector<T, T, float,
                                 std::conditional_t<kDqSplitRows, Shape<_64, D, BN>,
                                                    Shape<_64, Int<kDqCols0>, BN>>,
                                 GMMA::Major::MN, GMMA::Major::MN>(),
            std::conditional_t<kDqSplitRows, WarpGroupsAlongM, WarpGroupsAlongN>{}));
        static constexpr int kCol0 = 0;
        // The MMA's thread index of consumer thread t: t itself (of t's type: an unsigned
        // threadIdx.x keeps the slice's index arithmetic unsigned).
        template <class I>
        static __device__ I mma_thread(I t) {
            return t;
        }
    };
    template <int kGroup>
    struct DqPart {
        static constexpr int kCols = kGroup == 0 ? kDqCols0 : kHeadDim - kDqCols0;
        using TileShape = Shape<_64, Int<kCols>>;
        using Mma = decltype(make_tiled_mma(
            GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kCols>, BN>, GMMA::Major::MN,
                                 GMMA::Major::MN>()));
        static constexpr int kCol0 = kGroup * kDqCols0;
        template <class I>
        static __device__ I mma_thread(I t) {
            return t % kWarpGroupThreads;
        }
        // All block_m = 64 rows, so dS^T is the whole A operand.
        static_assert(!kDqSplitRows && kCols > 0 && kCols % kKAtomCols == 0);
    };
    // A consumer group's dV and dK GEMMs and their accumulators' tile. KvWhole: one tiled MMA
    // over both groups (MmaKV: 64 key rows each, or the wide tile's column halves). KvPart<g>:
    // the wide tile where halves would cut swizzle atoms, a WGMMA of group g over DqPart<g>'s
    // columns of dO^T and Q^T; its dQ block is that part's (Dq).
    struct KvWhole {
        using Mma = MmaKV;
        using TileShape = Shape<BN, D>;
        static constexpr int kCol0 = 0;
        template <class I>
        static __device__ I mma_thread(I t) {
            return t;
        }
        template <class Tn>
        static __device__ Tn const& cols(Tn const& t) {
            return t;
        }
    };
    template <int kGroup>
    struct KvPart {
        using Dq = DqPart<kGroup>;
        static constexpr int kCols = Dq::kCols;
        static constexpr int kCol0 = Dq::kCol0;
        using Mma = decltype(make_tiled_mma(
            GMMA::ss_op_selector<T, T, float, Shape<_64, Int<kCols>, BM>, GMMA::Major::K,
                                 GMMA::Major::MN>()));
        using TileShape = Shape<BN, Int<kCols>>;
        template <class I>
        static __device__ I mma_thread(I t) {
            return Dq::mma_thread(t);
        }
        template <class Tn>
        static __device__ auto cols(Tn const& t) {
            return smem_cols<kCol0, kCols>(t);
        }
        static_assert(kWide && kBlockN == kWarpGroupRows);
    };
    // The wide tile's groups each run a KvPart where their blocks differ.
    static constexpr bool kKvParts = kWide && !kDqPartsAlike;
    // Floats of group g's block; it starts at group 0's floats in a tile.
    static constexpr int kDqFloats0 = kDqSplitRows ? kWarpGroupRows * kHeadDim
                                                   : kBlockM * kDqCols0;
    static __host__ __device__ constexpr int dq_part_offset(int group) {
        return group * kDqFloats0;
    }
    static __host__ __device__ constexpr int dq_part_floats(int group) {
        return group == 0 ? kDqFloats0 : kBlockM * kHeadDim - kDqFloats0;
    }
    static_assert(kConsumerWarpGroups == 2 && dq_part_floats(1) % (4 * kWarpGroupThreads) == 0 &&
                  kDqFloats0 % (4 * kWarpGroupThreads) == 0);
    // Where float4 j of consumer thread t's (0-255) dQ fragment lives in a tile (shared memory
    // and the accumulator alike): in its group's block, j-major, so that a warp's float4 stores
    // are contiguous (no bank conflicts) and each block is one bulk reduction. The block's
    // offset comes from t, not from the group: the index arithmetic's form decides how the
    // compiler strength-reduces the addresses, and this one keeps the equal splits' code.
    static __device__ int dq_float4_index(int j, int t) {
        return t / kWarpGroupThreads * (kDqFloats0 / 4) + j * kWarpGroupThreads +
               t % kWarpGroupThreads;
    }

    using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<BM, D, Stages>{}));  // also dO
    // Q (dO) as the B operand of dK (dV), (d, block_m, stages): the same bytes, transposed view.
    using SmemLayoutQt = decltype(composition(
        SmemLayoutQ{}, make_ordered_layout(Shape<D, BM, Stages>{}, Step<_2, _1, _3>{})));
    using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<BN, D>{}));  // also V
    // K as the B operand of dQ, (d, block_n).
    using SmemLayoutKt =
        decltype(composition(SmemLayoutK{}, make_ordered_layout(Shape<D, BN>{}, Step<_2, _1>{})));
    // dS^T as the consumers write it (block_n, block_m, buffers), and as dQ's A operand
    // (block_m, block_n, buffers). A group computes dQ of step m - 1 in step m, after it wrote
    // dS^T(m); with four buffers it may write dS^T(m) once it knows the other group reached
    // step m - 2, which has then finished dQ(m - 4) with buffer m % 4. The turns keep the
    // groups closer than that, so three suffice (an exhaustive check of the barrier protocol,
    // 2026-11-27): three where four do not fit (block_m 128, d <= 64).
    // Wide: the groups meet every step, so two buffers of dS^T, and two of P^T after them
    // (slots kDsBuffers + b), suffice: a group overwrites buffer m % 2 at step m + 2 only after
    // both passed step m + 1's barrier, by which time both have waited for the GEMMs of step m.
    static constexpr int kDsBuffers = kWide ? 2 : kBlockM == 64 ? 4 : 3;
    static constexpr int kPBuffers = kWide ? 2 : 0;
    static constexpr int kDsSlots = kDsBuffers + kPBuffers;
    using SmemLayoutDs =
        decltype(tile_to_shape(SmemAtomDs{}, Shape<BN, BM, Int<kDsSlots>>{}));
    using SmemLayoutDsT = decltype(composition(
        SmemLayoutDs{},
        make_ordered_layout(Shape<BM, BN, Int<kDsSlots>>{}, Step<_2, _1, _3>{})));
    using StoreDs = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, T>{}, MmaSdP{}));

    // Global tensors as TMA sees them: (rows, d, heads, batch), as in the forward.
    using GmemShape = Shape<int, int, int, int>;
    using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
    using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<T const*>(nullptr)),
                                            std::declval<GmemShape>(), std::declval<GmemStride>()));
    using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GmemTensor>(),
                                        take<0, 2>(SmemLayoutQ{}), Shape<BM, D>{}, _1{}));
    using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GmemTensor>(),
                                        SmemLayoutK{}, Shape<BN, D>{}, _1{}));
    // The epilogue stages dK and dV in K's layout (stmatrix of the accumulators' 8 x 8 blocks)
    // and stores them by TMA in boxes of 16 rows (a warp's) by one swizzle atom of columns: a
    // K/V buffer holds a row's atoms block_n rows apart.
    static constexpr int kOutRows = 16;
    using OutBox = Shape<Int<kOutRows>, Int<kKAtomCols>>;
    using SmemLayoutOutBox = decltype(tile_to_shape(SmemAtomK{}, OutBox{}));
    using TmaOut = decltype(make_tma_copy(SM90_TMA_STORE{}, std::declval<GmemTensor>(),
                                          SmemLayoutOutBox{}, OutBox{}, _1{}));

    using QPipe = OperandPipeline<QOperand, kStages>;
    using DoPipe = OperandPipeline<DoOperand, kStages>;
    using PipeState = cutlass::PipelineState<kStages>;

    static constexpr uint32_t kRowBytes = kBlockM * sizeof(float);  // a tile's LSE or D
    static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(T) + kRowBytes;
    static constexpr uint32_t kKVBytes = 2 * kBlockN * kHeadDim * sizeof(T);

    struct SharedStorage {
        alignas(1024) cute::array_aligned<T, cosize_v<SmemLayoutK>> k;
        alignas(1024) cute::array_aligned<T, cosize_v<SmemLayoutK>> v;
        alignas(1024) cute::array_aligned<T, cosize_v<SmemLayoutQ>> q;
        alignas(1024) cute::array_aligned<T, cosize_v<SmemLayoutQ>> dout;
        alignas(1024) cute::array_aligned<T, cosize_v<SmemLayoutDs>> ds;
        // A tile's dQ, fp32, in the accumulator's order (Sm90BwdRows::dq_accum): each consumer
        // group's part contiguous.
        alignas(128) float dq[kBlockM * kHeadDim];
        // Per Q (dO) stage: the tile's log2-scaled LSE (rowsum(dO * O)), from the padded row
        // buffers of Sm90BwdRows.
        alignas(16) float lse[kStages * kBlockM];
        alignas(16) float dsum[kStages * kBlockM];
        typename QPipe::SharedStorage q_pipe;
        typename DoPipe::SharedStorage do_pipe;
        cutlass::arch::ClusterTransactionBarrier kv_full;
    };
    static constexpr int kSmemBytes = int(sizeof(SharedStorage));

    static_assert(kSmemBytes <= 227 * 1024, "tile does not fit shared memory");
};

// Where the SM90 backward keeps each query row's log2-scaled LSE and rowsum(dO * O): fp32
// buffers in which every sequence's rows start at a multiple of block_m and its last tile is
// padded to block_m rows, so that a tile's values are one aligned bulk copy. Padding rows hold
// LSE = +inf (P = 0) and D = 0, so rows past a sequence's end contribute nothing.
// Batched: (batch, heads, padded seqlen_q). Varlen: (heads, rows) with sequence b at
// block_m * floor((cu_seqlens_q[b] + b * block_m) / block_m), past the end of sequence b - 1's
// padded tiles.
// dQ's fp32 accumulator uses the same rows, d floats each, in tiles of block_m rows whose
// floats are stored in the consumer threads' fragment order (Sm90BwdTraits::dq_float4_index):
// each thread writes its fragment to shared memory without bank conflicts, and each consumer
// group's part of the tile is added to the accumulator in one bulk reduction. Rows past a
// sequence's end get exact zeros (their P is 0). The dQ kernel reads it back through the same
// fragment mapping. It starts at zero: the row kernel clears its rows for batched inputs, the
// launcher's memset the whole workspace for varlen.
struct Sm90BwdRows {
    float* lse_log2 = nullptr;
    float* dsum = nullptr;
    float* dq_accum = nullptr;
    int64_t head_stride = 0;  // rows per head

    template <int kBlockM>
    static int64_t rows_per_head(AttnShape const& p) {
        const int64_t padded_q = (int64_t(p.seqlen_q) + kBlockM - 1) / kBlockM * kBlockM;
        // Varlen: the offsets above stay below total_q + batch * block_m, and a sequence clamped
        // to max_seqlen_q spans at most its padded length past its offset.
        // A multiple of block_m, so that every head's tiles stay 16-byte aligned.
        const int64_t varlen_rows = int64_t(p.total_q) + int64_t(p.batch + 2) * kBlockM + padded_q;
        return p.is_varlen() ? varlen_rows / kBlockM * kBlockM : padded_q;
    }

    // Offset of (sequence, head)'s first row.
    template <int kBlockM>
    __device__ int64_t offset(AttnShape const& p, int64_t row_q, int bidb, int bidh) const {
        if (p.is_varlen()) {
            return bidh * head_stride + (row_q + int64_t(bidb) * kBlockM) / kBlockM * kBlockM;
        }
        return (int64_t(bidb) * p.nheads + bidh) * head_stride;
    }
};

// Everything the kernel reads, passed by value as a __grid_constant__ (TMA descriptors must live
// in parameter or constant memory).
template <class Traits>
struct Sm90BwdArgs {
    BwdParams p;
    typename Traits::TmaQ tma_q;
    typename Traits::TmaQ tma_do;
    typename Traits::TmaK tma_k;
    typename Traits::TmaK tma_v;
    typename Traits::TmaOut tma_dk;
    typename Traits::TmaOut tma_dv;
    Sm90BwdRows rows;
    int m_blocks;  // query tiles per (batch, head): the stride of p.dq_turns
    // Deterministic grids: heads launched in groups of this many, the group's highest key tiles
    // first, then their next ones (flash_bwd_sm90_kernel); 1: each head's key tiles in a row.
    int head_group;
    // Extents of the TMA views: varlen has rows = total and batch = 1.
    int rows_q, rows_k, batch;
};

}  // namespace flash
