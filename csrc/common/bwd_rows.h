// Per-row work of the backward's row kernels, which run before each main kernel: rowsum(dO * O)
// of a query row. The SM80 kernel gives each row a warp (row_dot); the SM90 kernel gives it d / 8
// threads and adds their 8-element pieces with dot8.
#pragma once

#include <cute/tensor.hpp>

#include "params.h"
#include "seq_info.h"

namespace flash {

// Rows per CTA of the row kernels.
constexpr int kRowKernelRows = 64;

// sum_i a[i] * b[i] of 8 elements of T held in 16 bytes each, added to acc.
template <class T>
__forceinline__ __device__ float dot8(uint4 const& a, uint4 const& b, float acc) {
    const T* ae = reinterpret_cast<const T*>(&a);
    const T* be = reinterpret_cast<const T*>(&b);
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) acc += float(ae[i]) * float(be[i]);
    return acc;
}

// sum_c dO[row, c] * O[row, c] of one query row, by a whole warp (8 columns per lane); every
// lane returns the sum.
template <class T>
__forceinline__ __device__ float row_dot(const BwdParams& p, const SeqInfo& seq, int bidb,
                                         int bidh, int row, int lane) {
    const T* o = static_cast<const T*>(p.o) + seq.q_offset(p.o_stride, p, bidb, row, bidh);
    const T* dO = static_cast<const T*>(p.dout) + seq.q_offset(p.do_stride, p, bidb, row, bidh);
    float acc = 0.f;
    for (int c = lane * 8; c < p.headdim; c += 32 * 8) {
        acc = dot8<T>(*reinterpret_cast<const uint4*>(o + c),
                      *reinterpret_cast<const uint4*>(dO + c), acc);
    }
    CUTE_UNROLL
    for (int s = 16; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffff, acc, s);
    return acc;
}

}  // namespace flash
