// SM80 forward: one CTA per (Q tile, batch, head), tile sizes from tile_size.h. K and V
// tiles stream through shared memory with cp.async, one tile in flight while the other is
// consumed; S and P stay in registers (mma.sync m16n8k16, fp32 accumulation).
#pragma once

#include <cutlass/numeric_types.h>

#include <cute/tensor.hpp>

#include "common/dropout.h"
#include "common/params.h"
#include "common/seq_info.h"
#include "sm80_traits.h"
#include "sm80_utils.h"
#include "common/score.h"
#include "common/softmax.h"
#include "tile_size.h"

namespace flash {

template <class T, int kHeadDim>
struct Sm80Fwd {
    static constexpr Sm80FwdTile kTile = sm80_fwd_tile(kHeadDim);
    static constexpr int kBlockM = kTile.block_m;
    static constexpr int kBlockN = kTile.block_n;
    static constexpr int kWarps = kTile.warps;
    static constexpr int kThreads = kWarps * 32;

    // Warps split the rows; N of the MMA tile is 16 so one ldmatrix.x4 feeds two 16x8 MMAs.
    using TiledMma = TiledMMA<Sm80MmaAtom<T>, Layout<Shape<Int<kWarps>, _1, _1>>,
                              Tile<Int<16 * kWarps>, _16, _16>>;
    using Copies = Sm80Copies<T, kHeadDim, kThreads>;
    using SmemQ = SmemTile<kBlockM, kHeadDim>;
    using SmemKV = SmemTile<kBlockN, kHeadDim>;
    using SmemVt = TransposedTile<SmemKV>;

    static constexpr int kSmemBytes = (kBlockM + 2 * kBlockN) * kHeadDim * sizeof(T);
    static_assert(kBlockM % (16 * kWarps) == 0 && kBlockN % 16 == 0);
};

// kExtras (ALiBi or dropout) and kPaged (K/V in pages, block_table): their own instantiations,
// so the kernels without them keep their code and registers (a paged K/V's row gather took 74
// more bytes of spills in the plain d=128 kernel, and 254 in the extras one).
template <class T, int kHeadDim, bool kExtras, bool kPaged>
__global__ void __launch_bounds__(Sm80Fwd<T, kHeadDim>::kThreads, 1)
    flash_fwd_sm80_kernel(const __grid_constant__ FwdParams p) {
    using K = Sm80Fwd<T, kHeadDim>;
    constexpr int kBlockM = K::kBlockM;
    constexpr int kBlockN = K::kBlockN;
    using BM = Int<kBlockM>;
    using BN = Int<kBlockN>;
    using D = Int<kHeadDim>;

    extern __shared__ __align__(128) char smem[];
    const int tid = threadIdx.x;
    // A flat grid (batch and heads can exceed gridDim.y/z limits): the M tiles of one head are
    // adjacent so they share K/V in L2, bottom tiles (most causal keys) first.
    const int num_m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
    const int m_block = num_m_blocks - 1 - int(blockIdx.x % num_m_blocks);
    const int bidh = int(blockIdx.x / num_m_blocks) % p.nheads;
    const int bidb = int(blockIdx.x / num_m_blocks) / p.nheads;
    const int bidh_k = bidh / (p.nheads / p.nheads_k);

    const SeqInfo seq(p, bidb);
    const int row0 = m_block * kBlockM;
    if (row0 >= seq.seqlen_q) return;
    const BandMask mask = seq.mask(p);
    int n_first, n_last;
    mask.key_block_range(row0, kBlockM, kBlockN, n_first, n_last);

    const T* q_ptr = static_cast<const T*>(p.q) + seq.q_offset(p.q_stride, p, bidb, row0, bidh);
    const T* k_ptr = static_cast<const T*>(p.k) + seq.k_offset(p.k_stride, p, 0, bidh_k);
    const T* v_ptr = static_cast<const T*>(p.v) + seq.k_offset(p.v_stride, p, 0, bidh_k);
    T* o_ptr = static_cast<T*>(p.o) + seq.q_offset(p.o_stride, p, bidb, row0, bidh);

    Tensor gQ =
        make_tensor(make_gmem_ptr(q_ptr), Shape<BM, D>{}, make_stride(p.q_stride.row, _1{}));
    Tensor gO =
        make_tensor(make_gmem_ptr(o_ptr), Shape<BM, D>{}, make_stride(p.o_stride.row, _1{}));
    // (BN, D, n_blocks): key tile n at rows [n * BN, (n + 1) * BN).
    Tensor gK = local_tile(make_tensor(make_gmem_ptr(k_ptr), make_shape(n_last * kBlockN, D{}),
                                       make_stride(p.k_stride.row, _1{})),
                           Shape<BN, D>{}, make_coord(_, 0));
    Tensor gV = local_tile(make_tensor(make_gmem_ptr(v_ptr), make_shape(n_last * kBlockN, D{}),
                                       make_stride(p.v_stride.row, _1{})),
                           Shape<BN, D>{}, make_coord(_, 0));

    T* smem_t = reinterpret_cast<T*>(smem);
    Tensor sQ = make_tensor(make_smem_ptr(smem_t), typename K::SmemQ{});
    Tensor sK = make_tensor(sQ.data() + size(sQ), typename K::SmemKV{});
    Tensor sV = make_tensor(sK.data() + size(sK), typename K::SmemKV{});
    Tensor sVt = make_tensor(sV.data(), typename K::SmemVt{});

    typename K::Copies::GmemLoad gload;
    auto gthr = gload.get_thread_slice(tid);
    Tensor tQgQ = gthr.partition_S(gQ);
    Tensor tQsQ = gthr.partition_D(sQ);
    Tensor tQcQ = gthr.partition_S(make_identity_tensor(Shape<BM, D>{}));
    Tensor tKgK = gthr.partition_S(gK);
    Tensor tKsK = gthr.partition_D(sK);
    Tensor tVgV = gthr.partition_S(gV);
    Tensor tVsV = gthr.partition_D(sV);
    Tensor tKVc = gthr.partition_S(make_identity_tensor(Shape<BN, D>{}));
    // Key block n of K (or V, from its tiles, head base and strides) into shared memory. Paged:
    // each row from its own page, so pages of any size and a left pad work alike (a separate
    // path for blocks that lie in one page cost the paged kernel 36-120 more bytes of spills).
    auto load_block = [&](auto const& tXgX, const T* head_base, TensorStrides const& s,
                          auto& tXsX, int n) {
        const int valid = seq.seqlen_k - n * kBlockN;
        if constexpr (!kPaged) {
            load_tile<kBlockN, kHeadDim>(gload, tXgX(_, _, _, n), tXsX, tKVc, valid, p.headdim);
        } else {
            // The block as if its rows were contiguous from page 0, each row then moved to its
            // page: only rows inside the sequence read the table.
            Tensor g = make_tensor(make_gmem_ptr(head_base), Shape<BN, D>{},
                                   make_stride(s.row, _1{}));
            Tensor tXgX_rows = gthr.partition_S(g);
            CUTE_UNROLL
            for (int m = 0; m < size<1>(tXsX); ++m) {
                const int row = get<0>(tKVc(0, m, 0));
                const bool row_ok = row < valid;
                const index_t shift =
                    row_ok ? seq.page_offset(s, p, n * kBlockN + row) - index_t(row) * s.row : 0;
                CUTE_UNROLL
                for (int k = 0; k < size<2>(tXsX); ++k) {
                    if (row_ok && get<1>(tKVc(0, m, k)) < p.headdim) {
                        Tensor src = make_tensor(tXgX_rows(_, m, k).data() + shift,
                                                 tXgX_rows(_, m, k).layout());
                        copy(gload, src, tXsX(_, m, k));
                    } else {
                        clear(tXsX(_, m, k));
                    }
                }
            }
        }
    };
    auto load_keys = [&](int n) { load_block(tKgK, k_ptr, p.k_stride, tKsK, n); };
    auto load_values = [&](int n) { load_block(tVgV, v_ptr, p.v_stride, tVsV, n); };

    typename K::TiledMma mma;
    auto thr_mma = mma.get_thread_slice(tid);
    Tensor rQ = thr_mma.partition_fragment_A(sQ);
    Tensor rK = thr_mma.partition_fragment_B(sK);
    Tensor rVt = thr_mma.partition_fragment_B(sVt);
    Tensor acc_o = partition_fragment_C(mma, Shape<BM, D>{});
    clear(acc_o);

    auto copy_q = make_tiled_copy_A(typename K::Copies::LdsmN{}, mma);
    auto copy_k = make_tiled_copy_B(typename K::Copies::LdsmN{}, mma);
    auto copy_v = make_tiled_copy_B(typename K::Copies::LdsmT{}, mma);
    Tensor sQ_part = copy_q.get_thread_slice(tid).partition_S(sQ);
    Tensor sK_part = copy_k.get_thread_slice(tid).partition_S(sK);
    Tensor sVt_part = copy_v.get_thread_slice(tid).partition_S(sVt);

    // Tile-local (row, col) of every score this thread holds, as a (rows, cols) view.
    Tensor cS = thr_mma.partition_C(make_identity_tensor(Shape<BM, BN>{}));
    Tensor cS_rc = make_tensor(cS.data(), acc_as_rows_cols(cS.layout()));

    const int rows_left = seq.seqlen_q - row0;
    load_tile<kBlockM, kHeadDim>(gload, tQgQ, tQsQ, tQcQ, rows_left, p.headdim);
    if (n_last > n_first) load_keys(n_last - 1);
    cp_async_fence();

    Tensor o_rc = make_tensor(acc_o.data(), acc_as_rows_cols(acc_o.layout()));
    constexpr int kRows = decltype(size<0>(o_rc))::value;
    OnlineSoftmax<kRows> softmax;

    const bool softcap = p.softcap > 0.f;
    // One key tile. The general variant (mask or softcap) is a separate instantiation, so the
    // per-element mask and tanh code neither adds register pressure to the plain tiles nor
    // spends their issue slots as predicated-off instructions.
    auto step = [&](int n, auto general) CUTLASS_LAMBDA_FUNC_INLINE {
        Tensor acc_s = partition_fragment_C(mma, Shape<BM, BN>{});
        clear(acc_s);
        cp_async_wait<0>();
        __syncthreads();  // K(n) has landed and every warp is done reading V(n + 1)
        load_values(n);
        cp_async_fence();

        gemm_smem(mma, acc_s, rQ, rK, sQ_part, sK_part, copy_q, copy_k);
        Tensor s_rc = make_tensor(acc_s.data(), acc_as_rows_cols(acc_s.layout()));
        if constexpr (decltype(general)::value) {
            if (softcap) apply_softcap(acc_s, p.softcap_prescale);
        }
        if constexpr (kExtras) {
            if (p.alibi_slopes != nullptr) {
                apply_alibi(s_rc, cS_rc, seq.alibi(p, bidb, bidh), row0, n * kBlockN);
            }
        }
        if constexpr (decltype(general)::value) apply_mask(s_rc, cS_rc, mask, row0, n * kBlockN);

        cp_async_wait<0>();
        __syncthreads();  // V(n) has landed and every warp is done reading K(n)
        if (n > n_first) {
            load_keys(n - 1);
            cp_async_fence();
        }

        softmax.update(s_rc, o_rc, p.scale_log2);
        if constexpr (kExtras) {
            // Dropped probabilities leave P V but not the row sums; 1 / (1 - p) scales O at the
            // end.
            if (p.rng_state != nullptr) {
                constexpr int kCols = decltype(size<1>(s_rc))::value;
                uint32_t kept[(kRows * kCols + 31) / 32];
                dropout_keep_bits(cS_rc, DropoutRng(p, bidb, bidh), row0, n * kBlockN, kept);
                CUTE_UNROLL
                for (int r = 0; r < kRows; ++r) {
                    CUTE_UNROLL
                    for (int c = 0; c < kCols; ++c) {
                        if (!dropout_kept(kept, r * kCols + c)) s_rc(r, c) = 0.f;
                    }
                }
            }
        }
        Tensor rP = convert_fragment<T>(acc_s);
        Tensor rP_a = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
        gemm_reg_smem(mma, acc_o, rP_a, rVt, sVt_part, copy_v);
    };

    // Key tiles run from the last to the first so the masked diagonal tiles come first.
    for (int n = n_last - 1; n >= n_first; --n) {
        if (softcap || mask.tile_needs_mask(row0, kBlockM, n * kBlockN, kBlockN)) {
            step(n, cute::true_type{});
        } else {
            step(n, cute::false_type{});
        }
    }

    float lse[kRows];
    softmax.finalize(o_rc, p.scale_log2, lse);
    if constexpr (kExtras) {
        if (p.rng_state != nullptr) {
            CUTE_UNROLL
            for (int i = 0; i < size(o_rc); ++i) o_rc(i) *= p.dropout_scale;
        }
    }
    if (p.sink != nullptr) {
        const float sink = p.sink[bidh];
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) join_sink(o_rc(r, _), lse[r], sink);
    }

    // Epilogue: O through shared memory (reusing Q's tile) for 16-byte coalesced stores.
    Tensor rO = convert_fragment<T>(acc_o);
    cp_async_wait<0>();  // when no key tile ran, the Q load may still be landing in sQ
    __syncthreads();     // and no warp still reads sQ
    Tensor sO = make_tensor(sQ.data(), typename K::SmemQ{});
    auto copy_c = make_tiled_copy_C(typename K::Copies::StoreC{}, mma);
    auto cthr = copy_c.get_thread_slice(tid);
    copy(copy_c, cthr.retile_S(rO), cthr.partition_D(sO));
    __syncthreads();

    typename K::Copies::GmemStore gstore;
    auto sthr = gstore.get_thread_slice(tid);
    Tensor tOsO = sthr.partition_S(sO);
    Tensor tOgO = sthr.partition_D(gO);
    Tensor tOcO = sthr.partition_S(make_identity_tensor(Shape<BM, D>{}));
    store_tile(gstore, tOsO, tOgO, tOcO, rows_left, p.headdim);

    Tensor cO = thr_mma.partition_C(make_identity_tensor(Shape<BM, D>{}));
    Tensor cO_rc = make_tensor(cO.data(), acc_as_rows_cols(cO.layout()));
    float* lse_ptr = p.lse + seq.lse_offset(p, bidb, bidh) + row0;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(cO_rc(r, 0));
        if (get<1>(cO_rc(r, 0)) == 0 && row < rows_left) lse_ptr[row] = lse[r];
    }
}

template <class T, int kHeadDim>
void run_fwd_sm80(FwdParams& p, cudaStream_t stream) {
    using K = Sm80Fwd<T, kHeadDim>;
    const bool extras = p.alibi_slopes != nullptr || p.rng_state != nullptr;
    auto kernel = p.block_table == nullptr
                      ? (extras ? flash_fwd_sm80_kernel<T, kHeadDim, true, false>
                                : flash_fwd_sm80_kernel<T, kHeadDim, false, false>)
                      : (extras ? flash_fwd_sm80_kernel<T, kHeadDim, true, true>
                                : flash_fwd_sm80_kernel<T, kHeadDim, false, true>);
    if (K::kSmemBytes >= 48 * 1024) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes);
    }
    const int num_m_blocks = (p.seqlen_q + K::kBlockM - 1) / K::kBlockM;
    dim3 grid(unsigned(num_m_blocks) * p.batch * p.nheads);
    kernel<<<grid, K::kThreads, K::kSmemBytes, stream>>>(p);
}

}  // namespace flash
