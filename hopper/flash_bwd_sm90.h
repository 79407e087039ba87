// SM90 backward, three launches:
//   1. rows:     per query row, rowsum(dO * O) and the log2-scaled LSE into the padded row
//                buffers the main kernel bulk-copies (Sm90BwdRows); for batched inputs it also
//                zeroes the rows' dQ accumulator (varlen clears the whole workspace first).
//   2. main:     warp-specialised, one CTA per (key tile, head, batch): warp group 0 produces
//                (TMA loads of K, V once and of Q, dO per query tile; registers lowered with
//                setmaxnreg), the consumer warp groups compute (Sm90BwdMainloop) and store dK,
//                dV (Sm90BwdEpilogue); a producer warp adds each query tile's dQ to an fp32
//                accumulator with bulk reductions.
//   3. dq:       dQ = softmax_scale * that accumulator, in the input dtype.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <algorithm>
#include <atomic>
#include <cute/tensor.hpp>

#include "bwd_traits_sm90.h"
#include "common/bwd_rows.h"
#include "common/params.h"
#include "common/seq_info.h"
#include "epilogue_bwd_sm90.h"
#include "mainloop_bwd_sm90.h"
#include "sm90_utils.h"
#include "tma_views.h"

namespace flash {

// Fills the padded row buffers: rows of a sequence's last tile past its end get LSE = +inf and
// D = 0. kRowKernelRows rows per CTA of 256 threads, d / 8 threads per row rounded down to a
// power of two, at most 32 (each one or two 16-byte loads of O and of dO per row: two at
// d = 96), so that a CTA's loads for all its rows are issued before any is used: with
// a warp per row, half its lanes idle at d = 128 and one row's loads in flight, this kernel ran
// at half the memory bandwidth. With clear_dq (batched inputs, where the launch does not clear
// the whole workspace) it also zeroes the dQ accumulator of its rows.
constexpr int kRowKernelThreads = 256;

constexpr int pow2_floor(int n) {
    int p = 1;
    while (2 * p <= n) p *= 2;
    return p;
}

template <class Traits>
__global__ void __launch_bounds__(kRowKernelThreads)
    flash_bwd_rows_sm90_kernel(const __grid_constant__ BwdParams p,
                               const __grid_constant__ Sm90BwdRows rows, bool clear_dq) {
    using T = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kD = Traits::D::value;
    // A power of two, so that a row's threads are lanes of one warp.
    constexpr int kRowThreads = pow2_floor(kD / 8 < 32 ? kD / 8 : 32);
    constexpr int kRowsPerPass = kRowKernelThreads / kRowThreads;
    constexpr int kPasses = kRowKernelRows / kRowsPerPass;
    constexpr int kChunks = (kD / 8 + kRowThreads - 1) / kRowThreads;  // 16-byte, per row
    static_assert(kPasses >= 1 && kRowKernelRows % kRowsPerPass == 0);
    constexpr float kLog2e = 1.4426950408889634f;
    const int sub = int(threadIdx.x) % kRowThreads;
    const int padded_q = (p.seqlen_q + kBlockM - 1) / kBlockM * kBlockM;
    const int row_blocks = (padded_q + kRowKernelRows - 1) / kRowKernelRows;
    const int row_block = int(blockIdx.x % row_blocks);
    const int bidh = int(blockIdx.x / row_blocks) % p.nheads;
    const int bidb = int(blockIdx.x / row_blocks) / p.nheads;
    const SeqInfo seq(p, bidb);
    const int seq_padded = (seq.seqlen_q + kBlockM - 1) / kBlockM * kBlockM;
    const int row_begin = row_block * kRowKernelRows;
    const int row_end = min(seq_padded, row_begin + kRowKernelRows);
    const int64_t out = rows.offset<kBlockM>(p, seq.row_q, bidb, bidh);

    uint4 o[kPasses][kChunks], d_o[kPasses][kChunks];
    CUTE_UNROLL
    for (int k = 0; k < kPasses; ++k) {
        const int row = row_begin + k * kRowsPerPass + int(threadIdx.x) / kRowThreads;
        const T* o_row = static_cast<const T*>(p.o) + seq.q_offset(p.o_stride, p, bidb, row, bidh);
        const T* do_row =
            static_cast<const T*>(p.dout) + seq.q_offset(p.do_stride, p, bidb, row, bidh);
        CUTE_UNROLL
        for (int c = 0; c < kChunks; ++c) {
            const int col = (c * kRowThreads + sub) * 8;
            const bool inside = row < seq.seqlen_q && col < p.headdim;
            o[k][c] = inside ? *reinterpret_cast<const uint4*>(o_row + col) : uint4{};
            d_o[k][c] = inside ? *reinterpret_cast<const uint4*>(do_row + col) : uint4{};
        }
    }
    const float* lse = p.lse + seq.lse_offset(p, bidb, bidh);
    CUTE_UNROLL
    for (int k = 0; k < kPasses; ++k) {
        float acc = 0.f;
        CUTE_UNROLL
        for (int c = 0; c < kChunks; ++c) acc = dot8<T>(o[k][c], d_o[k][c], acc);
        CUTE_UNROLL
        for (int s = kRowThreads / 2; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffff, acc, s);
        const int row = row_begin + k * kRowsPerPass + int(threadIdx.x) / kRowThreads;
        if (sub == 0 && row < row_end) {
            const bool inside = row < seq.seqlen_q;
            rows.dsum[out + row] = inside ? acc : 0.f;
            rows.lse_log2[out + row] = inside ? lse[row] * kLog2e : INFINITY;
        }
    }
    if (clear_dq) {
        float4* dq = reinterpret_cast<float4*>(rows.dq_accum + (out + row_begin) * kD);
        const int n = max(row_end - row_begin, 0) * kD / 4;
        for (int i = int(threadIdx.x); i < n; i += kRowKernelThreads) dq[i] = float4{};
    }
}

// dQ = softmax_scale * the fp32 accumulator, in the input dtype: a CTA per query tile, whose
// threads read back the fragments the consumer threads of that index wrote (Sm90BwdRows), then
// pass the tile through shared memory so that dQ's rows are written in 16-byte pieces (written
// from the fragments, 4 bytes at a time, this kernel ran at 40% of the memory bandwidth). dQ
// is the binding's own contiguous tensor with a head dim of a multiple of 8, so every piece is
// 16-byte aligned.
template <class Traits>
__global__ void __launch_bounds__(Traits::kConsumerThreads)
    flash_bwd_dq_sm90_kernel(const __grid_constant__ BwdParams p,
                             const __grid_constant__ Sm90BwdRows rows) {
    using T = typename Traits::Element;
    using D = typename Traits::D;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kD = D::value;
    // 8 elements of padding per row: the 4-byte writes of a warp's 8 rows x 4 column pairs
    // then fall on distinct banks.
    constexpr int kRowPitch = kD + 8;
    __shared__ alignas(16) T tile[kBlockM * kRowPitch];
    const int m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
    const int m = int(blockIdx.x % m_blocks);
    const int bidh = int(blockIdx.x / m_blocks) % p.nheads;
    const int bidb = int(blockIdx.x / m_blocks) / p.nheads;
    const SeqInfo seq(p, bidb);
    const int m0 = m * kBlockM;
    if (m0 >= seq.seqlen_q) return;
    // Thread t reads back what consumer thread t wrote: its group's block of the tile.
    auto stage_block = [&](auto part) {
        using Part = decltype(part);
        typename Part::Mma mma_dq;
        auto thr = mma_dq.get_thread_slice(Part::mma_thread(threadIdx.x));
        Tensor acc = partition_fragment_C(mma_dq, typename Part::TileShape{});
        Tensor coord = thr.partition_C(make_identity_tensor(typename Part::TileShape{}));
        const float4* src = reinterpret_cast<const float4*>(
            rows.dq_accum + (rows.offset<kBlockM>(p, seq.row_q, bidb, bidh) + m0) * kD);
        CUTE_UNROLL
        for (int j = 0; j < size(acc) / 4; ++j) {
            const float4 v = src[Traits::dq_float4_index(j, threadIdx.x)];
            acc(4 * j) = v.x * p.softmax_scale;
            acc(4 * j + 1) = v.y * p.softmax_scale;
            acc(4 * j + 2) = v.z * p.softmax_scale;
            acc(4 * j + 3) = v.w * p.softmax_scale;
        }
        Tensor r = convert_fragment<T>(acc);
        CUTE_UNROLL
        for (int i = 0; i < size(r); i += 2) {
            const int col = Part::kCol0 + get<1>(coord(i));
            *reinterpret_cast<uint32_t*>(&tile[get<0>(coord(i)) * kRowPitch + col]) =
                *reinterpret_cast<uint32_t const*>(&r(i));
        }
    };
    if constexpr (Traits::kDqPartsAlike) {
        stage_block(typename Traits::DqWhole{});
    } else if (threadIdx.x < kWarpGroupThreads) {
        stage_block(typename Traits::template DqPart<0>{});
    } else {
        stage_block(typename Traits::template DqPart<1>{});
    }
    __syncthreads();
    T* dq = static_cast<T*>(p.dq) + seq.q_offset(p.dq_stride, p, bidb, m0, bidh);
    const int rows_left = seq.seqlen_q - m0;
    constexpr int kPiecesPerThread = kBlockM * kD / 8 / Traits::kConsumerThreads;
    static_assert(kPiecesPerThread * Traits::kConsumerThreads * 8 == kBlockM * kD);
    CUTE_UNROLL
    for (int k = 0; k < kPiecesPerThread; ++k) {
        const int i = k * Traits::kConsumerThreads + int(threadIdx.x);
        const int row = i / (kD / 8);
        const int col = i % (kD / 8) * 8;
        if (row < rows_left && col < p.headdim) {
            *reinterpret_cast<uint4*>(dq + index_t(row) * p.dq_stride.row + col) =
                *reinterpret_cast<uint4 const*>(&tile[row * kRowPitch + col]);
        }
    }
}

// A consumer warp group of the main kernel: its query loop, then its dK and dV out. KvPart:
// its dV and dK GEMMs (Traits::KvWhole, or the wide tile's KvPart<g> where the groups' column
// blocks differ), which set its accumulators' shape. A function rather than a lambda: a lambda
// capturing the kernel's locals changed the d = 256 kernel's code.
template <class Traits, class KvPart>
__forceinline__ __device__ void bwd_sm90_consumer(Sm90BwdArgs<Traits> const& a,
                                                  typename Traits::SharedStorage& ss,
                                                  typename Traits::QPipe& q_pipe,
                                                  typename Traits::DoPipe& do_pipe,
                                                  SeqInfo const& seq, int bidb, int bidh,
                                                  Sm90BwdGeometry const& g) {
    typename KvPart::Mma mma_kv;
    Tensor acc_dk = partition_fragment_C(mma_kv, typename KvPart::TileShape{});
    Tensor acc_dv = partition_fragment_C(mma_kv, typename KvPart::TileShape{});
    clear(acc_dk);
    clear(acc_dv);
    if (g.has_queries()) {
        typename Traits::PipeState q_state, do_state;
        Sm90BwdMainloop<Traits>::template compute<KvPart>(a, ss, q_pipe, do_pipe, q_state,
                                                          do_state, seq, bidb, bidh, g, acc_dk,
                                                          acc_dv);
    }
    Sm90BwdEpilogue<Traits>::template store<KvPart>(a, ss, seq, bidb, bidh, g, acc_dk, acc_dv);
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ Sm90BwdArgs<Traits> a) {
    using Mainloop = Sm90BwdMainloop<Traits>;
    using QPipe = typename Traits::QPipe;
    using DoPipe = typename Traits::DoPipe;
    BwdParams const& p = a.p;

    extern __shared__ __align__(1024) char smem[];
    auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem);

    // Key tiles first, so that a causal grid starts with the tiles most query rows see (in
    // deterministic mode the highest first, and with a.head_group > 1 a group of heads' highest
    // tiles, then their next ones: bwd_launch).
    const int n_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    const BwdLaunch launch = bwd_launch(int(blockIdx.x), n_blocks, int(p.nheads * p.batch),
                                        a.head_group, p.deterministic);
    const int n_block = launch.n_block;
    const int bidh = launch.head % p.nheads;
    const int bidb = launch.head / p.nheads;
    const SeqInfo seq(p, bidb);
    const Sm90BwdGeometry g = Mainloop::geometry(p, seq, n_block);
    if (g.keys <= 0) return;  // past a varlen sequence's keys: the whole CTA leaves

    const bool is_producer = int(threadIdx.x) / kWarpGroupThreads == int(WarpGroupRole::kProducer);
    constexpr int kConsumerWarps = Traits::kConsumerThreads / 32;
    if (threadIdx.x == 0) ss.kv_full.init(1);
    QPipe q_pipe(ss.q_pipe, pipeline_params<QPipe>(is_producer, Traits::kQBytes), kConsumerWarps);
    DoPipe do_pipe(ss.do_pipe, pipeline_params<DoPipe>(is_producer, Traits::kQBytes),
                   kConsumerWarps);
    cutlass::arch::fence_barrier_init();
    __syncthreads();

    if (is_producer) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
        if (!g.has_queries()) return;
        const int warp = __shfl_sync(0xffffffff, int(threadIdx.x) / 32, 0);
        if (warp == int(BwdProducerWarp::kLoad)) {
            auto q_state = cutlass::make_producer_start_state<QPipe>();
            auto do_state = cutlass::make_producer_start_state<DoPipe>();
            Mainloop::load(a, ss, q_pipe, do_pipe, q_state, do_state, seq, bidb, bidh, g);
            q_pipe.producer_tail(q_state);
            do_pipe.producer_tail(do_state);
        } else if (warp == int(BwdProducerWarp::kDqReduce)) {
            Mainloop::reduce_dq(a, ss, seq, bidb, bidh, g);
        }
    } else {
        cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
        if constexpr (!Traits::kKvParts) {
            bwd_sm90_consumer<Traits, typename Traits::KvWhole>(a, ss, q_pipe, do_pipe, seq, bidb,
                                                                bidh, g);
        } else if (consumer_group() == 0) {
            bwd_sm90_consumer<Traits, typename Traits::template KvPart<0>>(a, ss, q_pipe, do_pipe,
                                                                           seq, bidb, bidh, g);
        } else {
            bwd_sm90_consumer<Traits, typename Traits::template KvPart<1>>(a, ss, q_pipe, do_pipe,
                                                                           seq, bidb, bidh, g);
        }
        if constexpr (Traits::kWide) Sm90BwdEpilogue<Traits>::store_wide(a, ss, seq, bidb, bidh, g);
    }
}

// Deterministic grids without a mask, whose heads have few key tiles: a head's tiles start
// together and wait at the first query tile for one another (the one ranked r for r steps),
// and as a wave's CTAs come from whole heads, every wave repeats that wait (d64 non-causal 1k
// cost 28% against the default, H100, 2026-11-28; causal tiles start at their diagonal, where
// none waits, and long heads free their SMs one tile after another). Launched as a group of
// heads' highest tiles, then their next ones, a tile starts after the one it follows. The
// group's Q, dO and fp32 dQ, which every tile of its heads reads or adds to, are kept within
// half of L2. d64 non-causal 1k/4k: deterministic mode then costs 6% instead of 25% (H200).
template <class Traits>
int det_head_group(BwdParams const& p) {
    if (!p.deterministic || p.window_left >= 0 || p.window_right >= 0) return 1;
    const DeviceInfo dev = current_device_info();
    const int num_sms = dev.sms, l2_bytes = dev.l2_bytes;
    const int n_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    if (2 * n_blocks > num_sms) return 1;
    constexpr int64_t kRowBytes =
        Traits::D::value * (2 * sizeof(typename Traits::Element) + sizeof(float)) + 8;
    const int64_t head_bytes = int64_t(p.seqlen_q) * kRowBytes;
    const int64_t heads = int64_t(p.nheads) * p.batch;
    return int(std::max<int64_t>(
        1, std::min<int64_t>({l2_bytes / 2 / std::max<int64_t>(head_bytes, 1), heads,
                              int64_t(num_sms)})));
}

template <class Traits>
void launch_bwd_sm90(BwdParams& p, cudaStream_t stream) {
    using T = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    const bool varlen = p.is_varlen();
    const int rows_q = varlen ? p.total_q : p.seqlen_q;
    const int rows_k = varlen ? p.total_k : p.seqlen_k;
    const int batch = varlen ? 1 : p.batch;

    Sm90BwdRows rows;
    rows.head_stride = Sm90BwdRows::rows_per_head<kBlockM>(p);
    const int64_t entries = rows.head_stride * p.nheads * (varlen ? 1 : p.batch);
    constexpr int kD = Traits::D::value;
    const int m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
    // The turn counters come first, padded to 256 bytes: the accumulator after them must be
    // 16-byte aligned for its float4 and bulk accesses (an odd count of query tiles, heads and
    // batches would misalign it otherwise).
    const int64_t turns =
        p.deterministic ? (int64_t(m_blocks) * p.nheads * p.batch + 63) / 64 * 64 : 0;
    float* ws = static_cast<float*>(p.workspace.allocate(
        p.workspace.context, ((2 + kD) * entries + turns) * int64_t(sizeof(float))));
    p.dq_turns = p.deterministic ? reinterpret_cast<int*>(ws) : nullptr;
    rows.dq_accum = ws + turns;
    rows.lse_log2 = rows.dq_accum + kD * entries;
    rows.dsum = rows.lse_log2 + entries;
    // The turn counters and the accumulator start at zero; varlen row buffers have rows
    // outside every sequence, which the bulk copies of a tile may read, so varlen clears the
    // whole workspace here. Batched rows all belong to a sequence: the row kernel zeroes their
    // accumulator as it passes.
    const int64_t cleared = varlen ? (2 + kD) * entries + turns : turns;
    if (cleared > 0) cudaMemsetAsync(ws, 0, cleared * sizeof(float), stream);
    const int padded_q = (p.seqlen_q + kBlockM - 1) / kBlockM * kBlockM;
    const unsigned row_grid =
        unsigned((padded_q + kRowKernelRows - 1) / kRowKernelRows) * p.batch * p.nheads;
    flash_bwd_rows_sm90_kernel<Traits>
        <<<row_grid, kRowKernelThreads, 0, stream>>>(p, rows, !varlen);

    auto gmem = [&](const void* ptr, int rows_, int heads, TensorStrides const& s) {
        return tma_gmem<T>(ptr, rows_, p.headdim, heads, batch, s);
    };
    using BM = typename Traits::BM;
    using BN = typename Traits::BN;
    using D = typename Traits::D;
    auto tma_q = [&](const void* ptr, TensorStrides const& s) {
        return make_tma_copy(SM90_TMA_LOAD{}, gmem(ptr, rows_q, p.nheads, s),
                             take<0, 2>(typename Traits::SmemLayoutQ{}), Shape<BM, D>{}, _1{});
    };
    auto tma_k = [&](const void* ptr, TensorStrides const& s) {
        return make_tma_copy(SM90_TMA_LOAD{}, gmem(ptr, rows_k, p.nheads_k, s),
                             typename Traits::SmemLayoutK{}, Shape<BN, D>{}, _1{});
    };
    auto tma_out = [&](const void* ptr, TensorStrides const& s) {
        return make_tma_copy(SM90_TMA_STORE{}, gmem(ptr, rows_k, p.nheads, s),
                             typename Traits::SmemLayoutOutBox{}, typename Traits::OutBox{}, _1{});
    };
    const Sm90BwdArgs<Traits> args{p,
                                   tma_q(p.q, p.q_stride),
                                   tma_q(p.dout, p.do_stride),
                                   tma_k(p.k, p.k_stride),
                                   tma_k(p.v, p.v_stride),
                                   tma_out(p.dk, p.dk_stride),
                                   tma_out(p.dv, p.dv_stride),
                                   rows,
                                   m_blocks,
                                   det_head_group<Traits>(p),
                                   rows_q,
                                   rows_k,
                                   batch};

    auto kernel = flash_bwd_sm90_kernel<Traits>;
    int device = 0;
    cudaGetDevice(&device);
    static std::atomic<bool> configured[64] = {};
    if (device >= 64 || !configured[device].load(std::memory_order_relaxed)) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Traits::kSmemBytes);
        if (device < 64) configured[device].store(true, std::memory_order_relaxed);
    }
    const int n_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    const dim3 grid(unsigned(n_blocks) * p.nheads * p.batch);
    kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);

    const dim3 dq_grid(unsigned((p.seqlen_q + kBlockM - 1) / kBlockM) * p.batch * p.nheads);
    flash_bwd_dq_sm90_kernel<Traits><<<dq_grid, Traits::kConsumerThreads, 0, stream>>>(p, rows);
}

template <class T, int kHeadDim>
void run_bwd_sm90(BwdParams& p, cudaStream_t stream) {
    if (p.alibi_slopes != nullptr) {
        launch_bwd_sm90<Sm90BwdTraits<T, kHeadDim, true>>(p, stream);
    } else {
        launch_bwd_sm90<Sm90BwdTraits<T, kHeadDim, false>>(p, stream);
    }
}

}  // namespace flash
