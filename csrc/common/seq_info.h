// Where one (batch, head) problem lives: sequence lengths and row offsets, batched or varlen.
// Device-valued inputs (cu_seqlens, seqused_k, kv_batch_idx, leftpad_k, block_table) are clamped
// to the tensors' extents so that bad values never send a kernel out of bounds, and a value that
// needed clamping is recorded (common/bad_input.h) so that it is reported, not silently wrong.
#pragma once

#include "bad_input.h"
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
        bidb_k = bidb;
        if (pages != nullptr) {
            bidb_k = 0;
        } else if (p.kv_batch_idx != nullptr) {
            const int given = p.kv_batch_idx[bidb];
            bidb_k = min(max(given, 0), p.batch_k - 1);
            if (bidb_k != given) report_bad_input(p.bad_input, BadInput::kKvBatchIdx, bidb, given);
        }
        if (p.is_varlen()) {
            // Entry 0 must be 0, and entry b + 1 at least entry b and at most the row count.
            constexpr BadInput kQ = BadInput::kCuSeqlensQ, kK = BadInput::kCuSeqlensK;
            const int q0 = bounded_start(p, p.cu_seqlens_q, bidb, p.total_q, kQ);
            const int q1 = bounded_end(p, p.cu_seqlens_q, bidb, q0, p.total_q, kQ);
            const int k0 = bounded_start(p, p.cu_seqlens_k, bidb, p.total_k, kK);
            const int k1 = bounded_end(p, p.cu_seqlens_k, bidb, k0, p.total_k, kK);
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
        if (seqlen_q > p.seqlen_q) {
            report_bad_input(p.bad_input, BadInput::kMaxSeqlenQ, bidb, seqlen_q);
            seqlen_q = p.seqlen_q;
        }
        if (seqlen_k > p.seqlen_k) {
            report_bad_input(p.bad_input, BadInput::kMaxSeqlenK, bidb, seqlen_k);
            seqlen_k = p.seqlen_k;
        }
        if (p.seqused_k != nullptr) {
            const int given = p.seqused_k[bidb];
            const int used = min(max(given, 0), seqlen_k);
            if (used != given) report_bad_input(p.bad_input, BadInput::kSequsedK, bidb, given);
            seqlen_k = used;
        }
        // Dead (and not loaded) in code that only needs the lengths.
        k_first = 0;
        if (p.leftpad_k != nullptr) {
            const int given = p.leftpad_k[bidb];
            k_first = min(max(given, 0), p.seqlen_k - seqlen_k);
            if (k_first != given) report_bad_input(p.bad_input, BadInput::kLeftpadK, bidb, given);
        }
    }

    // Element offset of (row, head) for an operand: batched tensors use the batch stride, varlen
    // ones the row stride (the batch lives in the row index).
    __device__ index_t q_offset(const TensorStrides& s, const AttnShape& p, int bidb, int row,
                                int head) const {
        return offset(s, p, bidb, row_q, row, head);
    }
    // Paged: the head's offset in page 0 (page_offset finds the rows, the left pad included).
    __device__ index_t k_offset(const TensorStrides& s, const AttnShape& p, int row,
                                int head) const {
        return offset(s, p, bidb_k, row_k, (pages == nullptr ? k_first : 0) + row, head);
    }

    // Paged K/V: the page holding row `row` of the sequence's pages (leftpad not applied). A bad
    // entry is recorded by its element offset in the table, which needs no further arithmetic
    // here (its batch row is offset / block_table_stride).
    __device__ int page(const AttnShape& p, int row) const {
        const int entry = row / p.page_size;
        const int given = pages[entry];
        const int page = min(max(given, 0), p.num_pages - 1);
        if (page != given) {
            report_bad_input(p.bad_input, BadInput::kBlockTable,
                             int(pages - p.block_table) + entry, given);
        }
        return page;
    }
    // Paged K/V: element offset of key `key` (row k_first + key of the sequence's pages) from
    // its head's in page 0.
    __device__ index_t page_offset(const TensorStrides& s, const AttnShape& p, int key) const {
        const int row = k_first + key;
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
                         seqlen_k - seqlen_q + p.alibi_offset};
    }

  private:
    // cu_seqlens[b], clamped into [0, total]; entry 0 must be 0.
    static __device__ int bounded_start(const AttnShape& p, const int* cu, int b, int total,
                                        BadInput what) {
        const int given = cu[b];
        const int start = min(max(given, 0), total);
        if (b == 0 && given != 0) report_bad_input(p.bad_input, what, 0, given);
        return start;
    }
    // cu_seqlens[b + 1], clamped into [start, total] (a bad entry b itself is reported as the
    // end of sequence b - 1).
    static __device__ int bounded_end(const AttnShape& p, const int* cu, int b, int start,
                                      int total, BadInput what) {
        const int given = cu[b + 1];
        const int end = min(max(given, start), total);
        if (end != given) report_bad_input(p.bad_input, what, b + 1, given);
        return end;
    }

    __device__ index_t offset(const TensorStrides& s, const AttnShape& p, int bidb, index_t row0,
                              int row, int head) const {
        index_t base = p.is_varlen() ? row0 * s.row : index_t(bidb) * s.batch;
        return base + index_t(row) * s.row + index_t(head) * s.head;
    }
};

}  // namespace flash
