// The e4m3 forward's two layout steps: P from the S accumulator to the PV GEMM's register A
// operand, and V transposed so that the PV GEMM reads it K-major (an e4m3 WGMMA takes both
// operands K-major).
//
// An e4m3 A operand holds, per thread and 32-column k block, the bytes of columns 4t..4t+3 and
// 16+4t..16+4t+3 (t = lane % 4) of its two rows; the fp32 accumulator holds columns 8j+2t and
// 8j+2t+1 for j = 0..3. Instead of moving values between lanes, P keeps each thread's own
// values and V's keys are permuted to match: column a of the k block holds key
// key_of_column(a) (the same order in every 32-key block). The transpose writes V^T in that
// order, so P V sums the same products.
#pragma once

#include <cute/tensor.hpp>
#include <cstdint>

namespace flash {

using namespace cute;

// The key at column a (0..31) of a 32-column k block of P, and its inverse.
__host__ __device__ constexpr int key_of_column(int a) {
    return (a & 16) | ((a & 2) << 2) | (((a >> 2) & 3) << 1) | (a & 1);
}
__host__ __device__ constexpr int column_of_key(int k) {
    return (k & 16) | (((k >> 1) & 3) << 2) | (((k >> 3) & 1) << 1) | (k & 1);
}

// Four floats to four e4m3 bytes (b0 in the low byte), rounded to nearest and saturated: two
// conversions joined by one move of their 16-bit halves, which ptxas turns into two F2FP, the
// second writing its pair into the upper half of the first's register. A 16-bit result widened
// and shifted in C++ cost masks, shifts and permutes per word instead.
__forceinline__ __device__ uint32_t e4m3x4(float b0, float b1, float b2, float b3) {
    uint32_t r;
    asm("{\n"
        ".reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi};\n"
        "}"
        : "=r"(r)
        : "f"(b0), "f"(b1), "f"(b2), "f"(b3));
    return r;
}

// P (a WGMMA accumulator of one warp group, ((2 cols, 2 row halves, N/8), 1, 1)) as the e4m3
// A operand of the PV GEMM, ((4 k, 2 row halves, 2 k halves), 1, N/32): each 4-byte register
// takes the thread's own values of two neighbouring 8-column groups, in key_of_column order.
template <class T, class Acc>
__forceinline__ __device__ auto p_as_e4m3_operand(Acc const& acc) {
    constexpr int kN = 2 * decltype(size(acc))::value;  // columns: 64 x kN over 128 threads
    static_assert(kN % 32 == 0, "block_n is a multiple of an e4m3 WGMMA's K");
    Tensor p = make_tensor<T>(Shape<Shape<_4, _2, _2>, _1, Int<kN / 32>>{});
    uint32_t* words = reinterpret_cast<uint32_t*>(p.data());
    CUTE_UNROLL
    for (int kb = 0; kb < kN / 32; ++kb) {
        CUTE_UNROLL
        for (int half = 0; half < 2; ++half) {
            CUTE_UNROLL
            for (int row = 0; row < 2; ++row) {
                const int v = 16 * kb + 8 * half + 2 * row;  // acc index: col + 2 row + 4 group
                words[4 * kb + 2 * half + row] =
                    e4m3x4(acc(v), acc(v + 1), acc(v + 4), acc(v + 5));
            }
        }
    }
    return p;
}

// The transpose moves blocks of 32 keys x 16 columns of d (512 bytes) with one ldmatrix and one
// stmatrix.trans per warp. The ldmatrix's four 8 x 16-byte matrices are rows of keys (16 bytes
// of d each); lane (r = lane / 4, q = lane % 4) receives bytes 4q..4q+3 of row r of each. Its
// four words then hold columns 2r, 2r + 1, 16 + 2r and 17 + 2r of the V^T block (in key order
// key_of_column; for odd r each pair comes in the other order), one word per column, for d
// rows 4q..4q+3. The stmatrix.trans writes 16-bit
// pairs: word o of lane (r, q) lands in rows 2q and 2q + 1 of matrix o, bytes 2r and 2r + 1 of
// both; so each output word pairs two neighbouring columns for two d rows, by one byte
// permute. Which rows each matrix gets is chosen so that both instructions touch the 32 banks
// once per 8-row phase: a matrix's 8 rows (keys on the way in, d rows on the way out) differ
// mod 8.

// The 32-key block's column that lane `lane`'s row of the ldmatrix addresses (matrix i = lane /
// 8, row j = lane % 8): matrix i takes the column pair 16 (i / 2) + 2j and of it the column of
// parity (i ^ j) & 1. The keys of one matrix then differ mod 8.
__host__ __device__ constexpr int transpose_load_column(int lane) {
    const int i = lane / 8, j = lane % 8;
    return 16 * (i / 2) + 2 * j + ((i ^ j) & 1);
}

// The d row (0..15) of the block that lane `lane`'s row of the stmatrix addresses (matrix o =
// lane / 8, row j = lane % 8; its 16 bytes are columns 16 (o / 2)..+15). Rows 2q, 2q + 1 of a
// matrix come from the lanes with lane % 4 = q, which hold d rows 4q..4q+3: matrix parity m
// takes the pair 2 (m ^ (q / 2)), so that a matrix holds d rows {0,1,4,5,10,11,14,15} or
// {2,3,6,7,8,9,12,13}, 8 residues mod 8.
__host__ __device__ constexpr int transpose_store_row(int lane) {
    const int o = lane / 8, j = lane % 8, q = j / 2;
    return 4 * q + 2 * ((o & 1) ^ (q / 2)) + (j & 1);
}

// The __byte_perm selector of lane `lane` that builds output word 2h + m from its input words
// 2h (x) and 2h + 1 (y): bytes (column 2r row p, column 2r + 1 row p, column 2r row p + 1,
// column 2r + 1 row p + 1), p = 2 (m ^ (q / 2)). Input word 2h holds column 2r when r is even.
__host__ __device__ constexpr uint32_t transpose_selector(int lane, int m) {
    const int r = lane / 4, q = lane % 4;
    const uint32_t p = 2u * uint32_t(m ^ (q / 2));
    const uint32_t x = 0u, y = 4u;  // __byte_perm's byte offsets of its two words
    // The offsets of the words of columns 2r (a) and 2r + 1 (b).
    const uint32_t a = (r & 1) ? y : x, b = (r & 1) ? x : y;
    return (a + p) | ((b + p) << 4) | ((a + p + 1) << 8) | ((b + p + 1) << 12);
}

__forceinline__ __device__ void load_matrix_x4(uint32_t addr, uint32_t (&w)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(addr));
}

__forceinline__ __device__ void store_matrix_x4_trans(uint32_t addr, uint32_t const (&w)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(addr), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
}

// Transposes stages of V (layout LayoutV: block_n keys x d x stages, K-major, at shared address
// v) into stages of V^T (LayoutVt: d x block_n x stages, block_n contiguous, keys in
// key_of_column order, at vt); one of kWarps warps, this one `warp`. The warps share units of
// kGroup blocks (one 32-key block, kGroup 16-column chunks of d inside one swizzle atom). A
// warp's units and their addresses in stage 0 are fixed, so they are computed once; a stage
// adds a constant to both. Within a unit the V address of chunk j is the first one with j
// XORed into its chunk field (V's swizzle permutes the 16-byte chunks of an atom's row by its
// row bits only; v and the stage size are multiples of the atom, so the field is the
// layout's), and the V^T address moves by 16 rows, whole swizzle atoms, a constant: a
// block then costs one instruction of address math. Shared-space addresses of 32 bits (a
// generic pointer would take two registers of the producer group's few).
template <int kWarps, class LayoutV, class LayoutVt>
class ValueTransposer {
    static constexpr int kBlockN = decltype(size<0>(LayoutV{}))::value;
    static constexpr int kD = decltype(size<1>(LayoutV{}))::value;
    static_assert(kBlockN % 32 == 0 && kD % 32 == 0);

  public:
    // 16-byte chunks in a row of V's swizzle atom (ss_smem_selector: 128, 64 or 32 bytes);
    // tests/cpp/fp8_transpose_sm90.cu checks the address steps against the layouts.
    static constexpr int kAtomChunks = kD % 128 == 0 ? 8 : kD % 64 == 0 ? 4 : 2;

  private:
    static constexpr int kKeyBlocks = kBlockN / 32;
    static constexpr int busiest(int group) {
        return (kKeyBlocks * kD / 16 / group + kWarps - 1) / kWarps * group;
    }
    // Units of four blocks where the atom has them and the busiest warp gets no more blocks
    // than with units of two.
    static constexpr int kGroup = kAtomChunks >= 4 && busiest(4) <= busiest(2) ? 4 : 2;
    static constexpr int kUnits = kKeyBlocks * (kD / 16 / kGroup);
    static constexpr int kUnitsPerWarp = (kUnits + kWarps - 1) / kWarps;
    static constexpr uint32_t kRowStep = uint32_t(LayoutVt{}(16, 0, 0) - LayoutVt{}(0, 0, 0));
    static constexpr uint32_t kStageV = uint32_t(LayoutV{}(0, 0, 1) - LayoutV{}(0, 0, 0));
    static constexpr uint32_t kStageVt = uint32_t(LayoutVt{}(0, 0, 1) - LayoutVt{}(0, 0, 0));
    // The XOR into the address's chunk field needs v and every stage on whole swizzle atoms.
    static_assert(kStageV % 1024 == 0 && kStageVt % 1024 == 0);

  public:
    __device__ ValueTransposer(uint32_t v, uint32_t vt, int warp) {
        const int lane = int(threadIdx.x % 32);
        const uint32_t key = uint32_t(key_of_column(transpose_load_column(lane)));
        const uint32_t row = uint32_t(transpose_store_row(lane));
        const uint32_t col = 16u * uint32_t(lane / 16);
        sel0_ = transpose_selector(lane, 0);
        sel1_ = transpose_selector(lane, 1);
        units_ = (kUnits - warp + kWarps - 1) / kWarps;
        CUTE_UNROLL
        for (int u = 0; u < kUnitsPerWarp; ++u) {
            const int unit = warp + u * kWarps;
            const uint32_t kb = uint32_t(unit % kKeyBlocks);
            const uint32_t dc = uint32_t(unit / kKeyBlocks) * kGroup;
            load_[u] = v + uint32_t(LayoutV{}(32u * kb + key, 16u * dc, 0u));
            store_[u] = vt + uint32_t(LayoutVt{}(16u * dc + row, 32u * kb + col, 0u));
        }
    }

    __device__ void operator()(int stage, int stage_t) const {
        const uint32_t v_offset = uint32_t(stage) * kStageV;
        const uint32_t vt_offset = uint32_t(stage_t) * kStageVt;
        CUTE_UNROLL
        for (int u = 0; u < kUnitsPerWarp; ++u) {
            if (u < units_) {
                const uint32_t ld = load_[u] + v_offset;
                const uint32_t st = store_[u] + vt_offset;
                CUTE_UNROLL
                for (int j = 0; j < kGroup; j += 2) {
                    uint32_t a[4], b[4];
                    load_matrix_x4(ld ^ (uint32_t(j) << 4), a);
                    load_matrix_x4(ld ^ (uint32_t(j + 1) << 4), b);
                    store_matrix_x4_trans(st + uint32_t(j) * kRowStep, interleave(a).w);
                    store_matrix_x4_trans(st + uint32_t(j + 1) * kRowStep, interleave(b).w);
                }
            }
        }
    }

  private:
    struct Words {
        uint32_t w[4];
    };
    __device__ Words interleave(uint32_t const (&a)[4]) const {
        return {{__byte_perm(a[0], a[1], sel0_), __byte_perm(a[0], a[1], sel1_),
                 __byte_perm(a[2], a[3], sel0_), __byte_perm(a[2], a[3], sel1_)}};
    }

    uint32_t load_[kUnitsPerWarp];
    uint32_t store_[kUnitsPerWarp];
    uint32_t sel0_, sel1_;
    int units_;
};

}  // namespace flash
