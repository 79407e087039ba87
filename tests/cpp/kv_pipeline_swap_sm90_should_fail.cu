// Compile-time test: V's pipeline must reject K's params, even at equal stage counts (the slip
// that once broke another project's Hopper build at users' pip install). Must NOT compile.
// EXPECT_ERROR: no instance of constructor
#include <cute/tensor.hpp>

#include "hopper/pipelines.h"

__global__ void swap_params() {
    extern __shared__ char smem[];
    auto& v_storage = *reinterpret_cast<flash::VPipeline<2>::SharedStorage*>(smem);
    flash::KPipeline<2>::Params k_params;
    flash::VPipeline<2> v(v_storage, k_params, 8);
}
