// The Python module flash_attn._C: what this build compiled, and the bad-input words. It uses
// pybind11 and no torch C++ type, so it adds no torch symbol; the kernels' ops live in the same
// library (flash_api.cpp), so importing this module registers torch.ops.flash_attn_cuda.
#include <cuda_runtime_api.h>
#include <cutlass/version.h>
// setup.py builds every C++ file against the stable ABI's target version, which torch's own
// pybind11 headers refuse; this file uses pybind11 only, no torch API.
#undef TORCH_TARGET_VERSION
#undef TORCH_STABLE_ONLY
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <vector>

#include "binding.h"
#include "common/registry.h"

namespace {

pybind11::dict build_info() {
    pybind11::dict info;
    pybind11::list kernels;
    std::vector<int> archs;
    for (const auto& e : flash::kernel_registry()) {
        pybind11::dict k;
        k["kind"] = e.kind == flash::Kind::kFwd ? "fwd" : "bwd";
        k["arch"] = e.arch;
        k["dtype"] = flash::dtype_name(e.dtype);
        k["headdim"] = e.headdim;
        kernels.append(k);
        if (std::find(archs.begin(), archs.end(), e.arch) == archs.end()) archs.push_back(e.arch);
    }
    std::sort(archs.begin(), archs.end());
    info["archs"] = archs;
    info["kernels"] = kernels;
    info["cuda"] =
        std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
    info["sass_archs"] = FLASH_ATTN_SASS_ARCHS;  // from setup.py: SASS targets, e.g. "80,90"
    info["cutlass"] = std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." +
                      std::to_string(CUTLASS_PATCH);
    return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "FlashAttention kernels (CUDA): build_info and the bad-input words; the kernels "
              "are torch.ops.<op_namespace>.{fwd,bwd,kvcache_update}";
    namespace py = pybind11;
    m.def("build_info", &build_info, "what this build compiled");
    m.def("bad_input_word_address", &flash_binding::bad_input_word_address,
          "host address of a device's bad-input word (common/bad_input.h), 0 if none yet",
          py::arg("device"));
    m.def("take_bad_input", &flash_binding::take_bad_input,
          "a device's bad-input word, atomically swapped for 0", py::arg("device"));
    m.attr("op_namespace") = FLASH_ATTN_STRINGIZE(FLASH_ATTN_OP_NAMESPACE);
}
