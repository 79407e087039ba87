// The current device's properties that the launchers of both archs read on every call.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace flash {

// The current device's SM count and L2 bytes, read once per device: the launchers need them on
// every call, and the attribute queries are host work.
struct DeviceInfo {
    int sms = 0;
    int l2_bytes = 0;
};
inline DeviceInfo current_device_info() {
    int device = 0;
    cudaGetDevice(&device);
    static std::atomic<int> sms_seen[64] = {}, l2_seen[64] = {};
    DeviceInfo d;
    if (device < 64) {
        d.sms = sms_seen[device].load(std::memory_order_acquire);
        d.l2_bytes = l2_seen[device].load(std::memory_order_relaxed);
    }
    if (d.sms == 0) {
        cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device);
        cudaDeviceGetAttribute(&d.l2_bytes, cudaDevAttrL2CacheSize, device);
        if (device < 64) {
            l2_seen[device].store(d.l2_bytes, std::memory_order_relaxed);
            sms_seen[device].store(d.sms, std::memory_order_release);  // after l2's
        }
    }
    return d;
}

}  // namespace flash
