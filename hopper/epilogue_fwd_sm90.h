// Epilogue of the SM90 forward: O (normalised, fp32 in registers) is converted and written from
// registers, two neighbouring columns (4 bytes) per store, predicated on the sequence's rows and
// the head dim so varlen tiles never touch a neighbouring sequence; the LSE likewise. Nothing
// goes through shared memory, so the Q buffer is free once the tile's last S GEMM has read it
// and the next tile's Q loads while this one finishes (short sequences gain most).
#pragma once

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <cute/tensor.hpp>

#include "fwd_traits_sm90.h"
#include "mainloop_fwd_sm90.h"
#include "seq_info.h"
#include "sm90_utils.h"

namespace flash {

template <class Traits>
struct Sm90FwdEpilogue {
    using T = typename Traits::Element;
    using BM = typename Traits::BM;
    using D = typename Traits::D;

    // Run by every consumer thread; `acc_o` and `lse` are this thread's rows. With GQA packing
    // `bidh` is the KV head and each packed row goes to its own query row and head.
    template <class AccO, int kRows>
    static __device__ void store(FwdParams const& p, SeqInfo const& seq, int bidb, int bidh,
                                 Sm90TileGeometry const& g, AccO const& acc_o,
                                 float const (&lse)[kRows]) {
        const int ctid = int(threadIdx.x) - 128;
        typename Traits::MmaPV mma_pv;
        auto thr_pv = mma_pv.get_thread_slice(ctid);
        Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<BM, D>{}));
        Tensor cO_rc = make_tensor(cO.data(), wgmma_acc_as_rows_cols(cO.layout()));
        Tensor o_rc = make_tensor(acc_o.data(), wgmma_acc_as_rows_cols(acc_o.layout()));
        static_assert(decltype(size<1>(o_rc))::value % 2 == 0);
        static_assert(decltype(size<0>(o_rc))::value == kRows);

        // Column offsets within the thread's fragment are compile-time constants: each store
        // is one immediate offset from the row's pointer.
        const auto base = cO_rc(0, 0);
        const auto offsets = cO_rc.layout();
        const int col0 = get<1>(base);
        T* o_ptr = static_cast<T*>(p.o) + seq.q_offset(p.o_stride, p, bidb, g.row0, bidh) + col0;
        float* lse_ptr = p.lse + seq.lse_offset(p, bidb, bidh) + g.row0;
        cutlass::NumericArrayConverter<T, float, 2> convert;
        CUTE_UNROLL
        for (int r = 0; r < size<0>(o_rc); ++r) {
            const int row = get<0>(base) + get<0>(offsets(r, 0));
            if (row >= g.rows) continue;
            T* row_ptr = o_ptr + index_t(row) * p.o_stride.row;
            float* row_lse = lse_ptr + row;
            if constexpr (Traits::kPackGQA) {
                const int prow = g.row0 + row;
                const int head = bidh * p.pack_gqa + prow % p.pack_gqa;
                const int qrow = prow / p.pack_gqa;
                row_ptr =
                    static_cast<T*>(p.o) + seq.q_offset(p.o_stride, p, bidb, qrow, head) + col0;
                row_lse = p.lse + seq.lse_offset(p, bidb, head) + qrow;
            }
            // Columns 2j and 2j + 1 of the view are neighbours in the row (the accumulator's
            // innermost mode); the base is 16-byte aligned and every stride a multiple of 8
            // elements (the binding's is_kernel_ready): 4-byte aligned stores.
            CUTE_UNROLL
            for (int c = 0; c < size<1>(o_rc); c += 2) {
                const int col = get<1>(offsets(0, c));
                cutlass::Array<float, 2> pair;
                pair[0] = o_rc(r, c);
                pair[1] = o_rc(r, c + 1);
                const cutlass::Array<T, 2> packed = convert(pair);
                if (col0 + col < p.headdim) {
                    *reinterpret_cast<uint32_t*>(row_ptr + col) =
                        reinterpret_cast<uint32_t const&>(packed);
                }
            }
            if (col0 == 0) *row_lse = lse[r];
        }
    }
};

}  // namespace flash
