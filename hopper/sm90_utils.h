// SM90 building blocks: warp-group roles, named barriers, WGMMA issue and register views of
// WGMMA accumulators.
#pragma once

#include <cuda_runtime.h>

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <type_traits>

#include "common/device.h"
#include "common/memory_order.h"

namespace flash {

using namespace cute;

// Threads of a warp group: the unit that issues a WGMMA and whose registers setmaxnreg sets.
constexpr int kWarpGroupThreads = 128;
// Rows of a WGMMA accumulator (the instruction's M): a consumer warp group's share of a tile.
constexpr int kWarpGroupRows = 64;

// Warp group 0 loads, the others compute.
enum class WarpGroupRole : int { kProducer = 0, kConsumer0 = 1, kConsumer1 = 2, kConsumer2 = 3 };

// The forward kernel's hardware named-barrier ids (0 is __syncthreads; there are 16). Nothing
// else in it uses named barriers, so the ids are ours from 1.
enum class NamedBarrier : int {
    kConsumers = 1,      // all consumer threads (clearing a V tail before its PV GEMM)
    kTurnConsumer0 = 2,  // consumer warp group g may issue its GEMMs: kTurnConsumer0 + g
    kTurnConsumer1 = 3,
    kTurnConsumer2 = 4,
    kEpilogue0 = 5,  // the 128 threads of consumer warp group g: kEpilogue0 + g
    kEpilogue1 = 6,
    kEpilogue2 = 7,
};

__forceinline__ __device__ NamedBarrier epilogue_barrier(int group) {
    return NamedBarrier(int(NamedBarrier::kEpilogue0) + group);
}

// This thread's consumer warp group (0 for threads 128-255). Read through a shuffle so that
// ptxas knows it is warp-uniform: branches on it then keep the uniform datapath (the pipeline
// stage arithmetic of the key loop moved to vector registers and spilled without it).
__forceinline__ __device__ int consumer_group() {
    return __shfl_sync(0xffffffff, int(threadIdx.x) / kWarpGroupThreads - 1, 0);
}

// Named-barrier operations on any kernel's barrier enum (each kernel names its own ids).
template <class Barrier>
__forceinline__ __device__ void barrier_sync(Barrier id, int threads) {
    static_assert(std::is_enum_v<Barrier>);
    asm volatile("bar.sync %0, %1;" ::"r"(int(id)), "r"(threads) : "memory");
}

template <class Barrier>
__forceinline__ __device__ void barrier_arrive(Barrier id, int threads) {
    static_assert(std::is_enum_v<Barrier>);
    asm volatile("bar.arrive %0, %1;" ::"r"(int(id)), "r"(threads) : "memory");
}

// gmem[0, bytes) += smem[0, bytes) in fp32, one bulk reduction issued by the calling thread (the
// copy engine reads shared memory and adds in L2). Grouped and waited for like TMA stores:
// cute::tma_store_arrive() commits, bulk_wait_read<N>() waits until at most N groups may still
// read shared memory, bulk_wait_done() until every group's writes are done.
__forceinline__ __device__ void bulk_reduce_add(float* gmem, float const* smem, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 ::"l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
                 : "memory");
}

template <int N>
__forceinline__ __device__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

__forceinline__ __device__ void bulk_wait_done() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// barrier_sync that also returns whether `pred` held for any of the threads.
__forceinline__ __device__ bool barrier_sync_or(NamedBarrier id, int threads, bool pred) {
    uint32_t any;
    asm volatile(
        "{\n\t.reg .pred p, q;\n\tsetp.ne.u32 p, %1, 0;\n\t"
        "bar.red.or.pred q, %2, %3, p;\n\tselp.u32 %0, 1, 0, q;\n\t}"
        : "=r"(any)
        : "r"(uint32_t(pred)), "r"(int(id)), "r"(threads)
        : "memory");
    return any != 0;
}

// The consumer groups issue their GEMMs in a ring: group g waits for its turn and passes it to
// group g + 1. Each turn barrier counts the waiting group and the one handing over.
template <int kGroups>
struct ConsumerTurns {
    static_assert(kGroups >= 2 && kGroups <= 3);
    static constexpr int kThreads = 2 * 128;

    __device__ static NamedBarrier turn_of(int group) {
        return NamedBarrier(int(NamedBarrier::kTurnConsumer0) + group);
    }
    // Before the first tile: the last group hands the first turn to group 0.
    __device__ static void start(int group) {
        if (group == kGroups - 1) barrier_arrive(turn_of(0), kThreads);
    }
    __device__ static void take(int group) { barrier_sync(turn_of(group), kThreads); }
    __device__ static void pass(int group) {
        barrier_arrive(turn_of(group + 1 == kGroups ? 0 : group + 1), kThreads);
    }
};

// acc (+)= A * B for one warp group, issued asynchronously: the caller waits with
// warpgroup_wait<N>() before it touches `acc` (or a register A) again.
template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
__forceinline__ __device__ void wgmma_issue(TiledMma& mma, TA const& a, TB const& b, TC& acc) {
    // A is either shared-memory descriptors (S = Q K^T) or registers (P in O += P V).
    constexpr bool kRegisterA = !is_same_v<typename TA::value_type, cute::GmmaDescriptor>;
    if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TA&>(a));
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a); ++k) {
        cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
        mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(acc);
    if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<TA&>(a));
}

// A WGMMA accumulator is ((2 cols, 2 row halves, N/8 col groups), MMA_M, MMA_N); view it as
// (rows, cols) for the row-wise softmax and masks. Each row is spread over a quad of lanes, as
// on SM80, so the quad reductions of softmax.h apply.
template <class Layout>
__forceinline__ __device__ auto wgmma_acc_as_rows_cols(Layout l) {
    static_assert(decltype(rank<0>(l))::value == 3);
    return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                       make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The registers of an accumulator's two neighbouring 8-column groups are those of one k16 slice
// of a register A operand, so P feeds the PV GEMM without shuffles:
// ((2,2,N/8), M, 1) -> ((2,2,2), M, N/16).
template <class Layout>
__forceinline__ __device__ auto wgmma_acc_as_a_operand(Layout l) {
    static_assert(decltype(size<2>(l))::value == 1);
    constexpr int kGroups = decltype(size<0, 2>(l))::value;
    static_assert(kGroups % 2 == 0);
    auto groups = get<0, 2>(l);
    auto split = make_layout(make_shape(_2{}, Int<kGroups / 2>{}),
                             make_stride(stride(groups), stride(groups) * _2{}));
    return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0>(split)), get<1>(l),
                       get<1>(split));
}

}  // namespace flash
