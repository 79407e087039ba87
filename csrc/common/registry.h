// A table of the kernels this build compiled. Each generated instantiation file adds its launcher
// at load time, so dispatch and build_info() see exactly what was built, with no macros.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "params.h"

namespace flash {

enum class Kind { kFwd, kBwd };
// Input dtypes; kE4m3 (SM90 forward only) writes a bf16 output.
enum class Dtype { kFp16, kBf16, kE4m3 };

inline const char* dtype_name(Dtype d) {
    return d == Dtype::kFp16 ? "fp16" : d == Dtype::kBf16 ? "bf16" : "e4m3";
}

using FwdLauncher = void (*)(FwdParams&, cudaStream_t);
using BwdLauncher = void (*)(BwdParams&, cudaStream_t);

struct KernelEntry {
    Kind kind;
    int arch;  // 80 or 90: the code path, not the SASS target
    Dtype dtype;
    int headdim;  // tier
    FwdLauncher fwd;
    BwdLauncher bwd;
};

inline std::vector<KernelEntry>& kernel_registry() {
    static std::vector<KernelEntry> table;
    return table;
}

struct RegisterFwd {
    RegisterFwd(int arch, Dtype dtype, int headdim, FwdLauncher fn) {
        kernel_registry().push_back({Kind::kFwd, arch, dtype, headdim, fn, nullptr});
    }
};

struct RegisterBwd {
    RegisterBwd(int arch, Dtype dtype, int headdim, BwdLauncher fn) {
        kernel_registry().push_back({Kind::kBwd, arch, dtype, headdim, nullptr, fn});
    }
};

}  // namespace flash
