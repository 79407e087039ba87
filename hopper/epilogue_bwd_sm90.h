// Epilogue of the SM90 backward: dK (scaled by softmax_scale, the score's derivative factor
// left out of the mainloop) and dV of the CTA's key rows, converted to the input dtype, staged
// in shared memory in K's swizzled layout and stored by TMA. Stores from registers (4-byte
// pieces, or 16-byte pieces of rows staged in shared memory) kept each CTA 5-8 us in its
// epilogue (H100, d = 128, a CTA timeline, 2026-11-27): the SM's stores drained at ~8 bytes per
// clock, where the TMA reads staged rows at ~64; TMA stores took it to 1.7-2.3 us.
//  - One K/V tile per group (block_n = 64 per group): each warp stages its 16 rows of dV in
//    those rows of V's buffer (only its own group's dP^T GEMMs read them, all finished by
//    then), one lane stores them, and once the TMA has read them the same follows for dK. No
//    barrier between the groups: the other group's dQ GEMMs may still read K.
//  - The wide tile (d = 160-256, each group a block of every row's columns): the groups meet
//    once both are done with K and V, stage dK in K's buffer and dV in V's, and 8 lanes store
//    16 rows each.
// dK and dV have one head per query head (the binding sums GQA groups) and are the binding's own
// contiguous tensors with a head dim of a multiple of 8, so every CTA writes rows of its own
// and every piece is 16-byte aligned.
#pragma once

#include <cute/tensor.hpp>
#include <type_traits>

#include "bwd_traits_sm90.h"
#include "common/fragment.h"
#include "common/seq_info.h"
#include "mainloop_bwd_sm90.h"
#include "sm90_utils.h"
#include "tma_views.h"

namespace flash {

template <class Traits>
struct Sm90BwdEpilogue {
    using T = typename Traits::Element;
    using BN = typename Traits::BN;
    using D = typename Traits::D;
    static constexpr int kD = D::value;
    static constexpr int kPieces = kD / 8;  // 16-byte pieces per row
    using SharedStorage = typename Traits::SharedStorage;
    using Staged = decltype(make_tensor(make_smem_ptr(static_cast<T*>(nullptr)),
                                        typename Traits::SmemLayoutK{}));

    static __device__ Staged staged(T* buf) {
        return make_tensor(make_smem_ptr(buf), typename Traits::SmemLayoutK{});
    }

    // This thread's accumulator of its group's block of columns (KvPart: Traits::KvWhole or
    // KvPart<g>), converted, into a K/V buffer in that buffer's swizzled layout (stmatrix),
    // fenced for the TMA's reads. A part's block starts on a whole swizzle atom.
    template <class KvPart, class Acc>
    static __device__ void stage(Acc const& acc, T* buf, int ctid) {
        constexpr int kCols = decltype(size<1>(typename KvPart::TileShape{}))::value;
        using Store =
            decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, T>{}, typename KvPart::Mma{}));
        auto store = Store{}.get_thread_slice(KvPart::mma_thread(ctid));
        Tensor block = domain_offset(make_coord(_0{}, Int<KvPart::kCol0>{}), staged(buf))
                           .compose(_, Int<kCols>{});
        Tensor r = convert_fragment<T>(acc);
        copy(Store{}, store.retile_S(r), store.partition_D(block));
        cutlass::arch::fence_view_async_shared();
    }

    // Rows [row0, row0 + 16) of a staged buffer to dK or dV by TMA, one box per swizzle atom of
    // columns (a row's atoms lie block_n rows apart), committed as one group. One thread.
    static __device__ void issue_rows(Sm90BwdArgs<Traits> const& a,
                                      typename Traits::TmaOut const& tma, T const* buf, int row0,
                                      SeqInfo const& seq, int bidb, int bidh,
                                      Sm90BwdGeometry const& g) {
        BwdParams const& p = a.p;
        using Box = typename Traits::OutBox;
        constexpr int kAtomCols = Traits::kKAtomCols;
        Tensor gOut = local_tile(tma_head_view(tma, a.rows_k, p.headdim, p.nheads, a.batch, bidh,
                                               bidb, p.is_varlen() ? seq.row_k : 0),
                                 Box{}, make_coord((g.n0 + row0) / Traits::kOutRows, _));
        CUTE_UNROLL
        for (int c = 0; c < kD / kAtomCols; ++c) {
            Tensor sBox = make_tensor(
                make_smem_ptr(buf + (c * Traits::kBlockN + row0) * kAtomCols),
                typename Traits::SmemLayoutOutBox{});
            auto t = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(sBox),
                                   group_modes<0, 2>(gOut(_, _, c)));
            copy(tma, get<1>(t), get<0>(t));
        }
        tma_store_arrive();
    }

    // A varlen tile's rows that cross the sequence's end (a warp's 16 at d <= 128): a TMA box
    // there would write into the next sequence's rows, so they go from registers (4-byte
    // pieces) ...
    template <class Acc, class Coord>
    static __device__ void write_fragment(Acc const& acc, Coord const& c, void* base,
                                          TensorStrides const& stride, BwdParams const& p,
                                          SeqInfo const& seq, int bidh, Sm90BwdGeometry const& g) {
        Tensor r = convert_fragment<T>(acc);
        T* out = static_cast<T*>(base) + seq.k_offset(stride, p, g.n0, bidh);
        CUTE_UNROLL
        for (int i = 0; i < size(r); i += 2) {
            const int row = get<0>(c(i));
            const int col = get<1>(c(i));
            if (row < g.keys && col < p.headdim) {
                *reinterpret_cast<uint32_t*>(out + index_t(row) * stride.row + col) =
                    *reinterpret_cast<uint32_t const*>(&r(i));
            }
        }
    }

    // ... or, the wide tile's, from the staged buffer in 16-byte pieces, piece i by consumer
    // thread i % kConsumerThreads.
    static __device__ void write_staged(T* buf, int ctid, void* base, TensorStrides const& stride,
                                        BwdParams const& p, SeqInfo const& seq, int bidh,
                                        Sm90BwdGeometry const& g) {
        constexpr int kThreads = Traits::kConsumerThreads;
        constexpr int kPerThread = Traits::kBlockN * kPieces / kThreads;
        static_assert(kPerThread * kThreads == Traits::kBlockN * kPieces);
        Staged sbuf = staged(buf);
        T* out = static_cast<T*>(base) + seq.k_offset(stride, p, g.n0, bidh);
        CUTE_UNROLL
        for (int k = 0; k < kPerThread; ++k) {
            const int i = k * kThreads + ctid;
            const int row = i / kPieces;
            const int piece = i % kPieces;
            if (row < g.keys && piece * 8 < p.headdim) {
                *reinterpret_cast<uint4*>(out + index_t(row) * stride.row + piece * 8) =
                    *reinterpret_cast<uint4 const*>(&sbuf(row, piece * 8));
            }
        }
    }

    template <class KvPart, class Acc>
    static __device__ void store(Sm90BwdArgs<Traits> const& a, SharedStorage& ss,
                                 SeqInfo const& seq, int bidb, int bidh,
                                 Sm90BwdGeometry const& g, Acc& acc_dk, Acc const& acc_dv) {
        BwdParams const& p = a.p;
        const int ctid = int(threadIdx.x) - kWarpGroupThreads;
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
        if constexpr (Traits::kWide) {
            barrier_sync(BwdBarrier::kEpilogue, Traits::kConsumerThreads);
            stage<KvPart>(acc_dk, ss.k.data(), ctid);
            stage<KvPart>(acc_dv, ss.v.data(), ctid);
        } else {
            // Warp w's rows, [16 w, +16), of dV then dK, through those rows of V's buffer. A
            // batched tile's rows past seqlen_k lie outside the TMA's tensor.
            static_assert(std::is_same_v<typename Traits::MmaKV, typename KvPart::Mma> &&
                              Traits::kOutRows * 4 == kWarpGroupRows,
                          "a warp's accumulator rows are its 16 of its group's 64 key rows");
            const int row0 = ctid / 32 * Traits::kOutRows;
            const bool issuer = ctid % 32 == 0;
            if (!p.is_varlen() || row0 + Traits::kOutRows <= g.keys) {
                stage<KvPart>(acc_dv, ss.v.data(), ctid);
                __syncwarp();
                if (issuer) {
                    issue_rows(a, a.tma_dv, ss.v.data(), row0, seq, bidb, bidh, g);
                    bulk_wait_read<0>();
                }
                __syncwarp();
                stage<KvPart>(acc_dk, ss.v.data(), ctid);
                __syncwarp();
                if (issuer) {
                    issue_rows(a, a.tma_dk, ss.v.data(), row0, seq, bidb, bidh, g);
                    bulk_wait_read<0>();
                }
            } else {
                typename KvPart::Mma mma_kv;
                Tensor c = mma_kv.get_thread_slice(ctid).partition_C(
                    make_identity_tensor(Shape<BN, D>{}));
                write_fragment(acc_dk, c, p.dk, p.dk_stride, p, seq, bidh, g);
                write_fragment(acc_dv, c, p.dv, p.dv_stride, p, seq, bidh, g);
            }
        }
    }

    // The wide tile's staged dK and dV to global memory, by every consumer thread after its
    // group's `store`; the barrier waits for both groups' blocks. One code for both groups'
    // parts, outside the per-group consumer body (two copies of it kept NVVM from inlining the
    // d = 224 consumer step).
    static __device__ void store_wide(Sm90BwdArgs<Traits> const& a, SharedStorage& ss,
                                      SeqInfo const& seq, int bidb, int bidh,
                                      Sm90BwdGeometry const& g) {
        BwdParams const& p = a.p;
        const int ctid = int(threadIdx.x) - kWarpGroupThreads;
        const int warp = ctid / 32;
        barrier_sync(BwdBarrier::kEpilogue, Traits::kConsumerThreads);
        if (!p.is_varlen() || g.keys == Traits::kBlockN) {
            // Warp w's lane 0 stores rows [16 (w % 4), +16) of dK (w < 4) or dV.
            static_assert(Traits::kConsumerThreads / 32 * Traits::kOutRows == 2 * Traits::kBlockN);
            constexpr int kRowWarps = Traits::kBlockN / Traits::kOutRows;
            const int row0 = warp % kRowWarps * Traits::kOutRows;
            if (ctid % 32 == 0) {
                if (warp < kRowWarps) {
                    issue_rows(a, a.tma_dk, ss.k.data(), row0, seq, bidb, bidh, g);
                } else {
                    issue_rows(a, a.tma_dv, ss.v.data(), row0, seq, bidb, bidh, g);
                }
                bulk_wait_read<0>();  // the buffers must outlive the TMA's reads
            }
        } else {
            write_staged(ss.k.data(), ctid, p.dk, p.dk_stride, p, seq, bidh, g);
            write_staged(ss.v.data(), ctid, p.dv, p.dv_stride, p, seq, bidh, g);
        }
    }
};

}  // namespace flash
