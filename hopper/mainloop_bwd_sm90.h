// Mainloop of the SM90 backward for one block_n-row K/V tile of one (batch, head).
//   Producer (one warp): K and V once, by TMA; then for every query tile that sees the keys, Q
//   with its log2 LSE and dO with its rowsum(dO * O), each into its own pipeline of stages.
//   Consumers (a warp group per 64 key rows; on the wide tile, d = 160-256, each group a block
//   of d's columns of the same 64 rows): S^T = K Q^T and dP^T = V dO^T, the score policy
//   (softcap, ALiBi, mask), P^T and dS^T, dV += P^T dO and dK += dS^T Q (from registers; on the
//   wide tile from shared memory), and dQ = dS K with dS from shared memory; each tile's dQ
//   goes back to shared memory.
//   dQ warp: adds each group's block of a tile's dQ to the fp32 accumulator with a bulk
//   reduction.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cute/tensor.hpp>

#include "bwd_traits_sm90.h"
#include "common/dq_turns.h"
#include "common/fragment.h"
#include "common/score.h"
#include "common/seq_info.h"
#include "sm90_utils.h"
#include "tma_views.h"

namespace flash {

// The key tile of one CTA and the query tiles [m_first, m_last) that see it.
struct Sm90BwdGeometry {
    int n0;       // first key row of the tile
    int keys;     // rows of the tile inside the sequence
    int m_first, m_last;

    __device__ bool has_queries() const { return m_last > m_first; }
};

template <class Traits>
struct Sm90BwdMainloop {
    using T = typename Traits::Element;
    static constexpr int kBlockM = Traits::kBlockM;
    static constexpr int kBlockN = Traits::kBlockN;
    using BM = typename Traits::BM;
    using BN = typename Traits::BN;
    using D = typename Traits::D;
    using Args = Sm90BwdArgs<Traits>;
    using SharedStorage = typename Traits::SharedStorage;
    using PipeState = typename Traits::PipeState;

    static __device__ Sm90BwdGeometry geometry(BwdParams const& p, SeqInfo const& seq,
                                               int n_block) {
        Sm90BwdGeometry g;
        g.n0 = n_block * kBlockN;
        g.keys = min(kBlockN, seq.seqlen_k - g.n0);
        seq.mask(p).query_block_range(g.n0, kBlockN, kBlockM, g.m_first, g.m_last);
        return g;
    }

    // ---------------------------------------------------------------- producer ----

    // Run by one whole warp; lane 0 issues the copies.
    static __device__ void load(Args const& a, SharedStorage& ss, typename Traits::QPipe& q_pipe,
                                typename Traits::DoPipe& do_pipe, PipeState& q_state,
                                PipeState& do_state, SeqInfo const& seq, int bidb, int bidh,
                                Sm90BwdGeometry const& g) {
        BwdParams const& p = a.p;
        const bool issuer = threadIdx.x % 32 == 0;
        const int bidh_k = bidh / (p.nheads / p.nheads_k);
        const bool varlen = p.is_varlen();

        Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
        Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutK{});
        Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
        Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutQ{});

        const index_t row_k = varlen ? seq.row_k : 0;
        Tensor gK = local_tile(tma_head_view(a.tma_k, a.rows_k, p.headdim, p.nheads_k, a.batch,
                                         bidh_k, bidb, row_k),
                               Shape<BN, D>{}, make_coord(g.n0 / kBlockN, _0{}));
        Tensor gV = local_tile(tma_head_view(a.tma_v, a.rows_k, p.headdim, p.nheads_k, a.batch,
                                         bidh_k, bidb, row_k),
                               Shape<BN, D>{}, make_coord(g.n0 / kBlockN, _0{}));
        const index_t row_q = varlen ? seq.row_q : 0;
        Tensor gQ = local_tile(
            tma_head_view(a.tma_q, a.rows_q, p.headdim, p.nheads, a.batch, bidh, bidb, row_q),
            Shape<BM, D>{}, make_coord(_, _0{}));
        Tensor gdO = local_tile(
            tma_head_view(a.tma_do, a.rows_q, p.headdim, p.nheads, a.batch, bidh, bidb, row_q),
            Shape<BM, D>{}, make_coord(_, _0{}));

        if (issuer) {
            ss.kv_full.arrive_and_expect_tx(Traits::kKVBytes);
            auto tk = tma_partition(a.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                    group_modes<0, 2>(gK));
            auto tv = tma_partition(a.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                    group_modes<0, 2>(gV));
            copy(a.tma_k.with(reinterpret_cast<uint64_t&>(ss.kv_full)), get<0>(tk), get<1>(tk));
            copy(a.tma_v.with(reinterpret_cast<uint64_t&>(ss.kv_full)), get<0>(tv), get<1>(tv));
        }

        auto tq = tma_partition(a.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                group_modes<0, 2>(gQ));
        auto tdo = tma_partition(a.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO),
                                 group_modes<0, 2>(gdO));
        const int64_t rows0 = a.rows.template offset<kBlockM>(p, seq.row_q, bidb, bidh);
        for (int m = g.m_first; m < g.m_last; ++m) {
            const int64_t rows = rows0 + int64_t(m) * kBlockM;
            q_pipe.producer_acquire(q_state);
            if (issuer) {
                auto* bar = q_pipe.producer_get_barrier(q_state);
                copy(a.tma_q.with(*bar), get<0>(tq)(_, m), get<1>(tq)(_, q_state.index()));
                SM90_BULK_COPY_G2S::copy(a.rows.lse_log2 + rows, bar,
                                         ss.lse + q_state.index() * kBlockM, Traits::kRowBytes);
            }
            ++q_state;
            do_pipe.producer_acquire(do_state);
            if (issuer) {
                auto* bar = do_pipe.producer_get_barrier(do_state);
                copy(a.tma_do.with(*bar), get<0>(tdo)(_, m), get<1>(tdo)(_, do_state.index()));
                SM90_BULK_COPY_G2S::copy(a.rows.dsum + rows, bar,
                                         ss.dsum + do_state.index() * kBlockM, Traits::kRowBytes);
            }
            ++do_state;
        }
    }

    // ---------------------------------------------------------------- score policy ----

    // P^T of one S^T tile in place (s_rc), and under softcap dS^T too (dp_rc). s_rc, dp_rc and
    // cS_rc are (rows, cols) views: rows are keys (n0 + row), columns queries (m0 + col).
    template <bool kSoftcap, class TensorRc, class CoordRc>
    static __forceinline__ __device__ void tile_probs(TensorRc& s_rc, TensorRc& dp_rc,
                                                      CoordRc const& cS_rc, BwdParams const& p,
                                                      BandMask const& mask, AlibiBias const& bias,
                                                      const float* lse, const float* dsum, int m0,
                                                      int n0) {
        // P^T = exp2(x * scale_log2 - lse_log2) column by column (a column is a query row),
        // x = t plus ALiBi's bias; masked scores are -inf and padding rows have lse = +inf,
        // so both give P = 0. dS^T = P^T * (dP^T - D) (* (1 - t^2) under softcap). The exp2
        // loop must not test the mask where it can help it: with the test in it, every
        // element is a basic block of its own, ptxas cannot overlap one element's exp2 with
        // the next, and a step timeline showed the loop taking twice as long. So the tiles
        // that need the mask either get a pass of their own that sets masked scores to -inf
        // first (Traits::kMaskPass; -inf stays -inf with ALiBi's bias added), or a copy of
        // the loop with the test. Under softcap the pass cannot work (tanh(-inf) = -1); there
        // with kMaskPass one loop keeps the test, which spills less than two copies.
        const AlibiDistance<false, CoordRc> distance(cS_rc, bias, m0, n0);
        auto probs = [&](auto masked) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(s_rc); ++c) {
                const int col = get<1>(cS_rc(0, c));
                const float lse_c = lse[col];
                [[maybe_unused]] const float d_c = kSoftcap ? dsum[col] : 0.f;
                CUTE_UNROLL
                for (int r = 0; r < size<0>(s_rc); ++r) {
                    const int row = get<0>(cS_rc(r, c));
                    const float t = kSoftcap ? fast_tanh(s_rc(r, c) * p.softcap_prescale)
                                             : s_rc(r, c);
                    float x = t;
                    if constexpr (Traits::kAlibi) x += bias.at(distance(r, c));
                    if (masked && !mask.keep(m0 + col, n0 + row)) x = -INFINITY;
                    const float prob = exp2f(x * p.scale_log2 - lse_c);
                    s_rc(r, c) = prob;
                    if constexpr (kSoftcap) {
                        dp_rc(r, c) = prob * (dp_rc(r, c) - d_c) * fmaxf(1.f - t * t, 0.f);
                    }
                }
            }
        };
        const bool masked = mask.tile_needs_mask(m0, kBlockM, n0, kBlockN);
        if constexpr (Traits::kMaskPass && !kSoftcap) {
            if (masked) apply_mask<true>(s_rc, cS_rc, mask, n0, m0);
            probs(cute::false_type{});
        } else if constexpr (Traits::kMaskPass) {
            probs(masked);
        } else if (masked) {
            probs(cute::true_type{});
        } else {
            probs(cute::false_type{});
        }
    }

    // dS^T = P^T * (dP^T - D) in place (dp_rc), without softcap.
    template <class TensorRc, class CoordRc>
    static __forceinline__ __device__ void tile_grads(TensorRc const& s_rc, TensorRc& dp_rc,
                                                      CoordRc const& cS_rc, const float* dsum) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(dp_rc); ++c) {
            const float d_c = dsum[get<1>(cS_rc(0, c))];
            CUTE_UNROLL
            for (int r = 0; r < size<0>(dp_rc); ++r) {
                dp_rc(r, c) = s_rc(r, c) * (dp_rc(r, c) - d_c);
            }
        }
    }

    // A group's block of a tile's dQ (acc_dq, done; Traits::DqWhole or DqPart) to shared memory
    // for the dQ warp, once the dQ warp has read the block before.
    template <class AccDq>
    static __forceinline__ __device__ void store_dq(AccDq const& acc_dq, SharedStorage& ss,
                                                    int ctid, int group) {
        barrier_sync(dq_empty(group), kDqSyncThreads);
        float4* dq = reinterpret_cast<float4*>(ss.dq);
        static_assert(decltype(size(acc_dq))::value % 4 == 0);
        CUTE_UNROLL
        for (int j = 0; j < size(acc_dq) / 4; ++j) {
            dq[Traits::dq_float4_index(j, ctid)] =
                make_float4(acc_dq(4 * j), acc_dq(4 * j + 1), acc_dq(4 * j + 2), acc_dq(4 * j + 3));
        }
        cutlass::arch::fence_view_async_shared();
        barrier_arrive(dq_full(group), kDqSyncThreads);
    }

    // ---------------------------------------------------------------- consumer ----

    // Runs the tile's query loop for this consumer warp group: acc_dk, acc_dv get the group's 64
    // key rows of dK (not yet scaled by softmax_scale) and dV (the wide tile: its block of d's
    // columns of all the tile's rows, KvPart's where the blocks differ); each query tile's dQ
    // goes to the shared buffer that the dQ warp reduces into the accumulator. KvPart:
    // Traits::KvWhole or KvPart<g>, this group's dV and dK GEMMs.
    template <class KvPart, class AccKV>
    static __device__ void compute(Args const& a, SharedStorage& ss,
                                   typename Traits::QPipe& q_pipe,
                                   typename Traits::DoPipe& do_pipe, PipeState& q_state,
                                   PipeState& do_state, SeqInfo const& seq, int bidb, int bidh,
                                   Sm90BwdGeometry const& g, AccKV& acc_dk, AccKV& acc_dv) {
        BwdParams const& p = a.p;
        const int ctid = int(threadIdx.x) - kWarpGroupThreads;
        const BandMask mask = seq.mask(p);

        Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
        Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutK{});
        Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKt{});
        Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
        Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutQ{});
        Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQt{});
        Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutQt{});
        Tensor sDs = make_tensor(make_smem_ptr(ss.ds.data()), typename Traits::SmemLayoutDs{});
        Tensor sDsT = make_tensor(make_smem_ptr(ss.ds.data()), typename Traits::SmemLayoutDsT{});

        typename Traits::MmaSdP mma_sdp;
        typename KvPart::Mma mma_kv;
        auto thr_sdp = mma_sdp.get_thread_slice(ctid);
        auto thr_kv = mma_kv.get_thread_slice(KvPart::mma_thread(ctid));
        Tensor tSrK = thr_sdp.partition_fragment_A(sK);     // (MMA, 1, d/16)
        Tensor tSrV = thr_sdp.partition_fragment_A(sV);
        Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, 1, d/16, stages)
        Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
        // (MMA, 1, block_m/16, stages), of the group's columns
        Tensor tKVrQt = thr_kv.partition_fragment_B(KvPart::cols(sQt));
        Tensor tKVrdOt = thr_kv.partition_fragment_B(KvPart::cols(sdOt));
        // dQ = dS K of a group's block (Traits::DqWhole or DqPart), this thread's operands: dS^T
        // (MMA, 1, block_n/16, buffers) and the block's columns of K (MMA, 1, block_n/16).
        auto dq_ds = [&](auto part) {
            using Part = decltype(part);
            auto thr_dq = typename Part::Mma{}.get_thread_slice(Part::mma_thread(ctid));
            return thr_dq.partition_fragment_A(sDsT);
        };
        auto dq_kt = [&](auto part) {
            using Part = decltype(part);
            using Cols = decltype(size<1>(typename Part::TileShape{}));
            auto thr_dq = typename Part::Mma{}.get_thread_slice(Part::mma_thread(ctid));
            return thr_dq.partition_fragment_B(smem_cols<Part::kCol0, Cols::value>(sKt));
        };
        // One tiled MMA over both groups (DqWhole) has its operands partitioned once, here, and
        // used in place: a copy (into a tuple, a by-value argument) moves the GMMA descriptors as
        // 64-bit words, which changed the code of d = 64 and 128 (spills at d = 64). Where the
        // groups' blocks differ (d = 96, 160-224) each step partitions its group's.
        using DqWhole = typename Traits::DqWhole;
        auto whole_only = [](auto partition) {
            if constexpr (Traits::kDqPartsAlike) {
                return partition(DqWhole{});
            } else {
                return 0;
            }
        };
        auto tDqrDs = whole_only(dq_ds);
        auto tDqrKt = whole_only(dq_kt);

        auto store_ds = typename Traits::StoreDs{}.get_thread_slice(ctid);
        Tensor tDssDs = store_ds.partition_D(sDs);  // (copy, rows, cols, buffers)

        // This thread's (key, query) coordinates of the S^T tile, as a (rows, cols) view.
        Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<BN, BM>{}));
        Tensor cS_rc = make_tensor(cS.data(), wgmma_acc_as_rows_cols(cS.layout()));

        AlibiBias bias{};
        if constexpr (Traits::kAlibi) bias = seq.alibi(p, bidb, bidh);

        const int group = consumer_group();
        // dQ of a query tile, the group's block (Traits::DqWhole or DqPart) from dS^T buffer
        // `buffer` (ds) and the block's columns of K (kt), to shared memory for the dQ warp.
        auto dq_tile = [&](auto part, int buffer, auto const& ds, auto const& kt) {
            using Part = decltype(part);
            typename Part::Mma mma_dq;
            Tensor acc_dq = partition_fragment_C(mma_dq, typename Part::TileShape{});
            wgmma_issue<true>(mma_dq, ds(_, _, _, buffer), kt, acc_dq);
            warpgroup_wait<0>();
            store_dq(acc_dq, ss, ctid, group);
        };

        if constexpr (Traits::kWide) {
            // Both groups share the 64 key rows. In a step each group computes its half of
            // S^T's and dP^T's query columns and writes its columns of P^T and dS^T to shared
            // memory; after a barrier of both groups it adds all of P^T dO and dS^T Q to its
            // block of d's columns of dV and dK (acc_dv, acc_dk), then computes the same block
            // of dQ's columns.
            Tensor tKVsPds = thr_kv.partition_fragment_A(sDs);  // (MMA, 1, block_m/16, slots)
            auto step = [&](int m, auto softcap) {
                constexpr bool kSoftcap = decltype(softcap)::value;
                const int m0 = m * kBlockM;
                const int q_stage = q_state.index();
                const int do_stage = do_state.index();
                // dS^T in slot `buffer`, P^T in slot kDsBuffers + buffer.
                const int buffer = (m - g.m_first) % Traits::kDsBuffers;
                Tensor acc_s = partition_fragment_C(mma_sdp, Shape<BN, BM>{});
                Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<BN, BM>{});
                Tensor s_rc = make_tensor(acc_s.data(), wgmma_acc_as_rows_cols(acc_s.layout()));
                Tensor dp_rc = make_tensor(acc_dp.data(), wgmma_acc_as_rows_cols(acc_dp.layout()));

                q_pipe.consumer_wait(q_state);
                do_pipe.consumer_wait(do_state);
                wgmma_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, q_stage), acc_s);
                wgmma_issue<true>(mma_sdp, tSrV, tSrdO(_, _, _, do_stage), acc_dp);
                if constexpr (kSoftcap) {
                    warpgroup_wait<0>();
                } else {
                    warpgroup_wait<1>();
                }
                const float* dsum = ss.dsum + do_stage * kBlockM;
                tile_probs<kSoftcap>(s_rc, dp_rc, cS_rc, p, mask, bias, ss.lse + q_stage * kBlockM,
                                     dsum, m0, g.n0);
                if constexpr (!kSoftcap) {
                    warpgroup_wait<0>();  // dP^T
                    tile_grads(s_rc, dp_rc, cS_rc, dsum);
                }
                Tensor rP = convert_fragment<T>(acc_s);
                Tensor rDs = convert_fragment<T>(acc_dp);
                copy(typename Traits::StoreDs{}, store_ds.retile_S(rP),
                     tDssDs(_, _, _, Traits::kDsBuffers + buffer));
                copy(typename Traits::StoreDs{}, store_ds.retile_S(rDs), tDssDs(_, _, _, buffer));
                cutlass::arch::fence_view_async_shared();
                barrier_sync(BwdBarrier::kPdsFull, Traits::kConsumerThreads);
                wgmma_issue<false>(mma_kv, tKVsPds(_, _, _, Traits::kDsBuffers + buffer),
                                   tKVrdOt(_, _, _, do_stage), acc_dv);
                wgmma_issue<false>(mma_kv, tKVsPds(_, _, _, buffer), tKVrQt(_, _, _, q_stage),
                                   acc_dk);
                warpgroup_wait<0>();
                // Q and dO are read for the last time: their one stage loads the next tile while dQ
                // runs.
                q_pipe.consumer_release(q_state);
                do_pipe.consumer_release(do_state);
                ++q_state;
                ++do_state;
                if constexpr (Traits::kDqPartsAlike) {
                    dq_tile(DqWhole{}, buffer, tDqrDs, tDqrKt);
                } else {
                    using Dq = typename KvPart::Dq;
                    dq_tile(Dq{}, buffer, dq_ds(Dq{}), dq_kt(Dq{}));
                }
            };

            ss.kv_full.wait(0);
            if (p.softcap > 0.f) {
                for (int m = g.m_first; m < g.m_last; ++m) step(m, cute::true_type{});
            } else {
                for (int m = g.m_first; m < g.m_last; ++m) step(m, cute::false_type{});
            }
        } else {
            // A group's barrier with the other.
            constexpr int kPairThreads = Traits::kConsumerThreads;
            auto ds_buffer = [&](int m) { return (m - g.m_first) % Traits::kDsBuffers; };

            // dQ of query tile m from both groups' rows of dS^T(m), the other group's once it has
            // signalled them. Its wait for every GEMM issued also completes the calling step's
            // dV and dK.
            auto dq_block = [&](int m, auto part, auto const& tDqrDs, auto const& tDqrKt) {
                barrier_sync(ds_full(1 - group, ds_buffer(m)), kPairThreads);
                dq_tile(part, ds_buffer(m), tDqrDs, tDqrKt);
            };
            auto dq_step = [&](int m) {
                if constexpr (Traits::kDqPartsAlike) {
                    dq_block(m, DqWhole{}, tDqrDs, tDqrKt);
                } else if (group == 0) {
                    using Part = typename Traits::template DqPart<0>;
                    dq_block(m, Part{}, dq_ds(Part{}), dq_kt(Part{}));
                } else {
                    using Part = typename Traits::template DqPart<1>;
                    dq_block(m, Part{}, dq_ds(Part{}), dq_kt(Part{}));
                }
            };

            // One query tile. Without softcap P^T is computed while the dP^T GEMM runs, and the dV
            // GEMM is issued before dS^T is computed. With it, dS^T needs d tanh / d x = 1 - t^2 of
            // each score, so P^T and dS^T are computed together once both GEMMs are done (t is not
            // kept across the dV GEMM: a second score tile of registers).
            auto step = [&](int m, auto softcap) {
                constexpr bool kSoftcap = decltype(softcap)::value;
                const int m0 = m * kBlockM;
                const int q_stage = q_state.index();
                const int do_stage = do_state.index();
                Tensor acc_s = partition_fragment_C(mma_sdp, Shape<BN, BM>{});
                Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<BN, BM>{});
                Tensor s_rc = make_tensor(acc_s.data(), wgmma_acc_as_rows_cols(acc_s.layout()));
                Tensor dp_rc = make_tensor(acc_dp.data(), wgmma_acc_as_rows_cols(acc_dp.layout()));

                q_pipe.consumer_wait(q_state);
                do_pipe.consumer_wait(do_state);
                barrier_sync(group_turn(group), kPairThreads);
                wgmma_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, q_stage), acc_s);
                wgmma_issue<true>(mma_sdp, tSrV, tSrdO(_, _, _, do_stage), acc_dp);
                barrier_arrive(group_turn(1 - group), kPairThreads);
                if constexpr (kSoftcap) {
                    warpgroup_wait<0>();
                } else {
                    warpgroup_wait<1>();
                }

                tile_probs<kSoftcap>(s_rc, dp_rc, cS_rc, p, mask, bias, ss.lse + q_stage * kBlockM,
                                     ss.dsum + do_stage * kBlockM, m0, g.n0);
                Tensor rP = convert_fragment<T>(acc_s);
                Tensor rP_a = make_tensor(rP.data(), wgmma_acc_as_a_operand(rP.layout()));
                wgmma_issue<false>(mma_kv, rP_a, tKVrdOt(_, _, _, do_stage), acc_dv);
                if constexpr (!kSoftcap) {
                    warpgroup_wait<1>();  // dP^T
                    tile_grads(s_rc, dp_rc, cS_rc, ss.dsum + do_stage * kBlockM);
                }
                Tensor rDs = convert_fragment<T>(acc_dp);
                Tensor rDs_a = make_tensor(rDs.data(), wgmma_acc_as_a_operand(rDs.layout()));
                wgmma_issue<false>(mma_kv, rDs_a, tKVrQt(_, _, _, q_stage), acc_dk);

                // This group's rows of dS^T(m) into the step's buffer, signalled to the other
                // group, then dQ of the step before (whose dS^T the other group wrote half a step
                // ago), so that neither group waits for the other here.
                copy(typename Traits::StoreDs{}, store_ds.retile_S(rDs),
                     tDssDs(_, _, _, ds_buffer(m)));
                cutlass::arch::fence_view_async_shared();
                barrier_arrive(ds_full(group, ds_buffer(m)), kPairThreads);
                if (m > g.m_first) {
                    dq_step(m - 1);
                } else {
                    warpgroup_wait<0>();
                }
                q_pipe.consumer_release(q_state);
                do_pipe.consumer_release(do_state);
                ++q_state;
                ++do_state;
            };

            ss.kv_full.wait(0);
            // Group 0 takes the first turn.
            if (group == 1) barrier_arrive(group_turn(0), kPairThreads);
            if (p.softcap > 0.f) {
                for (int m = g.m_first; m < g.m_last; ++m) step(m, cute::true_type{});
            } else {
                for (int m = g.m_first; m < g.m_last; ++m) step(m, cute::false_type{});
            }
            dq_step(g.m_last - 1);
            // The turn that the last step handed over is taken, so both turn barriers end clear.
            if (group == 0) barrier_sync(group_turn(0), kPairThreads);
        }
    }

    // A consumer group and the dQ warp meet at the group's dQ barriers.
    static constexpr int kDqSyncThreads = kWarpGroupThreads + 32;
    static_assert(Traits::kConsumerWarpGroups == 2);

    // The dQ warp (BwdProducerWarp::kDqReduce): adds each consumer group's block of a query
    // tile's dQ from shared memory to the fp32 accumulator with a bulk reduction, and hands that
    // block back to its group once the copy engine has read it.
    static __device__ void reduce_dq(Args const& a, SharedStorage& ss, SeqInfo const& seq,
                                     int bidb, int bidh, Sm90BwdGeometry const& g) {
        const bool issuer = threadIdx.x % 32 == 0;
        const int64_t rows0 = a.rows.template offset<kBlockM>(a.p, seq.row_q, bidb, bidh);
        const BandMask mask = seq.mask(a.p);
        const int n_block = g.n0 / kBlockN;
        const int n_end = (seq.seqlen_k + kBlockN - 1) / kBlockN;
        const DqTurns<kBlockM, kBlockN> turns(a.p.dq_turns, a.m_blocks, a.p.nheads, bidb, bidh);
        // Each group's block of the buffer starts free.
        auto give_back = [&](int group) { barrier_arrive(dq_empty(group), kDqSyncThreads); };
        for (int group = 0; group < Traits::kConsumerWarpGroups; ++group) give_back(group);
        int seen = -1;  // tile m's counter as read while the previous tile's reduction ran
        int rank = turns.enabled() ? turns.rank(mask, g.m_first, n_block, n_end) : 0;
        for (int m = g.m_first; m < g.m_last; ++m) {
            float* dst = a.rows.dq_accum + (rows0 + int64_t(m) * kBlockM) * D::value;
            if (issuer && turns.enabled()) turns.wait(m, rank, seen);
            __syncwarp();
            const bool more = m + 1 < g.m_last;
            // Each block goes back to its group as soon as the copy engine has read it, so that
            // group 0 does not wait for group 1's block (deterministic mode hands both back
            // once the tile's addition is done and the turn passed).
            CUTE_UNROLL
            for (int group = 0; group < Traits::kConsumerWarpGroups; ++group) {
                barrier_sync(dq_full(group), kDqSyncThreads);
                if (issuer) {
                    const int offset = Traits::dq_part_offset(group);
                    bulk_reduce_add(dst + offset, ss.dq + offset,
                                    uint32_t(sizeof(float)) * Traits::dq_part_floats(group));
                    tma_store_arrive();
                    if (!turns.enabled()) bulk_wait_read<0>();
                }
                __syncwarp();
                if (more && !turns.enabled()) give_back(group);
            }
            if (turns.enabled()) {
                // The next tile's counter is read while this tile's reduction completes; the
                // fence below makes a turn seen here an acquire.
                if (issuer && more) seen = turns.peek(m + 1);
                const int next_rank = more ? turns.rank(mask, m + 1, n_block, n_end) : 0;
                if (issuer) {
                    // The next key tile's addition must find this one's done.
                    bulk_wait_done();
                    fence_acq_rel_gpu();
                    turns.pass(m, rank);
                }
                rank = next_rank;
                __syncwarp();
                if (more) {
                    for (int group = 0; group < Traits::kConsumerWarpGroups; ++group) {
                        give_back(group);
                    }
                }
            }
        }
        // No final wait for completion: every reduction has read its shared memory, and a
        // grid's bulk writes are complete when the grid is (the dQ kernel reads them after
        // it). Leaving at once frees the SM for the next CTA a round trip earlier (H100, d=128:
        // 1.00-1.03x).
    }
};

}  // namespace flash
