// Where one (batch, head) problem lives: sequence lengths and row offsets, batched or varlen.
// Varlen offsets are clamped to the tensors' extents so that inconsistent cu_seqlens never send a
// kernel out of bounds (they only give wrong numbers, which FLASH_ATTN_CHECK_INPUTS=1 catches).
#pragma once

#include "mask.h"
#include "params.h"

namespace flash {

struct SeqInfo {
    int seqlen_q;
    int seqlen_k;
    index_t row_q;  // first row of this sequence in q's row space (batched: bidb * seqlen_q)
    index_t row_k;
    int bidb_k;  // the K/V batch entry (kv_batch_idx, clamped into K's batch); 0 when paged
    int k_first;  // the sequence's first key row in its K/V rows (leftpad_k), else 0
    const int* pages;  // paged K/V: this sequence's row of the block table, else nullptr

    __device__ SeqInfo(const AttnShape& p, int bidb) {
        pages = p.block_table == nullptr ? nullptr : p.block_table + bidb * p.block_table_stride;
        bidb_k = pages != nullptr             ? 0
                 : p.kv_batch_idx == nullptr ? bidb
                                             : min(max(p.kv_batch_idx[bidb], 0), p.batch_k - 1);
        if (p.is_varlen()) {
            int q0 = min(max(p.cu_seqlens_q[bidb], 0), p.total_q);
            int q1 = min(max(p.cu_seqlens_q[bidb + 1], q0), p.total_q);
            int k0 = min(max(p.cu_seqlens_k[bidb], 0), p.total_k);
            int k1 = min(max(p.cu_seqlens_k[bidb + 1], k0), p.total_k);
            row_q = q0;
            row_k = p.block_table == nullptr ? k0 : 0;  // paged: the table finds the rows
            seqlen_q = q1 - q0;
            seqlen_k = k1 - k0;
        } else {
            row_q = index_t(bidb) * p.seqlen_q;
            row_k = index_t(bidb_k) * p.seqlen_k;
            seqlen_q = p.seqlen_q;
            seqlen_k = p.seqlen_k;
        }
        // A sequence longer than max_seqlen (a wrong max_seqlen) is cut to it, so every kernel
        // of forward and backward sees the same rows and the grid covers them.
        seqlen_q = min(seqlen_q, p.seqlen_q);
        seqlen_k = min(seqlen_k, p.seqlen_k);
        if (p.seqused_k != nullptr) seqlen_k = min(max(p.seqused_k[bidb], 0), seqlen_k);
        // Dead (and not loaded) in code that only needs the lengths.
        k_first = p.leftpad_k == nullptr ? 0
                                         : min(max(p.leftpad_k[bidb], 0), p.seqlen_k - seqlen_k);
    }

    // Element offset of (row, head) for an operand: batched tensors use the batch stride, varlen
    // ones the row stride (the batch lives in the row index).
    __device__ index_t q_offset(const TensorStrides& s, const AttnShape& p, int bidb, int row,
                                int head) const {
        return offset(s, p, bidb, row_q, row, head);
    }
    __device__ index_t k_offset(const TensorStrides& s, const AttnShape& p, int row,
                                int head) const {
        return offset(s, p, bidb_k, row_k, k_first + row, head);
    }

    // Paged K/V: the page holding key row `row`, and the row within it.
    __device__ int page(const AttnShape& p, int row) const {
        return min(max(pages[row / p.page_size], 0), p.num_pages - 1);
    }
    // Paged K/V: element offset of key row `row` from its head's in page 0.
    __device__ index_t page_offset(const TensorStrides& s, const AttnShape& p, int row) const {
        return index_t(page(p, row)) * s.batch + index_t(row % p.page_size) * s.row;
    }

    // lse / softmax_d: batched (b, h, sq), varlen (h, total_q).
    __device__ index_t lse_offset(const AttnShape& p, int bidb, int head) const {
        return p.is_varlen() ? index_t(head) * p.total_q + row_q
                             : (index_t(bidb) * p.nheads + head) * p.seqlen_q;
    }

    __device__ BandMask mask(const AttnShape& p) const {
        return BandMask{seqlen_q, seqlen_k, p.window_left, p.window_right};
    }

    // Head `head`'s ALiBi bias (kernels instantiated for ALiBi: alibi_slopes is set). They
    // load it per tile: kept across the key loop it would hold a register in every tile.
    __device__ AlibiBias alibi(const AttnShape& p, int bidb, int head) const {
        return AlibiBias{p.alibi_slopes[bidb * p.alibi_batch_stride + head] * p.alibi_unit,
                         seqlen_k - seqlen_q};
    }

  private:
    __device__ index_t offset(const TensorStrides& s, const AttnShape& p, int bidb, index_t row0,
                              int row, int head) const {
        index_t base = p.is_varlen() ? row0 * s.row : index_t(bidb) * s.batch;
        return base + index_t(row) * s.row + index_t(head) * s.head;
    }
};

}  // namespace flash
