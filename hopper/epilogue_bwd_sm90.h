// Epilogue of the SM90 backward: dK (scaled by softmax_scale, the score's derivative factor
// left out of the mainloop) and dV of the CTA's key rows, converted and written from registers.
// A thread's accumulator pairs are neighbouring columns: one 4-byte store each, predicated on
// the sequence's keys and the head dim. dK and dV have one head per query head (the binding sums
// GQA groups), so every CTA writes rows of its own.
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

    template <class Acc>
    static __device__ void store_one(Acc const& acc, void* base, TensorStrides const& stride,
                                     BwdParams const& p, SeqInfo const& seq, int bidh,
                                     Sm90BwdGeometry const& g) {
        const int ctid = int(threadIdx.x) - kWarpGroupThreads;
        typename Traits::MmaKV mma_kv;
        Tensor c = mma_kv.get_thread_slice(ctid).partition_C(make_identity_tensor(Shape<BN, D>{}));
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

    template <class Acc>
    static __device__ void store(BwdParams const& p, SeqInfo const& seq, int bidh,
                                 Sm90BwdGeometry const& g, Acc& acc_dk, Acc const& acc_dv) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
        store_one(acc_dk, p.dk, p.dk_stride, p, seq, bidh, g);
        store_one(acc_dv, p.dv, p.dv_stride, p, seq, bidh, g);
    }
};

}  // namespace flash
