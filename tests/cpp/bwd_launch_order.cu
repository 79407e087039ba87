// Compile-time tests of the SM90 backward's launch order (this file must compile): bwd_launch
// maps the grid's launch indices onto every (key tile, head) exactly once, and in
// deterministic mode every tile a key tile waits for (its head's higher key tiles, whose dQ
// additions come first) has a smaller launch index, with or without head groups, including
// a last group of fewer heads.
#include "common/dq_turns.h"

namespace {

constexpr int kMaxTiles = 256;

constexpr bool check_launch(int n_blocks, int heads, int head_group, bool deterministic) {
    if (n_blocks * heads > kMaxTiles) return false;
    int launch_of[kMaxTiles] = {};  // (head, key tile) -> launch index + 1
    for (int i = 0; i < n_blocks * heads; ++i) {
        const flash::BwdLaunch l =
            flash::bwd_launch(i, n_blocks, heads, head_group, deterministic);
        if (l.n_block < 0 || l.n_block >= n_blocks || l.head < 0 || l.head >= heads) return false;
        int& slot = launch_of[l.head * n_blocks + l.n_block];
        if (slot != 0) return false;  // a tile launched twice
        slot = i + 1;
    }
    if (!deterministic) return true;
    for (int h = 0; h < heads; ++h) {
        for (int n = 0; n + 1 < n_blocks; ++n) {
            if (launch_of[h * n_blocks + n + 1] >= launch_of[h * n_blocks + n]) return false;
        }
    }
    return true;
}

constexpr bool check_all() {
    for (int n_blocks = 1; n_blocks <= 6; ++n_blocks) {
        for (int heads = 1; heads <= 11; ++heads) {
            if (!check_launch(n_blocks, heads, 1, false)) return false;
            for (int group = 1; group <= 12; ++group) {
                if (!check_launch(n_blocks, heads, group, true)) return false;
            }
        }
    }
    return check_launch(16, 16, 5, true) && check_launch(128, 2, 1, true);
}

static_assert(check_all(), "bwd_launch: a tile is missed, launched twice, or waits for a later one");

}  // namespace
