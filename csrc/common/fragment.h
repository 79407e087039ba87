// Register-fragment helpers shared by the SM80 and SM90 kernels: dtype conversion of a whole
// fragment, atomic accumulation of one into global memory, and reductions over the quad of
// lanes that shares an accumulator row (mma.sync and WGMMA accumulators alike).
#pragma once

#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <cute/tensor.hpp>

namespace flash {

using namespace cute;

template <class To, class Engine, class Layout>
__forceinline__ __device__ auto convert_fragment(Tensor<Engine, Layout> const& src) {
    using From = typename Engine::value_type;
    constexpr int N = decltype(size(src))::value;
    auto dst = make_tensor<To>(src.layout());
    cutlass::NumericArrayConverter<To, From, N> convert;
    *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
        convert(*reinterpret_cast<const cutlass::Array<From, N>*>(src.data()));
    return dst;
}

// dst += acc for an MMA accumulator fragment, with global atomics; `dst` is the same partition of
// global memory and `coord` of the tile's identity. Elements 2j and 2j+1 are adjacent columns, so
// sm_90 adds them with one vector reduction. Interior tiles skip the bounds test.
template <class Acc, class Dst, class Coord>
__forceinline__ __device__ void atomic_add_fragment(Acc const& acc, Dst& dst, Coord const& coord,
                                                    int max_row, int max_col, bool interior) {
    auto add_pair = [&](int i) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float2*>(&dst(i)), make_float2(acc(i), acc(i + 1)));
#else
        atomicAdd(&dst(i), acc(i));
        atomicAdd(&dst(i + 1), acc(i + 1));
#endif
    };
    if (interior) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc); i += 2) add_pair(i);
    } else {
        // Compare compile-time offsets against per-thread limits (as apply_mask in score.h does).
        const int row_limit = max_row - get<0>(coord(0));
        const int col_limit = max_col - get<1>(coord(0));
        CUTE_UNROLL
        for (int i = 0; i < size(acc); i += 2) {
            const auto off = coord.layout()(i);
            if (get<0>(off) < row_limit && get<1>(off) < col_limit) add_pair(i);
        }
    }
}

// The 4 lanes of a quad share an accumulator row.
__forceinline__ __device__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__forceinline__ __device__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}

}  // namespace flash
