// What the torch binding (flash_api.cpp, on the stable ABI) shares with the Python module
// (module.cpp, pybind11 with no torch type): each device's bad-input word (common/bad_input.h).
#pragma once

#include <cstdint>

// The torch.ops namespace of the kernels' ops. setup.py gives each A/B build
// (FLASH_ATTN_AB_BUILD=1) a namespace of its own, so that several builds can be loaded into one
// process (benchmarks/ab_builds.py) without registering the same ops twice.
#ifndef FLASH_ATTN_OP_NAMESPACE
#define FLASH_ATTN_OP_NAMESPACE flash_attn_cuda
#endif
#define FLASH_ATTN_STRINGIZE_(x) #x
#define FLASH_ATTN_STRINGIZE(x) FLASH_ATTN_STRINGIZE_(x)

namespace flash_binding {

// The host address of device `device`'s bad-input word for flash_attn/_bad_input.py to read,
// or 0 while it does not exist (no launch has recorded into it).
uint64_t bad_input_word_address(int64_t device);

// The word's value, swapped for 0 in one atomic exchange.
uint64_t take_bad_input(int64_t device);

}  // namespace flash_binding
