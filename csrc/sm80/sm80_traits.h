// SM80 types shared by the forward and backward kernels: the MMA atom, swizzled shared-memory
// layouts and the copy atoms. Tile sizes come from tile_size.h.
#pragma once

#include <cutlass/numeric_types.h>

#include <cute/tensor.hpp>
#include <type_traits>

#include "tile_size.h"

namespace flash {

using namespace cute;

template <class T>
using Sm80MmaAtom =
    std::conditional_t<std::is_same_v<T, cutlass::half_t>, MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                       MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;

// Swizzled row-major shared-memory tile. Rows are split into 64-element (32 for odd multiples of
// 32) swizzle atoms so that an 8-row ldmatrix touches every bank once.
template <int kCols>
using SmemAtom = decltype(composition(Swizzle<kCols % 64 == 0 ? 3 : 2, 3, 3>{},
                                      Layout<Shape<_8, Int<kCols % 64 == 0 ? 64 : 32>>,
                                             Stride<Int<kCols % 64 == 0 ? 64 : 32>, _1>>{}));

template <int kRows, int kCols>
using SmemTile = decltype(tile_to_shape(SmemAtom<kCols>{}, Shape<Int<kRows>, Int<kCols>>{}));

// (cols, rows) view of a row-major tile, read by ldmatrix.trans as a transposed operand.
template <class Tile>
using TransposedTile = decltype(composition(
    Tile{}, make_layout(make_shape(size<1>(Tile{}), size<0>(Tile{})), GenRowMajor{})));

// Global <-> shared copies and ldmatrix atoms for tiles of `kHeadDim` columns.
template <class T, int kHeadDim, int kThreads>
struct Sm80Copies {
    static constexpr int kAtomK = kHeadDim % 64 == 0 ? 64 : 32;
    // 16-byte global accesses, a row of the swizzle atom per group of threads (coalesced).
    static constexpr int kThreadsPerRow = kAtomK / 8;
    using GmemThreads = Layout<Shape<Int<kThreads / kThreadsPerRow>, Int<kThreadsPerRow>>,
                               Stride<Int<kThreadsPerRow>, _1>>;
    using GmemLoad = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, T>{},
                                              GmemThreads{}, Layout<Shape<_1, _8>>{}));
    using GmemStore =
        decltype(make_tiled_copy(Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, T>{},
                                 GmemThreads{}, Layout<Shape<_1, _8>>{}));

    using LdsmN = Copy_Atom<SM75_U32x4_LDSM_N, T>;
    using LdsmT = Copy_Atom<SM75_U16x8_LDSM_T, T>;
    // Accumulator fragments to shared memory: 2 consecutive elements per thread.
    using StoreC = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, T>;
};

}  // namespace flash
