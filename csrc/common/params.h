// Kernel parameters shared by the binding and every kernel. Plain structs: no torch here, so the
// kernels also compile in the torch-free CMake build.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASH_HOST_DEVICE __host__ __device__
#else
#define FLASH_HOST_DEVICE
#endif

namespace flash {

using index_t = int64_t;

// Where one operand lives: strides in elements, last dim contiguous.
struct TensorStrides {
    index_t batch = 0;  // unused for varlen (rows are offset by cu_seqlens instead)
    index_t row = 0;
    index_t head = 0;
};

// Sequence geometry and masking, shared by forward and backward.
struct AttnShape {
    int batch = 0;
    int nheads = 0;
    int nheads_k = 0;
    int headdim = 0;   // actual head dim (multiple of 8); the kernel tier may be larger
    int seqlen_q = 0;  // batched: the q length; varlen: max_seqlen_q (grid size only)
    int seqlen_k = 0;
    int total_q = 0;  // rows in q's first dim (varlen) or batch * seqlen_q
    int total_k = 0;
    const int* cu_seqlens_q = nullptr;  // varlen when non-null, (batch + 1,)
    const int* cu_seqlens_k = nullptr;
    const int* seqused_k = nullptr;  // (batch,), optional
    // Forward only, batched only, optional: query batch b reads entry kv_batch_idx[b] of K and
    // V, which then have batch_k entries (a KV cache indexed by cache_batch_idx).
    const int* kv_batch_idx = nullptr;
    int batch_k = 0;  // entries of K and V (batched); batch without kv_batch_idx
    // Forward only, batched, with seqused_k: query batch b's keys are the seqused_k[b] rows
    // from row leftpad_k[b] of its K/V entry or pages (a left-padded KV cache; clamped so that
    // they stay within seqlen_k). Only the loads see it: the kernels' masks and loops need no
    // more than seqused_k. With pages only the SM80 kernels take it.
    const int* leftpad_k = nullptr;
    // Forward only, optional: paged K/V of shape (num_pages, page_size, nheads_k, d). Key row
    // r of batch b is row r % page_size of page block_table[b * block_table_stride +
    // r / page_size] (clamped into the pages); batched, seqlen_k is the table's width times
    // page_size (varlen: cu_seqlens_k counts the keys). Any page_size >= 1 on the SM80
    // kernels (a key block gathered row by row); the SM90 kernels take multiples of 8 rows
    // (TMA boxes of up to a key block, as tall as the page allows).
    const int* block_table = nullptr;
    index_t block_table_stride = 0;
    int page_size = 0;
    int num_pages = 0;

    // Scores: s = q.k * scale; with softcap > 0: s = softcap * tanh(q.k * scale / softcap).
    // The kernels compute exp2(t * scale_log2 - m) with t = q.k (no softcap) or
    // t = tanh(q.k * softcap_prescale) (softcap).
    float softmax_scale = 1.f;
    float scale_log2 = 1.f;
    float softcap = 0.f;
    float softcap_prescale = 0.f;

    // ALiBi, optional: the score of query i and key j gets the bias
    // -slope * |i + seqlen_k - seqlen_q + alibi_offset - j| (bottom-right aligned, per
    // sequence), slope = alibi_slopes[b * alibi_batch_stride + h] (float32; stride 0: one slope
    // per head). alibi_unit converts it to the units of t above (1 / softmax_scale, or
    // 1 / softcap). alibi_offset (0 for a whole sequence) places a sub-block of a longer
    // sequence, as ring attention calls the kernels: only the bias moves, not the mask.
    const float* alibi_slopes = nullptr;
    index_t alibi_batch_stride = 0;
    float alibi_unit = 0.f;
    int alibi_offset = 0;

    // Dropout, optional (SM80 kernels): rng_state = (seed, offset[, entry0, row0, col0]), int64
    // in device memory, so that a CUDA graph replays fresh values; a score is kept when its
    // 16-bit number is below dropout_keep (round((1 - p) * 65536), common/dropout.h), and kept
    // probabilities are scaled by dropout_scale = 1 / (1 - p).
    const int64_t* rng_state = nullptr;
    // rng_state has five entries, (seed, offset, entry0, row0, col0): the call's scores take the
    // numbers of batch entry b + entry0, row i + row0 and column j + col0, as ring attention's
    // blocks of a sharded sequence need. The values live on the device, unchecked here: row0
    // and col0 must be multiples of 16 (the kernels take row0 / 16 and col0 / 16 blocks) and
    // entry0 >= 0, which flash_attn.dropout.at_positions checks where it builds the state.
    bool rng_positions = false;
    uint32_t dropout_keep = 65536;
    float dropout_scale = 1.f;

    // Learnable sink, optional (forward only; common/softmax.h join_sink): sink[h], float32,
    // one logit per query head. The backward needs nothing of it but the LSE that includes it.
    const float* sink = nullptr;

    // Bottom-right aligned window; negative means unbounded on that side.
    int window_left = -1;
    int window_right = -1;

    // Where the kernels record an out-of-range device-valued input (common/bad_input.h):
    // host-mapped, set by the binding. nullptr: not recorded.
    unsigned long long* bad_input = nullptr;

    FLASH_HOST_DEVICE bool is_varlen() const { return cu_seqlens_q != nullptr; }
};

// Device memory for one call's scratch, from the binding (torch's allocator, ordered on the
// call's stream like its outputs). `allocate` returns `bytes` bytes (256-byte aligned) that
// live until the call returns.
struct WorkspaceAllocator {
    void* (*allocate)(void* context, index_t bytes) = nullptr;
    void* context = nullptr;
};

struct FwdParams : AttnShape {
    const void* q = nullptr;
    const void* k = nullptr;
    const void* v = nullptr;
    void* o = nullptr;
    float* lse = nullptr;  // batched (b, h, sq); varlen (h, total_q)
    TensorStrides q_stride, k_stride, v_stride, o_stride;
    WorkspaceAllocator workspace;  // SM90: the tile schedulers' counters and split outputs
    // SM90, set by its launcher: query heads per KV head packed into one tile's rows (GQA
    // packing; packed row r is query row r / pack_gqa of head kv_head * pack_gqa +
    // r % pack_gqa). 1: tiles hold one query head.
    int pack_gqa = 1;
    // SM90: SMs the persistent kernels leave free for work running beside them (ring
    // attention's NCCL transfers). 0: the grid fills the GPU.
    int sm_margin = 0;
    // e4m3 inputs (SM90): float32 factors per (batch, KV head), contiguous (batch, nheads_k);
    // scores are (q * q_descale) . (k * k_descale) * softmax_scale and the output is taken of
    // v * v_descale. nullptr: 1.
    const float* q_descale = nullptr;
    const float* k_descale = nullptr;
    const float* v_descale = nullptr;
};

struct BwdParams : AttnShape {
    const void* q = nullptr;
    const void* k = nullptr;
    const void* v = nullptr;
    const void* o = nullptr;
    const void* dout = nullptr;
    const float* lse = nullptr;
    void* dq = nullptr;
    void* dk = nullptr;  // (.., nheads, d): one slot per query head; the binding sums GQA groups
    void* dv = nullptr;
    float* dq_accum = nullptr;   // SM80: lse's shape + (headdim_tier,), fp32, zeroed by the binding
    float* softmax_d = nullptr;  // rowsum(dO * O), same layout as lse (SM80)
    TensorStrides q_stride, k_stride, v_stride, o_stride, do_stride, dq_stride, dk_stride,
        dv_stride;
    WorkspaceAllocator workspace;  // SM90: the padded row buffers; both: dq_turns
    // dQ's partial sums added in a fixed order, so that repeated runs are bitwise equal.
    bool deterministic = false;
    // deterministic: per (batch, head, query tile), how many key tiles have added their dQ
    // (common/dq_turns.h); zeroed scratch set by each arch's launcher. nullptr otherwise.
    int* dq_turns = nullptr;
};

}  // namespace flash
