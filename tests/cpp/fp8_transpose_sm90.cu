// Compile-time tests of the e4m3 forward's V transpose (this file must compile): the lane
// mapping of hopper/fp8_sm90.h, composed with ldmatrix's and stmatrix.trans's fragment layouts
// (PTX ISA, "Warp-level matrix load/store": lane t holds row t / 4, 16-bit elements 2 (t % 4)
// and 2 (t % 4) + 1 of each 8 x 8 matrix, whose row addresses lanes 8 i..8 i + 7 give), moves
// byte (key column c, d row r) of a 32-key x 16-column block to (d row r, key column c), once
// each; key_of_column and column_of_key are inverses; and ValueTransposer's address steps hold
// for the e4m3 kernels' real shared-memory layouts at every head-dim tier (within a swizzle
// atom's chunks, V's address of chunk j is chunk 0's with j XORed into bits 4 and up; V^T's
// moves by a constant per 16 rows; a stage of either adds a constant).
#include "hopper/fwd_traits_sm90.h"

namespace {

constexpr bool columns_invert() {
    for (int a = 0; a < 32; ++a) {
        if (flash::column_of_key(flash::key_of_column(a)) != a) return false;
    }
    return true;
}

// The (key column, d row) of byte b of register i of lane t after the ldmatrix.x4.
struct Cell {
    int col, row;
};
constexpr Cell loaded(int t, int i, int b) {
    return {flash::transpose_load_column(8 * i + t / 4), 4 * (t % 4) + b};
}

constexpr bool block_transposes() {
    bool seen[16][32] = {};
    for (int t = 0; t < 32; ++t) {
        for (int o = 0; o < 4; ++o) {
            const int h = o / 2, m = o % 2;
            const uint32_t sel = flash::transpose_selector(t, m);
            for (int n = 0; n < 4; ++n) {
                // __byte_perm(word 2h, word 2h + 1, sel): nibble n picks a byte of the pair.
                const int pick = int((sel >> (4 * n)) & 7);
                const Cell src = loaded(t, 2 * h + pick / 4, pick % 4);
                // stmatrix.trans: half n / 2 of word o goes to the row that lane
                // 8 o + 2 (t % 4) + n / 2 addresses, bytes 2 (t / 4) and 2 (t / 4) + 1.
                const int row = flash::transpose_store_row(8 * o + 2 * (t % 4) + n / 2);
                const int col = 16 * h + 2 * (t / 4) + n % 2;
                if (src.col != col || src.row != row || seen[row][col]) return false;
                seen[row][col] = true;
            }
        }
    }
    return true;
}

// Each 8-row phase of both instructions holds 8 rows that differ mod 8 (keys on the way in, d
// rows on the way out): with the 128-byte swizzle of rows that are one atom wide, 32 banks.
constexpr bool rows_differ_mod_8() {
    for (int i = 0; i < 4; ++i) {
        int keys = 0, rows = 0;
        for (int j = 0; j < 8; ++j) {
            keys |= 1 << (flash::key_of_column(flash::transpose_load_column(8 * i + j)) % 8);
            rows |= 1 << (flash::transpose_store_row(8 * i + j) % 8);
        }
        if (keys != 0xff || rows != 0xff) return false;
    }
    return true;
}

template <int D>
constexpr bool unit_addressing(int lane0, int lanes) {
    using Traits = flash::Sm90FwdTraits<cutlass::float_e4m3_t, D, false>;
    using LayoutV = typename Traits::SmemLayoutKV;
    using LayoutVt = typename Traits::SmemLayoutVt;
    constexpr int kAtomChunks =
        flash::ValueTransposer<Traits::kTransposeWarps, LayoutV, LayoutVt>::kAtomChunks;
    const int row_step = LayoutVt{}(16, 0, 0) - LayoutVt{}(0, 0, 0);
    const int stage_v = LayoutV{}(0, 0, 1) - LayoutV{}(0, 0, 0);
    const int stage_vt = LayoutVt{}(0, 0, 1) - LayoutVt{}(0, 0, 0);
    for (int lane = lane0; lane < lane0 + lanes; ++lane) {
        const int key = flash::key_of_column(flash::transpose_load_column(lane));
        const int row = flash::transpose_store_row(lane), col = 16 * (lane / 16);
        for (int dc = 0; dc < D / 16; dc += kAtomChunks) {
            for (int j = 0; j < kAtomChunks; ++j) {
                const int v = LayoutV{}(key, 16 * (dc + j), 1);
                const int vt = LayoutVt{}(16 * (dc + j) + row, col, 1);
                if ((LayoutV{}(key, 16 * dc, 1) ^ (j << 4)) != v ||
                    v != LayoutV{}(key, 16 * (dc + j), 0) + stage_v ||
                    LayoutVt{}(16 * dc + row, col, 1) + j * row_step != vt ||
                    vt != LayoutVt{}(16 * (dc + j) + row, col, 0) + stage_vt) {
                    return false;
                }
            }
        }
    }
    return true;
}

// Half the lanes per assertion: each stays within the compiler's constexpr step budget.
#define FLASH_CHECK_UNITS(D)                                                                    \
    static_assert(unit_addressing<D>(0, 16) && unit_addressing<D>(16, 16),                     \
                  "ValueTransposer's address steps do not hold at d = " #D)
FLASH_CHECK_UNITS(32);
FLASH_CHECK_UNITS(64);
FLASH_CHECK_UNITS(96);
FLASH_CHECK_UNITS(128);
FLASH_CHECK_UNITS(160);
FLASH_CHECK_UNITS(192);
FLASH_CHECK_UNITS(224);
FLASH_CHECK_UNITS(256);

static_assert(columns_invert(), "column_of_key is not the inverse of key_of_column");
static_assert(block_transposes(), "the transpose's lane mapping does not transpose a block");
static_assert(rows_differ_mod_8(), "an 8-row phase of the transpose repeats a row mod 8");

}  // namespace
