// Compile-time test of the dynamic tile schedule (this file must compile): every (m_block,
// head) comes out exactly once, sections hold at most the L2 budget's heads and differ by at
// most one (the larger ones last), and each section hands out its bottom query tiles first.
#include "tile_scheduler.h"

namespace {

constexpr int kMaxTiles = 512;

constexpr bool check_schedule(int m_blocks, int nheads, int batch, int max_heads) {
    const flash::TileSchedulerParams p =
        flash::make_scheduler_params(m_blocks, nheads, batch, max_heads, nullptr);
    const flash::DynamicTileScheduler sched{p};
    const int heads = nheads * batch;
    const int units = flash::DynamicTileScheduler::num_units(p);
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

}  // namespace
