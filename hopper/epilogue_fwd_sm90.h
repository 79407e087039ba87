// Epilogue of the SM90 forward: O (normalised, fp32 in registers) is converted, staged in Q's
// shared-memory buffer and written with 16-byte stores predicated on the sequence's rows and the
// head dim, so varlen tiles never touch a neighbouring sequence; the LSE goes straight from
// registers.
#pragma once

#include <cute/tensor.hpp>

#include "fwd_traits_sm90.h"
#include "mainloop_fwd_sm90.h"
#include "seq_info.h"
#include "sm80_traits.h"
#include "sm80_utils.h"
#include "sm90_utils.h"

namespace flash {

template <class Traits>
struct Sm90FwdEpilogue {
    using T = typename Traits::Element;
    using BM = typename Traits::BM;
    using D = typename Traits::D;
    static constexpr int kHeadDim = D::value;
    using Copies = Sm80Copies<T, kHeadDim, Traits::kConsumerThreads>;

    // Run by every consumer thread; `acc_o` and `lse` are this thread's rows.
    template <class AccO, int kRows>
    static __device__ void store(FwdParams const& p, typename Traits::SharedStorage& ss,
                                 SeqInfo const& seq, int bidb, int bidh,
                                 Sm90TileGeometry const& g, AccO const& acc_o,
                                 float const (&lse)[kRows]) {
        const int ctid = int(threadIdx.x) - 128;
        typename Traits::MmaPV mma_pv;
        auto thr_pv = mma_pv.get_thread_slice(ctid);

        Tensor rO = convert_fragment<T>(acc_o);
        Tensor sO = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutO{});
        barrier_sync(NamedBarrier::kConsumers, Traits::kConsumerThreads);  // Q is no longer read
        auto copy_c = make_tiled_copy_C(typename Copies::StoreC{}, mma_pv);
        auto cthr = copy_c.get_thread_slice(ctid);
        copy(copy_c, cthr.retile_S(rO), cthr.partition_D(sO));
        barrier_sync(NamedBarrier::kConsumers, Traits::kConsumerThreads);

        T* o_ptr = static_cast<T*>(p.o) + seq.q_offset(p.o_stride, p, bidb, g.row0, bidh);
        Tensor gO =
            make_tensor(make_gmem_ptr(o_ptr), Shape<BM, D>{}, make_stride(p.o_stride.row, _1{}));
        typename Copies::GmemStore gstore;
        auto sthr = gstore.get_thread_slice(ctid);
        Tensor tOgO = sthr.partition_D(gO);
        store_tile(gstore, sthr.partition_S(sO), tOgO,
                   sthr.partition_S(make_identity_tensor(Shape<BM, D>{})), g.rows, p.headdim);

        Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<BM, D>{}));
        Tensor cO_rc = make_tensor(cO.data(), wgmma_acc_as_rows_cols(cO.layout()));
        float* lse_ptr = p.lse + seq.lse_offset(p, bidb, bidh) + g.row0;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            const int row = get<0>(cO_rc(r, 0));
            if (get<1>(cO_rc(r, 0)) == 0 && row < g.rows) lse_ptr[row] = lse[r];
        }
    }
};

}  // namespace flash
