// deterministic=True backward, both archs: the key tiles that see a query tile add their dQ
// partial sums to its fp32 accumulator one at a time, lowest key tile first, so that the sum's
// rounding is the same in every run. A counter per (batch, head, query tile) says how many have
// added; a key tile waits until it equals the tile's rank. Key tiles then walk their query tiles
// from the last down (QueryOrder), and the grid launches a head's key tiles in ascending order:
// - a tile only waits for lower tiles, launched before it: they hold an SM or are done, so no
//   tile waits for one that cannot start;
// - under a causal mask the lowest key tile, which sees the most query tiles, never waits, and
//   each tile above reaches a query tile one step after the tile below it (from the last query
//   tile down, every key tile sees them all up to its diagonal), so the waits stay short; walked
//   upwards, a tile would wait at its diagonal for every tile below it;
// - the longest tiles (causal: the lowest) start first, as without deterministic.
#pragma once

#include "mask.h"
#include "memory_order.h"

namespace flash {

template <int kBlockM, int kBlockN>
struct DqTurns {
    int* counts = nullptr;  // this (batch, head)'s counters, one per query tile; nullptr: any order

    __device__ DqTurns(int* all, int m_blocks, int nheads, int bidb, int bidh)
        : counts(all == nullptr ? nullptr : all + (int64_t(bidb) * nheads + bidh) * m_blocks) {}

    __device__ bool enabled() const { return counts != nullptr; }

    // Key tile n's rank among the key tiles that see query tile m: how many of them lie below
    // n. They are contiguous, since both ends of a key tile's query range
    // (BandMask::query_block_range) grow with the tile: the first is the first tile whose range
    // ends past m.
    static __device__ int rank(BandMask const& mask, int m, int n_block) {
        int lo = 0, hi = n_block;
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            int first, last;
            mask.query_block_range(mid * kBlockN, kBlockN, kBlockM, first, last);
            if (last > m) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        return n_block - lo;
    }

    // Called by one thread: returns once the tiles ranked before `rank` have added to tile m.
    __device__ void wait(int m, int rank) const {
        while (ld_acquire_gpu(counts + m) != rank) {
        }
    }

    // Called by one thread after its CTA's additions to tile m are complete and, for other
    // threads' additions, fenced and past a barrier.
    __device__ void pass(int m, int rank) const { st_release_gpu(counts + m, rank + 1); }
};

// The order in which a key tile walks its query tiles [first, last): ascending, or descending
// in deterministic mode (see above).
struct QueryOrder {
    int first, last;
    bool down;

    __device__ int count() const { return last - first; }
    __device__ int at(int i) const { return down ? last - 1 - i : first + i; }
};

}  // namespace flash
