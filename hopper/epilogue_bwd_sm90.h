// Epilogue of the SM90 backward: dK (scaled by softmax_scale, the score's derivative factor
// left out of the mainloop) and dV of the CTA's key rows, converted to the input dtype.
//  - One K/V tile per group (block_n = 64 per group): each thread writes its accumulator
//    pairs, 4 bytes each, straight to global memory. Passing each warp's 16 rows through V's
//    buffer and writing whole rows in 16-byte pieces instead ran at 1.04-1.12x up to 2k keys
//    but at 0.96 on causal 8k and 16k (H100, d = 128, 2026-11-27), with the same mainloop
//    instructions in a different order.
//  - The wide tile (d = 256, each group half of every row): the groups meet once both are done
//    with K and V, write dK into K's buffer and dV into V's, then copy whole rows out in 16-byte
//    pieces (1.01-1.11x, 0.99 at 16k non-causal, against the direct writes, same A/B).
// dK and dV have one head per query head (the binding sums GQA groups) and are the binding's own
// contiguous tensors with a head dim of a multiple of 8, so every CTA writes rows of its own
// and every piece is 16-byte aligned.
#pragma once

#include <cute/tensor.hpp>

#include "bwd_traits_sm90.h"
#include "common/fragment.h"
#include "common/seq_info.h"
#include "mainloop_bwd_sm90.h"
#include "sm90_utils.h"

namespace flash {

template <class Traits>
struct Sm90BwdEpilogue {
    using T = typename Traits::Element;
    using BN = typename Traits::BN;
    using D = typename Traits::D;
    static constexpr int kD = D::value;
    static constexpr int kPieces = kD / 8;  // 16-byte pieces per row
    // Staged rows (wide tile): a row's pieces are XOR-swizzled by the row, so that the 4-byte
    // writes of a warp (8 rows x 4 column pairs of one piece) fall on distinct banks.
    static constexpr int kSwizzle = 8;
    static_assert(!Traits::kWide || kPieces >= kSwizzle);

    static __device__ int staged_index(int row, int piece) {
        return row * kD + (piece ^ (row % kSwizzle)) * 8;
    }

    template <class Acc>
    static __device__ void stage(Acc const& acc, T* buf, int ctid) {
        typename Traits::MmaKV mma_kv;
        Tensor c = mma_kv.get_thread_slice(ctid).partition_C(make_identity_tensor(Shape<BN, D>{}));
        Tensor r = convert_fragment<T>(acc);
        CUTE_UNROLL
        for (int i = 0; i < size(r); i += 2) {
            const int row = get<0>(c(i));
            const int col = get<1>(c(i));
            *reinterpret_cast<uint32_t*>(buf + staged_index(row, col / 8) + col % 8) =
                *reinterpret_cast<uint32_t const*>(&r(i));
        }
    }

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

    // The wide tile's staged rows (buf) to global memory in 16-byte pieces, piece i by consumer
    // thread i % kConsumerThreads.
    static __device__ void write_staged(T const* buf, int ctid, void* base,
                                        TensorStrides const& stride, BwdParams const& p,
                                        SeqInfo const& seq, int bidh, Sm90BwdGeometry const& g) {
        constexpr int kThreads = Traits::kConsumerThreads;
        constexpr int kPerThread = Traits::kBlockN * kPieces / kThreads;
        static_assert(kPerThread * kThreads == Traits::kBlockN * kPieces);
        T* out = static_cast<T*>(base) + seq.k_offset(stride, p, g.n0, bidh);
        CUTE_UNROLL
        for (int k = 0; k < kPerThread; ++k) {
            const int i = k * kThreads + ctid;
            const int row = i / kPieces;
            const int piece = i % kPieces;
            if (row < g.keys && piece * 8 < p.headdim) {
                *reinterpret_cast<uint4*>(out + index_t(row) * stride.row + piece * 8) =
                    *reinterpret_cast<uint4 const*>(buf + staged_index(row, piece));
            }
        }
    }

    template <class Acc>
    static __device__ void store(BwdParams const& p, typename Traits::SharedStorage& ss,
                                 SeqInfo const& seq, int bidh, Sm90BwdGeometry const& g,
                                 Acc& acc_dk, Acc const& acc_dv) {
        const int ctid = int(threadIdx.x) - kWarpGroupThreads;
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
        if constexpr (Traits::kWide) {
            barrier_sync(BwdBarrier::kEpilogue, Traits::kConsumerThreads);
            stage(acc_dk, ss.k.data(), ctid);
            stage(acc_dv, ss.v.data(), ctid);
            barrier_sync(BwdBarrier::kEpilogue, Traits::kConsumerThreads);
            write_staged(ss.k.data(), ctid, p.dk, p.dk_stride, p, seq, bidh, g);
            write_staged(ss.v.data(), ctid, p.dv, p.dv_stride, p, seq, bidh, g);
        } else {
            typename Traits::MmaKV mma_kv;
            Tensor c =
                mma_kv.get_thread_slice(ctid).partition_C(make_identity_tensor(Shape<BN, D>{}));
            write_fragment(acc_dk, c, p.dk, p.dk_stride, p, seq, bidh, g);
            write_fragment(acc_dv, c, p.dv, p.dv_stride, p, seq, bidh, g);
        }
    }
};

}  // namespace flash
