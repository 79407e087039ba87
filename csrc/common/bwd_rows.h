// Row kernels of the backward shared by the SM80 and SM90 paths: a warp per query row computes
// rowsum(dO * O) before the main kernel, and converts the fp32 dQ accumulator after it.
#pragma once

#include <cute/tensor.hpp>

#include "params.h"
#include "seq_info.h"

namespace flash {

// Rows per CTA of the row_dot and dq_write kernels (a warp per row, 8 warps).
constexpr int kRowKernelRows = 64;

// Calls fn(seq, bidb, bidh, row, lane) once per query row of this CTA, a warp per row.
template <class Fn>
__forceinline__ __device__ void for_each_row(const BwdParams& p, Fn&& fn) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int row_blocks = (p.seqlen_q + kRowKernelRows - 1) / kRowKernelRows;
    const int row_block = int(blockIdx.x % row_blocks);
    const int bidh = int(blockIdx.x / row_blocks) % p.nheads;
    const int bidb = int(blockIdx.x / row_blocks) / p.nheads;
    const SeqInfo seq(p, bidb);
    const int row_end = min(seq.seqlen_q, (row_block + 1) * kRowKernelRows);
    for (int row = row_block * kRowKernelRows + warp; row < row_end; row += blockDim.x / 32) {
        fn(seq, bidb, bidh, row, lane);
    }
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

// softmax_d[row] = rowsum(dO * O) in lse's layout (the SM80 backward's first launch).
template <class T, int kHeadDim>
__global__ void flash_bwd_row_dot_kernel(const __grid_constant__ BwdParams p) {
    for_each_row(p, [&](const SeqInfo& seq, int bidb, int bidh, int row, int lane) {
        const float d = row_dot<T>(p, seq, bidb, bidh, row, lane);
        if (lane == 0) p.softmax_d[seq.lse_offset(p, bidb, bidh) + row] = d;
    });
}

// dq[row, c] = softmax_scale * dq_accum[row, c]; 8 columns per lane (both archs' last launch).
template <class T, int kHeadDim>
__global__ void flash_bwd_dq_write_kernel(const __grid_constant__ BwdParams p) {
    for_each_row(p, [&](const SeqInfo& seq, int bidb, int bidh, int row, int lane) {
        const float* acc = p.dq_accum + (seq.lse_offset(p, bidb, bidh) + row) * kHeadDim;
        T* dq = static_cast<T*>(p.dq) + seq.q_offset(p.dq_stride, p, bidb, row, bidh);
        for (int c = lane * 8; c < p.headdim; c += 32 * 8) {
            const float4 a = *reinterpret_cast<const float4*>(acc + c);
            const float4 b = *reinterpret_cast<const float4*>(acc + c + 4);
            T out[8] = {T(a.x * p.softmax_scale), T(a.y * p.softmax_scale),
                        T(a.z * p.softmax_scale), T(a.w * p.softmax_scale),
                        T(b.x * p.softmax_scale), T(b.y * p.softmax_scale),
                        T(b.z * p.softmax_scale), T(b.w * p.softmax_scale)};
            *reinterpret_cast<uint4*>(dq + c) = *reinterpret_cast<const uint4*>(out);
        }
    });
}

}  // namespace flash
