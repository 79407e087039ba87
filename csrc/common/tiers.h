// The head-dim tiers kernels are compiled for: the one list (setup.py and
// scripts/generate_kernels.py read it from this file).
#pragma once

namespace flash {

// Head-dim tiers that kernels are compiled for; a head dim runs on the smallest tier holding it.
constexpr int kHeadDimTiers[] = {32, 64, 96, 128, 160, 192, 224, 256};

constexpr int headdim_tier(int d) {
    for (int t : kHeadDimTiers) {
        if (d <= t) return t;
    }
    return 0;
}

}  // namespace flash
