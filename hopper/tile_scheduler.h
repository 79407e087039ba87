// Tile scheduler of the SM90 forward: CTAs walk the (m_block, head, batch) tiles with a static
// stride of gridDim.x. Persistent (grid = number of SMs) for uniform tiles; with a grid of one
// CTA per tile the hardware hands tiles out in index order as SMs free up, which balances tiles
// of different lengths (tile_config.h). The tiles of one head are adjacent, so the CTAs running
// at the same time share K and V in L2; within a head the bottom tiles (the most keys under a
// causal or window mask) come first, so the long tiles start early.
#pragma once

#include <cuda_runtime.h>

namespace flash {

struct StaticTileScheduler {
    struct Params {
        int num_m_blocks;
        int nheads;
        int batch;
    };

    struct Tile {
        int m_block;
        int bidh;
        int bidb;
    };

    Params params;

    __host__ __device__ static int num_tiles(Params const& p) {
        return p.num_m_blocks * p.nheads * p.batch;
    }

    __device__ int first() const { return int(blockIdx.x); }
    __device__ int next(int idx) const { return idx + int(gridDim.x); }
    __device__ bool valid(int idx) const { return idx < num_tiles(params); }

    __device__ Tile tile(int idx) const {
        const int hb = idx / params.num_m_blocks;
        return {params.num_m_blocks - 1 - idx % params.num_m_blocks, hb % params.nheads,
                hb / params.nheads};
    }
};

}  // namespace flash
