// Score policies shared by the SM80 and SM90 kernels, applied to a thread's score fragment
// viewed as (rows, cols): softcap, ALiBi's bias and the band mask (mask.h), in that order.
#pragma once

#include <cmath>
#include <cute/tensor.hpp>
#include <type_traits>
#include <utility>

#include "mask.h"

namespace flash {

using namespace cute;

__forceinline__ __device__ float fast_tanh(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Softcap: t = tanh(q.k * scale / softcap); the softmax then uses t * softcap * log2(e). Without
// softcap t = q.k and the scale is folded into the same exp2 FMA.
template <class Tensor>
__forceinline__ __device__ void apply_softcap(Tensor& s, float prescale) {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) s(i) = fast_tanh(s(i) * prescale);
}

// ALiBi's distance query + shift - key at each score of a thread's fragment, in float: one
// int-to-float conversion for the fragment's first coordinates, then the compile-time offsets of
// the others (an immediate add each), instead of a conversion per score: conversions run at 16 per
// clock and SM, an eighth of the float add's rate, and the forward's ALiBi kernel had about a
// hundred of them per key block (H100, d = 64/128 bf16: forward 0.99-1.02x, backward 0.98-1.03x,
// 2026-11-27). Exact while |distance| < 2^24. `coord` is a (rows, cols) identity view as for
// apply_mask below; kQueryRows: its rows are queries (the forwards' and the SM80 backward's S),
// else keys (the SM90 backward's S^T). q0 and k0 shift its coordinates to sequence positions.
template <bool kQueryRows, class Coord>
struct AlibiDistance {
    using Offsets = std::decay_t<decltype(std::declval<Coord const&>().layout())>;
    Offsets offsets;
    float d0;

    __device__ AlibiDistance(Coord const& coord, AlibiBias const& bias, int q0, int k0)
        : offsets(coord.layout()) {
        const auto base = coord(0, 0);
        const int q = q0 + int(get<kQueryRows ? 0 : 1>(base));
        const int k = k0 + int(get<kQueryRows ? 1 : 0>(base));
        d0 = float(q + bias.shift - k);
    }

    __device__ float operator()(int r, int c) const {
        const auto o = offsets(r, c);
        const int dq = int(get<kQueryRows ? 0 : 1>(o));
        const int dk = int(get<kQueryRows ? 1 : 0>(o));
        return d0 + float(dq - dk);
    }
};

// Adds ALiBi's bias to the scores: `s` and `coord` as for apply_mask below.
template <class Tensor, class Coord>
__forceinline__ __device__ void apply_alibi(Tensor& s, Coord const& coord, AlibiBias const& bias,
                                            int row0, int col0) {
    const AlibiDistance<true, Coord> distance(coord, bias, row0, col0);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s); ++c) s(r, c) += bias.at(distance(r, c));
    }
}

// ALiBi's bias on a tile of a thread's fragment whose rows (group) are [rows0, rows0 + rows)
// and columns [col0, col0 + cols); `s`, `coord`, `row0` and `col0` as for apply_alibi. On a tile
// wholly on one side of the diagonal (distance d = query + shift - key of one sign; every tile
// but those the diagonal crosses) the bias -slope |d| is linear in d: a column term, an FMA
// with a compile-time offset per score, and a row term left to the softmax in `term`
// (softmax.h: RowTerm), instead of the distance's add and the bias's FMA per score. Both terms
// are taken relative to the thread's first coordinates, so the column term stays small and the
// row term's rounding only touches tiles far from the diagonal, whose exps are 0 or negligible.
// Tiles the diagonal crosses get apply_alibi and a zero row term.
template <class Tensor, class Coord, int kRows>
__forceinline__ __device__ void apply_alibi_tile(Tensor& s, Coord const& coord,
                                                 AlibiBias const& bias, int row0, int rows0,
                                                 int rows, int col0, int cols,
                                                 float (&term)[kRows]) {
    const int d_min = rows0 + bias.shift - (col0 + cols - 1);
    const int d_max = rows0 + rows - 1 + bias.shift - col0;
    if (d_min < 0 && d_max > 0) {
        apply_alibi(s, coord, bias, row0, col0);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) term[r] = 0.f;
        return;
    }
    // -slope |d| = -slope_d d, slope_d = slope with d's sign; d = d0 + row offset - col offset.
    const float slope_d = d_min >= 0 ? bias.slope : -bias.slope;
    const AlibiDistance<true, Coord> distance(coord, bias, row0, col0);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
        term[r] = -slope_d * (distance.d0 + float(int(get<0>(distance.offsets(r, 0)))));
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s); ++c) {
            s(r, c) = fmaf(slope_d, float(int(get<1>(distance.offsets(r, c)))), s(r, c));
        }
    }
}

// Whether a thread's columns are those of mma accumulators: pairs of neighbouring columns 8
// apart, column c of the (rows, cols) view at offset 8 (c / 2) + c % 2 (SM80 mma.sync and SM90
// WGMMA alike).
template <class Offsets>
__host__ __device__ constexpr bool is_pair_columns(Offsets const& offsets) {
    for (int c = 0; c < int(size<1>(offsets)); ++c) {
        if (int(get<1>(offsets(0, c))) != 8 * (c / 2) + c % 2) return false;
    }
    return true;
}

// Of 32 columns at offsets 8 (c / 2) + c % 2, those below x, as a bit mask (bit c).
__forceinline__ __device__ uint32_t pair_columns_below(int x) {
    x = max(x, 0);
    const int n = min(2 * (x >> 3) + min(x & 7, 2), 32);
    return __funnelshift_lc(0xffffffffu, 0u, n);  // the low n bits; all 32 for n = 32
}

// Sets masked scores to -inf. `s` and `coord` are (rows, cols) views; coord holds tile-local
// (row, col) that row0/col0 shift into sequence coordinates. Column offsets inside the thread's
// fragment are compile-time constants, so no per-column index stays live in registers (it would
// be hoisted out of the key loop and spill). With the mma accumulators' columns each row's kept
// columns [lo, hi) become a bit mask per 32 columns, whose bits the compiler moves into
// predicates seven at a time (R2P): about one instruction per score instead of three (two
// compares and a select; the first block of a short causal tile spent a third of its softmax
// there: 192 of 556 instructions per warp at d=64 causal 512). Otherwise each column is compared
// against immediates. With GQA packing (`pack` > 1) tile rows are packed rows: query row =
// packed row / pack. kKeyRows: rows are keys and columns queries (the SM90 backward's S^T), each
// row's kept columns BandMask::row_limits.
template <bool kKeyRows = false, class Tensor, class Coord>
__forceinline__ __device__ void apply_mask(Tensor& s, Coord const& coord, BandMask const& mask,
                                           int row0, int col0, int pack = 1) {
    const auto base = coord(0, 0);
    const auto offsets = coord.layout();
    constexpr int kCols = decltype(size<1>(s))::value;
    constexpr bool kPairs = is_pair_columns(decltype(offsets){});
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
        int lo, hi;
        const int row = row0 + get<0>(base) + get<0>(offsets(r, 0));
        if constexpr (kKeyRows) {
            mask.row_limits(row, lo, hi);
        } else {
            mask.col_limits(row / pack, lo, hi);
        }
        lo -= col0 + get<1>(base);
        hi -= col0 + get<1>(base);
        if constexpr (kPairs) {
            CUTE_UNROLL
            for (int chunk = 0; chunk < (kCols + 31) / 32; ++chunk) {
                const uint32_t keep = pair_columns_below(hi - 128 * chunk) &
                                      ~pair_columns_below(lo - 128 * chunk);
                CUTE_UNROLL
                for (int c = 32 * chunk; c < kCols && c < 32 * chunk + 32; ++c) {
                    if (!((keep >> (c - 32 * chunk)) & 1u)) s(r, c) = -INFINITY;
                }
            }
        } else {
            CUTE_UNROLL
            for (int c = 0; c < kCols; ++c) {
                const int col = get<1>(offsets(0, c));
                if (col < lo || col >= hi) s(r, c) = -INFINITY;
            }
        }
    }
}

}  // namespace flash
