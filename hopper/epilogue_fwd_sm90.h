// Epilogue of the SM90 forward. O arrives normalised, fp32 in registers; the LSE is written from
// registers. Three ways out for O:
//  - store_staged (batched tiles, d >= 128): each consumer group converts its 64 x d slice,
//    writes it with stmatrix into the tile's last K or V stage (the mainloop kept that stage)
//    and one thread issues a TMA store; the stage goes back to the producer once the TMA has
//    read it. The group's own stores then take a few instructions, and the writes to HBM drain
//    while the next tile runs. The TMA clips rows past seqlen_q and columns past the head dim.
//  - store_buffered (batched, unpacked tiles, d <= 64; e4m3 at d = 128): the same through a
//    buffer of its own, so a group does not wait for the TMA's read until its next tile's store.
//  - store (varlen, packed GQA, d = 96, tiles without keys from d = 128): regrouped within each
//    quad of lanes so that a lane holds 8 neighbouring columns, written with 16-byte stores
//    predicated on the sequence's rows, so varlen tiles never touch a neighbouring sequence.
// None uses the Q buffer, so the next tile's Q loads while this one finishes.
#pragma once

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include <cute/tensor.hpp>

#include "fwd_traits_sm90.h"
#include "mainloop_fwd_sm90.h"
#include "common/seq_info.h"
#include "sm90_utils.h"
#include "tile_scheduler.h"
#include "tma_views.h"

namespace flash {

// 4 x 4 transpose of 32-bit values across the lanes of a quad (`lane` = lane % 4): lane q ends
// with v[i] = lane i's v[q]. Two butterfly rounds; in the round on bit b a lane replaces the
// entries whose index differs from its lane in bit b with its partner's entry at index ^ b.
__forceinline__ __device__ void quad_transpose(uint32_t* v, int lane) {
    CUTE_UNROLL
    for (int b = 1; b <= 2; b *= 2) {
        const bool high = lane & b;
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) {
            if (i & b) continue;  // i: the pair (i, i + b)
            const uint32_t send = high ? v[i] : v[i + b];
            const uint32_t got = __shfl_xor_sync(0xffffffff, send, b);
            if (high) {
                v[i] = got;
            } else {
                v[i + b] = got;
            }
        }
    }
}

template <class Traits>
struct Sm90FwdEpilogue {
    using T = typename Traits::OutElement;  // the output's type (bf16 for e4m3 inputs)
    using BM = typename Traits::BM;
    using D = typename Traits::D;

    // This consumer thread's tile coordinates (row, col) of its output, as a (rows, cols) view
    // in the order of acc_o's.
    static __device__ auto output_coords(int ctid) {
        typename Traits::MmaPV mma_pv;
        Tensor cO = mma_pv.get_thread_slice(ctid).partition_C(make_identity_tensor(Shape<BM, D>{}));
        return make_tensor(cO.data(), wgmma_acc_as_rows_cols(cO.layout()));
    }

    // The K or V stage this group kept for its O slice (the one before the state's; a release
    // reads the index only), once the other groups' last GEMMs have read it.
    static __device__ typename Traits::PipeState held_stage(
        typename Traits::SharedStorage& ss, typename Traits::PipeState const& k_state,
        typename Traits::PipeState const& v_state, int phase) {
        const bool in_values = Traits::slice_in_values(consumer_group());
        const int next = in_values ? v_state.index() : k_state.index();
        if (in_values) {
            ss.values_read.wait(phase);
        } else {
            ss.keys_read.wait(phase);
        }
        return typename Traits::PipeState(next == 0 ? Traits::kStages - 1 : next - 1, 0, 0);
    }

    // In place of store_staged where another CTA stores the tile (a piece of a split tile that
    // did not finish it): gives the kept stage back.
    static __device__ void release_staged(typename Traits::SharedStorage& ss,
                                          typename Traits::KPipe& k_pipe,
                                          typename Traits::VPipe& v_pipe,
                                          typename Traits::PipeState const& k_state,
                                          typename Traits::PipeState const& v_state, int phase) {
        const typename Traits::PipeState last = held_stage(ss, k_state, v_state, phase);
        if (Traits::slice_in_values(consumer_group())) {
            v_pipe.consumer_release(last);
        } else {
            k_pipe.consumer_release(last);
        }
    }

    static constexpr int kAccRows = 2;  // rows per thread of a WGMMA accumulator
    // Workspace per slot and piece (SplitPlan): the CTA's block_m x d fp32 outputs, and an LSE
    // per accumulator row of each consumer thread.
    static constexpr int64_t kPieceOBytes = int64_t(Traits::kBlockM) * D::value * sizeof(float);
    static constexpr int64_t kPieceLseBytes =
        int64_t(kAccRows) * Traits::kConsumerThreads * sizeof(float);

    // One piece of a split tile (SplitPlan): this group leaves its partial O and LSE in the
    // workspace, and the group that completes the tile's last piece merges every piece's into
    // acc_o and lse, weighting each by exp(its LSE - the merged LSE). Returns whether this group
    // now holds the tile's output (and stores it). The pieces run at the same time on other SMs:
    // each releases its writes before it counts itself in, and the merging group reads the
    // others' from L2 (ld.global.cg) after its count. Rows outside the sequence (`g`) are
    // neither written nor merged: a decode tile holds a few rows of its block_m.
    template <class AccO, int kRows>
    static __device__ bool merge_pieces(SplitPlan const& s, Tile const& t,
                                        Sm90TileGeometry const& g, AccO& acc_o,
                                        float (&lse)[kRows]) {
        static_assert(kRows == kAccRows);
        constexpr int kThreads = Traits::kConsumerThreads;
        Tensor o_rc = make_tensor(acc_o.data(), wgmma_acc_as_rows_cols(acc_o.layout()));
        // Each row's values go in fours (one float4 of the workspace), so the merge adds another
        // piece's rows in place, without a second accumulator (d=256 has no registers for one).
        constexpr int kQuads = decltype(size<1>(o_rc))::value / 4;
        static_assert(decltype(size<1>(o_rc))::value % 4 == 0);
        static_assert(decltype(size<0>(o_rc))::value == kRows);
        const int ctid = int(threadIdx.x) - 128;
        const int group = consumer_group();
        const int rank = Traits::kClusterM == 1 ? 0 : int(cute::block_rank_in_cluster());
        const index_t slot = index_t(t.split) * Traits::kClusterM + rank;
        Tensor cO_rc = output_coords(ctid);
        auto in_sequence = [&](int r) { return g.holds_row(get<0>(cO_rc(r, 0))); };
        auto o_of = [&](int piece, int r, int j) {
            return reinterpret_cast<float4*>(s.o) +
                   ((slot * s.max_pieces + piece) * kRows * kQuads + r * kQuads + j) * kThreads +
                   ctid;
        };
        auto lse_of = [&](int piece, int r) {
            return s.lse + ((slot * s.max_pieces + piece) * kRows + r) * kThreads + ctid;
        };
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            if (!in_sequence(r)) continue;
            CUTE_UNROLL
            for (int j = 0; j < kQuads; ++j) {
                __stcg(o_of(t.piece, r, j), make_float4(o_rc(r, 4 * j), o_rc(r, 4 * j + 1),
                                                         o_rc(r, 4 * j + 2), o_rc(r, 4 * j + 3)));
            }
            __stcg(lse_of(t.piece, r), lse[r]);
        }
        // The group's writes, then one thread's release and count: the barrier orders the
        // group's writes before its fence. The merging group's acquire fence orders its reads
        // after the count, the barrier its other threads' reads.
        barrier_sync(epilogue_barrier(group), 128);
        bool last = false;
        if (ctid % 128 == 0) {
            fence_acq_rel_gpu();
            last = atomicAdd(s.arrived + slot * Traits::kConsumerWarpGroups + group, 1) ==
                   t.pieces - 1;
            if (last) fence_acq_rel_gpu();
        }
        if (!barrier_sync_or(epilogue_barrier(group), 128, last)) return false;

        // A row that saw no key in a piece has LSE +inf and O 0 there (OnlineSoftmax::
        // finalize): it weighs nothing. The pieces are summed in their order, this group's own
        // read back like the others', so the result does not depend on which piece finished
        // last: the forward stays deterministic.
        auto live = [](float x) { return x == INFINITY ? -INFINITY : x; };
        auto lse_piece = [&](int q, int r) { return q == t.piece ? lse[r] : __ldcg(lse_of(q, r)); };
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            if (!in_sequence(r)) continue;
            float top = -INFINITY;
            for (int q = 0; q < t.pieces; ++q) top = fmaxf(top, live(lse_piece(q, r)));
            CUTE_UNROLL
            for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) = 0.f;
            float sum = 0.f;
            for (int q = 0; q < t.pieces; ++q) {
                const float w = top == -INFINITY ? 0.f : __expf(live(lse_piece(q, r)) - top);
                sum += w;
                CUTE_UNROLL
                for (int j = 0; j < kQuads; ++j) {
                    const float4 x = __ldcg(o_of(q, r, j));
                    o_rc(r, 4 * j) += w * x.x;
                    o_rc(r, 4 * j + 1) += w * x.y;
                    o_rc(r, 4 * j + 2) += w * x.z;
                    o_rc(r, 4 * j + 3) += w * x.w;
                }
            }
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            CUTE_UNROLL
            for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= inv;
            lse[r] = sum > 0.f ? top + logf(sum) : INFINITY;
        }
        return true;
    }

    // Whether tiles leave through the dedicated O buffer (store_buffered): batched, unpacked
    // tiles, d <= 64 (e4m3: d = 128). A TMA box of varlen rows would cross into the
    // neighbouring sequences.
    static __device__ bool buffered_output(FwdParams const& p) {
        return Traits::kBufferedOutput && (!Traits::kBand || !p.is_varlen());
    }

    // This group's 64 x d slice of O: converted, written to `slice` with stmatrix, then one
    // thread issues its TMA store to the tile's rows [row0 + 64 group, +64) and commits it.
    // The TMA clips rows outside [0, seqlen_q) and columns past the head dim.
    template <class AccO>
    static __device__ void stage_slice(Sm90FwdArgs<Traits> const& a, T* slice, int bidb,
                                       int bidh, Sm90TileGeometry const& g, AccO const& acc_o) {
        FwdParams const& p = a.p;
        const int ctid = int(threadIdx.x) - 128;
        const int group = consumer_group();
        Tensor rO = convert_fragment<T>(acc_o);
        Tensor sO = make_tensor(make_smem_ptr(slice), typename Traits::SmemLayoutOSlice{});
        typename Traits::StoreOSlice store;
        auto thr = store.get_thread_slice(ctid % 128);
        copy(store, thr.retile_S(rO), thr.partition_D(sO));
        cutlass::arch::fence_view_async_shared();  // stmatrix writes, then the TMA reads
        barrier_sync(epilogue_barrier(group), 128);
        if (ctid % 128 == 0) {
            Tensor gO = local_tile(tma_head_view(a.tma_o, a.rows_q, p.headdim, p.nheads,
                                                 a.batch_q, bidh, bidb, g.row0 + 64 * group),
                                   Shape<_64, D>{}, make_coord(_0{}, _0{}));
            auto to = tma_partition(a.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO),
                                    group_modes<0, 2>(gO));
            copy(a.tma_o, get<1>(to), get<0>(to));
            tma_store_arrive();
        }
    }

    // The learnable sink of each of this thread's rows (common/softmax.h join_sink), once the
    // tile's pieces are merged. A packed tile's row r is of query head bidh * pack + r % pack.
    template <class AccO, int kRows>
    static __device__ void join_sinks(FwdParams const& p, int bidh, Sm90TileGeometry const& g,
                                      AccO& acc_o, float (&lse)[kRows]) {
        Tensor o_rc = make_tensor(acc_o.data(), wgmma_acc_as_rows_cols(acc_o.layout()));
        Tensor cO_rc = output_coords(int(threadIdx.x) - 128);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            int head = bidh;
            if constexpr (Traits::kPackGQA) {
                head = bidh * p.pack_gqa + (g.row0 + get<0>(cO_rc(r, 0))) % p.pack_gqa;
            }
            join_sink(o_rc(r, _), lse[r], p.sink[head]);
        }
    }

    // The LSE of this thread's rows inside the sequence (one lane per quad writes a row's).
    template <int kRows>
    static __device__ void store_lse(FwdParams const& p, SeqInfo const& seq, int bidb, int bidh,
                                     Sm90TileGeometry const& g, float const (&lse)[kRows]) {
        const int ctid = int(threadIdx.x) - 128;
        Tensor cO_rc = output_coords(ctid);
        float* lse_ptr = p.lse + seq.lse_offset(p, bidb, bidh) + g.row0;
        if (ctid % 4 == 0) {
            CUTE_UNROLL
            for (int r = 0; r < kRows; ++r) {
                const int row = get<0>(cO_rc(r, 0));
                if (g.holds_row(row)) lse_ptr[row] = lse[r];
            }
        }
    }

    // Run by every consumer thread after a tile with keys when Mainloop::staged_output holds;
    // k_state / v_state are past the tile's last stages. `phase`: parity of the tile's
    // keys_read / values_read completion.
    template <class AccO, int kRows>
    static __device__ void store_staged(Sm90FwdArgs<Traits> const& a,
                                        typename Traits::SharedStorage& ss,
                                        typename Traits::KPipe& k_pipe,
                                        typename Traits::VPipe& v_pipe,
                                        typename Traits::PipeState const& k_state,
                                        typename Traits::PipeState const& v_state, int phase,
                                        SeqInfo const& seq, int bidb, int bidh,
                                        Sm90TileGeometry const& g,
                                        AccO const& acc_o, float const (&lse)[kRows]) {
        const int ctid = int(threadIdx.x) - 128;
        const int group = consumer_group();
        const bool in_values = Traits::slice_in_values(group);
        const typename Traits::PipeState last = held_stage(ss, k_state, v_state, phase);
        constexpr int kStageElems = Traits::kBlockN * D::value;
        constexpr int kSliceElems = 64 * D::value;
        T* slice = (in_values ? ss.v.data() : ss.k.data()) + last.index() * kStageElems +
                   (in_values ? group - Traits::kSlicesPerStage : group) * kSliceElems;
        stage_slice(a, slice, bidb, bidh, g, acc_o);
        if (ctid % 128 == 0) tma_store_wait<0>();  // the slice has been read
        barrier_sync(epilogue_barrier(group), 128);
        if (in_values) {
            v_pipe.consumer_release(last);
        } else {
            k_pipe.consumer_release(last);
        }
        store_lse(a.p, seq, bidb, bidh, g, lse);
    }

    // Run by every consumer thread when buffered_output holds. The group first waits for the
    // TMA to have read its previous slice from the buffer, then stages this one and leaves.
    template <class AccO, int kRows>
    static __device__ void store_buffered(Sm90FwdArgs<Traits> const& a,
                                          typename Traits::SharedStorage& ss,
                                          SeqInfo const& seq, int bidb, int bidh,
                                          Sm90TileGeometry const& g, AccO const& acc_o,
                                          float const (&lse)[kRows]) {
        const int group = consumer_group();
        if (g.group_outside(group)) return;  // nothing of the slice is stored
        if (Traits::kEndAligned && g.row0 + 64 * group < 0) {
            // A TMA store from a negative row faults (an illegal instruction) where a load
            // zero-fills: the top tile's slice across the sequence's start goes from registers.
            store(a.p, seq, bidb, bidh, g, acc_o, lse);
            return;
        }
        if constexpr (Traits::kBufferedOutput) {  // the buffer exists (else never called)
            if (int(threadIdx.x) % 128 == 0) tma_store_wait<0>();
            barrier_sync(epilogue_barrier(group), 128);
            T* slice = ss.o.data() + group * cosize_v<typename Traits::SmemLayoutOSlice>;
            stage_slice(a, slice, bidb, bidh, g, acc_o);
            store_lse(a.p, seq, bidb, bidh, g, lse);
        }
    }

    // After the last tile: the buffer must outlive the TMA's reads of it.
    static __device__ void drain_buffered(FwdParams const& p) {
        if (buffered_output(p) && int(threadIdx.x) % 128 == 0) tma_store_wait<0>();
    }

    // Run by every consumer thread; `acc_o` and `lse` are this thread's rows. With GQA packing
    // `bidh` is the KV head and each packed row goes to its own query row and head.
    template <class AccO, int kRows>
    static __device__ void store(FwdParams const& p, SeqInfo const& seq, int bidb, int bidh,
                                 Sm90TileGeometry const& g, AccO const& acc_o,
                                 float const (&lse)[kRows]) {
        const int ctid = int(threadIdx.x) - 128;
        Tensor cO_rc = output_coords(ctid);
        Tensor o_rc = make_tensor(acc_o.data(), wgmma_acc_as_rows_cols(acc_o.layout()));
        static_assert(decltype(size<1>(o_rc))::value % 2 == 0);
        static_assert(decltype(size<0>(o_rc))::value == kRows);

        // Lane q of a quad holds columns 8j + 2q and 8j + 2q + 1 of its row for every 8-column
        // group j (one 4-byte pair each). A 4 x 4 transpose of pairs within the quad gives lane
        // q all of group 4m + q: one 16-byte store instead of four 4-byte ones, 64 bytes of a
        // row per quad per store. With 4-byte stores, which touch 8 rows in 16-byte pieces
        // per warp store, O's stores cost 15% at seqlen 512 (d=128); 16-byte ones gained 5.9%.
        constexpr int kGroups = decltype(size<1>(o_rc))::value / 2;
        static_assert(kGroups % 4 == 0, "head-dim tiers are multiples of 32");
        const int quad_lane = ctid % 4;
        const auto base = cO_rc(0, 0);
        const auto offsets = cO_rc.layout();
        T* o_ptr = static_cast<T*>(p.o) + seq.q_offset(p.o_stride, p, bidb, g.row0, bidh);
        float* lse_ptr = p.lse + seq.lse_offset(p, bidb, bidh) + g.row0;
        cutlass::NumericArrayConverter<T, float, 2> convert;
        CUTE_UNROLL
        for (int r = 0; r < size<0>(o_rc); ++r) {
            uint32_t pairs[kGroups];
            CUTE_UNROLL
            for (int j = 0; j < kGroups; ++j) {
                cutlass::Array<float, 2> pair;
                pair[0] = o_rc(r, 2 * j);
                pair[1] = o_rc(r, 2 * j + 1);
                const cutlass::Array<T, 2> packed = convert(pair);
                pairs[j] = reinterpret_cast<uint32_t const&>(packed);
            }
            // Every lane shuffles, whatever its row: the row bound only predicates the stores.
            CUTE_UNROLL
            for (int m = 0; m < kGroups / 4; ++m) quad_transpose(pairs + 4 * m, quad_lane);
            const int row = get<0>(base) + get<0>(offsets(r, 0));
            if (!g.holds_row(row)) continue;
            T* row_ptr = o_ptr + index_t(row) * p.o_stride.row;
            float* row_lse = lse_ptr + row;
            if constexpr (Traits::kPackGQA) {
                const int prow = g.row0 + row;
                const int head = bidh * p.pack_gqa + prow % p.pack_gqa;
                const int qrow = prow / p.pack_gqa;
                row_ptr = static_cast<T*>(p.o) + seq.q_offset(p.o_stride, p, bidb, qrow, head);
                row_lse = p.lse + seq.lse_offset(p, bidb, head) + qrow;
            }
            // The base is 16-byte aligned and every stride a multiple of 8 elements (the
            // binding's is_kernel_ready); the head dim is a multiple of 8, so a group is wholly
            // inside it or wholly padding.
            CUTE_UNROLL
            for (int m = 0; m < kGroups / 4; ++m) {
                const int col = 8 * (4 * m + quad_lane);
                if (col < p.headdim) {
                    *reinterpret_cast<uint4*>(row_ptr + col) = make_uint4(
                        pairs[4 * m], pairs[4 * m + 1], pairs[4 * m + 2], pairs[4 * m + 3]);
                }
            }
            if (quad_lane == 0) *row_lse = lse[r];
        }
    }
};

}  // namespace flash
