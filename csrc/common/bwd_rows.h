// Per-row work of the backward shared by the SM80 and SM90 paths: rowsum(dO * O) of a query
// row, computed by a whole warp, in the row kernels that run before each main kernel.
#pragma once

#include <cute/tensor.hpp>

#include "params.h"
#include "seq_info.h"

namespace flash {

// Rows per CTA of the row kernels (a warp per row, 8 warps).
constexpr int kRowKernelRows = 64;

// sum_c dO[row, c] * O[row, c] of one query row, by a whole warp (8 columns per lane); every
// lane returns the sum.
template <class T>
__forceinline__ __device__ float row_dot(const BwdParams& p, const SeqInfo& seq, int bidb,
                                         int bidh, int row, int lane) {
    const T* o = static_cast<const T*>(p.o) + seq.q_offset(p.o_stride, p, bidb, row, bidh);
    const T* dO = static_cast<const T*>(p.dout) + seq.q_offset(p.do_stride, p, bidb, row, bidh);
    float acc = 0.f;
    for (int c = lane * 8; c < p.headdim; c += 32 * 8) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
        const uint4 dv = *reinterpret_cast<const uint4*>(dO + c);
        const T* oe = reinterpret_cast<const T*>(&ov);
        const T* de = reinterpret_cast<const T*>(&dv);
        CUTE_UNROLL
        for (int i = 0; i < 8; ++i) acc += float(oe[i]) * float(de[i]);
    }
    CUTE_UNROLL
    for (int s = 16; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffff, acc, s);
    return acc;
}

}  // namespace flash
