// Compile-time test: each pipeline accepts its own Params (this file must compile).
#include <cute/tensor.hpp>

#include "hopper/pipelines.h"

__global__ void build_pipelines() {
    extern __shared__ char smem[];
    auto& k_storage = *reinterpret_cast<flash::KPipeline<2>::SharedStorage*>(smem);
    auto& v_storage = *reinterpret_cast<flash::VPipeline<2>::SharedStorage*>(
        smem + sizeof(flash::KPipeline<2>::SharedStorage));
    flash::KPipeline<2>::Params k_params;
    flash::VPipeline<2>::Params v_params;
    flash::KPipeline<2> k(k_storage, k_params, 8);
    flash::VPipeline<2> v(v_storage, v_params, 8);
}
