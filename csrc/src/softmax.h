// Score and softmax policies shared by the SM80 and SM90 kernels. Both archs hold a score tile
// so that each row is spread over the 4 lanes of a quad, viewed here as a (rows, cols) tensor.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "mask.h"
#include "sm80_utils.h"

namespace flash {

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

// Sets masked scores to -inf. `s` and `coord` are (rows, cols) views; coord holds tile-local
// (row, col) that row0/col0 shift into sequence coordinates. Column offsets inside the thread's
// fragment are compile-time constants, so each compare is against an immediate and no per-column
// index stays live in registers (it would be hoisted out of the key loop and spill).
template <class Tensor, class Coord>
__forceinline__ __device__ void apply_mask(Tensor& s, Coord const& coord, BandMask const& mask,
                                           int row0, int col0) {
    const auto base = coord(0, 0);
    const auto offsets = coord.layout();
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
        int lo, hi;
        mask.col_limits(row0 + get<0>(base) + get<0>(offsets(r, 0)), lo, hi);
        lo -= col0 + get<1>(base);
        hi -= col0 + get<1>(base);
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s); ++c) {
            const int col = get<1>(offsets(0, c));
            if (col < lo || col >= hi) s(r, c) = -INFINITY;
        }
    }
}

// Online softmax over key tiles for the rows this thread holds.
template <int kRows>
struct OnlineSoftmax {
    float row_max[kRows];
    float row_sum[kRows];  // this thread's partial sums; the quad is summed in finalize()

    __forceinline__ __device__ OnlineSoftmax() {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            row_max[r] = -INFINITY;
            row_sum[r] = 0.f;
        }
    }

    // Turns scores `s` into unnormalised probabilities and rescales the running output `o`
    // (both (rows, cols) views) when a row's max moved.
    template <class S, class O>
    __forceinline__ __device__ void update(S& s, O& o, float scale_log2) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            float m = row_max[r];
            CUTE_UNROLL
            for (int c = 0; c < size<1>(s); ++c) m = fmaxf(m, s(r, c));
            m = quad_max(m);
            float prev = row_max[r];
            row_max[r] = m;
            float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
            if (prev != m) {
                // prev == -inf means nothing was accumulated yet: scale by 0, not by exp2(+big).
                float corr = prev == -INFINITY ? 0.f : exp2f(prev * scale_log2 - m_scaled);
                row_sum[r] *= corr;
                CUTE_UNROLL
                for (int c = 0; c < size<1>(o); ++c) o(r, c) *= corr;
            }
            float sum = 0.f;
            CUTE_UNROLL
            for (int c = 0; c < size<1>(s); ++c) {
                s(r, c) = exp2f(s(r, c) * scale_log2 - m_scaled);
                sum += s(r, c);
            }
            row_sum[r] += sum;
        }
    }

    // Normalises `o` and returns the natural-log LSE per row (+inf for rows that kept nothing).
    template <class O>
    __forceinline__ __device__ void finalize(O& o, float scale_log2, float (&lse)[kRows]) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            float sum = quad_sum(row_sum[r]);
            bool empty = sum == 0.f || sum != sum;
            float inv = empty ? 0.f : 1.f / sum;
            lse[r] = empty ? INFINITY : (row_max[r] * scale_log2 + __log2f(sum)) * float(M_LN2);
            CUTE_UNROLL
            for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv;
        }
    }
};

}  // namespace flash
