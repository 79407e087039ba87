// SM80 building blocks in CuTe: register-layout views of MMA accumulators, shared-memory GEMMs
// with ldmatrix double buffering, and predicated tile copies.
#pragma once

#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <cute/tensor.hpp>

#include "common/fragment.h"

namespace flash {

using namespace cute;

// An SM80 MMA accumulator is ((2 cols, 2 row halves), MMA_M, MMA_N). View it as (rows, cols) so
// row-wise softmax and masking can index it as a matrix.
template <class Layout>
__forceinline__ __device__ auto acc_as_rows_cols(Layout l) {
    static_assert(decltype(rank<0>(l))::value == 2);
    return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// Two neighbouring 16x8 accumulator tiles hold exactly the registers of one 16x16 A operand, so
// P can feed the next MMA without leaving registers: ((2,2), M, N) -> ((2,2,2), M, N/2).
template <class Layout>
__forceinline__ __device__ auto acc_as_a_operand(Layout l) {
    auto d = logical_divide(l, Shape<Underscore, Underscore, _2>{});
    return make_layout(make_layout(get<0>(d), get<2, 0>(d)), get<1>(d), get<2, 1>(d));
}

// acc += A * B with both operands read from shared memory; fragment k+1 is loaded while k runs.
template <class TiledMma, class Acc, class RA, class RB, class SA, class SB, class CopyA,
          class CopyB>
__forceinline__ __device__ void gemm_smem(TiledMma& mma, Acc& acc, RA& rA, RB& rB, SA const& sA,
                                          SB const& sB, CopyA const& copy_a, CopyB const& copy_b) {
    auto rA_view = copy_a.get_slice(threadIdx.x).retile_D(rA);
    auto rB_view = copy_b.get_slice(threadIdx.x).retile_D(rB);
    constexpr int K = decltype(size<2>(rA))::value;
    copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
    copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
    CUTE_UNROLL
    for (int k = 0; k < K; ++k) {
        if (k + 1 < K) {
            copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
            copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
        }
        cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
    }
}

// acc += A * B with A already in registers (P in the forward) and B from shared memory.
template <class TiledMma, class Acc, class RA, class RB, class SB, class CopyB>
__forceinline__ __device__ void gemm_reg_smem(TiledMma& mma, Acc& acc, RA const& rA, RB& rB,
                                              SB const& sB, CopyB const& copy_b) {
    auto rB_view = copy_b.get_slice(threadIdx.x).retile_D(rB);
    constexpr int K = decltype(size<2>(rA))::value;
    copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
    CUTE_UNROLL
    for (int k = 0; k < K; ++k) {
        if (k + 1 < K) copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
        cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
    }
}

// Global -> shared copy of a kTileRows x kTileCols tile: rows >= max_row and columns >= max_col
// are zero-filled, so padding rows and head-dim padding contribute exact zeros to every GEMM.
// Interior tiles (the common case) take an unpredicated path.
template <int kTileRows, int kTileCols, class TiledCopy, class Src, class Dst, class Coord>
__forceinline__ __device__ void load_tile(TiledCopy const& tcopy, Src const& src, Dst& dst,
                                          Coord const& coord, int max_row, int max_col) {
    if (max_row >= kTileRows && max_col >= kTileCols) {
        copy(tcopy, src, dst);
        return;
    }
    CUTE_UNROLL
    for (int m = 0; m < size<1>(dst); ++m) {
        bool row_ok = get<0>(coord(0, m, 0)) < max_row;
        CUTE_UNROLL
        for (int k = 0; k < size<2>(dst); ++k) {
            if (row_ok && get<1>(coord(0, m, k)) < max_col) {
                copy(tcopy, src(_, m, k), dst(_, m, k));
            } else {
                clear(dst(_, m, k));
            }
        }
    }
}

// Shared -> global tile copy of the rows < max_row and columns < max_col.
template <class TiledCopy, class Src, class Dst, class Coord>
__forceinline__ __device__ void store_tile(TiledCopy const& tcopy, Src const& src, Dst& dst,
                                           Coord const& coord, int max_row, int max_col) {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(src); ++m) {
        if (get<0>(coord(0, m, 0)) < max_row) {
            CUTE_UNROLL
            for (int k = 0; k < size<2>(src); ++k) {
                if (get<1>(coord(0, m, k)) < max_col) copy(tcopy, src(_, m, k), dst(_, m, k));
            }
        }
    }
}

}  // namespace flash
