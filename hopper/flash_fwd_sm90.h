// SM90 forward kernel: warp-specialised and persistent (clusters of two CTAs share K/V loads
// from d = 128 without a band). Warp group 0 produces (TMA loads into the K and V pipelines,
// registers lowered with setmaxnreg), the consumer warp groups compute (WGMMA, softmax,
// epilogue, registers raised). Parts: Sm90FwdMainloop, Sm90FwdEpilogue, StaticTileScheduler;
// types and tile sizes in Sm90FwdTraits.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cute/tensor.hpp>

#include "epilogue_fwd_sm90.h"
#include "fwd_traits_sm90.h"
#include "mainloop_fwd_sm90.h"
#include "common/params.h"
#include "common/seq_info.h"
#include "sm90_utils.h"
#include "tile_scheduler.h"
#include "tma_views.h"

namespace flash {

// The pipeline of the stages the consumers' PV GEMMs read: V's own (a reference to v_pipe), or
// for e4m3 the transposed stages' (constructed here, so thread 0 initialises its barriers).
template <class Traits>
__device__ decltype(auto) values_pipe(typename Traits::SharedStorage& ss,
                                      typename Traits::VPipe& v_pipe) {
    if constexpr (Traits::kFp8) {
        return typename Traits::VtPipe(ss.vt_pipe, Traits::kTransposeWarps,
                                       Traits::kConsumerThreads / 32);
    } else {
        return (v_pipe);
    }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ Sm90FwdArgs<Traits> a) {
    using Mainloop = Sm90FwdMainloop<Traits>;
    using Epilogue = Sm90FwdEpilogue<Traits>;
    using QPipe = typename Traits::QPipe;
    using KPipe = typename Traits::KPipe;
    using VPipe = typename Traits::VPipe;

    extern __shared__ __align__(1024) char smem[];
    auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem);
    const bool is_producer = int(threadIdx.x / 128) == int(WarpGroupRole::kProducer);

    // Paged K/V in boxes (Traits::kValueWarp): the producer group's warp 1 loads V and reads
    // the tile queue too.
    constexpr bool values_warp = Traits::kValueWarp;
    if (threadIdx.x == 0) {
        ss.tiles.init(Traits::kConsumerThreads / 32 + Traits::kTransposeWarps + int(values_warp));
        ss.keys_read.init(Traits::kConsumerThreads / 32);
        ss.values_read.init(Traits::kConsumerThreads / 32);
    }
    // Packed tiles: the consumers gather Q, the producer's acquire hands them the free buffer.
    constexpr uint32_t kQLoadBytes = Traits::kPackGQA ? 0 : Traits::kQBytes;
    QPipe q_pipe(ss.q_pipe, pipeline_params<QPipe>(is_producer, kQLoadBytes),
                 Traits::kConsumerThreads / 32);
    KPipe k_pipe(ss.k_pipe, pipeline_params<KPipe>(is_producer, Traits::kKVBytes),
                 Traits::kConsumerThreads / 32);
    VPipe v_pipe(ss.v_pipe,
                 pipeline_params<VPipe>(is_producer, Traits::kKVBytes, values_warp ? 32 : 0),
                 Traits::kValueReaderWarps);
    auto&& values = values_pipe<Traits>(ss, v_pipe);
    cutlass::arch::fence_barrier_init();
    if constexpr (Traits::kClusterM > 1) {
        // The other CTAs' multicasts and releases reach our barriers: they must be initialised.
        cute::cluster_arrive_relaxed();
        cute::cluster_wait();
    } else {
        __syncthreads();
    }

    const typename Traits::Scheduler sched{a.sched};
    if (is_producer) {
        cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
        const int warp = int(threadIdx.x / 32);
        if constexpr (Traits::kFp8) {
            if (warp != 0) {
                Mainloop::transpose_values(a, ss, v_pipe, values, sched, warp - 1);
                return;
            }
        }
        if (values_warp && warp == 1) {
            Mainloop::load_values(a, ss, q_pipe, k_pipe, v_pipe, sched);
            return;
        }
        if (warp != 0) return;  // one warp issues every load (but V's, above)
        auto q_state = cutlass::make_producer_start_state<QPipe>();
        auto k_state = cutlass::make_producer_start_state<KPipe>();
        auto v_state = cutlass::make_producer_start_state<VPipe>();
        // Units whose tile has no query rows (past a varlen sequence's end) never reach the
        // consumers. Only varlen has such tiles, and varlen never runs in clusters, so the CTAs
        // of a pair always agree.
        const bool varlen = a.p.is_varlen();
        auto has_rows = [&](int u) {
            const Tile t = sched.tile(u);
            return Mainloop::geometry(a.p, SeqInfo(a.p, t.bidb), t).has_rows();
        };
        auto next_with_rows = [&](int u, bool fetch) {
            while (fetch || (varlen && sched.valid(u) && !has_rows(u))) {
                u = __shfl_sync(0xffffffff, threadIdx.x % 32 == 0 ? sched.next(u) : 0, 0);
                fetch = false;
            }
            return u;
        };
        // Hands unit u to the queue's readers (the consumers, and e4m3's transposing warps or
        // the V warp), or kDone past the schedule's end; returns what it handed.
        int handed = 0;
        auto hand_out = [&](int u) {
            u = sched.valid(u) ? u : TileQueue::kDone;
            ss.tiles.push(handed++, u);
            return u;
        };
        int unit = hand_out(next_with_rows(sched.first(), false));
        while (unit != TileQueue::kDone) {
            const Tile t = sched.tile(unit);
            const SeqInfo seq(a.p, t.bidb);
            const Sm90TileGeometry g = Mainloop::geometry(a.p, seq, t);
            if (g.has_keys()) {
                Mainloop::load(a, ss, q_pipe, k_pipe, v_pipe, q_state, k_state, v_state, seq,
                               t.bidb, t.bidh, t.m_block, t.shared_kv, g,
                               values_warp ? Mainloop::LoadPart::kQueryKeys
                                           : Mainloop::LoadPart::kAll);
            }
            unit = hand_out(next_with_rows(unit, true));
        }
        // Also keeps this CTA (its barriers) alive until the cluster's last releases arrived.
        q_pipe.producer_tail(q_state);
        k_pipe.producer_tail(k_state);
        if (!values_warp) v_pipe.producer_tail(v_state);
    } else {
        cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
        if constexpr (Traits::kPingPong) {
            ConsumerTurns<Traits::kConsumerWarpGroups>::start(consumer_group());
        }
        typename Traits::QState q_state;
        typename Traits::PipeState k_state;
        typename Traits::ValuesState v_state;
        int out_phase = 0;  // parity of keys_read / values_read, one phase per staged tile
        typename Traits::MmaPV mma_pv;
        int taken = 0;
        for (int unit = ss.tiles.pop(taken++); unit != TileQueue::kDone;) {
            const Tile t = sched.tile(unit);
            const SeqInfo seq(a.p, t.bidb);
            const Sm90TileGeometry g = Mainloop::geometry(a.p, seq, t);
            // The producer hands out tiles with query rows only.
            Tensor acc_o =
                partition_fragment_C(mma_pv, Shape<typename Traits::BM, typename Traits::D>{});
            constexpr int kRows = decltype(size<0>(wgmma_acc_as_rows_cols(acc_o.layout())))::value;
            float lse[kRows];
            // O goes out through a K/V stage of the tile (batched tiles with keys).
            const bool staged = Mainloop::staged_output(a.p) && g.has_keys();
            // Idle groups (rows all outside the sequence) run the loop without GEMMs; the constant
            // below is false where that is off, so no second copy of the loop is compiled.
            if (g.has_keys() && Traits::kSkipIdleGroups && g.group_outside(consumer_group())) {
                Mainloop::compute(a, ss, q_pipe, k_pipe, values, q_state, k_state, v_state, seq,
                                  t.bidb, t.bidh, g, acc_o, lse,
                                  cute::bool_constant<Traits::kSkipIdleGroups>{});
            } else if (g.has_keys()) {
                Mainloop::compute(a, ss, q_pipe, k_pipe, values, q_state, k_state, v_state, seq,
                                  t.bidb, t.bidh, g, acc_o, lse, cute::false_type{});
            } else {
                // No key is visible: the rows attend to nothing.
                clear(acc_o);
                CUTE_UNROLL
                for (int r = 0; r < kRows; ++r) lse[r] = INFINITY;
            }
            // A piece of a split tile: only the group that merges the pieces stores the rows.
            bool stores = true;
            if constexpr (Traits::kSplitTiles) {
                if (t.split >= 0) {
                    stores = Epilogue::merge_pieces(sched.params.split, t, g, acc_o, lse);
                }
            }
            if (stores && a.p.sink != nullptr) Epilogue::join_sinks(a.p, t.bidh, g, acc_o, lse);
            // The staged and buffered paths are compiled only where the traits have them (not
            // staged for e4m3, whose stages are too small for its 16-bit output); elsewhere
            // `staged` and buffered_output are false.
            if (staged) {
                if constexpr (Traits::kStagedOutput) {
                    if (stores) {
                        Epilogue::store_staged(a, ss, k_pipe, v_pipe, k_state, v_state,
                                               out_phase, seq, t.bidb, t.bidh, g, acc_o, lse);
                    } else {
                        Epilogue::release_staged(ss, k_pipe, v_pipe, k_state, v_state, out_phase);
                    }
                    out_phase ^= 1;
                }
            } else if (stores && Epilogue::buffered_output(a.p)) {
                if constexpr (Traits::kBufferedOutput) {
                    Epilogue::store_buffered(a, ss, seq, t.bidb, t.bidh, g, acc_o, lse);
                }
            } else if (stores) {
                Epilogue::store(a.p, seq, t.bidb, t.bidh, g, acc_o, lse);
            }
            unit = ss.tiles.pop(taken++);
        }
        Epilogue::drain_buffered(a.p);
    }
}

// Most heads per section of the dynamic schedule: as many as keep their K and V within about half
// of an H100's 50 MiB L2 (query heads of one GQA group share theirs). `heads`: the heads the
// schedule walks (KV heads when GQA is packed).
template <class Traits>
int heads_per_section(FwdParams const& p, int heads) {
    constexpr int64_t kL2Budget = int64_t(24) << 20;
    const int64_t kv_bytes =
        2 * int64_t(p.seqlen_k) * p.headdim * int64_t(sizeof(typename Traits::Element));
    const int64_t per_head = std::max<int64_t>(kv_bytes * p.nheads_k / heads, 1);
    return int(std::clamp<int64_t>(kL2Budget / per_head, 1, int64_t(heads) * p.batch));
}

// Query tiles per head of one sequence: packed rows with GQA packing (run_fwd_sm90 sets
// p.pack_gqa, 1 when unpacked, before it picks a kernel).
template <class Traits>
int query_tiles(FwdParams const& p) {
    return (p.seqlen_q * p.pack_gqa + Traits::kBlockM - 1) / Traits::kBlockM;
}

// Key blocks of the longest key sequence (varlen: max_seqlen_k).
template <class Traits>
int key_blocks(FwdParams const& p) {
    return (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
}

// Whether the query tiles of all heads form whole clusters, as the static schedule needs.
template <class Traits>
bool whole_clusters(FwdParams const& p) {
    return int64_t(query_tiles<Traits>(p)) * p.nheads * p.batch % Traits::kClusterM == 0;
}

// The launch configuration of `clusters` clusters of the kernel (CTAs where kClusterM is 1).
template <class Traits>
struct Sm90Launch {
    cudaLaunchAttribute cluster_dim = {};
    cudaLaunchConfig_t config = {};

    Sm90Launch(int clusters, cudaStream_t stream) {
        cluster_dim.id = cudaLaunchAttributeClusterDimension;
        cluster_dim.val.clusterDim.x = Traits::kClusterM;
        cluster_dim.val.clusterDim.y = 1;
        cluster_dim.val.clusterDim.z = 1;
        config.gridDim = dim3(Traits::kClusterM * clusters);
        config.blockDim = dim3(Traits::kThreads);
        config.dynamicSmemBytes = Traits::kSmemBytes;
        config.stream = stream;
        config.attrs = &cluster_dim;  // hence no copies
        config.numAttrs = Traits::kClusterM > 1 ? 1 : 0;
    }
    Sm90Launch(Sm90Launch const&) = delete;
    Sm90Launch& operator=(Sm90Launch const&) = delete;
};

// How many CTAs (clusters) of the kernel fit on the current device at once; the first call per
// device also opts the kernel into its shared memory. A failure surfaces as the launch error
// the binding checks.
template <class Traits>
int resident_clusters() {
    auto kernel = flash_fwd_sm90_kernel<Traits>;
    constexpr int kCluster = Traits::kClusterM;
    int device = 0;
    cudaGetDevice(&device);
    static std::atomic<int> resident[64] = {};
    int clusters = device < 64 ? resident[device].load(std::memory_order_relaxed) : 0;
    if (clusters > 0) return clusters;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
    const int num_sms = current_device_info().sms;
    clusters = num_sms / kCluster;
    if constexpr (kCluster > 1) {
        // GPCs hold whole clusters: fewer than num_sms / 2 pairs may be resident.
        const Sm90Launch<Traits> launch(clusters, nullptr);
        int fit = 0;
        if (cudaOccupancyMaxActiveClusters(&fit, kernel, &launch.config) != cudaSuccess) {
            cudaGetLastError();  // a failed query only means the estimate above stays
        } else if (fit > 0) {
            clusters = std::min(clusters, fit);
        }
    }
    clusters = std::max(clusters, 1);
    if (device < 64) resident[device].store(clusters, std::memory_order_relaxed);
    return clusters;
}

// resident_clusters less the clusters that would cover p.sm_margin SMs, at least one.
template <class Traits>
int usable_clusters(FwdParams const& p) {
    constexpr int kCluster = Traits::kClusterM;
    return std::max(1, resident_clusters<Traits>() - (p.sm_margin + kCluster - 1) / kCluster);
}

// Whether tiles may be split by keys: the static schedule's last round (SplitPlan) and the
// packed kernel's few tiles (kv_pieces); FLASH_ATTN_SPLIT=0 turns both off (tests run both).
inline bool split_enabled() {
    const char* env = std::getenv("FLASH_ATTN_SPLIT");
    return env == nullptr || env[0] != '0';
}

template <class Traits>
void launch_fwd_sm90(FwdParams& p, cudaStream_t stream) {
    using T = typename Traits::Element;
    const bool varlen = p.is_varlen();
    const int rows_q = varlen ? p.total_q : p.seqlen_q;
    // Paged K/V: the TMA views are (page_size, d, heads, pages).
    const bool paged = p.block_table != nullptr;
    const int rows_k = paged ? p.page_size : varlen ? p.total_k : p.seqlen_k;
    const int batch = varlen ? 1 : p.batch;
    const int batch_k = paged ? p.num_pages : varlen ? 1 : p.batch_k;
    auto gmem = [&](const void* ptr, int rows, int heads, int entries, TensorStrides const& s) {
        return tma_gmem<T>(ptr, rows, p.headdim, heads, entries, s);
    };
    using BM = typename Traits::BM;
    using BN = typename Traits::BN;
    using D = typename Traits::D;
    using Epilogue = Sm90FwdEpilogue<Traits>;
    // With GQA packing a sequence has seqlen_q * pack_gqa rows per KV head.
    const int heads = p.nheads / p.pack_gqa;
    TileSchedulerParams sched = make_scheduler_params(
        query_tiles<Traits>(p), heads, p.batch, heads_per_section<Traits>(p, heads), nullptr);
    const int clusters = usable_clusters<Traits>(p);
    const int blocks = key_blocks<Traits>(p);
    // Workspace slots of split tiles (each with max_pieces partial outputs) and counters: the
    // dynamic scheduler's, then one per slot and consumer group.
    int64_t slots = 0;
    int64_t counters = 0;
    if constexpr (Traits::kBand) {
        const int tiles = Traits::Scheduler::num_units(sched);
        if (Traits::kSplitTiles && split_enabled()) {
            sched.pieces = kv_pieces(tiles, clusters, blocks);
        }
        if (sched.pieces > 1) {
            slots = tiles;
            sched.split.max_pieces = sched.pieces;
        }
        counters = 1;
    } else {
        if (split_enabled()) {
            sched.split = plan_split(Traits::Scheduler::num_units(sched), clusters, blocks);
        }
        slots = int64_t(sched.split.tail) * Traits::kClusterM;
    }
    const int units = Traits::Scheduler::num_units(sched);
    int grid = std::min(units, clusters);
    if (sched.split.per > 0) grid = clusters;
    const int64_t arrived_offset = counters;
    counters += slots * Traits::kConsumerWarpGroups;
    // Workspace: the counters (zeroed here), then a split's partial LSEs and outputs.
    const int64_t slots_pieces = slots * sched.split.max_pieces;
    auto round_up = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
    const int64_t counter_bytes = round_up(counters * int64_t(sizeof(int)));
    const int64_t lse_bytes = round_up(slots_pieces * Epilogue::kPieceLseBytes);
    const int64_t o_bytes = slots_pieces * Epilogue::kPieceOBytes;
    if (counters > 0) {
        char* ws = static_cast<char*>(
            p.workspace.allocate(p.workspace.context, counter_bytes + lse_bytes + o_bytes));
        sched.counter = reinterpret_cast<int*>(ws);
        sched.split.arrived = reinterpret_cast<int*>(ws) + arrived_offset;
        sched.split.lse = reinterpret_cast<float*>(ws + counter_bytes);
        sched.split.o = reinterpret_cast<float*>(ws + counter_bytes + lse_bytes);
        cudaMemsetAsync(ws, 0, counters * sizeof(int), stream);
    }
    const auto gmem_k = gmem(p.k, rows_k, p.nheads_k, batch_k, p.k_stride);
    const auto gmem_v = gmem(p.v, rows_k, p.nheads_k, batch_k, p.v_stride);
    Sm90FwdArgs<Traits> args{
        p,
        make_tma_copy(SM90_TMA_LOAD{}, gmem(p.q, rows_q, p.nheads, batch, p.q_stride),
                      typename Traits::SmemLayoutQ{}, Shape<BM, D>{}, _1{}),
        Traits::make_tma_kv(gmem_k),
        Traits::make_tma_kv(gmem_v),
        {},
        make_tma_copy(SM90_TMA_STORE{},
                      tma_gmem<typename Traits::OutElement>(p.o, rows_q, p.headdim, p.nheads,
                                                            batch, p.o_stride),
                      typename Traits::SmemLayoutOSlice{}, Shape<_64, D>{}, _1{}),
        rows_q,
        rows_k,
        batch,
        batch_k,
        sched};
    if (Traits::kBand && p.block_table != nullptr && p.page_size % Traits::kBlockN != 0) {
        Traits::make_paged_rows(args.paged_rows, p.page_size, gmem_k, gmem_v);
    }

    const Sm90Launch<Traits> launch(std::max(grid, 1), stream);
    cudaLaunchKernelEx(&launch.config, flash_fwd_sm90_kernel<Traits>, args);
}

// The packed kernel's query heads per tile (GQA packing: the query heads of one KV head share
// tiles), or 0 for the unpacked kernels. Packs where that saves at least a quarter of the tiles
// of one head per tile: short query sequences (decode). Where it saves less, the unpacked
// kernels are faster: the packed one gathers Q with cp.async, stores O from registers and never
// runs in clusters (4 query heads per KV head, packed / unpacked: d=128 non-causal 2048 0.94,
// 8k 0.93, causal 2048 0.93; d=256 non-causal 2048 0.90). `few_tiles`: the
// band kernel would run too few tiles to fill the GPU against many keys; the packed kernel
// (also for a group of one query head) splits each tile's keys over SMs (kv_pieces).
// FLASH_ATTN_PACK_GQA=1 packs every GQA call, =0 none (tests run both).
inline int pack_gqa_factor(FwdParams const& p, int block_m, bool few_tiles) {
    const int group = p.nheads / p.nheads_k;
    const char* env = std::getenv("FLASH_ATTN_PACK_GQA");
    if (env != nullptr && env[0] == '0') return 0;
    if (few_tiles) return group;
    if (group == 1) return 0;
    if (env != nullptr && env[0] == '1') return group;
    const int64_t packed = (int64_t(p.seqlen_q) * group + block_m - 1) / block_m;
    const int64_t unpacked = int64_t(group) * ((p.seqlen_q + block_m - 1) / block_m);
    return 4 * packed <= 3 * unpacked ? group : 0;
}

template <class T, int kHeadDim>
void run_fwd_sm90(FwdParams& p, cudaStream_t stream) {
    using Band = Sm90FwdTraits<T, kHeadDim, true>;
    using Plain = Sm90FwdTraits<T, kHeadDim, false>;
    p.pack_gqa = 1;
    const bool band = p.window_left >= 0 || p.window_right >= 0;
    // The plain kernel runs batched sequences that end where their tensors do (no varlen, no
    // seqused_k, not paged), and its clusters pair query tiles: all heads' tiles must make whole
    // pairs. It splits the keys of a grid with few tiles itself (SplitPlan). Other shapes take
    // the band kernel, whose mask and schedule handle them.
    const bool batched = !p.is_varlen() && p.seqused_k == nullptr && p.block_table == nullptr;
    const bool plain = !band && batched && whole_clusters<Plain>(p);
    // ALiBi: the same choice of plain or band kernel, each instantiated with the bias. e4m3 has
    // no ALiBi kernel (the binding refuses ALiBi there).
    if constexpr (!Band::kFp8) {
        if (p.alibi_slopes != nullptr) {
            if (plain) {
                launch_fwd_sm90<Sm90FwdTraits<T, kHeadDim, false, false, true>>(p, stream);
            } else {
                launch_fwd_sm90<Sm90FwdTraits<T, kHeadDim, true, false, true>>(p, stream);
            }
            return;
        }
    }
    using Packed = Sm90FwdTraits<T, kHeadDim, true, true>;
    // The band kernel, packed or not. Paged K/V in pages that do not hold whole key blocks come
    // in boxes of a page, whose loads the kValueWarp kernels (bf16/fp16) share between two
    // producer warps.
    const bool boxes = p.block_table != nullptr && p.page_size % Band::kBlockN != 0;
    auto launch_band = [&](auto pack_gqa) {
        constexpr bool kPack = decltype(pack_gqa)::value;
        if constexpr (!Band::kFp8) {
            if (boxes) {
                launch_fwd_sm90<Sm90FwdTraits<T, kHeadDim, true, kPack, false, true>>(p, stream);
                return;
            }
        }
        if constexpr (!kPack && kHeadDim > 192) {
            if (p.seqlen_k <= sm90_short_keys_max(Band::kFp8)) {
                launch_fwd_sm90<Sm90FwdTraits<T, kHeadDim, true, false, false, false, true>>(
                    p, stream);
                return;
            }
        }
        launch_fwd_sm90<Sm90FwdTraits<T, kHeadDim, true, kPack>>(p, stream);
    };
    const bool few_tiles =
        !plain && split_enabled() &&
        kv_pieces(query_tiles<Band>(p) * p.nheads * p.batch, usable_clusters<Packed>(p),
                  key_blocks<Band>(p)) > 1;
    const int pack = pack_gqa_factor(p, Packed::kBlockM, few_tiles);
    if (pack > 0) {
        p.pack_gqa = pack;
        launch_band(std::true_type{});
    } else if (plain) {
        launch_fwd_sm90<Plain>(p, stream);
    } else {
        launch_band(std::false_type{});
    }
}

}  // namespace flash
