// TMA pipelines of the SM90 forward. Q, K and V each get their own pipeline type with its own
// Params type, so handing K's params (or barriers) to V's pipeline is a compile error even
// when both have the same stage count (tests/cpp/kv_pipeline_swap_sm90_should_fail.cu).
//
// The producer side is CUTLASS's TMA pipeline (acquire a free stage, arm its full barrier with
// the tile's bytes, wait for the consumers' releases at the end). The release is ours: one lane
// per consumer warp arrives on the stage's empty barrier in every CTA of the cluster (the CTAs
// that multicast into this stage). CUTLASS's release keeps a signalling flag and a target CTA
// per thread and pipeline in registers, and at d = 128 those four registers spilled in the key
// loop; elect.sync and a compile-time cluster size need none.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace flash {

struct QOperand {};
struct KOperand {};
struct VOperand {};

template <class Operand, int kStages, int kClusterM = 1>
class OperandPipeline : public cutlass::PipelineTmaAsync<kStages> {
    using Base = cutlass::PipelineTmaAsync<kStages>;

  public:
    using SharedStorage = typename Base::SharedStorage;
    using PipelineState = typename Base::PipelineState;

    // Distinct per operand: deriving keeps every field of the CUTLASS params.
    struct Params : Base::Params {
        using operand = Operand;
    };

    // Thread 0 initialises the barriers: full ones take the producer's arrival (plus the
    // tile's bytes), empty ones one arrival per consumer warp of each CTA in the cluster. The
    // caller fences and syncs the cluster before any use.
    CUTLASS_DEVICE OperandPipeline(SharedStorage& storage, Params const& params, int consumer_warps)
        : Base(storage, params, cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>{},
               cute::false_type{}, cute::false_type{}),
          empty_(&storage.empty_barrier_[0]) {
        if (threadIdx.x == 0) {
            CUTE_UNROLL
            for (int s = 0; s < kStages; ++s) {
                storage.full_barrier_[s].init(1);
                storage.empty_barrier_[s].init(consumer_warps * kClusterM);
            }
        }
    }

    // Called by every lane of a consumer warp once the warp is done with the stage.
    CUTLASS_DEVICE void consumer_release(PipelineState const& state) {
        if (cute::elect_one_sync()) {
            if constexpr (kClusterM == 1) {
                empty_[state.index()].arrive();
            } else {
                CUTE_UNROLL
                for (int cta = 0; cta < kClusterM; ++cta) empty_[state.index()].arrive(cta, 1u);
            }
        }
    }

  private:
    typename Base::EmptyBarrier* empty_;
};

// A pipeline's params for this thread: the producer warp group produces, thread `leader` (lane
// 0 of the warp that issues its loads) arms the full barriers with `bytes` per stage.
template <class Pipe>
CUTLASS_DEVICE typename Pipe::Params pipeline_params(bool is_producer, uint32_t bytes,
                                                     int leader = 0) {
    typename Pipe::Params params;
    params.role = is_producer ? Pipe::ThreadCategory::Producer : Pipe::ThreadCategory::Consumer;
    params.is_leader = int(threadIdx.x) == leader;
    params.transaction_bytes = bytes;
    return params;
}

// The e4m3 forward's transposed V stages (hopper/fp8_sm90.h): the producer group's transposing
// warps fill a stage with ordinary stores and arrive once per warp; the consumer warps wait for
// it, read it with WGMMA and release it like a TMA stage. The same PipelineState as the TMA
// pipelines, so the consumers' key loop is the same code for both.
template <int kStages>
class TransposedVPipeline {
  public:
    using PipelineState = cutlass::PipelineState<kStages>;
    struct SharedStorage {
        cutlass::arch::ClusterBarrier full[kStages];
        cutlass::arch::ClusterBarrier empty[kStages];
    };

    // Thread 0 initialises the barriers; the caller fences and syncs before any use.
    CUTLASS_DEVICE TransposedVPipeline(SharedStorage& storage, int producer_warps,
                                       int consumer_warps)
        : full_(&storage.full[0]), empty_(&storage.empty[0]) {
        if (threadIdx.x == 0) {
            CUTE_UNROLL
            for (int s = 0; s < kStages; ++s) {
                storage.full[s].init(producer_warps);
                storage.empty[s].init(consumer_warps);
            }
        }
    }

    // A transposing warp, from cutlass::make_producer_start_state (phase 1: every stage free).
    CUTLASS_DEVICE void producer_acquire(PipelineState const& state) {
        empty_[state.index()].wait(state.phase());
    }
    // Every lane of a transposing warp once its stores are issued: they become visible to the
    // WGMMA's reads (the async proxy) before the warp's one arrival.
    CUTLASS_DEVICE void producer_commit(PipelineState const& state) {
        cutlass::arch::fence_view_async_shared();
        __syncwarp();
        if (cute::elect_one_sync()) full_[state.index()].arrive();
    }
    CUTLASS_DEVICE void consumer_wait(PipelineState const& state) {
        full_[state.index()].wait(state.phase());
    }
    CUTLASS_DEVICE void consumer_release(PipelineState const& state) {
        if (cute::elect_one_sync()) empty_[state.index()].arrive();
    }

  private:
    cutlass::arch::ClusterBarrier* full_;
    cutlass::arch::ClusterBarrier* empty_;
};

// Q is never multicast: each CTA of a cluster loads its own tile's.
template <int kStages>
using QPipeline = OperandPipeline<QOperand, kStages, 1>;
template <int kStages, int kClusterM = 1>
using KPipeline = OperandPipeline<KOperand, kStages, kClusterM>;
template <int kStages, int kClusterM = 1>
using VPipeline = OperandPipeline<VOperand, kStages, kClusterM>;

}  // namespace flash
