// Ordering of memory accesses between CTAs on different SMs (gpu scope), for flags and counts
// that CTAs hand each other: the forward's split merge and the deterministic backward.
#pragma once

namespace flash {

// A flag between CTAs: load with acquire, store with release (gpu scope).
__forceinline__ __device__ int ld_acquire_gpu(int const* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// A look at a flag that does not wait for its value: a fence.acq_rel.gpu after it makes a value
// that some release wrote an acquire of that release.
__forceinline__ __device__ int ld_relaxed_gpu(int const* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__forceinline__ __device__ void st_release_gpu(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Orders this thread's memory accesses (and, after a barrier, its CTA's) with those of other
// SMs: a release before a count others read, an acquire after reading theirs.
__forceinline__ __device__ void fence_acq_rel_gpu() {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

}  // namespace flash
