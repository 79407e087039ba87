// The kernel of kvcache_update.h: one thread per output element (k, v, then rotated q), after
// one per batch entry for seqused_k. Rows landing outside the cache are dropped and positions
// outside the rotary tables clamped, so bad lengths or indices never address out of range; the
// bad values are recorded (common/bad_input.h), once per batch entry where they are per entry.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "bad_input.h"
#include "kvcache_update.h"

namespace flash {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;  // grid-stride beyond: a few waves on any GPU

// Explicit conversions: they hold whether or not __CUDA_NO_HALF_CONVERSIONS__ is defined.
__device__ float to_float(__half x) { return __half2float(x); }
__device__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ float to_float(float x) { return x; }
template <class T>
__device__ T from_float(float x);
template <>
__device__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

struct RowOf {
    int b, j, h, i;  // batch, row, head, column of element e of a (batch, rows, heads, d) tensor
};

__device__ RowOf row_of(index_t e, int rows, int heads, int d) {
    RowOf r;
    r.i = int(e % d);
    e /= d;
    r.h = int(e % heads);
    e /= heads;
    r.j = int(e % rows);
    r.b = int(e / rows);
    return r;
}

__device__ index_t at(const Strides4& s, int b, int j, int h, int i) {
    return b * s.batch + j * s.row + h * s.head + i * s.col;
}

// Column i of a row rotated at table row pos, in float32 with each product rounded (no FMA),
// as the PyTorch path computes it.
template <class T, class Table>
__device__ T rotated(const KVCacheUpdateParams& p, const T* x, const Strides4& s, int b, int j,
                     int h, int i, index_t pos) {
    if (i >= p.rotary_dim) return x[at(s, b, j, h, i)];
    const int half = p.rotary_dim / 2;
    const int pair = p.interleaved ? i / 2 : i % half;
    const bool second = p.interleaved ? (i & 1) != 0 : i >= half;
    const int c0 = p.interleaved ? 2 * pair : pair;
    const int c1 = p.interleaved ? c0 + 1 : pair + half;
    const float x0 = to_float(x[at(s, b, j, h, c0)]);
    const float x1 = to_float(x[at(s, b, j, h, c1)]);
    const index_t t = min(max(pos, index_t(0)), index_t(p.seqlen_ro - 1)) * half + pair;
    const float c = to_float(static_cast<const Table*>(p.rotary_cos)[t]);
    const float sn = to_float(static_cast<const Table*>(p.rotary_sin)[t]);
    const float r = second ? __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c))
                           : __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
    return from_float<T>(r);
}

// T = uint8_t: e4m3 caches, whose rows are copied as bytes and never rotated (the binding
// refuses rotary tables with them).
template <class T, class Table>
__global__ void __launch_bounds__(kThreads) kvcache_update_kernel(KVCacheUpdateParams p) {
    constexpr bool kRotates = !std::is_same_v<T, uint8_t>;
    const index_t kv_elems = index_t(p.batch) * p.seqlen_new * p.nheads_k * p.headdim;
    const index_t q_elems =
        p.q_rot == nullptr ? 0 : index_t(p.batch) * p.seqlen_q * p.nheads * p.headdim;
    const index_t total = p.batch + 2 * kv_elems + q_elems;
    // 64-bit: cache_seqlens + seqlen_new may pass INT_MAX.
    auto first_row = [&](int b) {
        return index_t(p.cache_seqlens ? p.cache_seqlens[b] : p.seqlen_offset);
    };
    for (index_t e = blockIdx.x * index_t(kThreads) + threadIdx.x; e < total;
         e += index_t(gridDim.x) * kThreads) {
        if (e < p.batch) {
            const int b = int(e);
            const index_t first = first_row(b);
            const int end =
                int(min(max(first + p.seqlen_new, index_t(0)), index_t(p.seqlen_cache)));
            const bool fits = first >= 0 && first + p.seqlen_new <= p.seqlen_cache;
            if (p.cache_seqlens != nullptr && !fits) {
                report_bad_input(p.bad_input, BadInput::kCacheSeqlens, b, p.cache_seqlens[b]);
            }
            int pad = 0;
            if (p.cache_leftpad != nullptr) {
                const int given = p.cache_leftpad[b];
                pad = min(max(given, 0), end);
                if (pad != given) report_bad_input(p.bad_input, BadInput::kLeftpadK, b, given);
            }
            if (p.cache_batch_idx != nullptr) {
                const int given = p.cache_batch_idx[b];
                if (given < 0 || given >= p.batch_cache) {
                    report_bad_input(p.bad_input, BadInput::kKvBatchIdx, b, given);
                }
            }
            p.seqused_k[b] = end - pad;
            continue;
        }
        index_t x = e - p.batch;
        if (x < 2 * kv_elems) {
            const bool is_v = x >= kv_elems;
            const RowOf r = row_of(is_v ? x - kv_elems : x, p.seqlen_new, p.nheads_k, p.headdim);
            const index_t pos = first_row(r.b) + r.j;
            if (pos < 0 || pos >= p.seqlen_cache) continue;  // past the cache: dropped
            int entry = p.cache_batch_idx == nullptr
                            ? r.b
                            : min(max(p.cache_batch_idx[r.b], 0), p.batch_cache - 1);
            int row = int(pos);
            if (p.block_table != nullptr) {
                const index_t at_entry = r.b * p.block_table_stride + row / p.page_size;
                const int page = p.block_table[at_entry];
                entry = min(max(page, 0), p.batch_cache - 1);
                if (entry != page) {
                    report_bad_input(p.bad_input, BadInput::kBlockTable, int(at_entry), page);
                }
                row %= p.page_size;
            }
            if (is_v) {
                static_cast<T*>(p.v_cache)[at(p.v_cache_stride, entry, row, r.h, r.i)] =
                    static_cast<const T*>(p.v)[at(p.v_stride, r.b, r.j, r.h, r.i)];
            } else {
                const T* k = static_cast<const T*>(p.k);
                T val;
                if constexpr (kRotates) {
                    val = p.rotary_dim > 0
                              ? rotated<T, Table>(p, k, p.k_stride, r.b, r.j, r.h, r.i, pos)
                              : k[at(p.k_stride, r.b, r.j, r.h, r.i)];
                } else {
                    val = k[at(p.k_stride, r.b, r.j, r.h, r.i)];
                }
                static_cast<T*>(p.k_cache)[at(p.k_cache_stride, entry, row, r.h, r.i)] = val;
            }
            continue;
        }
        if constexpr (kRotates) {
            x -= 2 * kv_elems;
            const RowOf r = row_of(x, p.seqlen_q, p.nheads, p.headdim);
            const index_t pos = first_row(r.b) + (p.q_rows_advance ? r.j : 0);
            static_cast<T*>(p.q_rot)[at(p.q_rot_stride, r.b, r.j, r.h, r.i)] = rotated<T, Table>(
                p, static_cast<const T*>(p.q), p.q_stride, r.b, r.j, r.h, r.i, pos);
        }
    }
}

template <class T, class Table>
void launch(const KVCacheUpdateParams& p, cudaStream_t stream) {
    const index_t kv_elems = index_t(p.batch) * p.seqlen_new * p.nheads_k * p.headdim;
    const index_t q_elems =
        p.q_rot == nullptr ? 0 : index_t(p.batch) * p.seqlen_q * p.nheads * p.headdim;
    const index_t total = p.batch + 2 * kv_elems + q_elems;
    const int blocks = int(std::min<index_t>((total + kThreads - 1) / kThreads, kMaxBlocks));
    kvcache_update_kernel<T, Table><<<std::max(blocks, 1), kThreads, 0, stream>>>(p);
}

template <class T>
void launch_for(const KVCacheUpdateParams& p, cudaStream_t stream) {
    if (p.table_fp32) {
        launch<T, float>(p, stream);
    } else {
        launch<T, T>(p, stream);
    }
}

}  // namespace

void run_kvcache_update(const KVCacheUpdateParams& p, Dtype dtype, cudaStream_t stream) {
    if (dtype == Dtype::kE4m3) {
        launch<uint8_t, uint8_t>(p, stream);
    } else if (dtype == Dtype::kFp16) {
        launch_for<__half>(p, stream);
    } else {
        launch_for<__nv_bfloat16>(p, stream);
    }
}

}  // namespace flash
