// SM80 backward, three launches:
//   1. row_dot:  softmax_d = rowsum(dO * O) per query row (fp32).
//   2. main:     one CTA per (key tile, batch, head) keeps K, V and the dK, dV accumulators, and
//                walks the query tiles that can see its keys; dQ partials go to an fp32 buffer
//                with atomics.
//   3. dq_write: dQ = softmax_scale * dq_accum, cast to the input dtype.
#pragma once

#include <cutlass/numeric_types.h>

#include <cute/tensor.hpp>

#include "common/bwd_rows.h"
#include "common/dq_turns.h"
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
struct Sm80Bwd {
    static constexpr Sm80BwdTile kTile = sm80_bwd_tile(kHeadDim);
    static constexpr int kBlockM = kTile.block_m;
    static constexpr int kBlockN = kTile.block_n;
    static constexpr int kWarps = kTile.warps;
    static constexpr int kThreads = kWarps * 32;

    // One warp layout per GEMM shape (see tile_size.h); N of each MMA tile is 16 per warp so
    // one ldmatrix.x4 feeds two 16x8 MMAs.
    template <int kWarpsM>
    using Mma = TiledMMA<Sm80MmaAtom<T>, Layout<Shape<Int<kWarpsM>, Int<kWarps / kWarpsM>, _1>>,
                         Tile<Int<16 * kWarpsM>, Int<16 * (kWarps / kWarpsM)>, _16>>;
    using MmaSdP = Mma<kTile.sdp_warps_m>;  // S = Q K^T, dP = dO V^T    (block_m x block_n)
    using MmaKV = Mma<kTile.dkv_warps_n>;   // dV += P^T dO, dK += dS^T Q (block_n x d)
    using MmaQ = Mma<kTile.dq_warps_m>;     // dQ = dS K                  (block_m x d)
    using Copies = Sm80Copies<T, kHeadDim, kThreads>;
    using SmemQ = SmemTile<kBlockM, kHeadDim>;  // also dO
    using SmemKV = SmemTile<kBlockN, kHeadDim>;
    using SmemP = SmemTile<kBlockM, kBlockN>;  // also dS
    using SmemQt = TransposedTile<SmemQ>;
    using SmemKt = TransposedTile<SmemKV>;
    using SmemPt = TransposedTile<SmemP>;

    static constexpr int kSmemBytes =
        (2 * kBlockM * kHeadDim + 2 * kBlockN * kHeadDim + 2 * kBlockM * kBlockN) * sizeof(T);
    static_assert(kWarps == 8 && kBlockM % 64 == 0 && kBlockN % 64 == 0);
};

// Calls fn(seq, bidb, bidh, row, lane) once per query row of this CTA, a warp per row.
template <class Fn>
__forceinline__ __device__ void for_each_row(const BwdParams& p, Fn&& fn) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int row_blocks = (p.seqlen_q + kRowKernelRows - 1) / kRowKernelRows;
    const int row_block = int(blockIdx.x % row_blocks);
    const int bidh = int(blockIdx.x / row_blocks) % p.nheads;
    const int bidb = int(blockIdx.x / row_blocks) / p.nheads;
    const SeqInfo seq(p, bidb);
    const int row_end = min(seq.seqlen_q, (row_block + 1) * kRowKernelRows);
    for (int row = row_block * kRowKernelRows + warp; row < row_end; row += blockDim.x / 32) {
        fn(seq, bidb, bidh, row, lane);
    }
}

// softmax_d[row] = rowsum(dO * O) in lse's layout (the SM80 backward's first launch).
template <class T, int kHeadDim>
__global__ void flash_bwd_row_dot_kernel(const __grid_constant__ BwdParams p) {
    for_each_row(p, [&](const SeqInfo& seq, int bidb, int bidh, int row, int lane) {
        const float d = row_dot<T>(p, seq, bidb, bidh, row, lane);
        if (lane == 0) p.softmax_d[seq.lse_offset(p, bidb, bidh) + row] = d;
    });
}

// dq[row, c] = softmax_scale * dq_accum[row, c]; 8 columns per lane.
template <class T, int kHeadDim>
__global__ void flash_bwd_dq_write_kernel(const __grid_constant__ BwdParams p) {
    for_each_row(p, [&](const SeqInfo& seq, int bidb, int bidh, int row, int lane) {
        const float* acc = p.dq_accum + (seq.lse_offset(p, bidb, bidh) + row) * kHeadDim;
        T* dq = static_cast<T*>(p.dq) + seq.q_offset(p.dq_stride, p, bidb, row, bidh);
        for (int c = lane * 8; c < p.headdim; c += 32 * 8) {
            const float4 a = *reinterpret_cast<const float4*>(acc + c);
            const float4 b = *reinterpret_cast<const float4*>(acc + c + 4);
            T out[8] = {T(a.x * p.softmax_scale), T(a.y * p.softmax_scale),
                        T(a.z * p.softmax_scale), T(a.w * p.softmax_scale),
                        T(b.x * p.softmax_scale), T(b.y * p.softmax_scale),
                        T(b.z * p.softmax_scale), T(b.w * p.softmax_scale)};
            *reinterpret_cast<uint4*>(dq + c) = *reinterpret_cast<const uint4*>(out);
        }
    });
}

// The backward's instantiations: the plain kernel, kDeterministic (the dQ turns of
// deterministic=True) and kExtras (ALiBi and dropout, with or without the turns; its bias is 0
// without ALiBi). Each extra in the plain kernel would cost it: a run-time ALiBi flag 2-6%,
// the turns raised its spills from 32 to 132 bytes at d=128. Deterministic runs without ALiBi
// or dropout have a kernel of their own: on the kExtras kernel (whose code alone, with ALiBi,
// cost 20-23%) they ran at 0.62-0.69 of the default, on their own at 0.67-0.76 (d = 64 and
// 128, 4k and 16k, H200, 2026-11-28).
enum class Sm80BwdKind { kPlain, kDeterministic, kExtras };

template <class T, int kHeadDim, Sm80BwdKind kKind>
__global__ void __launch_bounds__(Sm80Bwd<T, kHeadDim>::kThreads, 1)
    flash_bwd_sm80_kernel(const __grid_constant__ BwdParams p) {
    using K = Sm80Bwd<T, kHeadDim>;
    constexpr bool kExtras = kKind == Sm80BwdKind::kExtras;
    constexpr bool kTurns = kKind != Sm80BwdKind::kPlain;
    constexpr int kBlockM = K::kBlockM;
    constexpr int kBlockN = K::kBlockN;
    using BM = Int<kBlockM>;
    using BN = Int<kBlockN>;
    using D = Int<kHeadDim>;

    extern __shared__ __align__(128) char smem[];
    const int tid = threadIdx.x;
    // Flat grid; low key tiles see the most causal rows, so they launch first (in deterministic
    // mode the highest first: key_tile_of_launch).
    const int num_n_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
    const int n_block = key_tile_of_launch(int(blockIdx.x % num_n_blocks), num_n_blocks,
                                           kTurns && p.deterministic);
    const int bidh = int(blockIdx.x / num_n_blocks) % p.nheads;
    const int bidb = int(blockIdx.x / num_n_blocks) / p.nheads;
    const int bidh_k = bidh / (p.nheads / p.nheads_k);

    const SeqInfo seq(p, bidb);
    const int col0 = n_block * kBlockN;
    if (col0 >= seq.seqlen_k) return;
    const BandMask mask = seq.mask(p);
    const DqTurns<kBlockM, kBlockN> turns(kTurns ? p.dq_turns : nullptr,
                                          (p.seqlen_q + kBlockM - 1) / kBlockM, p.nheads, bidb,
                                          bidh);
    const int n_end = (seq.seqlen_k + kBlockN - 1) / kBlockN;
    int m_first, m_last;
    mask.query_block_range(col0, kBlockN, kBlockM, m_first, m_last);
    const int cols_left = seq.seqlen_k - col0;

    const T* q_ptr = static_cast<const T*>(p.q) + seq.q_offset(p.q_stride, p, bidb, 0, bidh);
    const T* do_ptr = static_cast<const T*>(p.dout) + seq.q_offset(p.do_stride, p, bidb, 0, bidh);
    const T* k_ptr = static_cast<const T*>(p.k) + seq.k_offset(p.k_stride, p, col0, bidh_k);
    const T* v_ptr = static_cast<const T*>(p.v) + seq.k_offset(p.v_stride, p, col0, bidh_k);
    T* dk_ptr = static_cast<T*>(p.dk) + seq.k_offset(p.dk_stride, p, col0, bidh);
    T* dv_ptr = static_cast<T*>(p.dv) + seq.k_offset(p.dv_stride, p, col0, bidh);
    const float* lse_ptr = p.lse + seq.lse_offset(p, bidb, bidh);
    const float* d_ptr = p.softmax_d + seq.lse_offset(p, bidb, bidh);
    float* dq_acc_ptr = p.dq_accum + seq.lse_offset(p, bidb, bidh) * kHeadDim;

    // (BM, D, m_blocks) views of Q and dO; (BN, D) tiles of K, V, dK, dV.
    Tensor gQ = local_tile(make_tensor(make_gmem_ptr(q_ptr), make_shape(m_last * kBlockM, D{}),
                                       make_stride(p.q_stride.row, _1{})),
                           Shape<BM, D>{}, make_coord(_, 0));
    Tensor gdO = local_tile(make_tensor(make_gmem_ptr(do_ptr), make_shape(m_last * kBlockM, D{}),
                                        make_stride(p.do_stride.row, _1{})),
                            Shape<BM, D>{}, make_coord(_, 0));
    Tensor gK =
        make_tensor(make_gmem_ptr(k_ptr), Shape<BN, D>{}, make_stride(p.k_stride.row, _1{}));
    Tensor gV =
        make_tensor(make_gmem_ptr(v_ptr), Shape<BN, D>{}, make_stride(p.v_stride.row, _1{}));
    Tensor gdK =
        make_tensor(make_gmem_ptr(dk_ptr), Shape<BN, D>{}, make_stride(p.dk_stride.row, _1{}));
    Tensor gdV =
        make_tensor(make_gmem_ptr(dv_ptr), Shape<BN, D>{}, make_stride(p.dv_stride.row, _1{}));

    T* smem_t = reinterpret_cast<T*>(smem);
    Tensor sQ = make_tensor(make_smem_ptr(smem_t), typename K::SmemQ{});
    Tensor sdO = make_tensor(sQ.data() + size(sQ), typename K::SmemQ{});
    Tensor sK = make_tensor(sdO.data() + size(sdO), typename K::SmemKV{});
    Tensor sV = make_tensor(sK.data() + size(sK), typename K::SmemKV{});
    Tensor sP = make_tensor(sV.data() + size(sV), typename K::SmemP{});
    Tensor sdS = make_tensor(sP.data() + size(sP), typename K::SmemP{});
    Tensor sQt = make_tensor(sQ.data(), typename K::SmemQt{});
    Tensor sdOt = make_tensor(sdO.data(), typename K::SmemQt{});
    Tensor sKt = make_tensor(sK.data(), typename K::SmemKt{});
    Tensor sPt = make_tensor(sP.data(), typename K::SmemPt{});
    Tensor sdSt = make_tensor(sdS.data(), typename K::SmemPt{});

    typename K::Copies::GmemLoad gload;
    auto gthr = gload.get_thread_slice(tid);
    Tensor tQgQ = gthr.partition_S(gQ);
    Tensor tQsQ = gthr.partition_D(sQ);
    Tensor tdOgdO = gthr.partition_S(gdO);
    Tensor tdOsdO = gthr.partition_D(sdO);
    Tensor tQc = gthr.partition_S(make_identity_tensor(Shape<BM, D>{}));
    Tensor tKgK = gthr.partition_S(gK);
    Tensor tKsK = gthr.partition_D(sK);
    Tensor tVgV = gthr.partition_S(gV);
    Tensor tVsV = gthr.partition_D(sV);
    Tensor tKc = gthr.partition_S(make_identity_tensor(Shape<BN, D>{}));

    typename K::MmaSdP mma_sdp;
    typename K::MmaKV mma_kv;
    typename K::MmaQ mma_q;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    auto thr_kv = mma_kv.get_thread_slice(tid);
    auto thr_q = mma_q.get_thread_slice(tid);
    auto ldsm_sdp_a = make_tiled_copy_A(typename K::Copies::LdsmN{}, mma_sdp);
    auto ldsm_sdp_b = make_tiled_copy_B(typename K::Copies::LdsmN{}, mma_sdp);
    auto ldsm_kv_a = make_tiled_copy_A(typename K::Copies::LdsmT{}, mma_kv);
    auto ldsm_kv_b = make_tiled_copy_B(typename K::Copies::LdsmT{}, mma_kv);
    auto ldsm_q_a = make_tiled_copy_A(typename K::Copies::LdsmN{}, mma_q);
    auto ldsm_q_b = make_tiled_copy_B(typename K::Copies::LdsmT{}, mma_q);
    Tensor sQ_a = ldsm_sdp_a.get_thread_slice(tid).partition_S(sQ);
    Tensor sdO_a = ldsm_sdp_a.get_thread_slice(tid).partition_S(sdO);
    Tensor sK_b = ldsm_sdp_b.get_thread_slice(tid).partition_S(sK);
    Tensor sV_b = ldsm_sdp_b.get_thread_slice(tid).partition_S(sV);
    Tensor sPt_a = ldsm_kv_a.get_thread_slice(tid).partition_S(sPt);
    Tensor sdSt_a = ldsm_kv_a.get_thread_slice(tid).partition_S(sdSt);
    Tensor sdOt_b = ldsm_kv_b.get_thread_slice(tid).partition_S(sdOt);
    Tensor sQt_b = ldsm_kv_b.get_thread_slice(tid).partition_S(sQt);
    Tensor sdS_a = ldsm_q_a.get_thread_slice(tid).partition_S(sdS);
    Tensor sKt_b = ldsm_q_b.get_thread_slice(tid).partition_S(sKt);

    auto store_sdp = make_tiled_copy_C(typename K::Copies::StoreC{}, mma_sdp);
    auto sdp_thr = store_sdp.get_thread_slice(tid);
    Tensor tPsP = sdp_thr.partition_D(sP);
    Tensor tdSsdS = sdp_thr.partition_D(sdS);

    Tensor acc_dk = partition_fragment_C(mma_kv, Shape<BN, D>{});
    Tensor acc_dv = partition_fragment_C(mma_kv, Shape<BN, D>{});
    clear(acc_dk);
    clear(acc_dv);

    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<BM, BN>{}));
    Tensor cS_rc = make_tensor(cS.data(), acc_as_rows_cols(cS.layout()));
    Tensor cdQ = thr_q.partition_C(make_identity_tensor(Shape<BM, D>{}));

    load_tile<kBlockN, kHeadDim>(gload, tKgK, tKsK, tKc, cols_left, p.headdim);
    load_tile<kBlockN, kHeadDim>(gload, tVgV, tVsV, tKc, cols_left, p.headdim);
    if (m_first < m_last) {
        const int rows = seq.seqlen_q - m_first * kBlockM;
        load_tile<kBlockM, kHeadDim>(gload, tQgQ(_, _, _, m_first), tQsQ, tQc, rows, p.headdim);
        load_tile<kBlockM, kHeadDim>(gload, tdOgdO(_, _, _, m_first), tdOsdO, tQc, rows, p.headdim);
    }
    cp_async_fence();

    const bool softcap = p.softcap > 0.f;
    constexpr float kLog2e = 1.4426950408889634f;
    // One query tile. The general variant (mask or softcap) is a separate instantiation: folded
    // into one body, the compiler predicates the mask and tanh code instead of branching over
    // it, and every tile pays its issue slots (SASS: 30% of the loop's instructions).
    auto step = [&](int m, auto general) CUTLASS_LAMBDA_FUNC_INLINE {
        constexpr bool kGeneral = decltype(general)::value;
        const int row0 = m * kBlockM;
        const int rows_left = seq.seqlen_q - row0;
        // deterministic: this tile's turn among those adding to query tile m's dQ. Found here,
        // where fewer registers are live than at the addition.
        const int rank = turns.enabled() ? turns.rank(mask, m, n_block, n_end) : 0;

        Tensor acc_s = partition_fragment_C(mma_sdp, Shape<BM, BN>{});
        Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<BM, BN>{});
        Tensor s_rc = make_tensor(acc_s.data(), acc_as_rows_cols(acc_s.layout()));
        Tensor dp_rc = make_tensor(acc_dp.data(), acc_as_rows_cols(acc_dp.layout()));
        constexpr int kRows = decltype(size<0>(s_rc))::value;
        float lse_log2[kRows], row_d[kRows];
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            const int row = get<0>(cS_rc(r, 0));
            // Rows past the sequence get lse = +inf: P = 0 there, so they contribute nothing.
            lse_log2[r] = row < rows_left ? lse_ptr[row0 + row] * kLog2e : INFINITY;
            row_d[r] = row < rows_left ? d_ptr[row0 + row] : 0.f;
        }

        cp_async_wait<0>();
        __syncthreads();  // Q(m), dO(m) (and K, V) have landed
        clear(acc_s);
        clear(acc_dp);
        {
            Tensor rA = thr_sdp.partition_fragment_A(sQ);
            Tensor rB = thr_sdp.partition_fragment_B(sK);
            gemm_smem(mma_sdp, acc_s, rA, rB, sQ_a, sK_b, ldsm_sdp_a, ldsm_sdp_b);
        }
        {
            Tensor rA = thr_sdp.partition_fragment_A(sdO);
            Tensor rB = thr_sdp.partition_fragment_B(sV);
            gemm_smem(mma_sdp, acc_dp, rA, rB, sdO_a, sV_b, ldsm_sdp_a, ldsm_sdp_b);
        }
        [[maybe_unused]] AlibiBias bias{};
        if constexpr (kGeneral) {
            if (softcap) apply_softcap(acc_s, p.softcap_prescale);
            apply_mask(s_rc, cS_rc, mask, row0, col0);
        }
        constexpr int kCols = decltype(size<1>(s_rc))::value;
        [[maybe_unused]] uint32_t kept[(kRows * kCols + 31) / 32];
        [[maybe_unused]] const bool dropout = kExtras && p.rng_state != nullptr;
        if constexpr (kExtras) {
            if (p.alibi_slopes != nullptr) bias = seq.alibi(p, bidb, bidh);
            if (dropout) dropout_keep_bits(cS_rc, DropoutRng(p, bidb, bidh), row0, col0, kept);
        }
        [[maybe_unused]] const AlibiDistance<true, decltype(cS_rc)> distance(cS_rc, bias, row0,
                                                                             col0);
        // P = exp(s - lse); dS = P * (dP - D), times d tanh / d x = 1 - t^2 under softcap (t
        // without ALiBi's bias, a constant of the score). Under dropout (mask Z, kept entries
        // scaled by 1 / (1 - p)): dV takes P * Z, and dP = dO V^T reaches the scores through Z
        // too, dS = P * (dP * Z - D); D = rowsum(dO * O) already holds the dropped output.
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            CUTE_UNROLL
            for (int c = 0; c < kCols; ++c) {
                const float t = s_rc(r, c);
                float x = t;
                if constexpr (kExtras) x += bias.at(distance(r, c));
                const float prob = exp2f(x * p.scale_log2 - lse_log2[r]);
                float z = 1.f;
                if constexpr (kExtras) {
                    if (dropout) z = dropout_kept(kept, r * kCols + c) ? p.dropout_scale : 0.f;
                }
                s_rc(r, c) = prob * z;
                dp_rc(r, c) = prob * (dp_rc(r, c) * z - row_d[r]);
                if constexpr (kGeneral) {
                    if (softcap) dp_rc(r, c) *= fmaxf(1.f - t * t, 0.f);
                }
            }
        }
        copy(store_sdp, sdp_thr.retile_S(convert_fragment<T>(acc_s)), tPsP);
        copy(store_sdp, sdp_thr.retile_S(convert_fragment<T>(acc_dp)), tdSsdS);
        __syncthreads();  // P and dS are in shared memory

        {
            Tensor rA = thr_kv.partition_fragment_A(sPt);
            Tensor rB = thr_kv.partition_fragment_B(sdOt);
            gemm_smem(mma_kv, acc_dv, rA, rB, sPt_a, sdOt_b, ldsm_kv_a, ldsm_kv_b);
        }
        {
            Tensor rA = thr_kv.partition_fragment_A(sdSt);
            Tensor rB = thr_kv.partition_fragment_B(sQt);
            gemm_smem(mma_kv, acc_dk, rA, rB, sdSt_a, sQt_b, ldsm_kv_a, ldsm_kv_b);
        }
        __syncthreads();  // nobody reads Q(m) or dO(m) any more: prefetch the next tile
        if (m + 1 < m_last) {
            const int rows = seq.seqlen_q - (m + 1) * kBlockM;
            load_tile<kBlockM, kHeadDim>(gload, tQgQ(_, _, _, m + 1), tQsQ, tQc, rows, p.headdim);
            load_tile<kBlockM, kHeadDim>(gload, tdOgdO(_, _, _, m + 1), tdOsdO, tQc, rows,
                                         p.headdim);
        }
        cp_async_fence();

        Tensor acc_dq = partition_fragment_C(mma_q, Shape<BM, D>{});
        clear(acc_dq);
        {
            Tensor rA = thr_q.partition_fragment_A(sdS);
            Tensor rB = thr_q.partition_fragment_B(sKt);
            gemm_smem(mma_q, acc_dq, rA, rB, sdS_a, sKt_b, ldsm_q_a, ldsm_q_b);
        }
        // Rows kHeadDim floats apart: every address is one pointer plus a constant.
        Tensor gdQacc = make_tensor(make_gmem_ptr(dq_acc_ptr + index_t(row0) * kHeadDim),
                                    Shape<BM, D>{}, Stride<D, _1>{});
        Tensor tdQg = thr_q.partition_C(gdQacc);
        // deterministic: one key tile at a time adds to the tile, each address once per tile.
        if (turns.enabled()) {
            if (tid == 0) turns.wait(m, rank);
            __syncthreads();
        }
        atomic_add_fragment(acc_dq, tdQg, cdQ, rows_left, p.headdim,
                            rows_left >= kBlockM && p.headdim == kHeadDim);
        // The barrier puts every thread's additions before thread 0's fence, which then orders
        // them all before the pass (cumulativity); a fence in every thread held every warp
        // until its own additions completed (1.03-1.05x without, H100, d = 128, 4k/16k).
        if (turns.enabled()) {
            __syncthreads();
            if (tid == 0) {
                fence_acq_rel_gpu();
                turns.pass(m, rank);
            }
        }
    };

    for (int m = m_first; m < m_last; ++m) {
        if (softcap || mask.tile_needs_mask(m * kBlockM, kBlockM, col0, kBlockN)) {
            step(m, cute::true_type{});
        } else {
            step(m, cute::false_type{});
        }
    }

    // Epilogue: dK (times the softmax scale, the d score / d x factor) and dV through shared
    // memory, reusing the K and V tiles.
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.softmax_scale;
    Tensor rdK = convert_fragment<T>(acc_dk);
    Tensor rdV = convert_fragment<T>(acc_dv);
    cp_async_wait<0>();
    __syncthreads();  // last dQ GEMM is done reading K
    auto store_kv = make_tiled_copy_C(typename K::Copies::StoreC{}, mma_kv);
    auto kv_thr = store_kv.get_thread_slice(tid);
    copy(store_kv, kv_thr.retile_S(rdK), kv_thr.partition_D(sK));
    copy(store_kv, kv_thr.retile_S(rdV), kv_thr.partition_D(sV));
    __syncthreads();
    typename K::Copies::GmemStore gstore;
    auto sthr = gstore.get_thread_slice(tid);
    Tensor tKc_out = sthr.partition_S(make_identity_tensor(Shape<BN, D>{}));
    Tensor tdKs = sthr.partition_S(sK);
    Tensor tdKg = sthr.partition_D(gdK);
    Tensor tdVs = sthr.partition_S(sV);
    Tensor tdVg = sthr.partition_D(gdV);
    store_tile(gstore, tdKs, tdKg, tKc_out, cols_left, p.headdim);
    store_tile(gstore, tdVs, tdVg, tKc_out, cols_left, p.headdim);
}

template <class T, int kHeadDim>
void run_bwd_sm80(BwdParams& p, cudaStream_t stream) {
    using K = Sm80Bwd<T, kHeadDim>;
    dim3 row_grid(unsigned((p.seqlen_q + kRowKernelRows - 1) / kRowKernelRows) * p.batch *
                  p.nheads);
    flash_bwd_row_dot_kernel<T, kHeadDim><<<row_grid, 256, 0, stream>>>(p);

    auto kernel = p.alibi_slopes != nullptr || p.rng_state != nullptr
                      ? flash_bwd_sm80_kernel<T, kHeadDim, Sm80BwdKind::kExtras>
                  : p.deterministic
                      ? flash_bwd_sm80_kernel<T, kHeadDim, Sm80BwdKind::kDeterministic>
                      : flash_bwd_sm80_kernel<T, kHeadDim, Sm80BwdKind::kPlain>;
    if (K::kSmemBytes >= 48 * 1024) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes);
    }
    if (p.deterministic) {
        const int64_t turns =
            int64_t((p.seqlen_q + K::kBlockM - 1) / K::kBlockM) * p.nheads * p.batch;
        p.dq_turns = static_cast<int*>(
            p.workspace.allocate(p.workspace.context, turns * int64_t(sizeof(int))));
        cudaMemsetAsync(p.dq_turns, 0, turns * sizeof(int), stream);
    }
    dim3 grid(unsigned((p.seqlen_k + K::kBlockN - 1) / K::kBlockN) * p.batch * p.nheads);
    kernel<<<grid, K::kThreads, K::kSmemBytes, stream>>>(p);

    flash_bwd_dq_write_kernel<T, kHeadDim><<<row_grid, 256, 0, stream>>>(p);
}

}  // namespace flash
