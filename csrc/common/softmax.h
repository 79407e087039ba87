// Online softmax shared by the SM80 and SM90 kernels. Both archs hold a score tile so that each
// row is spread over the 4 lanes of a quad, viewed here as a (rows, cols) tensor.
#pragma once

#include <cmath>
#include <type_traits>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "fragment.h"

namespace flash {

struct MaxOp {
    static constexpr float kIdentity = -INFINITY;
    __forceinline__ __device__ static float apply(float a, float b) { return fmaxf(a, b); }
};
struct SumOp {
    static constexpr float kIdentity = 0.f;
    __forceinline__ __device__ static float apply(float a, float b) { return a + b; }
};

// Reduces row r of a (rows, cols) view over this thread's columns with 4 independent partials:
// a single running value would be a dependency chain as long as the row.
template <class Op, class S>
__forceinline__ __device__ float row_reduce(S const& s, int r) {
    float part[4] = {Op::kIdentity, Op::kIdentity, Op::kIdentity, Op::kIdentity};
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) part[c % 4] = Op::apply(part[c % 4], s(r, c));
    return Op::apply(Op::apply(part[0], part[1]), Op::apply(part[2], part[3]));
}

// x rounded to nearest (ties to even) at T's precision (bf16: 8 significant bits, fp16: 11,
// e4m3: 4), kept in fp32: what the conversion of P for the PV GEMM does to x, in three integer
// ops (through cutlass::NumericConverter the d=256 band key loops load 2 more spilled values).
// Exact for T's normal range; below it (P < 2^-14 in fp16, 2^-6 in e4m3) it rounds finer than
// T, which only matters for terms far too small to move a row's output.
template <class T>
__forceinline__ __device__ float round_to(float x) {
    constexpr int kDropped = std::is_same_v<T, cutlass::half_t>          ? 13
                             : std::is_same_v<T, cutlass::float_e4m3_t> ? 20
                                                                        : 16;
    const uint32_t bits = __float_as_uint(x);
    const uint32_t half = (1u << (kDropped - 1)) - 1 + ((bits >> kDropped) & 1u);
    return __uint_as_float((bits + half) & ~((1u << kDropped) - 1));
}

// A term per row that a key tile's scores still lack: the softmax treats row r's scores as
// s(r, c) + v[r] without adding it to each of them. ALiBi's bias on a tile wholly on one side of
// the diagonal is a column term (one FMA per score, against two for the bias itself) plus such a
// row term (score.h). NoRowTerm: the scores are complete.
struct NoRowTerm {};
template <int kRows>
struct RowTerm {
    float v[kRows];
};
template <class Term>
inline constexpr bool kHasRowTerm = !std::is_same_v<Term, NoRowTerm>;

// Online softmax over key tiles for the rows this thread holds.
template <int kRows>
struct OnlineSoftmax {
    float row_max[kRows];
    float row_sum[kRows];  // this thread's partial sums; the quad is summed in finalize()

    __forceinline__ __device__ OnlineSoftmax() {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            row_max[r] = -INFINITY;
            row_sum[r] = 0.f;
        }
    }

    // Turns scores `s` into unnormalised probabilities and rescales the running output `o`
    // (both (rows, cols) views).
    template <class S, class O>
    __forceinline__ __device__ void update(S& s, O& o, float scale_log2) {
        float corr[kRows];
        update_scores(s, scale_log2, corr);
        scale_rows(o, corr);
    }

    // The score half of update(): `corr` is the factor the running output must be scaled by.
    // Split out so that a kernel whose output GEMM is still in flight can defer the rescale.
    // Branch-free: every row's max is reduced before any exp, so the quad shuffles of all rows
    // overlap instead of serialising behind per-row branches.
    // `term`: see RowTerm; the running max and the LSE include it.
    template <class S, class Term = NoRowTerm>
    __forceinline__ __device__ void update_scores(S& s, float scale_log2, float (&corr)[kRows],
                                                  Term const& term = Term{}) {
        float m_new[kRows];
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            float m = row_reduce<MaxOp>(s, r);
            if constexpr (kHasRowTerm<Term>) m += term.v[r];
            m_new[r] = fmaxf(row_max[r], m);
        }
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) m_new[r] = quad_max(m_new[r]);
        float m_scaled[kRows];
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            m_scaled[r] = m_new[r] == -INFINITY ? 0.f : m_new[r] * scale_log2;
            // Exactly 1 when the max did not move (the FFMA's residue would make it 1 - ulp and
            // defeat rescale()'s skip); prev == -inf below a finite max gives exp2(-inf) = 0.
            corr[r] = row_max[r] == m_new[r] ? 1.f : exp2f(row_max[r] * scale_log2 - m_scaled[r]);
            row_max[r] = m_new[r];
            row_sum[r] *= corr[r];
        }
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) exps(s, r, scale_log2, m_scaled[r], term);
    }

    // Row r: s = exp2((s + term) * scale_log2 - m_scaled), summed into row_sum. The term moves
    // into the row's constant, so a score costs the same FMA either way.
    template <class S, class Term>
    __forceinline__ __device__ void exps(S& s, int r, float scale_log2, float m_scaled,
                                         Term const& term) {
        if constexpr (kHasRowTerm<Term>) m_scaled = fmaf(-term.v[r], scale_log2, m_scaled);
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s); ++c) s(r, c) = exp2f(s(r, c) * scale_log2 - m_scaled);
        row_sum[r] += row_reduce<SumOp>(s, r);
    }

    // update_scores() for a block after the first: the exps keep the running max unless a row of
    // this warp rises more than kLazyMargin (log2 units) above it. On that common path the exps
    // need no quad shuffle and corr is 1 (the output is not rescaled); P then reaches at most
    // 2^kLazyMargin, which fp32 sums and bf16/fp16 (relative precision) hold as well as 1.
    // A warp-wide vote keeps the branch uniform.
    // A row's largest P is then no longer exactly 1 but rounded to T for the PV GEMM, which in a
    // row dominated by one key costs up to half an ulp of T in the output. `err` (this thread's
    // kRows floats, in shared memory: two more live registers slowed the key loops by up to 16%)
    // collects that rounding of each thread's largest entry for the output's normaliser
    // (finalize()), so such a row's output stays as exact as with max-1 exps; the LSE keeps the
    // exact sum.
    static constexpr float kLazyMargin = 8.f;
    template <class T, class S, class Term = NoRowTerm>
    __forceinline__ __device__ void update_scores_lazy(S& s, float scale_log2,
                                                       float (&corr)[kRows], float* err,
                                                       Term const& term = Term{}) {
        float m_scaled[kRows];
        float top_err[kRows];
        bool rises = false;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            // A row with no key so far (-inf) rises with its first finite score.
            const bool none = row_max[r] == -INFINITY;
            m_scaled[r] = none ? 0.f : row_max[r] * scale_log2;
            const float limit = none ? -INFINITY : m_scaled[r] + kLazyMargin;
            float m_thread = row_reduce<MaxOp>(s, r);
            if constexpr (kHasRowTerm<Term>) m_thread += term.v[r];
            rises |= m_thread * scale_log2 > limit;
            // Off the exps' path: only the lazy branch below reads it.
            const float top = exp2f(m_thread * scale_log2 - m_scaled[r]);
            top_err[r] = round_to<T>(top) - top;
        }
        if (__any_sync(0xffffffffu, rises)) {
            update_scores(s, scale_log2, corr, term);
            CUTE_UNROLL
            for (int r = 0; r < kRows; ++r) err[r] *= corr[r];
            return;
        }
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            corr[r] = 1.f;
            err[r] += top_err[r];
            exps(s, r, scale_log2, m_scaled[r], term);
        }
    }

    // o *= corr, row by row.
    template <class O>
    __forceinline__ __device__ static void scale_rows(O& o, float const (&corr)[kRows]) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(o); ++c) o(r, c) *= corr[r];
        }
    }

    // scale_rows(), skipped when no row max of this thread moved, which is most key blocks once
    // the max has settled. The SM90 key loop gains 0-2% from the skip (d=128/256); the SM80
    // loop, which rescales right after the exps, lost 3% to the branch at d=128 and keeps
    // update()'s unconditional scale.
    template <class O>
    __forceinline__ __device__ static void rescale(O& o, float const (&corr)[kRows]) {
        bool moved = false;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) moved |= corr[r] != 1.f;
        if (moved) scale_rows(o, corr);
    }

    // Normalises `o` and returns the natural-log LSE per row (+inf for rows that kept nothing).
    // `err`: update_scores_lazy()'s rounding terms, added to the output's normaliser only.
    template <class O>
    __forceinline__ __device__ void finalize(O& o, float scale_log2, float (&lse)[kRows],
                                             float const* err = nullptr) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
            float sum = quad_sum(row_sum[r]);
            bool empty = sum == 0.f || sum != sum;
            float norm = err == nullptr ? sum : quad_sum(row_sum[r] + err[r]);
            float inv = empty ? 0.f : 1.f / norm;
            lse[r] = empty ? INFINITY : (row_max[r] * scale_log2 + __log2f(sum)) * float(M_LN2);
            CUTE_UNROLL
            for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv;
        }
    }
};

// A learnable sink (gpt-oss) joined to one finished row: its logit `sink` (natural log, the
// scores' units after the scale) adds exp(sink) to the row's sum, so the row's LSE becomes
// logaddexp(lse, sink) and its normalised output shrinks by exp(lse - that). A row without a
// kept key (lse = +inf, output 0) gets lse = sink; with a -inf sink too it stays +inf. Applied
// once per row after split pieces are merged, so every piece runs without it.
template <class Row>
__forceinline__ __device__ void join_sink(Row&& o_row, float& lse, float sink) {
    const float kept = lse == INFINITY ? -INFINITY : lse;
    const float top = fmaxf(kept, sink);
    if (top == -INFINITY) return;
    const float joined = top + __logf(__expf(kept - top) + __expf(sink - top));
    const float shrink = __expf(kept - joined);
    CUTE_UNROLL
    for (int c = 0; c < size(o_row); ++c) o_row(c) *= shrink;
    lse = joined;
}

}  // namespace flash
