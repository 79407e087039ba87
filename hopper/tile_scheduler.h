// Tile schedulers of the SM90 forward. Both are persistent: the grid holds as many CTAs as fit
// on the GPU at once, and each walks work units until they run out. A unit is kClusterM
// neighbouring query tiles of one head, one per CTA of a cluster (they share K and V through
// multicast).
//  - StaticTileScheduler: uniform tiles (no band mask). CTAs stride through the units by the
//    grid size; the tiles of one head are adjacent, so the CTAs running at the same time share
//    K and V in L2.
//  - DynamicTileScheduler: tiles of different lengths (causal, window, varlen). Units come
//    longest first, the bottom query tiles (the most keys under a causal mask) of a section of
//    heads before the tiles above them, and a CTA that finished early takes the next unit from
//    a global counter. A section holds at most as many heads as keep their K and V in L2
//    together; the sections differ by at most one head, the larger ones last. A small last
//    section would start its longest tiles when most CTAs are about to run dry (a list-
//    scheduling model of the causal grid: 87% of the ideal at d=256 2k with a 1-head tail
//    section, 97% balanced).
// Only the producer warp asks the scheduler for the next unit; the consumers read it from a
// TileQueue in shared memory.
#pragma once

#include <cuda_runtime.h>
#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>

namespace flash {

struct TileSchedulerParams {
    int num_m_blocks;  // a multiple of the cluster size (run_fwd_sm90 checks it)
    int nheads;
    int batch;
    // Dynamic only: the nheads * batch heads fall into `sections` sections, the first ones of
    // `section_heads` heads and the last `wide_sections` of section_heads + 1.
    int sections;
    int section_heads;
    int wide_sections;
    int* counter;  // dynamic only: zero at launch, counts the units handed out
};

// Sections of at most `max_heads` heads each, as even as possible.
__host__ __device__ constexpr TileSchedulerParams make_scheduler_params(int num_m_blocks, int nheads, int batch,
                                                 int max_heads, int* counter) {
    const int heads = nheads * batch;
    const int sections = (heads + max_heads - 1) / max_heads;
    return {num_m_blocks, nheads, batch, sections, heads / sections, heads % sections, counter};
}

struct Tile {
    int m_block;
    int bidh;
    int bidb;
};

template <int kClusterM>
struct StaticTileScheduler {
    using Params = TileSchedulerParams;
    Params params;

    __host__ __device__ static constexpr int num_units(Params const& p) {
        return (p.num_m_blocks / kClusterM) * p.nheads * p.batch;
    }

    __device__ int first() const { return int(blockIdx.x) / kClusterM; }
    __device__ int next(int unit) const { return unit + int(gridDim.x) / kClusterM; }
    __device__ bool valid(int unit) const { return unit < num_units(params); }

    __device__ Tile tile(int unit) const {
        const int groups = params.num_m_blocks / kClusterM;
        const int hb = unit / groups;
        const int rank = kClusterM == 1 ? 0 : int(cute::block_rank_in_cluster());
        return {(groups - 1 - unit % groups) * kClusterM + rank, hb % params.nheads,
                hb / params.nheads};
    }
};

struct DynamicTileScheduler {
    using Params = TileSchedulerParams;
    Params params;

    __host__ __device__ static constexpr int num_units(Params const& p) {
        return p.num_m_blocks * p.nheads * p.batch;
    }

    __device__ int first() const { return int(blockIdx.x); }
    // One lane of the producer warp calls this.
    __device__ int next(int) const { return int(gridDim.x) + atomicAdd(params.counter, 1); }
    __device__ bool valid(int unit) const { return unit < num_units(params); }

    __host__ __device__ constexpr Tile tile(int unit) const {
        const int narrow = params.sections - params.wide_sections;
        const int narrow_units = narrow * params.section_heads * params.num_m_blocks;
        const bool wide = unit >= narrow_units;
        const int section_heads = params.section_heads + (wide ? 1 : 0);
        const int per_section = section_heads * params.num_m_blocks;
        const int local = wide ? unit - narrow_units : unit;
        const int section = local / per_section;
        const int in_section = local - section * per_section;
        const int first_head =
            (wide ? narrow * params.section_heads : 0) + section * section_heads;
        const int bh = first_head + in_section % section_heads;
        return {params.num_m_blocks - 1 - in_section / section_heads, bh % params.nheads,
                bh / params.nheads};
    }
};

// Two slots through which the producer warp hands each unit to the consumer warps: the
// producer may run one unit ahead (it prefetches the next tile's K during this tile's
// epilogue).
struct TileQueue {
    static constexpr int kSlots = 2;
    int unit[kSlots];
    cutlass::arch::ClusterBarrier full[kSlots];   // the producer's lane 0 wrote the slot
    cutlass::arch::ClusterBarrier empty[kSlots];  // every consumer warp read it

    __device__ void init(int consumer_warps) {
        for (int s = 0; s < kSlots; ++s) {
            full[s].init(1);
            empty[s].init(consumer_warps);
        }
    }

    // Producer warp, the i-th unit it hands out.
    __device__ void push(int i, int u) {
        const int s = i % kSlots;
        empty[s].wait(((i / kSlots) & 1) ^ 1);
        if (threadIdx.x % 32 == 0) {
            unit[s] = u;
            full[s].arrive();
        }
        __syncwarp();
    }

    // Every consumer thread, the i-th unit.
    __device__ int pop(int i) {
        const int s = i % kSlots;
        full[s].wait((i / kSlots) & 1);
        const int u = unit[s];
        __syncwarp();
        if (cute::elect_one_sync()) empty[s].arrive();
        return u;
    }
};

}  // namespace flash
