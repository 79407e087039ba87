// Mainloop of the SM90 forward for one tile of block_m query rows.
//   Producer (one warp; two where paged K/V come in boxes, V's on the second): TMA loads of Q
//   once per tile and of K and V per key block, each into its own pipeline of shared-memory
//   stages.
//   Consumers (one warp group per 64 rows): S = Q K^T, score policy (softcap, mask), online
//   softmax, O += P V. With the tile's `overlap` a group's PV GEMM of block n+1 is in flight
//   while its softmax of block n runs; with `kPingPong` the warp groups take turns issuing, so
//   one group's softmax also overlaps the others' GEMMs (all of it without `overlap`).
// Key blocks run from the last to the first so the masked diagonal blocks come first.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cute/tensor.hpp>

#include "fp8_sm90.h"
#include "fwd_traits_sm90.h"
#include "common/seq_info.h"
#include "common/score.h"
#include "common/softmax.h"
#include "sm90_utils.h"
#include "tma_views.h"

namespace flash {

// Where one tile's rows and keys live, as seen by both roles. With GQA packing the tile's rows
// are packed rows (FwdParams::pack_gqa); q_row0 and q_span give the query rows they cover.
struct Sm90TileGeometry {
    int row0;  // (packed) row of the sequence at the tile's first row; < 0 in an end-aligned
               // top tile (Traits::kEndAligned)
    int row_begin, rows;  // the tile's rows [row_begin, rows) lie inside the sequence
    int q_row0, q_span;   // query rows [q_row0, q_row0 + q_span) of the tile's block_m rows
    int n_first, n_last;  // key blocks [n_first, n_last) the tile's rows can see

    __device__ bool has_rows() const { return rows > row_begin; }
    // Whether the tile's row r lies inside the sequence.
    __device__ bool holds_row(int r) const { return r >= row_begin && r < rows; }
    __device__ bool has_keys() const { return n_last > n_first; }
    // Whether the tile's rows [64 g, 64 g + 64) all lie outside the sequence.
    __device__ bool group_outside(int group) const {
        return 64 * group >= rows || 64 * group + 64 <= row_begin;
    }
};

template <class Traits>
struct Sm90FwdMainloop {
    using T = typename Traits::Element;
    static constexpr int kBlockM = Traits::kBlockM;
    static constexpr int kBlockN = Traits::kBlockN;
    using BM = typename Traits::BM;
    using BN = typename Traits::BN;
    using D = typename Traits::D;
    using Args = Sm90FwdArgs<Traits>;
    using SharedStorage = typename Traits::SharedStorage;
    using PipeState = typename Traits::PipeState;

    // Query heads per tile row group: 1 unless this is the packed instantiation.
    static __device__ int pack_factor(FwdParams const& p) {
        return Traits::kPackGQA ? p.pack_gqa : 1;
    }

    // The unit's tile, and its key blocks where it is a piece of a split tile (Tile).
    static __device__ Sm90TileGeometry geometry(FwdParams const& p, SeqInfo const& seq,
                                                Tile const& t) {
        const int pack = pack_factor(p);
        Sm90TileGeometry g;
        const int seq_rows = seq.seqlen_q * pack;
        const int pad = Traits::kEndAligned ? (kBlockM - seq_rows % kBlockM) % kBlockM : 0;
        g.row0 = t.m_block * kBlockM - pad;
        g.row_begin = max(0, -g.row0);
        g.rows = min(kBlockM, seq_rows - g.row0);
        g.q_row0 = g.row0 / pack;
        g.q_span = (g.row0 + kBlockM - 1) / pack - g.q_row0 + 1;
        seq.mask(p).key_block_range(g.q_row0, g.q_span, kBlockN, g.n_first, g.n_last);
        if constexpr (Traits::kBand && Traits::kSplitTiles) {
            if (t.pieces > 1) piece_key_blocks(t.piece, t.pieces, g.n_first, g.n_last);
        } else if constexpr (!Traits::kBand) {
            g.n_first = max(g.n_first, t.n_begin);
            g.n_last = min(g.n_last, t.n_end);
        }
        return g;
    }

    // The Q buffer of the pipeline's stage (the stage index is known 0 with one buffer: fewer
    // registers in the key loops).
    static __device__ auto query_buffer(SharedStorage& ss, typename Traits::QState const& q) {
        const int index = Traits::kQStages == 1 ? 0 : q.index();
        return make_tensor(make_smem_ptr(ss.q.data() + index * Traits::kQElems),
                           typename Traits::SmemLayoutQ{});
    }

    // ---------------------------------------------------------------- producer ----

    // What a call of load() issues: everything, or (Traits::kValueWarp) Q and K in one warp and
    // V in another. A run-time argument: as a template argument the producer's copies of load()
    // spilled more (measured when the split was a run-time choice in every band kernel, d64 at
    // 24 registers: 440 bytes against 344).
    enum class LoadPart { kAll, kQueryKeys, kValues };

    // Issues the loads of one tile. Run by one whole warp; lane 0 issues the copies. Q's
    // buffer is acquired after K's first block is issued (its release is the tile's last S
    // GEMM two tiles back with two buffers, the previous tile's with one). `shared_kv`: the
    // cluster's CTAs all run tiles of this head (Tile::shared_kv).
    static __device__ void load(Args const& a, SharedStorage& ss, typename Traits::QPipe& q_pipe,
                                typename Traits::KPipe& k_pipe, typename Traits::VPipe& v_pipe,
                                typename Traits::QState& q_state, PipeState& k_state,
                                PipeState& v_state, SeqInfo const& seq, int bidb, int bidh,
                                int m_block, bool shared_kv, Sm90TileGeometry const& g,
                                LoadPart part = LoadPart::kAll) {
        const bool keys = part != LoadPart::kValues;
        const bool values = part != LoadPart::kQueryKeys;
        FwdParams const& p = a.p;
        const bool issuer = threadIdx.x % 32 == 0;
        // Packed tiles are scheduled per KV head.
        const int bidh_k = Traits::kPackGQA ? bidh : bidh / (p.nheads / p.nheads_k);
        const bool varlen = p.is_varlen();

        Tensor sQ = query_buffer(ss, q_state);
        Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKV{});
        Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutKV{});

        // An end-aligned top tile starts above the sequence: TMA zero-fills rows before the
        // tensor's first, and a varlen tile reads the previous sequence's (never stored).
        const index_t q_shift = g.row0 - m_block * kBlockM;
        Tensor gQ = local_tile(
            tma_head_view(a.tma_q, a.rows_q, p.headdim, p.nheads, a.batch_q, bidh, bidb,
                      (varlen ? seq.row_q : 0) + q_shift),
            Shape<BM, D>{}, make_coord(m_block, _0{}));
        const index_t row_k = (varlen ? seq.row_k : 0) + seq.k_first;
        Tensor gK = local_tile(tma_head_view(a.tma_k, a.rows_k, p.headdim, p.nheads_k, a.batch_k,
                                         bidh_k, seq.bidb_k, row_k),
                               Shape<BN, D>{}, make_coord(_, _0{}));
        Tensor gV = local_tile(tma_head_view(a.tma_v, a.rows_k, p.headdim, p.nheads_k, a.batch_k,
                                         bidh_k, seq.bidb_k, row_k),
                               Shape<BN, D>{}, make_coord(_, _0{}));

        // In a cluster each K/V tile is loaded in kCluster slices. Where the cluster's CTAs
        // share the head, this CTA loads its own slice for every CTA of the cluster; otherwise
        // it loads every slice for itself alone (the stage's barriers count the same bytes).
        constexpr int kCluster = Traits::kClusterM;
        const int rank = kCluster == 1 ? 0 : int(cute::block_rank_in_cluster());
        auto tq = tma_partition(a.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                group_modes<0, 2>(gQ));
        Tensor tQg = get<0>(tq);  // (TMA)
        Tensor tQs = get<1>(tq);

        // Slice `slice` of key block n into the pipeline's stage, for the CTAs in `ctas`.
        auto load_slice = [&](auto const& tma, auto& pipe, PipeState const& state, auto const& s,
                              auto const& gmem, int slice, int n, uint16_t ctas) {
            auto part = tma_partition(tma, slice, Layout<Int<kCluster>>{},
                                      group_modes<0, 2>(s), group_modes<0, 2>(gmem));
            auto* barrier = pipe.producer_get_barrier(state);
            if constexpr (kCluster == 1) {
                copy(tma.with(*barrier), get<0>(part)(_, n), get<1>(part)(_, state.index()));
            } else {
                copy(tma.with(*barrier, ctas), get<0>(part)(_, n), get<1>(part)(_, state.index()));
            }
        };
        // Key block n into the pipeline's next stage.
        auto load_block = [&](auto& pipe, PipeState& state, auto const& tma, auto const& s,
                              auto const& gmem, int n) {
            pipe.producer_acquire(state);
            if (issuer && (kCluster == 1 || shared_kv)) {
                load_slice(tma, pipe, state, s, gmem, rank, n, uint16_t((1u << kCluster) - 1));
            } else if (issuer) {
                for (int slice = 0; slice < kCluster; ++slice) {
                    load_slice(tma, pipe, state, s, gmem, slice, n, uint16_t(1u << rank));
                }
            }
            ++state;
        };
        // Paged K/V (band kernels only; the TMA views are then (page_size, d) per page). Pages
        // of whole key blocks: block n lies in one page. Other pages (a multiple of 8 rows, the
        // launcher's rule): block n in boxes of Traits::box_rows rows, each from its page.
        const bool paged = Traits::kBand && seq.pages != nullptr;
        const bool paged_rows = paged && p.page_size % kBlockN != 0;
        auto page_blocks = [&](auto const& tma, int n) {
            return local_tile(tma_head_view(tma, a.rows_k, p.headdim, p.nheads_k, a.batch_k, bidh_k,
                                        seq.page(p, n * kBlockN), 0),
                              Shape<BN, D>{}, make_coord(_, _0{}));
        };
        // Lane j loads box j: its page-table read starts before the wait for a free stage, and
        // the boxes' address arithmetic and TMA issues run side by side. Decode with pages of 16
        // in 8-row boxes (H100, 2026-11-27, 4k / 16k keys) ran at 0.24-0.31 of the speed of
        // pages that hold whole blocks with one thread reading each box's page and issuing its
        // load in turn, 0.30-0.36 with the reads in parallel and one thread issuing, 0.50-0.62
        // this way; in 16-row boxes 0.67-0.79.
        static_assert(kBlockN / 8 <= 32, "one lane per box");
        auto load_rows = [&](auto rows, auto& pipe, PipeState& state, auto const& tma,
                             auto const& s, int n) {
            constexpr int kRows = decltype(rows)::value;
            const int lane = int(threadIdx.x % 32);
            constexpr int kBoxes = kBlockN / kRows;
            using BR = Int<kRows>;
            // Boxes past the sequence's last row read the page of its last box: the table need
            // not hold entries past the sequence, their keys are masked and their values cleared
            // (clear_v_tail), and the stage's barrier still counts a whole block's bytes.
            const int last_box = max(seq.seqlen_k - 1, 0) / kRows * kRows;
            const int row = min(n * kBlockN + kRows * min(lane, kBoxes - 1), last_box);
            const int page = seq.page(p, row);
            pipe.producer_acquire(state);
            if (lane < kBoxes) {
                auto* barrier = pipe.producer_get_barrier(state);
                Tensor g = local_tile(tma_head_view(tma, a.rows_k, p.headdim, p.nheads_k,
                                                    a.batch_k, bidh_k, page, 0),
                                      Shape<BR, D>{}, make_coord(_, _0{}));  // (rows, d, boxes)
                Tensor sl = local_tile(s(_, _, state.index()), Shape<BR, D>{},
                                       make_coord(lane, _0{}));  // (rows, d)
                auto part = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(sl),
                                          group_modes<0, 2>(g));
                copy(tma.with(*barrier), get<0>(part)(_, row % p.page_size / kRows),
                     get<1>(part));
            }
            ++state;
        };
        // is_k: true_type for K, false_type for V.
        auto load_paged_rows = [&](auto is_k, auto& pipe, PipeState& state, auto const& s,
                                   int n) {
            Traits::with_box_rows(p.page_size, [&](auto rows) {
                auto const& pair =
                    Traits::template paged_pair<decltype(rows)::value>(a.paged_rows);
                if constexpr (decltype(is_k)::value) {
                    load_rows(rows, pipe, state, pair.k, s, n);
                } else {
                    load_rows(rows, pipe, state, pair.v, s, n);
                }
            });
        };
        auto load_kv = [&](auto is_k, auto& pipe, PipeState& state, auto const& tma,
                           auto const& s, auto const& gmem, int n) {
            if (paged_rows) {
                load_paged_rows(is_k, pipe, state, s, n);
            } else if (paged) {
                load_block(pipe, state, tma, s, page_blocks(tma, n),
                           n * kBlockN % p.page_size / kBlockN);
            } else {
                load_block(pipe, state, tma, s, gmem, n);
            }
        };
        auto load_k = [&](int n) {
            load_kv(std::true_type{}, k_pipe, k_state, a.tma_k, sK, gK, n);
        };
        auto load_v = [&](int n) {
            load_kv(std::false_type{}, v_pipe, v_state, a.tma_v, sV, gV, n);
        };

        if (keys) {
            load_k(g.n_last - 1);
            q_pipe.producer_acquire(q_state);
            if (issuer && !Traits::kPackGQA) {
                copy(a.tma_q.with(*q_pipe.producer_get_barrier(q_state)), tQg, tQs);
            }
            ++q_state;
        }
        // K runs one block ahead of V: an iteration's S GEMM of block n and PV GEMM of block
        // n + 1 free K's stage before V's, so K(n) is issued as soon as its stage frees.
        for (int n = g.n_last - 2; n >= g.n_first; --n) {
            if (keys) load_k(n);
            if (values) load_v(n + 1);
        }
        if (values) load_v(g.n_first);
    }

    // The producer group's warp 1 in Traits::kValueWarp kernels: takes the same units from the
    // tile queue as the consumers and loads each tile's V blocks.
    static __device__ void load_values(Args const& a, SharedStorage& ss,
                                       typename Traits::QPipe& q_pipe,
                                       typename Traits::KPipe& k_pipe,
                                       typename Traits::VPipe& v_pipe,
                                       typename Traits::Scheduler const& sched) {
        typename Traits::QState q_state;  // untouched: this warp loads V only
        PipeState k_state;
        PipeState v_state = cutlass::make_producer_start_state<typename Traits::VPipe>();
        int taken = 0;
        for (int unit = ss.tiles.pop(taken++); unit != TileQueue::kDone;
             unit = ss.tiles.pop(taken++)) {
            const Tile t = sched.tile(unit);
            const SeqInfo seq(a.p, t.bidb);
            const Sm90TileGeometry g = geometry(a.p, seq, t);
            if (g.has_keys()) {
                load(a, ss, q_pipe, k_pipe, v_pipe, q_state, k_state, v_state, seq, t.bidb,
                     t.bidh, t.m_block, t.shared_kv, g, LoadPart::kValues);
            }
        }
        v_pipe.producer_tail(v_state);
    }

    // e4m3: the producer group's transposing warps (warp `warp` of kTransposeWarps). They take
    // the same units from the tile queue as the consumers and, for each tile with keys, wait for
    // each of its V stages in the order the producer loads them, write it transposed into the
    // next V^T stage and release it.
    static __device__ void transpose_values(Args const& a, SharedStorage& ss,
                                            typename Traits::VPipe& v_pipe,
                                            typename Traits::VtPipe& vt_pipe,
                                            typename Traits::Scheduler const& sched, int warp) {
        static_assert(Traits::kFp8);
        const ValueTransposer<Traits::kTransposeWarps, typename Traits::SmemLayoutKV,
                              typename Traits::SmemLayoutVt>
            transpose(cute::cast_smem_ptr_to_uint(ss.v.data()),
                      cute::cast_smem_ptr_to_uint(ss.vt.data()), warp);
        PipeState v_state;
        typename Traits::ValuesState vt_state(0, 1, 0);  // a producer's start: all stages free
        int taken = 0;
        for (int unit = ss.tiles.pop(taken++); unit != TileQueue::kDone;
             unit = ss.tiles.pop(taken++)) {
            const Tile t = sched.tile(unit);
            const Sm90TileGeometry g = geometry(a.p, SeqInfo(a.p, t.bidb), t);
            for (int n = g.n_first; n < g.n_last; ++n) {
                v_pipe.consumer_wait(v_state);
                vt_pipe.producer_acquire(vt_state);
                transpose(v_state.index(), vt_state.index());
                v_pipe.consumer_release(v_state);
                vt_pipe.producer_commit(vt_state);
                ++v_state;
                ++vt_state;
            }
        }
    }

    // ---------------------------------------------------------------- consumer ----

    // Whether tiles with keys leave through shared memory and a TMA store (the epilogue's
    // store_staged): batched, unpacked tiles (the plain kernel runs batched tiles only), d >= 128.
    // Below, a thread's O is four 16-byte stores, and staging in a K/V stage lost 1-3.5%.
    static __device__ bool staged_output(FwdParams const& p) {
        return Traits::kStagedOutput && (!Traits::kBand || !p.is_varlen());
    }

    // GQA packing: packed row r of the tile is query row (row0 + r) / G of head
    // kv_head * G + (row0 + r) % G. No TMA box describes those rows for a run-time G, so the
    // consumer warp groups gather them with 16-byte cp.async (head-dim padding zero-filled, as
    // TMA does), then make the writes visible to WGMMA (the async proxy) before either group
    // reads them. Rows past the sequence are zeroed: their scores are never stored, but the
    // lazy softmax's warp-wide vote reads them, and whatever an earlier tile left there would
    // change the rounding of the rows that are stored from run to run.
    template <class SmemQ>
    static __device__ void gather_packed_query(FwdParams const& p, SmemQ& sQ, SeqInfo const& seq,
                                               int bidb, int kv_head, Sm90TileGeometry const& g) {
        constexpr int kPer = 16 / int(sizeof(T));  // elements per 16-byte chunk
        constexpr int kChunks = D::value / kPer;      // chunks per row
        const T* q = static_cast<const T*>(p.q);
        for (int i = int(threadIdx.x) - 128; i < g.rows * kChunks; i += Traits::kConsumerThreads) {
            const int r = i / kChunks;
            const int c = (i % kChunks) * kPer;
            const int prow = g.row0 + r;
            const bool in_dim = c < p.headdim;
            const T* src = q + seq.q_offset(p.q_stride, p, bidb, prow / p.pack_gqa,
                                            kv_head * p.pack_gqa + prow % p.pack_gqa);
            SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(
                *reinterpret_cast<const uint128_t*>(src + (in_dim ? c : 0)),
                *reinterpret_cast<uint128_t*>(&sQ(r, c)), in_dim);
        }
        for (int i = int(threadIdx.x) - 128 + g.rows * kChunks; i < kBlockM * kChunks;
             i += Traits::kConsumerThreads) {
            *reinterpret_cast<uint4*>(&sQ(i / kChunks, (i % kChunks) * kPer)) =
                make_uint4(0, 0, 0, 0);
        }
        cp_async_wait<0>();
        cutlass::arch::fence_view_async_shared();
        barrier_sync(NamedBarrier::kConsumers, Traits::kConsumerThreads);
    }

    // Runs one tile for this consumer warp group: acc_o gets the normalised output, lse the
    // natural-log LSE of this thread's rows. Releases Q's buffer once Q is no longer read.
    // With staged_output(p) the epilogue stages O in the tile's last K or V stage
    // (Traits::SmemLayoutOSlice, the stage before k_state / v_state on return), so this group
    // keeps that stage instead of releasing it, and every warp arrives on keys_read /
    // values_read once its last S / PV GEMM is done.
    // `idle` (compile-time): this group's 64 rows all lie outside the sequence (the partial
    // tile of a sequence whose length is not a multiple of block_m: the last one, or the first
    // where tiles are end-aligned). It then issues no GEMMs and computes no softmax, so the
    // other groups get the tensor cores to themselves, but it keeps every wait, release, turn
    // and barrier of the tile; its rows are never stored.
    // e4m3: `v_pipe` is the transposed V's (Traits::ValuesPipe); q_descale * k_descale joins the
    // scores' scale and v_descale the output's.
    template <class AccO, int kRows, bool kIdle>
    static __device__ void compute(Args const& a, SharedStorage& ss,
                                   typename Traits::QPipe& q_pipe, typename Traits::KPipe& k_pipe,
                                   typename Traits::ValuesPipe& v_pipe,
                                   typename Traits::QState& q_state,
                                   PipeState& k_state, typename Traits::ValuesState& v_state,
                                   SeqInfo const& seq, int bidb, int bidh,
                                   Sm90TileGeometry const& g, AccO& acc_o,
                                   float (&lse)[kRows], cute::bool_constant<kIdle>) {
        FwdParams const& p = a.p;
        const int ctid = int(threadIdx.x) - 128;
        const int group = consumer_group();
        const BandMask mask = seq.mask(p);
        // This group's 64 rows as query rows: the mask is decided per group, not per tile.
        const int group_row0 = g.row0 + 64 * group;
        const int group_q_row0 = group_row0 / pack_factor(p);
        const int group_q_span = (group_row0 + 63) / pack_factor(p) - group_q_row0 + 1;

        Tensor sQ = query_buffer(ss, q_state);
        Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKV{});
        Tensor sVt = make_tensor(make_smem_ptr(values_buffer(ss)), typename Traits::SmemLayoutVt{});

        typename Traits::MmaQK mma_qk;
        typename Traits::MmaPV mma_pv;
        auto thr_qk = mma_qk.get_thread_slice(ctid);
        // The shared-memory descriptors are one per warp group: from a slice whose index ptxas
        // knows to be warp-uniform, they live in uniform registers instead of being rebuilt in
        // vector registers before every WGMMA.
        const int wg_thread0 = group * kWarpGroupThreads;
        auto wg_qk = mma_qk.get_thread_slice(wg_thread0);
        auto wg_pv = mma_pv.get_thread_slice(wg_thread0);
        Tensor tSrQ = wg_qk.partition_fragment_A(sQ);   // (MMA, 1, d/16)
        Tensor tSrK = wg_qk.partition_fragment_B(sK);   // (MMA, 1, d/16, stages)
        Tensor tOrV = wg_pv.partition_fragment_B(sVt);  // (MMA, 1, block_n/16, stages)

        Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<BM, BN>{}));
        Tensor cS_rc = make_tensor(cS.data(), wgmma_acc_as_rows_cols(cS.layout()));
        Tensor o_rc = make_tensor(acc_o.data(), wgmma_acc_as_rows_cols(acc_o.layout()));
        OnlineSoftmax<kRows> softmax;
        static_assert(kRows == 2, "SharedStorage::row_err holds two rows per thread");
        float* row_err = ss.row_err + kRows * ctid;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) row_err[r] = 0.f;
        clear(acc_o);

        // Turns between the consumer warp groups: wait for ours, pass it on once issued.
        using Turns = ConsumerTurns<Traits::kConsumerWarpGroups>;
        auto take_turn = [&] {
            if constexpr (Traits::kPingPong) Turns::take(group);
        };
        auto pass_turn = [&] {
            if constexpr (Traits::kPingPong) Turns::pass(group);
        };

        // The scores' scale (softcap's prescale under softcap), with e4m3's q and k descales.
        float scale_log2 = p.scale_log2;
        float softcap_prescale = p.softcap_prescale;
        float v_descale = 1.f;
        if constexpr (Traits::kFp8) {
            // A packed tile's head is its KV head.
            const int kv = bidb * p.nheads_k +
                           (Traits::kPackGQA ? bidh : bidh / (p.nheads / p.nheads_k));
            const float qk = (p.q_descale ? p.q_descale[kv] : 1.f) *
                             (p.k_descale ? p.k_descale[kv] : 1.f);
            if (p.softcap > 0.f) {
                softcap_prescale *= qk;
            } else {
                scale_log2 *= qk;
            }
            if (p.v_descale) v_descale = p.v_descale[kv];
        }

        // softcap, ALiBi's bias (a row term of it handed to the softmax), then the mask where the
        // block needs one (`may_mask` false: the caller knows it does not), then the online
        // softmax (`lazy`: blocks after the first keep the running max unless it moved by a
        // margin).
        auto scores = [&](auto& acc_s, int n, float (&corr)[kRows], auto may_mask, auto lazy) {
            Tensor s_rc = make_tensor(acc_s.data(), wgmma_acc_as_rows_cols(acc_s.layout()));
            if (p.softcap > 0.f) apply_softcap(acc_s, softcap_prescale);
            [[maybe_unused]] std::conditional_t<Traits::kAlibi, RowTerm<kRows>, NoRowTerm> term;
            if constexpr (Traits::kAlibi) {
                apply_alibi_tile(s_rc, cS_rc, seq.alibi(p, bidb, bidh), g.row0, group_row0,
                                 kWarpGroupRows, n * kBlockN, kBlockN, term.v);
            }
            if constexpr (decltype(may_mask)::value) {
                if (mask.tile_needs_mask(group_q_row0, group_q_span, n * kBlockN, kBlockN)) {
                    apply_mask(s_rc, cS_rc, mask, g.row0, n * kBlockN, pack_factor(p));
                }
            }
            if constexpr (decltype(lazy)::value) {
                softmax.template update_scores_lazy<T>(s_rc, scale_log2, corr, row_err, term);
            } else {
                softmax.update_scores(s_rc, scale_log2, corr, term);
            }
        };

        // V rows past the sequence's end in its last block were read from whatever memory holds
        // them (the next varlen sequence, an unused KV-cache slot). Their P is exactly 0, but
        // 0 * NaN is NaN: zero them before the first PV GEMM reads the block. Batched tensors
        // without seqused_k end at the sequence, and TMA zero-fills past a tensor's end.
        // e4m3 clears the keys' columns of the transposed stage.
        auto clear_v_tail = [&](int n) {
            if constexpr (!Traits::kBand) return;  // batched only (run_fwd_sm90)
            const int valid = seq.seqlen_k - n * kBlockN;
            if (valid >= kBlockN || !(p.is_varlen() || p.seqused_k != nullptr)) return;
            const int stage = v_state.index();
            constexpr int kD = D::value;
            for (int i = ctid; i < (kBlockN - valid) * kD; i += Traits::kConsumerThreads) {
                const int key = valid + i / kD;
                if constexpr (Traits::kFp8) {
                    sVt(i % kD, (key & ~31) | column_of_key(key & 31), stage) = T(0);
                } else {
                    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()),
                                            typename Traits::SmemLayoutKV{});
                    sV(key, i % kD, stage) = T(0);
                }
            }
            cutlass::arch::fence_view_async_shared();  // generic writes, then WGMMA reads
            barrier_sync(NamedBarrier::kConsumers, Traits::kConsumerThreads);
        };

        // V of block n + 1, the PV GEMM's operand in the step of block n: wait for its stage (and
        // clear its tail if it is the sequence's last block), and release it after that GEMM.
        auto values_wait = [&](int n) {
            v_pipe.consumer_wait(v_state);
            if (n == g.n_last - 2) clear_v_tail(n + 1);
        };
        auto values_done = [&] {
            v_pipe.consumer_release(v_state);
            ++v_state;
        };

        // After the S GEMM of block n: K's stage is free (the tile's last one stays with a group
        // that stages its O slice there), and after the tile's last S GEMM Q too (the producer
        // loads the next tile's Q while this one finishes).
        const bool keep_keys = staged_output(p) && !Traits::slice_in_values(group);
        auto keys_done = [&](int n) {
            if (n != g.n_first || !keep_keys) k_pipe.consumer_release(k_state);
            ++k_state;
            if (n == g.n_first) {
                q_pipe.consumer_release(q_state);
                ++q_state;
                if (staged_output(p) && cute::elect_one_sync()) ss.keys_read.arrive();
            }
        };

        Tensor acc_s = partition_fragment_C(mma_qk, Shape<BM, BN>{});
        float corr[kRows];
        if constexpr (kIdle) {
            clear(acc_s);  // what the skipped steps leave behind must still be defined
            CUTE_UNROLL
            for (int r = 0; r < kRows; ++r) corr[r] = 1.f;
        }
        q_pipe.consumer_wait(q_state);
        if constexpr (Traits::kPackGQA) gather_packed_query(p, sQ, seq, bidb, bidh, g);

        // Band tiles: the first key blocks (the rightmost) can lie wholly right of this group's
        // rows, past the causal diagonal or the window. The group then keeps those blocks'
        // waits, releases and turns but issues no GEMMs for them, so the groups with work get
        // the tensor cores sooner. It computes at least the tile's last block (n_first): rows
        // that see no key at all keep the softmax's fully masked path.
        int n = g.n_last - 1;
        if constexpr (Traits::kBand && !kIdle) {
            int group_first, group_last;
            mask.key_block_range(group_q_row0, group_q_span, kBlockN, group_first, group_last);
            const int n_top = max(group_last, g.n_first + 1);
            for (; n >= n_top; --n) {
                k_pipe.consumer_wait(k_state);
                if (n < g.n_last - 1) values_wait(n);
                take_turn();
                pass_turn();
                keys_done(n);
                if (n < g.n_last - 1) values_done();
            }
        }
        // The V stage of the last skipped block: waited and released with the first block.
        const bool v_held = n < g.n_last - 1;

        // First block: S only.
        k_pipe.consumer_wait(k_state);
        if (v_held) values_wait(n);
        take_turn();
        if constexpr (!kIdle) {
            wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, k_state.index()), acc_s);
        }
        pass_turn();
        warpgroup_wait<0>();
        keys_done(n);
        if (v_held) values_done();
        if constexpr (!kIdle) scores(acc_s, n, corr, cute::true_type{}, cute::false_type{});
        Tensor rP = p_fragment(acc_s);
        if (n > g.n_first) k_pipe.consumer_wait(k_state);

        // Middle blocks: S of block n and O += P V of block n + 1. With `overlap` both are in
        // flight together, and each step waits for the next block's K between its softmax and
        // its PV wait: the branch there keeps ptxas from hoisting the PV wait above the softmax
        // (it does within one basic block, which leaves the softmax no GEMM to overlap).
        // Without it the PV GEMM is done before S is issued into the registers P held.
        auto step = [&](int n, auto may_mask) CUTLASS_LAMBDA_FUNC_INLINE {
            Tensor rP_a = p_operand(rP);
            values_wait(n);
            take_turn();
            if constexpr (Traits::kTile.overlap) {
                if constexpr (!kIdle) {
                    wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, k_state.index()), acc_s);
                    wgmma_issue<false>(mma_pv, rP_a, tOrV(_, _, _, v_state.index()), acc_o);
                }
                pass_turn();
                warpgroup_wait<1>();
                keys_done(n);
                if constexpr (!kIdle) scores(acc_s, n, corr, may_mask, cute::true_type{});
                if (n > g.n_first) k_pipe.consumer_wait(k_state);
                warpgroup_wait<0>();
                values_done();
            } else {
                // P's registers are free once its PV GEMM is done: S reuses them.
                if constexpr (!kIdle) {
                    wgmma_issue<false>(mma_pv, rP_a, tOrV(_, _, _, v_state.index()), acc_o);
                    warpgroup_wait<0>();
                    wgmma_issue<true>(mma_qk, tSrQ, tSrK(_, _, _, k_state.index()), acc_s);
                }
                pass_turn();
                warpgroup_wait<0>();
                keys_done(n);
                values_done();
                if constexpr (!kIdle) scores(acc_s, n, corr, may_mask, cute::true_type{});
                if (n > g.n_first) k_pipe.consumer_wait(k_state);
            }
            OnlineSoftmax<kRows>::rescale(o_rc, corr);
            rP = p_fragment(acc_s);
        };
        --n;
        if constexpr (Traits::kBand && !Traits::kPackGQA) {
            // The blocks this group's rows see whole run a step without the mask test (a copy
            // of the plain kernel's): testing every block cost the band kernel ~5% against the
            // plain one on the same unmasked work. Not in the packed
            // kernel, whose row mapping leaves no registers for a second copy (it spilled in
            // the loop).
            int clean_lo, clean_hi;
            mask.unmasked_key_blocks(group_q_row0, group_q_span, kBlockN, clean_lo, clean_hi);
            clean_lo = max(clean_lo, g.n_first);
            while (n >= g.n_first) {
                if (n < clean_hi && n >= clean_lo) {
                    for (; n >= clean_lo; --n) step(n, cute::false_type{});
                } else {
                    step(n, cute::true_type{});
                    --n;
                }
            }
        } else {
            for (; n >= g.n_first; --n) step(n, cute::bool_constant<Traits::kBand>{});
        }

        // Last block: O += P V only.
        Tensor rP_a = p_operand(rP);
        values_wait(n);  // n == n_first - 1 here
        take_turn();
        if constexpr (!kIdle) {
            wgmma_issue<false>(mma_pv, rP_a, tOrV(_, _, _, v_state.index()), acc_o);
        }
        pass_turn();
        warpgroup_wait<0>();
        // The tile's last V stage, unless the epilogue stages this group's O slice in it.
        const bool staged = staged_output(p);
        if (!staged || !Traits::slice_in_values(group)) v_pipe.consumer_release(v_state);
        ++v_state;
        if (staged && Traits::kAnySliceInValues && cute::elect_one_sync()) ss.values_read.arrive();

        softmax.finalize(o_rc, scale_log2, lse, row_err);
        if constexpr (Traits::kFp8) {
            CUTE_UNROLL
            for (int i = 0; i < size(acc_o); ++i) acc_o(i) *= v_descale;
        }
    }

    // P in the input type: converted in place (16-bit), or packed as the e4m3 A operand.
    template <class Acc>
    static __device__ auto p_fragment(Acc const& acc_s) {
        if constexpr (Traits::kFp8) {
            return p_as_e4m3_operand<T>(acc_s);
        } else {
            return convert_fragment<T>(acc_s);
        }
    }
    // p_fragment's registers as the PV GEMM's A operand.
    template <class P>
    static __device__ auto p_operand(P& rP) {
        if constexpr (Traits::kFp8) {
            return make_tensor(rP.data(), rP.layout());
        } else {
            return make_tensor(rP.data(), wgmma_acc_as_a_operand(rP.layout()));
        }
    }
    // The shared memory the PV GEMMs read V from: V's own stages, or e4m3's transposed ones.
    static __device__ T* values_buffer(SharedStorage& ss) {
        if constexpr (Traits::kFp8) {
            return ss.vt.data();
        } else {
            return ss.v.data();
        }
    }

};

}  // namespace flash
