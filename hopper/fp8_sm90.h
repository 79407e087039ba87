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

// Two floats to two e4m3 bytes (lo in the low byte), rounded to nearest and saturated.
__forceinline__ __device__ uint32_t e4m3x2(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

__forceinline__ __device__ uint32_t e4m3x4(float b0, float b1, float b2, float b3) {
    return e4m3x2(b0, b1) | (e4m3x2(b2, b3) << 16);
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

// Byte j of word i of the result is byte i of w[j]: a 4 x 4 byte transpose.
__forceinline__ __device__ void transpose_bytes_4x4(uint32_t (&w)[4]) {
    const uint32_t t0 = __byte_perm(w[0], w[1], 0x5140);
    const uint32_t t1 = __byte_perm(w[2], w[3], 0x5140);
    const uint32_t t2 = __byte_perm(w[0], w[1], 0x7362);
    const uint32_t t3 = __byte_perm(w[2], w[3], 0x7362);
    w[0] = __byte_perm(t0, t1, 0x5410);
    w[1] = __byte_perm(t0, t1, 0x7632);
    w[2] = __byte_perm(t2, t3, 0x5410);
    w[3] = __byte_perm(t2, t3, 0x7632);
}

__forceinline__ __device__ uint32_t load_shared_u32(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

__forceinline__ __device__ void store_shared_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// Writes stage `stage` of V (layout LayoutV: block_n keys x d x stages, K-major, at shared
// address v) transposed into stage `stage_t` of V^T (LayoutVt: d x block_n x stages, block_n
// contiguous, keys in key_of_column order, at vt), run by `warps` warps, this one `warp`. A lane
// moves 4 keys x 4 columns of d per item: four 4-byte loads, a byte transpose, four 4-byte
// stores. Lane (p = lane / 4, q = lane % 4) of item (s, u) takes keys from the 16-key group
// (p + s) % (block_n / 16) and columns 4p + 32u: with 128-byte rows in 128-byte swizzle atoms
// (d = 128 and block_n = 128), each of a warp's loads and stores then touches 32 different
// banks. Shared-space addresses of 32 bits (a generic pointer would take two registers of
// the producer group's few); unsigned coordinates, so that the layouts' divisions by their
// atoms' extents are shifts.
template <class LayoutV, class LayoutVt>
__forceinline__ __device__ void transpose_value_stage(uint32_t v, int stage, uint32_t vt,
                                                      int stage_t, int warp, int warps) {
    constexpr int kBlockN = decltype(size<0>(LayoutV{}))::value;
    constexpr int kD = decltype(size<1>(LayoutV{}))::value;
    static_assert(kBlockN % 32 == 0 && kD % 32 == 0);
    constexpr int kGroups = kBlockN / 16;
    constexpr int kItems = kGroups * (kD / 32);
    const int lane = int(threadIdx.x % 32);
    const int p = lane / 4;
    const int q = lane % 4;
    for (int item = warp; item < kItems; item += warps) {
        const int s = item % kGroups;
        const int u = item / kGroups;
        const int col0 = 16 * ((p + s) % kGroups) + 4 * q;  // V^T columns col0..col0 + 3
        const int d0 = 4 * p + 32 * u;                      // V's columns d0..d0 + 3
        uint32_t w[4];
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
            const int key = (col0 & ~31) | key_of_column((col0 & 31) + j);
            w[j] = load_shared_u32(v + uint32_t(LayoutV{}(uint32_t(key), uint32_t(d0),
                                                          uint32_t(stage))));
        }
        transpose_bytes_4x4(w);
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
            store_shared_u32(vt + uint32_t(LayoutVt{}(uint32_t(d0 + i), uint32_t(col0),
                                                      uint32_t(stage_t))),
                             w[i]);
        }
    }
}

}  // namespace flash
