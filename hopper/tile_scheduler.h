// Tile scheduler of the SM90 forward: clusters walk the (m_block group, head, batch) work units
// with a static stride of the number of clusters. A unit is kClusterM neighbouring query tiles
// of one head, one per CTA of the cluster (they share K and V through multicast). Persistent
// (one CTA per SM) for uniform tiles; with one CTA per tile the hardware hands tiles out in
// index order as SMs free up, which balances tiles of different lengths (tile_config.h). The
// tiles of one head are adjacent, so the CTAs running at the same time share K and V in L2;
// within a head the bottom tiles (the most keys under a causal or window mask) come first, so
// the long tiles start early.
#pragma once

#include <cuda_runtime.h>
#include <cute/arch/cluster_sm90.hpp>

namespace flash {

struct TileSchedulerParams {
    int num_m_blocks;  // a multiple of the cluster size (the launch checks it)
    int nheads;
    int batch;
};

template <int kClusterM>
struct StaticTileScheduler {
    using Params = TileSchedulerParams;

    struct Tile {
        int m_block;
        int bidh;
        int bidb;
    };

    Params params;

    // Work units: clusters' worth of tiles.
    __host__ __device__ static int num_units(Params const& p) {
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

}  // namespace flash
