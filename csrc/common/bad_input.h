// Out-of-range device-valued inputs (cu_seqlens, seqused_k / cache_seqlens, kv_batch_idx /
// cache_batch_idx, leftpad / cache_leftpad, block_table, a too-small max_seqlen): the kernels
// clamp such a value so that nothing is read or written out of bounds, and record it here so
// that it does not pass silently. The record is one 64-bit word in host-mapped memory (one per
// device, owned by the binding), which the Python layer reads at its next call without a
// device sync (flash_attn/_bad_input.py decodes it and raises a ValueError).
//
// Layout: bits 56-63 the BadInput code, bits 32-55 the index (batch entry, the cu_seqlens
// index, or a block_table entry's element offset), bits 0-31 the value as given. One plain
// 64-bit store: when several threads or launches find bad values, one of them is kept whole.
#pragma once

#include <cstdint>

namespace flash {

// The codes are read by flash_attn/_bad_input.py: keep the two in step.
enum class BadInput : uint32_t {
    kNone = 0,
    kCuSeqlensQ = 1,    // index: the cu_seqlens_q entry
    kCuSeqlensK = 2,    // index: the cu_seqlens_k entry
    kSequsedK = 3,      // seqused_k[b] (flash_attn_with_kvcache: cache_seqlens[b])
    kKvBatchIdx = 4,    // cache_batch_idx[b]
    kLeftpadK = 5,      // cache_leftpad[b]
    kBlockTable = 6,    // index: the entry's element offset in block_table
    kMaxSeqlenQ = 7,    // sequence b's query count, above max_seqlen_q
    kMaxSeqlenK = 8,    // sequence b's key count, above max_seqlen_k or its pages' capacity
    kCacheSeqlens = 9,  // cache_seqlens[b], negative or leaving no room for the new rows
};

#if defined(__CUDACC__)
__device__ __forceinline__ void report_bad_input(unsigned long long* word, BadInput what,
                                                 int index, int value) {
    if (word == nullptr) return;
    // Indices past 24 bits saturate (flash_attn/_bad_input.py says "at least").
    const unsigned int index24 = index < 0 ? 0u : index > 0xFFFFFF ? 0xFFFFFFu : unsigned(index);
    const unsigned long long packed = (static_cast<unsigned long long>(what) << 56) |
                                      (static_cast<unsigned long long>(index24) << 32) |
                                      static_cast<unsigned int>(value);
    *reinterpret_cast<volatile unsigned long long*>(word) = packed;
}
#endif

}  // namespace flash
