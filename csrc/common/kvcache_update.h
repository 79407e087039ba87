// flash_attn_with_kvcache's cache update in one launch: the new k/v rows written into the cache
// at cache_seqlens[b] (k rotated), q rotated at its positions, and the attention's seqused_k.
// bf16/fp16, and e4m3 caches (rows copied as bytes, never rotated).
// Plain CUDA (no CuTe): a few thousand rows of element-wise work, bound by the launch.
#pragma once

#include <cuda_runtime.h>

#include "params.h"
#include "registry.h"  // Dtype

namespace flash {

// Strides in elements of a (batch, rows, heads, headdim) tensor, any layout.
struct Strides4 {
    index_t batch = 0, row = 0, head = 0, col = 1;
};

struct KVCacheUpdateParams {
    // Caches (batch_cache, seqlen_cache, nheads_k, headdim), written in place.
    void* k_cache = nullptr;
    void* v_cache = nullptr;
    Strides4 k_cache_stride, v_cache_stride;
    // New rows (batch, seqlen_new, nheads_k, headdim); nullptr when seqlen_new is 0.
    const void* k = nullptr;
    const void* v = nullptr;
    Strides4 k_stride, v_stride;
    // q (batch, seqlen_q, nheads, headdim) and its rotated copy; q_rot nullptr: no rotary.
    const void* q = nullptr;
    void* q_rot = nullptr;
    Strides4 q_stride, q_rot_stride;
    // Row where batch b's new rows start: cache_seqlens[b], or seqlen_offset for every b.
    const int* cache_seqlens = nullptr;
    int seqlen_offset = 0;
    const int* cache_batch_idx = nullptr;  // cache entry of batch b (clamped), or b
    // Paged caches (num_pages, page_size, nheads_k, headdim): row r of batch b is row
    // r % page_size of page block_table[b * block_table_stride + r / page_size] (clamped);
    // seqlen_cache is then the table's width times page_size.
    const int* block_table = nullptr;
    index_t block_table_stride = 0;
    int page_size = 0;
    // Rotary tables (seqlen_ro, rotary_dim / 2), contiguous, q's dtype or float32.
    const void* rotary_cos = nullptr;
    const void* rotary_sin = nullptr;
    bool table_fp32 = false;
    int rotary_dim = 0;
    int seqlen_ro = 0;
    bool interleaved = true;  // pairs (2i, 2i + 1); else (i, i + rotary_dim / 2)
    bool q_rows_advance = false;  // q row j at position cache_seqlens[b] + j (causal or local)
    int batch = 0, batch_cache = 0, seqlen_cache = 0, seqlen_new = 0, seqlen_q = 0;
    int nheads = 0, nheads_k = 0, headdim = 0;
    // First cache row of batch b's keys (cache_leftpad), or nullptr: 0.
    const int* cache_leftpad = nullptr;
    // Out, (batch,): end - min(max(cache_leftpad[b], 0), end), the keys of batch b, with
    // end = min(max(cache_seqlens[b] + seqlen_new, 0), seqlen_cache).
    int* seqused_k = nullptr;
    // Where an out-of-range cache_seqlens, cache_batch_idx, cache_leftpad or block_table entry
    // is recorded (common/bad_input.h): host-mapped, set by the binding; nullptr: not recorded.
    unsigned long long* bad_input = nullptr;
};

// Launches the update on `stream`; fp16 or bf16 tensors.
void run_kvcache_update(const KVCacheUpdateParams& p, Dtype dtype, cudaStream_t stream);

}  // namespace flash
