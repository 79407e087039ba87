// Compile-time tests of the mask policy (this file must compile): BandMask::unmasked_key_blocks
// names exactly the key blocks in which tile_needs_mask finds nothing to mask, for causal,
// window and unbounded bands, seqlen_q above, equal to and below seqlen_k, and row ranges that
// start before the sequence (end-aligned top tiles) or run past it; BandMask::row_limits names
// exactly the rows whose keep() holds for a column, columns past the keys included.
#include "common/mask.h"

namespace {

constexpr bool check_mask(int seqlen_q, int seqlen_k, int left, int right, int block_n) {
    const flash::BandMask mask{seqlen_q, seqlen_k, left, right};
    for (int row0 = -64; row0 < seqlen_q + 64; row0 += 13) {
        for (int rows : {1, 64, 77}) {
            int lo = 0, hi = 0;
            mask.unmasked_key_blocks(row0, rows, block_n, lo, hi);
            for (int n = 0; n * block_n < seqlen_k + 2 * block_n; ++n) {
                const bool clean = n >= lo && n < hi;
                if (clean == mask.tile_needs_mask(row0, rows, n * block_n, block_n)) return false;
            }
        }
    }
    return true;
}

constexpr bool check_rows(int seqlen_q, int seqlen_k, int left, int right) {
    const flash::BandMask mask{seqlen_q, seqlen_k, left, right};
    for (int col = 0; col < seqlen_k + 9; ++col) {
        int lo = 0, hi = 0;
        mask.row_limits(col, lo, hi);
        for (int row = 0; row < seqlen_q; ++row) {
            if ((row >= lo && row < hi) != mask.keep(row, col)) return false;
        }
        if (hi > seqlen_q) return false;
    }
    return true;
}

constexpr bool check_all_rows(int seqlen_q, int seqlen_k) {
    for (int left : {-1, 0, 9, 70}) {
        for (int right : {-1, 0, 7, 50}) {
            if (!check_rows(seqlen_q, seqlen_k, left, right)) return false;
        }
    }
    return true;
}

// seqlen_q above, equal to and below seqlen_k; one pair per assertion (the constexpr budget).
static_assert(check_all_rows(1, 1), "row_limits disagrees with keep");
static_assert(check_all_rows(1, 90), "row_limits disagrees with keep");
static_assert(check_all_rows(90, 1), "row_limits disagrees with keep");
static_assert(check_all_rows(61, 61), "row_limits disagrees with keep");
static_assert(check_all_rows(40, 97), "row_limits disagrees with keep");
static_assert(check_all_rows(97, 40), "row_limits disagrees with keep");

// One block size per assertion: each stays within the compiler's constexpr step budget. The
// kernels' key blocks: 128 (d <= 128), 96 (d <= 192), 80 (d <= 256); 64 for good measure.
constexpr bool check_all(int block_n) {
    for (int sq : {1, 100, 300}) {
        for (int sk : {1, 128, 300, 513}) {
            for (int left : {-1, 0, 40, 200}) {
                for (int right : {-1, 0, 7, 150}) {
                    if (!check_mask(sq, sk, left, right, block_n)) return false;
                }
            }
        }
    }
    return true;
}

static_assert(check_all(64), "unmasked_key_blocks disagrees with tile_needs_mask");
static_assert(check_all(80), "unmasked_key_blocks disagrees with tile_needs_mask");
static_assert(check_all(96), "unmasked_key_blocks disagrees with tile_needs_mask");
static_assert(check_all(128), "unmasked_key_blocks disagrees with tile_needs_mask");

}  // namespace
