// Mask policy shared by the SM80 and SM90 kernels: the bottom-right aligned causal/window band
// plus the key-length bound; and ALiBi's bias (all four kernels). Works in sequence coordinates;
// the kernels map tile coordinates in.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace flash {

// ALiBi's bias in the units of the kernels' score t (AttnShape::alibi_unit folded into the
// slope); `shift` aligns rows and columns bottom-right, as BandMask::shift().
struct AlibiBias {
    float slope;
    int shift;

    // The bias at the distance row + shift - col, in float (AlibiDistance).
    __host__ __device__ float at(float distance) const { return -slope * fabsf(distance); }
};

struct BandMask {
    int seqlen_q;
    int seqlen_k;
    int left;   // < 0: unbounded
    int right;  // < 0: unbounded

    // Row i keeps columns [i + shift - left, i + shift + right] intersected with [0, seqlen_k).
    __host__ __device__ constexpr int shift() const { return seqlen_k - seqlen_q; }

    __host__ __device__ constexpr bool keep(int row, int col) const {
        if (col >= seqlen_k) return false;
        if (right >= 0 && col > row + shift() + right) return false;
        if (left >= 0 && col < row + shift() - left) return false;
        return true;
    }

    // Kept columns of `row` are [lo, hi).
    __host__ __device__ void col_limits(int row, int& lo, int& hi) const {
        hi = right >= 0 ? min(seqlen_k, row + shift() + right + 1) : seqlen_k;
        lo = left >= 0 ? row + shift() - left : 0;
    }

    // Rows that keep column `col` are [lo, hi): the band's rows of it, none past the keys.
    // Rows past seqlen_q are outside too (the backward's padding rows, whose P is 0 anyway).
    __host__ __device__ constexpr void row_limits(int col, int& lo, int& hi) const {
        lo = 0;
        hi = col < seqlen_k ? seqlen_q : 0;
        if (right >= 0 && col - shift() - right > lo) lo = col - shift() - right;
        if (left >= 0 && col - shift() + left + 1 < hi) hi = col - shift() + left + 1;
    }

    // Key blocks [first, last) that rows [row0, row0 + rows) can see.
    __host__ __device__ void key_block_range(int row0, int rows, int block_n, int& first,
                                             int& last) const {
        int col_end = seqlen_k;
        if (right >= 0) col_end = min(col_end, row0 + rows - 1 + shift() + right + 1);
        int col_begin = 0;
        if (left >= 0) col_begin = max(0, row0 + shift() - left);
        first = col_begin / block_n;
        last = col_end <= col_begin ? first : (col_end + block_n - 1) / block_n;
    }

    // Query blocks [first, last) whose rows can see columns [col0, col0 + cols).
    __host__ __device__ void query_block_range(int col0, int cols, int block_m, int& first,
                                               int& last) const {
        int row_begin = 0;
        if (right >= 0) row_begin = max(0, col0 - shift() - right);
        int row_end = seqlen_q;
        if (left >= 0) row_end = min(row_end, col0 + cols - 1 - shift() + left + 1);
        int num_cols = min(cols, seqlen_k - col0);
        first = row_begin / block_m;
        last = (row_end <= row_begin || num_cols <= 0) ? first : (row_end + block_m - 1) / block_m;
    }

    // True when some element of the tile is masked, so the per-element test must run.
    __host__ __device__ constexpr bool tile_needs_mask(int row0, int rows, int col0,
                                                       int cols) const {
        if (col0 + cols > seqlen_k) return true;
        if (right >= 0 && col0 + cols - 1 > row0 + shift() + right) return true;
        if (left >= 0 && col0 < row0 + rows - 1 + shift() - left) return true;
        return false;
    }

    // Key blocks [lo, hi) in which no element of rows [row0, row0 + rows) is masked: exactly
    // the blocks n >= 0 with !tile_needs_mask(row0, rows, n * block_n, block_n). Empty when
    // lo >= hi.
    __host__ __device__ constexpr void unmasked_key_blocks(int row0, int rows, int block_n,
                                                           int& lo, int& hi) const {
        // Block n ends at column (n + 1) * block_n - 1: within the keys and the right bound.
        hi = seqlen_k / block_n;
        if (right >= 0) {
            const int end = row0 + shift() + right + 1;  // first column the top row drops
            const int by_right = end > 0 ? end / block_n : 0;
            hi = by_right < hi ? by_right : hi;
        }
        // Block n starts at column n * block_n: at or past the bottom row's left bound.
        lo = 0;
        if (left >= 0) {
            const int begin = row0 + rows - 1 + shift() - left;
            lo = begin > 0 ? (begin + block_n - 1) / block_n : 0;
        }
    }
};

}  // namespace flash
