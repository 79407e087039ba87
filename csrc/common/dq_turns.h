// deterministic=True backward, both archs: the key tiles that see a query tile add their dQ
// partial sums to its fp32 accumulator one at a time, highest key tile first, so that the sum's
// rounding is the same in every run. A counter per (batch, head, query tile) says how many have
// added; a key tile waits until it equals the tile's rank.
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

    // The key tiles that see query tile m are the key blocks that its rows inside the sequence
    // see (BandMask::key_block_range), a contiguous range; key tile n's rank is the number of
    // them above n. Highest first: a causal key tile's first query tiles are those it starts
    // (rank 0), and each later one waits only for the tiles above it, a step ahead of it; in
    // ascending order a tile would wait at its first query tiles for every tile below it.
    // n_end: the sequence's key tiles.
    static __device__ int rank(BandMask const& mask, int m, int n_block, int n_end) {
        const int row0 = m * kBlockM;
        int first, last;
        mask.key_block_range(row0, min(kBlockM, mask.seqlen_q - row0), kBlockN, first, last);
        return min(last, n_end) - 1 - n_block;
    }

    // Called by one thread: returns once the tiles ranked before `rank` have added to tile m.
    __device__ void wait(int m, int rank) const {
        while (ld_acquire_gpu(counts + m) != rank) {
        }
    }

    // wait() after a first look taken earlier (`seen`, from peek): the look's load ran while
    // other work was in flight, so a turn that had already come costs no second round trip.
    // peek is relaxed (an acquire load would hold the thread until it returns); the caller
    // issues a fence.acq_rel.gpu between it and the accesses the turn orders.
    __device__ int peek(int m) const { return ld_relaxed_gpu(counts + m); }
    __device__ void wait(int m, int rank, int seen) const {
        if (seen != rank) wait(m, rank);
    }

    // Called by one thread after its CTA's additions to tile m: past a barrier that every adding
    // thread reached after its additions, and a fence.acq_rel.gpu of this thread after it (or
    // the additions' own completion wait, for bulk reductions).
    __device__ void pass(int m, int rank) const { st_release_gpu(counts + m, rank + 1); }
};

// Deterministic grids launch a (batch, head)'s key tiles from the highest down: a tile waits
// only for tiles launched before it, which hold an SM or are done, so none waits for a tile
// that cannot start. This relies on CTAs starting in blockIdx order, which CUDA does not
// promise but the hardware does for a 1-D grid (FlashAttention-3's deterministic mode relies on
// the same).
__host__ __device__ constexpr int key_tile_of_launch(int launch_index, int n_blocks,
                                                     bool deterministic) {
    return deterministic ? n_blocks - 1 - launch_index : launch_index;
}

// The SM90 backward's CTA `launch`: its key tile and its head, counting (batch, head) pairs.
// A head's key tiles in a row (key_tile_of_launch), or, with `head_group` > 1 (deterministic
// grids without a mask whose heads have few key tiles), a group of heads' highest tiles, then
// their next ones. Either way each tile a deterministic tile waits for (its head's higher key
// tiles) is launched before it (tests/cpp/bwd_launch_order.cu).
struct BwdLaunch {
    int n_block;
    int head;
};
__host__ __device__ constexpr BwdLaunch bwd_launch(int launch, int n_blocks, int heads,
                                                   int head_group, bool deterministic) {
    if (head_group > 1) {
        const int group = launch / (head_group * n_blocks);
        const int left = heads - group * head_group;
        const int in_group = head_group < left ? head_group : left;
        const int i = launch - group * head_group * n_blocks;
        return {n_blocks - 1 - i / in_group, group * head_group + i % in_group};
    }
    // Unsigned: the launch index is blockIdx.x, and the kernels' division stays unsigned.
    return {key_tile_of_launch(int(unsigned(launch) % unsigned(n_blocks)), n_blocks, deterministic),
            int(unsigned(launch) / unsigned(n_blocks))};
}

}  // namespace flash
