// Compile-time tests of the tile schedules (this file must compile).
//  - Dynamic: every (m_block, head) comes out exactly once, sections hold at most the L2
//    budget's heads and differ by at most one (the larger ones last), and each section hands
//    out its bottom query tiles first.
//  - Static with a split last round (SplitPlan): the whole rounds and the tail add up to the
//    units, every key block of every tail tile is in exactly one piece, a tile's pieces are
//    numbered 0..count-1 with count <= max_pieces and <= kMaxSplit + 1, and the split is made
//    only where it shortens the last round by at least kSplitMinSaving key blocks.
//  - Dynamic with split tiles (kv_pieces, decode): each (tile, piece) comes out once, a tile's
//    pieces are neighbouring units, and the pieces' key blocks cover the tile's exactly, in order.
//  - FastDivider, the decode's division, agrees with `/` around the multiples of every divisor up
//    to 400, at the dividends' upper end, and for large divisors.
#include <climits>
#include <cstdint>

#include "hopper/tile_scheduler.h"

namespace {

constexpr bool check_divider(int d) {
    const flash::FastDivider f(d);
    for (int64_t k = 0; k < 40; ++k) {
        for (int64_t n = k * d - 1; n <= k * d + 1; ++n) {
            if (n >= 0 && n <= INT_MAX && f.div(int(n)) != int(n) / d) return false;
        }
    }
    const int top[] = {INT_MAX, INT_MAX - 1, INT_MAX - d + 1, INT_MAX / d * d, INT_MAX / d * d - 1};
    for (int n : top) {
        if (f.div(n) != n / d) return false;
    }
    return true;
}

constexpr bool check_dividers() {
    for (int d = 1; d <= 400; ++d) {
        if (!check_divider(d)) return false;
    }
    const int large[] = {1 << 20, (1 << 20) + 1, 1000003, (1 << 30) + 1, INT_MAX - 1, INT_MAX};
    for (int d : large) {
        if (!check_divider(d)) return false;
    }
    return true;
}

static_assert(check_dividers(), "FastDivider differs from /");

constexpr int kMaxTiles = 512;

constexpr bool check_schedule(int m_blocks, int nheads, int batch, int max_heads) {
    const flash::TileSchedulerParams p =
        flash::make_scheduler_params(m_blocks, nheads, batch, max_heads, nullptr);
    const flash::DynamicTileScheduler<false> sched{p};
    const int heads = nheads * batch;
    const int units = flash::DynamicTileScheduler<false>::num_units(p);
    if (units != m_blocks * heads || units > kMaxTiles) return false;
    if (p.section_heads + (p.wide_sections > 0 ? 1 : 0) > max_heads) return false;
    if ((p.sections - p.wide_sections) * p.section_heads +
            p.wide_sections * (p.section_heads + 1) != heads) {
        return false;
    }
    bool seen[kMaxTiles] = {};
    int prev_m = m_blocks, prev_section_end = 0, section_end = 0;
    for (int u = 0; u < units; ++u) {
        const flash::Tile t = sched.tile(u);
        if (t.m_block < 0 || t.m_block >= m_blocks || t.bidh < 0 || t.bidh >= nheads ||
            t.bidb < 0 || t.bidb >= batch) {
            return false;
        }
        const int bh = t.bidb * nheads + t.bidh;
        const int idx = bh * m_blocks + t.m_block;
        if (seen[idx]) return false;
        seen[idx] = true;
        // Within a section m_block never grows; it restarts at the bottom in the next one.
        if (u == section_end) {
            prev_section_end = section_end;
            const int narrow_units = (p.sections - p.wide_sections) * p.section_heads * m_blocks;
            section_end += (u < narrow_units ? p.section_heads : p.section_heads + 1) * m_blocks;
            if (t.m_block != m_blocks - 1) return false;
        } else if (t.m_block > prev_m) {
            return false;
        }
        prev_m = t.m_block;
    }
    return prev_section_end < units && section_end == units;
}

static_assert(check_schedule(5, 7, 1, 3), "7 heads, at most 3 per section: 2 + 2 + 3");
static_assert(check_schedule(4, 8, 2, 3), "16 heads, at most 3 per section: 2 x 2 + 4 x 3");
static_assert(check_schedule(3, 4, 1, 4), "one section");
static_assert(check_schedule(6, 5, 3, 1), "one head per section");
static_assert(check_schedule(1, 16, 4, 5), "one query tile per head");

constexpr int kMaxKeyBlocks = 8192;

constexpr bool check_split(int units, int clusters, int key_blocks, bool expect_split) {
    const flash::SplitPlan s = flash::plan_split(units, clusters, key_blocks);
    if ((s.per > 0) != expect_split) return false;
    if (s.per == 0) return s.full_units == units && s.tail == 0;
    if (s.full_units % clusters != 0 || s.full_units + s.tail != units) return false;
    if (s.tail <= 0 || s.tail >= clusters) return false;
    if (key_blocks - s.per < flash::kSplitMinSaving) return false;
    if (s.tail * key_blocks > kMaxKeyBlocks || s.max_pieces > flash::kMaxSplit + 1) return false;
    bool covered[kMaxKeyBlocks] = {};
    int seen_pieces[kMaxKeyBlocks] = {};  // per tile: a bit per piece index
    for (int c = 0; c < clusters; ++c) {
        for (int j = 0; j < 3; ++j) {
            const flash::SplitPiece pc = flash::split_piece(s, c, j);
            if (pc.tile < 0) continue;
            if (j == 2 || pc.tile >= s.tail || pc.n_begin >= pc.n_end || pc.n_begin < 0 ||
                pc.n_end > key_blocks || pc.count > s.max_pieces || pc.index < 0 ||
                pc.index >= pc.count) {
                return false;
            }
            if (seen_pieces[pc.tile] & (1 << pc.index)) return false;
            seen_pieces[pc.tile] |= 1 << pc.index;
            for (int n = pc.n_begin; n < pc.n_end; ++n) {
                bool& b = covered[pc.tile * key_blocks + n];
                if (b) return false;
                b = true;
            }
        }
    }
    for (int i = 0; i < s.tail * key_blocks; ++i) {
        if (!covered[i]) return false;
    }
    for (int t = 0; t < s.tail; ++t) {
        // The cluster holding the tile's first key block: its first piece or its second.
        const int c = (t * key_blocks) / s.per;
        const flash::SplitPiece first = flash::split_piece(s, c, 0);
        const int count = (first.tile == t ? first : flash::split_piece(s, c, 1)).count;
        if (seen_pieces[t] != (1 << count) - 1) return false;
    }
    return true;
}

static_assert(check_split(1024, 66, 47, true), "d=128 8k on 128 x 176 tiles: 15 rounds + 34 units split");
static_assert(check_split(1024, 66, 94, true), "d=128 16k on 128 x 176 tiles");
static_assert(check_split(1024, 66, 12, false), "d=128 2k on 128 x 176 tiles: 5 blocks shorter is too little");
static_assert(check_split(512, 66, 52, true), "d=256 4k: 7 rounds + 50 units");
static_assert(check_split(2816, 132, 32, true), "d=64 4k: 21 rounds + 44 units");
static_assert(check_split(32, 66, 47, true), "fewer units than clusters: all split");
static_assert(check_split(1, 66, 47, true), "one unit: kMaxSplit pieces");
static_assert(check_split(72, 66, 24, true), "one round + 6 units");
static_assert(check_split(1024, 66, 4, false), "4 key blocks");
static_assert(check_split(132, 66, 47, false), "whole rounds");
static_assert(check_split(1054, 66, 47, false), "a tail of 64 / 66 is not worth splitting");

constexpr bool check_pieces(int m_blocks, int nheads, int batch, int clusters, int n_first,
                            int n_last, int expect_pieces) {
    flash::TileSchedulerParams p =
        flash::make_scheduler_params(m_blocks, nheads, batch, nheads * batch, nullptr);
    const int tiles = flash::DynamicTileScheduler<true>::num_units(p);
    p.pieces = flash::kv_pieces(tiles, clusters, n_last);
    if (p.pieces != expect_pieces) return false;
    if (p.pieces > flash::kMaxPieces || (p.pieces > 1 && 4 * tiles > clusters)) return false;
    const flash::DynamicTileScheduler<true> sched{p};
    const int units = flash::DynamicTileScheduler<true>::num_units(p);
    if (units != tiles * p.pieces || units > kMaxTiles) return false;
    for (int u = 0; u < units; ++u) {
        const flash::Tile t = sched.tile(u);
        const flash::Tile whole = sched.whole_tile(u / p.pieces);
        if (t.m_block != whole.m_block || t.bidh != whole.bidh || t.bidb != whole.bidb) return false;
        if (p.pieces == 1) {
            if (t.split != -1 || t.pieces != 1) return false;
            continue;
        }
        if (t.split != u / p.pieces || t.pieces != p.pieces || t.piece != u % p.pieces) return false;
        // This piece's blocks start where the previous piece's end.
        int first = n_first, last = n_last;
        flash::piece_key_blocks(t.piece, t.pieces, first, last);
        int prev_end = n_first;
        if (t.piece > 0) {
            int pf = n_first, pl = n_last;
            flash::piece_key_blocks(t.piece - 1, t.pieces, pf, pl);
            prev_end = pl;
        }
        if (first != prev_end || last < first || last > n_last) return false;
        if (t.piece == t.pieces - 1 && last != n_last) return false;
    }
    return true;
}

static_assert(check_pieces(1, 4, 8, 132, 0, 64, 4), "decode, 8 x 4 KV heads, 8k keys: 4 pieces");
static_assert(check_pieces(1, 8, 1, 132, 0, 64, 16), "8 tiles: at most kMaxPieces");
static_assert(check_pieces(1, 8, 1, 132, 0, 10, 2), "10 key blocks: pieces of at least 4");
static_assert(check_pieces(1, 8, 1, 132, 3, 10, 2), "a tile's own range [3, 10)");
static_assert(check_pieces(1, 8, 1, 132, 0, 7, 1), "7 key blocks: not split");
static_assert(check_pieces(2, 11, 3, 132, 0, 33, 1), "66 tiles: not split");
static_assert(check_pieces(3, 11, 1, 132, 0, 33, 4), "33 tiles: four pieces");
static_assert(check_pieces(1, 34, 1, 132, 0, 64, 1), "34 tiles: not split");
static_assert(check_pieces(1, 1, 1, 132, 0, 1000, 16), "one tile, long keys");

}  // namespace
