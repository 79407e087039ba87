// TMA pipelines of the SM90 forward. K and V each get their own pipeline type with its own
// Params type, so handing K's params (or barriers) to V's pipeline is a compile error even
// when both have the same stage count (tests/cpp/kv_pipeline_swap_sm90_should_fail.cu).
#pragma once

#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace flash {

struct KOperand {};
struct VOperand {};

template <class Operand, int kStages>
class OperandPipeline : public cutlass::PipelineTmaAsync<kStages> {
    using Base = cutlass::PipelineTmaAsync<kStages>;

  public:
    using SharedStorage = typename Base::SharedStorage;

    // Distinct per operand: deriving keeps every field of the CUTLASS params.
    struct Params : Base::Params {
        using operand = Operand;
    };

    template <class ClusterShape, class InitBarriers, class InitMasks>
    CUTLASS_DEVICE OperandPipeline(SharedStorage& storage, Params const& params,
                                   ClusterShape cluster_shape, InitBarriers init_barriers,
                                   InitMasks init_masks)
        : Base(storage, params, cluster_shape, init_barriers, init_masks) {}
};

template <int kStages>
using KPipeline = OperandPipeline<KOperand, kStages>;
template <int kStages>
using VPipeline = OperandPipeline<VOperand, kStages>;

}  // namespace flash
