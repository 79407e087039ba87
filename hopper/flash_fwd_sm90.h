// SM90 forward kernel: warp-specialised, persistent for uniform tiles. Warp group 0 produces (TMA loads into
// the K and V pipelines, registers lowered with setmaxnreg), the consumer warp groups compute
// (WGMMA, softmax, epilogue, registers raised). Parts: Sm90FwdMainloop, Sm90FwdEpilogue,
// StaticTileScheduler; types and tile sizes in Sm90FwdTraits.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <algorithm>
#include <atomic>
#include <cute/tensor.hpp>

#include "epilogue_fwd_sm90.h"
#include "fwd_traits_sm90.h"
#include "mainloop_fwd_sm90.h"
#include "params.h"
#include "seq_info.h"
#include "sm90_utils.h"
#include "tile_scheduler.h"

namespace flash {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ Sm90FwdArgs<Traits> a) {
    using Mainloop = Sm90FwdMainloop<Traits>;
    using Epilogue = Sm90FwdEpilogue<Traits>;
    using KPipe = typename Traits::KPipe;
    using VPipe = typename Traits::VPipe;
    using PipeRole = typename KPipe::ThreadCategory;
    constexpr int kQueryEmptyThreads = Traits::kConsumerThreads + 32;  // consumers + producer warp

    extern __shared__ __align__(1024) char smem[];
    auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem);
    const bool is_producer = int(threadIdx.x / 128) == int(WarpGroupRole::kProducer);

    if (threadIdx.x == 0) ss.q_full.init(1);
    typename KPipe::Params k_params;
    k_params.role = is_producer ? PipeRole::Producer : PipeRole::Consumer;
    k_params.is_leader = threadIdx.x == 0;
    k_params.num_consumers = Traits::kConsumerThreads;
    k_params.transaction_bytes = Traits::kKVBytes;
    typename VPipe::Params v_params;
    v_params.role = k_params.role;
    v_params.is_leader = k_params.is_leader;
    v_params.num_consumers = k_params.num_consumers;
    v_params.transaction_bytes = Traits::kKVBytes;
    KPipe k_pipe(ss.k_pipe, k_params, Shape<_1, _1, _1>{}, cute::true_type{}, cute::true_type{});
    VPipe v_pipe(ss.v_pipe, v_params, Shape<_1, _1, _1>{}, cute::true_type{}, cute::true_type{});
    cutlass::arch::fence_barrier_init();
    __syncthreads();

    const StaticTileScheduler sched{a.sched};
    if (is_producer) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
        if (threadIdx.x / 32 != 0) return;  // one warp issues every load
        auto k_state = cutlass::make_producer_start_state<KPipe>();
        auto v_state = cutlass::make_producer_start_state<VPipe>();
        bool first = true;
        for (int idx = sched.first(); sched.valid(idx); idx = sched.next(idx)) {
            const auto t = sched.tile(idx);
            const SeqInfo seq(a.p, t.bidb);
            const Sm90TileGeometry g = Mainloop::geometry(a.p, seq, t.m_block);
            // Once per tile after the first, matched by the consumers' arrive below.
            auto wait_query_empty = [&] {
                if (!first) barrier_sync(NamedBarrier::kQueryEmpty, kQueryEmptyThreads);
            };
            if (g.has_rows() && g.has_keys()) {
                Mainloop::load(a, ss, k_pipe, v_pipe, k_state, v_state, seq, t.bidb, t.bidh,
                               t.m_block, g, wait_query_empty);
            } else {
                wait_query_empty();
            }
            first = false;
        }
        k_pipe.producer_tail(k_state);
        v_pipe.producer_tail(v_state);
    } else {
        cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
        const int ctid = int(threadIdx.x) - 128;
        if constexpr (Traits::kPingPong) ConsumerTurns<Traits::kConsumerWarpGroups>::start(ctid / 128);
        typename Traits::PipeState k_state, v_state;
        int q_phase = 0;
        typename Traits::MmaPV mma_pv;
        for (int idx = sched.first(); sched.valid(idx); idx = sched.next(idx)) {
            const auto t = sched.tile(idx);
            const SeqInfo seq(a.p, t.bidb);
            const Sm90TileGeometry g = Mainloop::geometry(a.p, seq, t.m_block);
            if (g.has_rows()) {
                Tensor acc_o =
                    partition_fragment_C(mma_pv, Shape<typename Traits::BM, typename Traits::D>{});
                constexpr int kRows = decltype(size<0>(wgmma_acc_as_rows_cols(acc_o.layout())))::value;
                float lse[kRows];
                if (g.has_keys()) {
                    Mainloop::compute(a, ss, k_pipe, v_pipe, k_state, v_state, q_phase, seq, g,
                                      acc_o, lse);
                } else {
                    // No key is visible: the rows attend to nothing.
                    clear(acc_o);
                    CUTE_UNROLL
                    for (int r = 0; r < kRows; ++r) lse[r] = INFINITY;
                }
                Epilogue::store(a.p, ss, seq, t.bidb, t.bidh, g, acc_o, lse);
            }
            if (sched.valid(sched.next(idx))) {
                // The Q/O buffer is free: order our shared-memory accesses before the next TMA.
                cutlass::arch::fence_view_async_shared();
                barrier_arrive(NamedBarrier::kQueryEmpty, kQueryEmptyThreads);
            }
        }
    }
}

// TMA needs every stride to be a multiple of 16 bytes; a mode of extent 1 is never stepped, so
// any such stride serves for it.
inline int64_t tma_stride(int64_t stride, int64_t extent, int64_t headdim) {
    return extent <= 1 ? headdim : stride;
}

template <class Traits>
void launch_fwd_sm90(FwdParams& p, cudaStream_t stream) {
    using T = typename Traits::Element;
    const bool varlen = p.is_varlen();
    const int rows_q = varlen ? p.total_q : p.seqlen_q;
    const int rows_k = varlen ? p.total_k : p.seqlen_k;
    const int batch = varlen ? 1 : p.batch;
    auto gmem = [&](const void* ptr, int rows, int heads, TensorStrides const& s) {
        return make_tensor(make_gmem_ptr(static_cast<T const*>(ptr)),
                           make_shape(rows, p.headdim, heads, batch),
                           make_stride(tma_stride(s.row, rows, p.headdim), _1{},
                                       tma_stride(s.head, heads, p.headdim),
                                       tma_stride(s.batch, batch, p.headdim)));
    };
    using BM = typename Traits::BM;
    using BN = typename Traits::BN;
    using D = typename Traits::D;
    const StaticTileScheduler::Params sched{(p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM,
                                            p.nheads, p.batch};
    const Sm90FwdArgs<Traits> args{
        p,
        make_tma_copy(SM90_TMA_LOAD{}, gmem(p.q, rows_q, p.nheads, p.q_stride),
                      typename Traits::SmemLayoutQ{}, Shape<BM, D>{}, _1{}),
        make_tma_copy(SM90_TMA_LOAD{}, gmem(p.k, rows_k, p.nheads_k, p.k_stride),
                      take<0, 2>(typename Traits::SmemLayoutKV{}), Shape<BN, D>{}, _1{}),
        make_tma_copy(SM90_TMA_LOAD{}, gmem(p.v, rows_k, p.nheads_k, p.v_stride),
                      take<0, 2>(typename Traits::SmemLayoutKV{}), Shape<BN, D>{}, _1{}),
        rows_q,
        rows_k,
        batch,
        batch,
        sched};

    auto kernel = flash_fwd_sm90_kernel<Traits>;
    int device = 0;
    cudaGetDevice(&device);
    // Once per device; a failure surfaces as the launch error the binding checks.
    static std::atomic<uint64_t> smem_configured{0};
    const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
    if (bit == 0 || (smem_configured.load(std::memory_order_relaxed) & bit) == 0) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Traits::kSmemBytes);
        smem_configured.fetch_or(bit, std::memory_order_relaxed);
    }
    int grid = StaticTileScheduler::num_tiles(sched);
    if constexpr (Traits::kPersistent) {
        int num_sms = 0;
        cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
        grid = std::min(grid, num_sms);
    }
    kernel<<<std::max(grid, 1), Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
}

template <class T, int kHeadDim>
void run_fwd_sm90(FwdParams& p, cudaStream_t stream) {
    if (p.window_left >= 0 || p.window_right >= 0) {
        launch_fwd_sm90<Sm90FwdTraits<T, kHeadDim, true>>(p, stream);
    } else {
        launch_fwd_sm90<Sm90FwdTraits<T, kHeadDim, false>>(p, stream);
    }
}

}  // namespace flash
