// Tile schedulers of the SM90 forward. Both are persistent: the grid holds as many CTAs as fit
// on the GPU at once, and each walks work units until they run out. A unit is kClusterM
// neighbouring query tiles, one per CTA of a cluster. Tiles of one head share K and V through
// multicast; where a head's tile count is not a multiple of kClusterM, a unit may span two
// heads, and its CTAs then load K and V each for itself (Tile::shared_kv).
//  - StaticTileScheduler: uniform tiles (no band mask). CTAs stride through the units by the
//    grid size; the tiles of one head are adjacent, so the CTAs running at the same time share
//    K and V in L2. Units that do not fill a last round are split by key blocks over all the
//    clusters (SplitPlan).
//  - DynamicTileScheduler: tiles of different lengths (causal, window, varlen). Units come
//    longest first, the bottom query tiles (the most keys under a causal mask) of a section of
//    heads before the tiles above them, and a CTA that finished early takes the next unit from
//    a global counter. A section holds at most as many heads as keep their K and V in L2
//    together; the sections differ by at most one head, the larger ones last. A small last
//    section would start its longest tiles when most CTAs are about to run dry (a list-
//    scheduling model of the causal grid: 87% of the ideal at d=256 2k with a 1-head tail
//    section, 97% balanced). Where the tiles are too few to fill the GPU (decode: a few
//    query rows per KV head against a long cache), each tile's keys are split into `pieces`
//    units (kv_pieces), merged as the static schedule's pieces are.
// Only the producer warp asks the scheduler for the next unit; the consumers read it from a
// TileQueue in shared memory.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>

namespace flash {

// The static schedule's last round, split by key blocks. Whole rounds of units run first; the
// `tail` units left (fewer than the grid's clusters) are cut into pieces of consecutive key
// blocks: numbering the tail's key blocks tile after tile, cluster c takes [c * per,
// (c + 1) * per), so it runs at most two pieces (the end of one tile, the start of the next).
// Each piece's CTAs leave their partial O and LSE in a workspace, and the consumer group that
// completes a tile's last piece merges them (Sm90FwdEpilogue::merge_pieces). Unsplit, the
// clusters past `tail` idle through the last round: on 128 x 176 tiles the d=128 non-causal
// grid ran 1024 units on 66 clusters, 15.52 rounds in 16. Also the
// split-KV of grids with fewer units than clusters (tail = units).
struct SplitPlan {
    int full_units = 0;  // units run whole, a multiple of the clusters
    int tail = 0;        // units split after them
    int key_blocks = 0;  // of every tile (static tiles see every key)
    int per = 0;         // tail key blocks per cluster; 0: nothing is split
    int max_pieces = 0;  // most pieces of one tile: workspace slots per split tile
    // Workspace; a slot is one CTA's tile of a split unit (tail tile * kClusterM + rank).
    float* o = nullptr;      // (slot, piece, thread's row, four columns, consumer thread)
    float* lse = nullptr;    // (slot, piece, rows per thread, consumer thread)
    int* arrived = nullptr;  // (slot, consumer group): pieces done; zero at launch
};

// A split is made only where it shortens the last round by at least this many key blocks. Each
// piece costs about a tile's fixed cost (1-2 blocks: the pipeline's fill and drain) plus its
// partial output's write and the merge's reads, and the clusters reach the tail at different
// times: split on/off, same build, graph-timed in turns, d=128 non-causal gained +1.2% at 8k
// and +2.0% at 16k (22 and 45 blocks shorter), nothing at 2048 (5), and lost 1.5% at 1024 (3);
// d=256 lost 5.7% at 1024 (3).
constexpr int kSplitMinSaving = 8;
// At most this many clusters share a tile: the merge reads every other piece's output.
constexpr int kMaxSplit = 4;

struct SplitPiece {
    int tile;             // tail tile (unit full_units + tile); -1: no such piece
    int n_begin, n_end;   // its key blocks
    int index, count;     // which piece of the tile, of how many
};

// Piece j of cluster c (j = 0 or 1; none from 2 on, and none past the tail).
__host__ __device__ constexpr SplitPiece split_piece(SplitPlan const& s, int c, int j) {
    const int total = s.tail * s.key_blocks;
    const int begin = c * s.per;
    const int end = begin + s.per < total ? begin + s.per : total;
    const int tile = begin / s.key_blocks + j;
    const int first = tile * s.key_blocks;
    if (begin >= total || first >= end) return {-1, 0, 0, 0, 0};
    const int first_cluster = first / s.per;
    const int last_cluster = (first + s.key_blocks - 1) / s.per;
    return {tile, (begin > first ? begin : first) - first,
            (end < first + s.key_blocks ? end : first + s.key_blocks) - first,
            c - first_cluster, last_cluster - first_cluster + 1};
}

// `units` on `clusters` with `key_blocks` per tile: split the last round where that pays.
__host__ __device__ constexpr SplitPlan plan_split(int units, int clusters, int key_blocks) {
    SplitPlan s;
    const int tail = units % clusters;
    s.full_units = units;
    if (tail == 0) return s;
    const int even = (tail * key_blocks + clusters - 1) / clusters;
    const int fewest = (key_blocks + kMaxSplit - 1) / kMaxSplit;
    const int per = even > fewest ? even : fewest;
    if (key_blocks - per < kSplitMinSaving) return s;
    s.full_units = units - tail;
    s.tail = tail;
    s.key_blocks = key_blocks;
    s.per = per;
    for (int t = 0; t < tail; ++t) {
        const int first = t * key_blocks;
        const int count = (first + key_blocks - 1) / per - first / per + 1;
        s.max_pieces = count > s.max_pieces ? count : s.max_pieces;
    }
    return s;
}

// Division by a divisor fixed at launch: a multiply-high, an add and a shift (the round-up
// method of Granlund and Montgomery, exact for every dividend in [0, 2^31)), where `/` by a
// run-time int is a sequence of ~25 instructions. The dynamic schedule's decode took four of
// them, ~120 instructions in each of the twelve consumer warps at every tile (now ~40).
struct FastDivider {
    uint32_t mul = 1;  // the divisor 1: (n * 1 >> 32) + n = n
    int shift = 0;

    FastDivider() = default;
    // Divisors below 1 (never passed: the binding returns before launching empty problems)
    // give the divisor 1's identity rather than a host division by zero.
    __host__ __device__ constexpr explicit FastDivider(int divisor) {
        if (divisor <= 1) return;
        while ((int64_t(1) << shift) < divisor) ++shift;
        mul = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << shift) - uint64_t(divisor)) /
                           uint64_t(divisor) +
                       1);
    }

    // n / divisor for 0 <= n < 2^31.
    __host__ __device__ constexpr int div(int n) const {
        const uint64_t high = (uint64_t(mul) * uint32_t(n)) >> 32;
        return int((high + uint32_t(n)) >> shift);
    }
};

struct TileSchedulerParams {
    int num_m_blocks;  // static: num_m_blocks * nheads * batch is a multiple of the cluster
                       // size (run_fwd_sm90 checks it)
    int nheads;
    int batch;
    // Dynamic only: the nheads * batch heads fall into `sections` sections, the first ones of
    // `section_heads` heads and the last `wide_sections` of section_heads + 1.
    int sections;
    int section_heads;
    int wide_sections;
    int* counter;  // dynamic only: zero at launch, counts the units handed out
    // Static: the split last round. Dynamic: only the workspace (o, lse, arrived, max_pieces =
    // pieces) of split tiles.
    SplitPlan split;
    int pieces = 1;  // dynamic only: units per tile, each a share of its key blocks
    // The decode's divisors (make_scheduler_params sets them): nheads, num_m_blocks, and the
    // narrow and wide sections' heads and units.
    FastDivider by_nheads, by_m_blocks;
    FastDivider by_narrow_heads, by_wide_heads, by_narrow_units, by_wide_units;
};

// Dynamic schedule: pieces per tile where `tiles` leave at least three quarters of `clusters`
// idle. Decode at d=128 (benchmark_decode.py): 32 tiles in 4 pieces ran
// 1.20-1.88x as fast as unsplit; 64 tiles in 2 pieces 0.95-0.99x at 10 of 12 shapes (64 SMs
// already read K/V at 1.9-2.8 TB/s). Each piece keeps at least kMinPieceBlocks key blocks (its
// fill, drain and partial output cost about a tile's fixed cost), and at most kMaxPieces
// pieces are merged.
constexpr int kMinPieceBlocks = 4;
constexpr int kMaxPieces = 16;
__host__ __device__ constexpr int kv_pieces(int tiles, int clusters, int key_blocks) {
    if (tiles <= 0 || 4 * tiles > clusters) return 1;
    int pieces = clusters / tiles;
    pieces = pieces < kMaxPieces ? pieces : kMaxPieces;
    const int by_keys = key_blocks / kMinPieceBlocks;
    pieces = pieces < by_keys ? pieces : by_keys;
    return pieces > 1 ? pieces : 1;
}

// Key blocks [n_first, n_last) of piece `piece` of `pieces` of a tile that sees [n_first,
// n_last): consecutive shares, the last one shorter (possibly empty).
__host__ __device__ constexpr void piece_key_blocks(int piece, int pieces, int& n_first,
                                                    int& n_last) {
    const int per = (n_last - n_first + pieces - 1) / pieces;
    const int begin = n_first + piece * per;
    const int end = begin + per;
    n_first = begin < n_last ? begin : n_last;
    n_last = end < n_last ? end : n_last;
}

// Sections of at most `max_heads` heads each, as even as possible.
__host__ __device__ constexpr TileSchedulerParams make_scheduler_params(int num_m_blocks,
                                                                        int nheads, int batch,
                                                                        int max_heads,
                                                                        int* counter) {
    const int heads = nheads * batch;
    TileSchedulerParams p{};
    p.num_m_blocks = num_m_blocks;
    p.nheads = nheads;
    p.batch = batch;
    p.sections = (heads + max_heads - 1) / max_heads;
    p.section_heads = heads / p.sections;
    p.wide_sections = heads % p.sections;
    p.counter = counter;
    p.by_nheads = FastDivider(nheads);
    p.by_m_blocks = FastDivider(num_m_blocks);
    p.by_narrow_heads = FastDivider(p.section_heads);
    p.by_wide_heads = FastDivider(p.section_heads + 1);
    p.by_narrow_units = FastDivider(p.section_heads * num_m_blocks);
    p.by_wide_units = FastDivider((p.section_heads + 1) * num_m_blocks);
    return p;
}

// A key-block bound past any tile's last block: a unit that is not a piece sees all its keys.
constexpr int kAllKeyBlocks = 1 << 30;

struct Tile {
    int m_block;
    int bidh;
    int bidb;
    // Static: key blocks [n_begin, n_end) of the tile this unit computes (clamped to what its
    // rows see). A piece of a split tile has split >= 0 (its workspace slot: the static tail
    // tile, or the dynamic tile's index) and is piece `piece` of `pieces`; a dynamic piece
    // takes its share of the keys its tile's rows see (piece_key_blocks).
    int n_begin = 0;
    int n_end = kAllKeyBlocks;
    int split = -1;
    int piece = 0;
    int pieces = 1;
    // Static, clusters: every CTA of the unit runs a tile of this head (K and V multicast).
    bool shared_kv = true;
};

template <int kClusterM>
struct StaticTileScheduler {
    using Params = TileSchedulerParams;
    Params params;

    __host__ __device__ static constexpr int num_units(Params const& p) {
        return p.num_m_blocks * p.nheads * p.batch / kClusterM;
    }

    __device__ int clusters() const { return int(gridDim.x) / kClusterM; }
    __device__ int first() const { return int(blockIdx.x) / kClusterM; }
    __device__ int next(int unit) const { return unit + clusters(); }
    // Units past full_units name the pieces of the split tail: piece (unit - full_units) /
    // clusters of cluster (unit - full_units) % clusters.
    __device__ SplitPiece piece(int unit) const {
        const int rel = unit - params.split.full_units;
        return split_piece(params.split, rel % clusters(), rel / clusters());
    }
    __device__ bool valid(int unit) const {
        if (params.split.per == 0) return unit < num_units(params);
        return unit < params.split.full_units || piece(unit).tile >= 0;
    }

    __device__ Tile tile(int unit) const {
        if (params.split.per == 0 || unit < params.split.full_units) return whole(unit);
        const SplitPiece pc = piece(unit);
        Tile t = whole(params.split.full_units + pc.tile);
        t.n_begin = pc.n_begin;
        t.n_end = pc.n_end;
        t.split = pc.tile;
        t.piece = pc.index;
        t.pieces = pc.count;
        return t;
    }

    // The tiles of all heads in a row, each head's from the last query tile down; unit u holds
    // tiles [u * kClusterM, (u + 1) * kClusterM).
    __device__ Tile whole(int unit) const {
        const int rank = kClusterM == 1 ? 0 : int(cute::block_rank_in_cluster());
        const int m_blocks = params.num_m_blocks;
        const int first = unit * kClusterM;
        const int i = first + rank;
        const int hb = params.by_m_blocks.div(i);
        const int bidb = params.by_nheads.div(hb);
        Tile t{m_blocks - 1 - (i - hb * m_blocks), hb - bidb * params.nheads, bidb};
        t.shared_kv = first / m_blocks == (first + kClusterM - 1) / m_blocks;
        return t;
    }
};

// kPieces: tiles may be split by keys (Params::pieces); without it the schedule has no code
// for pieces (the band kernel's producer spilled more with it).
template <bool kPieces>
struct DynamicTileScheduler {
    using Params = TileSchedulerParams;
    Params params;

    __host__ __device__ static constexpr int num_units(Params const& p) {
        return p.num_m_blocks * p.nheads * p.batch * (kPieces ? p.pieces : 1);
    }

    __device__ int first() const { return int(blockIdx.x); }
    // One lane of the producer warp calls this.
    __device__ int next(int) const { return int(gridDim.x) + atomicAdd(params.counter, 1); }
    __device__ bool valid(int unit) const { return unit < num_units(params); }

    // The pieces of one tile are neighbouring units, so they run at the same time.
    __host__ __device__ constexpr Tile tile(int unit) const {
        if constexpr (!kPieces) return whole_tile(unit);
        const int pieces = params.pieces;
        const int whole = pieces == 1 ? unit : unit / pieces;
        Tile t = whole_tile(whole);
        if (pieces > 1) {
            t.split = whole;
            t.piece = unit - whole * pieces;
            t.pieces = pieces;
        }
        return t;
    }

    __host__ __device__ constexpr Tile whole_tile(int unit) const {
        const int narrow = params.sections - params.wide_sections;
        const int narrow_units = narrow * params.section_heads * params.num_m_blocks;
        const bool wide = unit >= narrow_units;
        const int section_heads = params.section_heads + (wide ? 1 : 0);
        const int per_section = section_heads * params.num_m_blocks;
        const FastDivider by_heads = wide ? params.by_wide_heads : params.by_narrow_heads;
        const FastDivider by_units = wide ? params.by_wide_units : params.by_narrow_units;
        const int local = wide ? unit - narrow_units : unit;
        const int section = by_units.div(local);
        const int in_section = local - section * per_section;
        const int row = by_heads.div(in_section);  // query tiles from the bottom
        const int first_head =
            (wide ? narrow * params.section_heads : 0) + section * section_heads;
        const int bh = first_head + in_section - row * section_heads;
        const int bidb = params.by_nheads.div(bh);
        return {params.num_m_blocks - 1 - row, bh - bidb * params.nheads, bidb};
    }
};

// Two slots through which the producer warp hands each unit to the consumer warps (and to
// e4m3's transposing warps or the kValueWarp kernels' V warp): the producer may run one unit
// ahead (it prefetches the next tile's K during this tile's epilogue).
// The consumers learn the schedule's end from kDone, not from the scheduler: its test of a split
// tail's pieces, in the consumer loop, made the d=256 key loop spill.
struct TileQueue {
    static constexpr int kSlots = 2;
    static constexpr int kDone = -1;
    int unit[kSlots];
    cutlass::arch::ClusterBarrier full[kSlots];   // the producer's lane 0 wrote the slot
    cutlass::arch::ClusterBarrier empty[kSlots];  // every reader warp read it

    __device__ void init(int reader_warps) {
        for (int s = 0; s < kSlots; ++s) {
            full[s].init(1);
            empty[s].init(reader_warps);
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

    // Every thread of a reader warp (consumers, e4m3 transposers, paged V loader), the i-th unit.
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
