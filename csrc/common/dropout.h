// Attention dropout: the keep mask of flash_attn/dropout.py, drawn inside the kernels.
//
// Each 16 x 16 block of a (batch entry, head)'s scores takes one Philox4x32-10 call per lane of
// the warp that holds it, counter (32 * key block + lane, query block, b * nheads + h, offset),
// key (seed low, seed high); the call's four words give the lane's eight 16-bit numbers, and an
// element is kept when its number is below `keep` = round((1 - p) * 65536). The element's number
// is picked by its place in the mma accumulator fragment (m16n8: lane 4g + t holds rows g, g + 8
// and columns 2t, 2t + 1 of each 8-column atom), so every thread computes only the calls whose
// numbers it uses. The reference replays the same calls, which is what the exact tests compare.
#pragma once

#include <cute/tensor.hpp>

#include "params.h"

namespace flash {

using namespace cute;

__forceinline__ __device__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
    constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
    constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
    CUTE_UNROLL
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += kWeyl0;
            k1 += kWeyl1;
        }
        const uint32_t hi0 = __umulhi(kMul0, c.x), lo0 = kMul0 * c.x;
        const uint32_t hi1 = __umulhi(kMul1, c.z), lo1 = kMul1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// One (batch entry, head)'s generator: the call's (seed, offset) from AttnShape::rng_state, and
// with AttnShape::rng_positions the call's place in a larger attention: its entry, 16-row and
// 16-column block offsets.
struct DropoutRng {
    uint32_t seed_lo, seed_hi, offset_lo, bh, keep;
    int qb0, kb0;

    __device__ DropoutRng(const AttnShape& p, int bidb, int bidh)
        : seed_lo(uint32_t(uint64_t(p.rng_state[0]))),
          seed_hi(uint32_t(uint64_t(p.rng_state[0]) >> 32)),
          offset_lo(uint32_t(uint64_t(p.rng_state[1]))),
          bh(uint32_t((bidb + (p.rng_positions ? int(p.rng_state[2]) : 0)) * p.nheads + bidh)),
          keep(p.dropout_keep),
          qb0(p.rng_positions ? int(p.rng_state[3] / 16) : 0),
          kb0(p.rng_positions ? int(p.rng_state[4] / 16) : 0) {}

    // The four words of this lane for the 16 x 16 block (query block qb, key block kb) of the
    // call.
    __device__ uint4 words(int qb, int kb, int lane) const {
        return philox4x32_10(
            make_uint4(uint32_t(32 * (kb + kb0) + lane), uint32_t(qb + qb0), bh, offset_lo),
            seed_lo, seed_hi);
    }
};

// Bit r * cols + c of `bits` says whether the score (r, c) of a thread's (rows, cols) view of an
// m16n8 accumulator is kept. `coord` holds tile-local (row, col), shifted into sequence
// coordinates by row0/col0 (multiples of 16, like every tile start). Rows 2i and 2i + 1 of the
// view are rows g and g + 8 of one 16-row block, columns 2j and 2j + 1 the pair 2t, 2t + 1 of
// one 8-column atom; two atoms share a Philox call when they fall in one 16-column block.
template <int kWords, class Coord>
__forceinline__ __device__ void dropout_keep_bits(Coord const& coord, DropoutRng const& rng,
                                                  int row0, int col0, uint32_t (&bits)[kWords]) {
    constexpr int kRows = decltype(size<0>(coord))::value;
    constexpr int kCols = decltype(size<1>(coord))::value;
    static_assert(kRows % 2 == 0 && kCols % 2 == 0 && kWords * 32 >= kRows * kCols);
    const int lane = threadIdx.x % 32;
    CUTE_UNROLL
    for (int w = 0; w < kWords; ++w) bits[w] = 0u;
    CUTE_UNROLL
    for (int rb = 0; rb < kRows / 2; ++rb) {
        const int row = row0 + get<0>(coord(2 * rb, 0));
        int last_kb = -1;
        uint4 words = make_uint4(0u, 0u, 0u, 0u);
        CUTE_UNROLL
        for (int a = 0; a < kCols / 2; ++a) {
            const int col = col0 + get<1>(coord(2 * rb, 2 * a));
            const int kb = col / 16;
            if (kb != last_kb) {
                words = rng.words(row / 16, kb, lane);
                last_kb = kb;
            }
            // Numbers (col % 16 / 8) * 4 + row half * 2 + column in the pair: words 0-1 for the
            // block's first 8 columns, 2-3 for the second.
            const bool second = (col % 16) >= 8;
            CUTE_UNROLL
            for (int dr = 0; dr < 2; ++dr) {
                const uint32_t word = dr == 0 ? (second ? words.z : words.x)
                                              : (second ? words.w : words.y);
                CUTE_UNROLL
                for (int dc = 0; dc < 2; ++dc) {
                    const uint32_t number = dc == 0 ? (word & 0xFFFFu) : (word >> 16);
                    const int i = (2 * rb + dr) * kCols + 2 * a + dc;
                    if (number < rng.keep) bits[i / 32] |= 1u << (i % 32);
                }
            }
        }
    }
}

template <int kWords>
__forceinline__ __device__ bool dropout_kept(const uint32_t (&bits)[kWords], int i) {
    return (bits[i / 32] >> (i % 32)) & 1u;
}

}  // namespace flash
