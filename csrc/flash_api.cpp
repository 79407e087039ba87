// The one torch binding: checks what the kernels rely on, fills the params, picks a registered
// kernel for the GPU's code path and launches it. Users' mistakes are caught (with friendlier
// messages) by flash_attn/_validation.py first; these checks keep direct callers safe.
#include <ATen/MemoryOverlap.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda.h>
#include <cutlass/version.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>

#include "common/bad_input.h"
#include "common/kvcache_update.h"
#include "common/params.h"
#include "common/registry.h"
#include "common/tiers.h"
#include "hopper/tile_size.h"

namespace {

using flash::Dtype;
using flash::Kind;

// Error messages are built without C++ streams: some GCC installs link only a static libstdc++,
// so this module carries a second copy of the stream/locale code next to torch's, and formatting
// a number through a stream here crashed the process instead of raising.
void append(std::string& s, const char* v) { s += v; }
void append(std::string& s, at::ScalarType t) { s += c10::toString(t); }
void append(std::string& s, const c10::Device& d) { s += d.str(); }

void append(std::string& s, c10::IntArrayRef a) {
    s += '[';
    for (size_t i = 0; i < a.size(); ++i) {
        if (i > 0) s += ", ";
        s += std::to_string(a[i]);
    }
    s += ']';
}

template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void append(std::string& s, T v) {
    if constexpr (std::is_same_v<T, char>) {
        s += v;
    } else if constexpr (std::is_floating_point_v<T>) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%g", double(v));
        s += buf;
    } else {
        s += std::to_string(v);
    }
}

template <class... Args>
std::string str_of(const Args&... args) {
    std::string s;
    (append(s, args), ...);
    return s;
}

// Raises c10::Error (a RuntimeError in Python) with a message built by str_of.
#define FA_CHECK(cond, ...)                                       \
    do {                                                          \
        if (!(cond)) C10_THROW_ERROR(Error, str_of(__VA_ARGS__)); \
    } while (0)

Dtype dtype_of(const at::Tensor& t) {
    if (t.scalar_type() == at::kHalf) return Dtype::kFp16;
    if (t.scalar_type() == at::kBFloat16) return Dtype::kBf16;
    C10_THROW_ERROR(
        Error, str_of("flash_attn: expected float16 or bfloat16 tensors, got ", t.scalar_type()));
}

const char* dtype_name(Dtype d) { return d == Dtype::kFp16 ? "fp16" : "bf16"; }

// NotImplementedError for a valid request this build cannot serve, raised through the Python
// error state. flash_attn.ops.require_kernel raises first for every Python entry point.
template <class... Args>
[[noreturn]] void raise_not_implemented(const Args&... args) {
    const std::string msg = str_of(args...);
    PyErr_SetString(PyExc_NotImplementedError, msg.c_str());
    throw pybind11::error_already_set();
}

// The code path for this GPU: 80 (mma.sync kernels) on compute capability 8.x and 9.x; the SM90
// kernels take 9.0 once registered unless FLASH_ATTN_FORCE_SM80=1 or `sm90_ok` is false (a
// request they do not serve).
int code_path(Kind kind, Dtype dtype, int tier, bool sm90_ok) {
    const auto* props = at::cuda::getCurrentDeviceProperties();
    if (props->major < 8) {
        raise_not_implemented("flash_attn: needs compute capability 8.0 or newer, this GPU is ",
                              props->major, ".", props->minor);
    }
    const char* force = std::getenv("FLASH_ATTN_FORCE_SM80");
    const bool force_sm80 = force != nullptr && std::string(force) == "1";
    if (props->major == 9 && props->minor == 0 && !force_sm80 && sm90_ok) {
        for (const auto& e : flash::kernel_registry()) {
            if (e.kind == kind && e.arch == 90 && e.dtype == dtype && e.headdim == tier) return 90;
        }
    }
    return 80;
}

const flash::KernelEntry& find_kernel(Kind kind, Dtype dtype, int headdim, bool sm90_ok = true) {
    const int tier = flash::headdim_tier(headdim);
    const int arch = code_path(kind, dtype, tier, sm90_ok);
    for (const auto& e : flash::kernel_registry()) {
        if (e.kind == kind && e.arch == arch && e.dtype == dtype && e.headdim == tier) return e;
    }
    raise_not_implemented(
        "flash_attn: no ", kind == Kind::kFwd ? "forward" : "backward",
        " kernel was built for ", dtype_name(dtype), " head dim ", headdim, " (tier ", tier, ", sm",
        arch, " path). Rebuild with FLASH_ATTN_HEADDIMS including ", tier,
        ", FLASH_ATTN_DTYPES including ", dtype_name(dtype),
        kind == Kind::kBwd ? " and FLASH_ATTN_DISABLE_BACKWARD unset" : "",
        "; `python -m flash_attn` lists what was built.");
}

// Kernels read rows with 16-byte accesses: the last dim must be contiguous, every other stride a
// multiple of 8 elements and the base 16-byte aligned.
// Strides must also be positive where the extent is above 1: an expanded (stride 0) K or V is
// copied, since TMA descriptors take no zero or negative strides.
bool is_kernel_ready(const at::Tensor& t) {
    bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    for (int i = 0; i + 1 < t.dim(); ++i) {
        ok = ok && (t.size(i) == 1 || (t.stride(i) > 0 && t.stride(i) % 8 == 0));
    }
    return ok;
}

// Inputs that are not kernel-ready are copied once into fresh (aligned, contiguous) memory;
// contiguous() would hand back a misaligned contiguous view unchanged.
at::Tensor kernel_ready(const at::Tensor& t) {
    return is_kernel_ready(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

flash::TensorStrides strides_of(const at::Tensor& t, bool varlen) {
    if (varlen) return {0, t.stride(0), t.stride(1)};
    return {t.stride(0), t.stride(1), t.stride(2)};
}

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Tensor& q) {
    FA_CHECK(t.is_cuda(), "flash_attn: ", name, " must be a CUDA tensor");
    FA_CHECK(t.device() == q.device(), "flash_attn: ", name, " is on ", t.device(), ", q on ",
             q.device());
    FA_CHECK(t.scalar_type() == q.scalar_type(), "flash_attn: ", name, " has dtype ",
             t.scalar_type(), ", q has ", q.scalar_type());
}

// An optional per-sequence int32 tensor (seqused_k, kv_batch_idx, cache_seqlens, ...).
void check_batch_ints(const std::optional<at::Tensor>& t, const char* name, int64_t batch,
                      const at::Tensor& q) {
    FA_CHECK(!t.has_value() ||
                 (t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous() &&
                  t->numel() == batch && t->device() == q.device()),
             "flash_attn: ", name, " must be a contiguous int32 tensor of shape (batch,) on q's "
             "device");
}

// A paged K/V `k` (num_pages >= 1, page_size, nheads_k, d) and its block_table (batch,
// max_num_blocks_per_seq >= 1), last dim contiguous; pages of any size >= 1.
// Returns the keys a sequence can hold.
int64_t check_block_table(const at::Tensor& bt, int64_t batch, const at::Tensor& k,
                          const at::Tensor& q) {
    FA_CHECK(bt.scalar_type() == at::kInt && bt.dim() == 2 && bt.size(0) == batch &&
                 bt.size(1) > 0 && bt.stride(1) == 1 && bt.device() == q.device(),
             "flash_attn: block_table must be an int32 tensor of shape (batch, "
             "max_num_blocks_per_seq) on q's device with a contiguous last dim");
    FA_CHECK(k.size(0) > 0 && k.size(1) > 0,
             "flash_attn: a paged K/V needs at least one page of at least one row, got a cache "
             "of shape ", k.sizes());
    return bt.size(1) * k.size(1);
}

void check_cu_seqlens(const std::optional<at::Tensor>& t, const char* name, int64_t batch,
                      const at::Tensor& q) {
    FA_CHECK(t.has_value(), "flash_attn: ", name, " is required for varlen inputs");
    FA_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous(),
             "flash_attn: ", name, " must be a contiguous 1-D int32 tensor");
    FA_CHECK(t->device() == q.device(), "flash_attn: ", name, " must be on ", q.device());
    FA_CHECK(t->numel() == batch + 1, "flash_attn: ", name, " must have batch + 1 = ", batch + 1,
             " entries, got ", t->numel());
}

// Shape, varlen offsets, scale and mask: the part of the params forward and backward share.
struct Problem {
    bool varlen;
    int64_t batch, batch_k, seqlen_q, seqlen_k, nheads, nheads_k, headdim, total_q, total_k;
    int64_t page_size = 0;  // paged K/V (block_table), else 0
};

Problem describe(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::optional<at::Tensor>& cu_seqlens_q,
                 const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                 int64_t max_seqlen_k, const std::optional<at::Tensor>& kv_batch_idx = {},
                 const std::optional<at::Tensor>& block_table = {}) {
    dtype_of(q);
    FA_CHECK(q.is_cuda(), "flash_attn: q must be a CUDA tensor");
    check_cuda_tensor(k, "k", q);
    check_cuda_tensor(v, "v", q);
    Problem pb{};
    pb.varlen = cu_seqlens_q.has_value();
    const bool paged = block_table.has_value();
    const int64_t rank = pb.varlen ? 3 : 4;
    const int64_t k_rank = paged ? 4 : rank;  // pages (num_pages, page_size, nheads_k, d)
    FA_CHECK(q.dim() == rank && k.dim() == k_rank && v.dim() == k_rank,
             "flash_attn: q must be ", rank, "-D and k, v ", k_rank, "-D",
             pb.varlen ? " (varlen)" : "", paged ? " (paged)" : "");
    FA_CHECK(k.sizes() == v.sizes(), "flash_attn: k and v must have the same shape");
    pb.headdim = q.size(-1);
    pb.nheads = q.size(-2);
    pb.nheads_k = k.size(-2);
    FA_CHECK(k.size(-1) == pb.headdim, "flash_attn: q and k head dims differ");
    FA_CHECK(pb.headdim % 8 == 0 && pb.headdim > 0 && pb.headdim <= 256,
             "flash_attn: head dim must be a multiple of 8 in [8, 256], got ", pb.headdim);
    FA_CHECK(pb.nheads > 0 && pb.nheads_k > 0 && pb.nheads % pb.nheads_k == 0,
             "flash_attn: nheads (", pb.nheads, ") must be a multiple of nheads_k (", pb.nheads_k,
             ")");
    // A paged K/V: pages of any size, a table row per sequence; returns the keys a sequence
    // can hold.
    auto check_pages = [&]() -> int64_t {
        FA_CHECK(!kv_batch_idx.has_value(),
                 "flash_attn: kv_batch_idx and block_table cannot be used together");
        pb.page_size = k.size(1);
        pb.batch_k = k.size(0);
        return check_block_table(*block_table, pb.batch, k, q);
    };
    if (pb.varlen) {
        pb.batch = cu_seqlens_q->numel() - 1;
        check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", pb.batch, q);
        check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", pb.batch, q);
        FA_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, "flash_attn: max_seqlen must be >= 0");
        FA_CHECK(!kv_batch_idx.has_value(),
                 "flash_attn: kv_batch_idx is for batched K/V, not varlen (cu_seqlens) inputs");
        pb.total_q = q.size(0);
        pb.batch_k = 1;
        // Paged: cu_seqlens_k counts keys held in pages; a sequence holds at most a table row.
        const int64_t capacity = paged ? check_pages() : 0;
        // Paged, total_k only bounds cu_seqlens_k (SeqInfo's clamp): capped to stay in int.
        pb.total_k = paged ? std::min<int64_t>(pb.batch * capacity, (int64_t(1) << 31) - 1)
                           : k.size(0);
        // No sequence is longer than its tensor (or table row); the kernels clamp each one to
        // max_seqlen.
        pb.seqlen_q = std::min(max_seqlen_q, pb.total_q);
        pb.seqlen_k = std::min(max_seqlen_k, paged ? capacity : pb.total_k);
    } else {
        FA_CHECK(!cu_seqlens_k.has_value(), "flash_attn: cu_seqlens_k given without cu_seqlens_q");
        pb.batch = q.size(0);
        pb.seqlen_q = q.size(1);
        pb.seqlen_k = k.size(1);
        pb.batch_k = k.size(0);
        if (paged) {
            pb.seqlen_k = check_pages();
        } else if (kv_batch_idx.has_value()) {
            check_batch_ints(kv_batch_idx, "kv_batch_idx", pb.batch, q);
            FA_CHECK(pb.batch_k > 0, "flash_attn: kv_batch_idx needs k with at least one entry");
        } else {
            FA_CHECK(pb.batch_k == pb.batch, "flash_attn: q and k batch sizes differ");
        }
        pb.total_q = pb.batch * pb.seqlen_q;
        pb.total_k = pb.page_size > 0 ? pb.batch_k * pb.page_size : pb.batch_k * pb.seqlen_k;
    }
    FA_CHECK(pb.total_q < (int64_t(1) << 31) && pb.total_k < (int64_t(1) << 31) &&
                 pb.seqlen_k < (int64_t(1) << 31),
             "flash_attn: more than 2^31 rows are not supported");
    return pb;
}

// The word the current device's kernels record an out-of-range input in (common/bad_input.h):
// 8 bytes of mapped, pinned host memory per device, allocated at the device's first launch
// outside a CUDA-graph capture (allocating pinned memory synchronizes, which a capture refuses)
// and kept for the process. `host` is what the Python layer reads, `device` what kernels write.
// Launches before it exists, or on a device where it could not be allocated, record nothing.
struct BadInputWord {
    unsigned long long* host = nullptr;
    unsigned long long* device = nullptr;
    bool failed = false;
};

std::mutex& bad_input_mutex() {
    static std::mutex mutex;
    return mutex;
}

std::vector<BadInputWord>& bad_input_words() {
    static std::vector<BadInputWord> words;
    return words;
}

// The device pointer for a launch on `device` and `stream`, or nullptr (not recorded).
unsigned long long* bad_input_word_for_launch(int device, cudaStream_t stream) {
    if (device < 0) return nullptr;
    std::lock_guard<std::mutex> lock(bad_input_mutex());
    auto& words = bad_input_words();
    if (words.size() <= size_t(device)) words.resize(size_t(device) + 1);
    BadInputWord& w = words[size_t(device)];
    if (w.host != nullptr || w.failed) return w.device;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone) {
        cudaGetLastError();
        return nullptr;  // allocated at a later launch outside the capture
    }
    void* host = nullptr;
    void* dev = nullptr;
    if (cudaHostAlloc(&host, sizeof(unsigned long long),
                      cudaHostAllocMapped | cudaHostAllocPortable) == cudaSuccess) {
        *static_cast<unsigned long long*>(host) = 0;
        if (cudaHostGetDevicePointer(&dev, host, 0) == cudaSuccess) {
            w.host = static_cast<unsigned long long*>(host);
            w.device = static_cast<unsigned long long*>(dev);
            return w.device;
        }
        cudaFreeHost(host);
    }
    cudaGetLastError();  // a failure here must not surface as a later launch's error
    w.failed = true;
    return nullptr;
}

unsigned long long* current_bad_input_word() {
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
    }
    return bad_input_word_for_launch(device, at::cuda::getCurrentCUDAStream());
}

void fill_shape(flash::AttnShape& s, const Problem& pb,
                const std::optional<at::Tensor>& cu_seqlens_q,
                const std::optional<at::Tensor>& cu_seqlens_k, double softmax_scale, bool causal,
                int64_t window_left, int64_t window_right, double softcap) {
    FA_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0,
             "flash_attn: softmax_scale must be finite and > 0, got ", softmax_scale);
    FA_CHECK(std::isfinite(softcap) && softcap >= 0, "flash_attn: softcap must be >= 0, got ",
             softcap);
    FA_CHECK(window_left >= -1 && window_right >= -1,
             "flash_attn: window_size entries must be >= -1");
    s.bad_input = current_bad_input_word();
    s.batch = pb.batch;
    s.batch_k = pb.batch_k;
    s.nheads = pb.nheads;
    s.nheads_k = pb.nheads_k;
    s.headdim = pb.headdim;
    s.seqlen_q = pb.seqlen_q;
    s.seqlen_k = pb.seqlen_k;
    s.total_q = pb.total_q;
    s.total_k = pb.total_k;
    s.cu_seqlens_q = pb.varlen ? cu_seqlens_q->data_ptr<int>() : nullptr;
    s.cu_seqlens_k = pb.varlen ? cu_seqlens_k->data_ptr<int>() : nullptr;
    constexpr double kLog2e = 1.4426950408889634;
    s.softmax_scale = float(softmax_scale);
    s.softcap = float(softcap);
    if (softcap > 0) {
        s.softcap_prescale = float(softmax_scale / softcap);
        s.scale_log2 = float(softcap * kLog2e);
    } else {
        s.softcap_prescale = 0.f;
        s.scale_log2 = float(softmax_scale * kLog2e);
    }
    // right >= seqlen_q or left >= seqlen_k keeps every key (see BandMask::keep): unbounded,
    // which also keeps the kernels' int arithmetic small.
    s.window_left = (window_left < 0 || window_left >= pb.seqlen_k) ? -1 : int(window_left);
    s.window_right = causal                                              ? 0
                     : (window_right < 0 || window_right >= pb.seqlen_q) ? -1
                                                                         : int(window_right);
}

// ALiBi slopes: float32 (nheads,) or (batch, nheads), last dim contiguous, on q's device;
// fill_shape first (the unit depends on the scale and softcap).
void set_alibi(flash::AttnShape& s, const std::optional<at::Tensor>& slopes, const Problem& pb,
               const at::Tensor& q) {
    if (!slopes.has_value()) return;
    const at::Tensor& a = *slopes;
    FA_CHECK(a.scalar_type() == at::kFloat && a.device() == q.device() && a.stride(-1) == 1 &&
                 ((a.dim() == 1 && a.size(0) == pb.nheads) ||
                  (a.dim() == 2 && a.size(0) == pb.batch && a.size(1) == pb.nheads)),
             "flash_attn: alibi_slopes must be a float32 tensor of shape (nheads,) or (batch, "
             "nheads) on q's device with a contiguous last dim");
    s.alibi_slopes = a.data_ptr<float>();
    s.alibi_batch_stride = a.dim() == 2 ? a.stride(0) : 0;
    s.alibi_unit = s.softcap > 0.f ? 1.f / s.softcap : 1.f / s.softmax_scale;
}

// Dropout (dropout_p > 0): the mask's (seed, offset) come from rng_state, int64 (2,) on q's device,
// which the kernels read, so that a replayed CUDA graph uses the values its capture wrote there.
// The SM80 kernels draw it (common/dropout.h).
void set_dropout(flash::AttnShape& s, double dropout_p, const std::optional<at::Tensor>& rng_state,
                 const at::Tensor& q) {
    if (dropout_p <= 0.0) return;
    FA_CHECK(dropout_p < 1.0, "flash_attn: dropout_p must be in [0, 1), got ", dropout_p);
    FA_CHECK(rng_state.has_value() && rng_state->scalar_type() == at::kLong &&
                 rng_state->numel() == 2 && rng_state->is_contiguous() &&
                 rng_state->device() == q.device(),
             "flash_attn: dropout needs rng_state, a contiguous int64 tensor of 2 elements "
             "(seed, offset) on q's device");
    s.rng_state = rng_state->data_ptr<int64_t>();
    // Round half to even, as Python's round() in flash_attn/dropout.py.
    const double keep = std::nearbyint((1.0 - dropout_p) * 65536.0);
    s.dropout_keep = uint32_t(std::clamp(keep, 0.0, 65536.0));
    s.dropout_scale = float(1.0 / (1.0 - dropout_p));
}

// Grids are flat and gridDim.x is at most 2^31 - 1. Every tile (and the row kernels' blocks)
// covers at least 64 rows, so this bound holds for each launch.
void check_grid(const Problem& pb) {
    const int64_t blocks = (std::max(pb.seqlen_q, pb.seqlen_k) + 63) / 64 * pb.batch * pb.nheads;
    FA_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "flash_attn: ", blocks,
             " thread blocks (batch x nheads x ceil(max seqlen / 64)) exceed the grid limit "
             "2^31 - 1; split the batch into several calls");
}

// Params::workspace: one byte tensor per call, kept alive by the caller's Workspace.
struct Workspace {
    at::TensorOptions options;
    at::Tensor bytes;
};

void* allocate_workspace(void* context, flash::index_t bytes) {
    auto* w = static_cast<Workspace*>(context);
    w->bytes = at::empty({bytes}, w->options.dtype(at::kByte));
    return w->bytes.data_ptr();
}

void check_launch() {
    const cudaError_t err = cudaGetLastError();
    FA_CHECK(err == cudaSuccess, "flash_attn: kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

std::vector<at::Tensor> fwd(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            std::optional<at::Tensor> out_, std::optional<at::Tensor> cu_seqlens_q,
                            std::optional<at::Tensor> cu_seqlens_k,
                            std::optional<at::Tensor> seqused_k, int64_t max_seqlen_q,
                            int64_t max_seqlen_k, double softmax_scale, bool causal,
                            int64_t window_left, int64_t window_right, double softcap,
                            std::optional<at::Tensor> kv_batch_idx,
                            std::optional<at::Tensor> block_table,
                            std::optional<at::Tensor> leftpad_k,
                            std::optional<at::Tensor> alibi_slopes,
                            std::optional<at::Tensor> sink, double dropout_p,
                            std::optional<at::Tensor> rng_state, int64_t sm_margin) {
    FA_CHECK(sm_margin >= 0, "flash_attn: sm_margin must be >= 0, got ", sm_margin);
    const Problem pb = describe(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, kv_batch_idx, block_table);
    if (sink.has_value()) {
        FA_CHECK(sink->scalar_type() == at::kFloat && sink->dim() == 1 &&
                     sink->size(0) == pb.nheads && sink->is_contiguous() &&
                     sink->device() == q_in.device(),
                 "flash_attn: the learnable sink must be a contiguous float32 tensor of shape "
                 "(nheads,) on q's device");
    }
    if (leftpad_k.has_value()) {
        FA_CHECK(!pb.varlen && seqused_k.has_value(),
                 "flash_attn: leftpad_k is for batched K/V with seqused_k (not with "
                 "cu_seqlens)");
        check_batch_ints(leftpad_k, "leftpad_k", pb.batch, q_in);
    }
    at::cuda::CUDAGuard guard(q_in.device());
    const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
    // The SM90 kernels read a paged K/V by TMA, a key block at a time where pages hold whole
    // key blocks, else in boxes of 8 rows (a swizzle atom's height); pages of other sizes, and a
    // left pad with pages (which moves the rows off those boundaries), run on the SM80 kernels,
    // which gather a paged block row by row. So does dropout, which only they draw.
    const bool sm90_ok =
        dropout_p <= 0.0 &&
        (pb.page_size == 0 || (pb.page_size % 8 == 0 && !leftpad_k.has_value()));
    const auto& entry = find_kernel(Kind::kFwd, dtype_of(q), pb.headdim, sm90_ok);
    check_grid(pb);

    at::Tensor out;
    if (out_.has_value()) {
        out = *out_;
        check_cuda_tensor(out, "out", q);
        FA_CHECK(out.sizes() == q.sizes(), "flash_attn: out must have q's shape ", q.sizes());
        FA_CHECK(out.stride(-1) == 1, "flash_attn: out must have a contiguous last dim");
        FA_CHECK(is_kernel_ready(out),
                 "flash_attn: out must be 16-byte aligned with strides that are multiples of 8");
    } else {
        out = at::empty_like(q, q.options().memory_format(at::MemoryFormat::Contiguous));
    }
    const auto f32 = q.options().dtype(at::kFloat);
    at::Tensor lse = pb.varlen ? at::empty({pb.nheads, pb.total_q}, f32)
                               : at::empty({pb.batch, pb.nheads, pb.seqlen_q}, f32);
    if (pb.varlen) {
        // Rows outside every sequence (or past max_seqlen_q) get no kernel writes: they read as
        // attending to nothing, like the reference.
        out.zero_();
        lse.fill_(std::numeric_limits<float>::infinity());
    }
    if (pb.batch == 0 || pb.seqlen_q == 0 || pb.total_q == 0) return {out, lse};
    if (pb.seqlen_k == 0 || pb.total_k == 0) {
        // No keys at all: every row attends to nothing (and a TMA view cannot be empty).
        out.zero_();
        lse.fill_(std::numeric_limits<float>::infinity());
        return {out, lse};
    }

    flash::FwdParams p;
    fill_shape(p, pb, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right,
               softcap);
    check_batch_ints(seqused_k, "seqused_k", pb.batch, q);
    if (seqused_k.has_value()) p.seqused_k = seqused_k->data_ptr<int>();
    if (kv_batch_idx.has_value()) p.kv_batch_idx = kv_batch_idx->data_ptr<int>();
    if (leftpad_k.has_value()) p.leftpad_k = leftpad_k->data_ptr<int>();
    set_alibi(p, alibi_slopes, pb, q);
    set_dropout(p, dropout_p, rng_state, q);
    p.sm_margin = int(std::min<int64_t>(sm_margin, 1 << 20));
    if (sink.has_value()) p.sink = sink->data_ptr<float>();
    if (block_table.has_value()) {
        p.block_table = block_table->data_ptr<int>();
        p.block_table_stride = block_table->stride(0);
        p.page_size = int(pb.page_size);
        p.num_pages = int(pb.batch_k);
    }
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.o = out.data_ptr();
    p.lse = lse.data_ptr<float>();
    p.q_stride = strides_of(q, pb.varlen);
    // Pages have batched strides (page, row, head), varlen or not.
    p.k_stride = strides_of(k, pb.varlen && pb.page_size == 0);
    p.v_stride = strides_of(v, pb.varlen && pb.page_size == 0);
    p.o_stride = strides_of(out, pb.varlen);
    Workspace workspace{q.options(), {}};
    p.workspace = {&allocate_workspace, &workspace};
    entry.fwd(p, at::cuda::getCurrentCUDAStream());
    check_launch();
    return {out, lse};
}

std::vector<at::Tensor> bwd(const at::Tensor& dout_in, const at::Tensor& q_in,
                            const at::Tensor& k_in, const at::Tensor& v_in,
                            const at::Tensor& out_in, const at::Tensor& lse,
                            std::optional<at::Tensor> dq_, std::optional<at::Tensor> dk_,
                            std::optional<at::Tensor> dv_, std::optional<at::Tensor> cu_seqlens_q,
                            std::optional<at::Tensor> cu_seqlens_k, int64_t max_seqlen_q,
                            int64_t max_seqlen_k, double softmax_scale, bool causal,
                            int64_t window_left, int64_t window_right, double softcap,
                            bool deterministic, std::optional<at::Tensor> alibi_slopes,
                            double dropout_p, std::optional<at::Tensor> rng_state) {
    const Problem pb =
        describe(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    check_cuda_tensor(dout_in, "dout", q_in);
    check_cuda_tensor(out_in, "out", q_in);
    FA_CHECK(dout_in.sizes() == q_in.sizes() && out_in.sizes() == q_in.sizes(),
             "flash_attn: dout and out must have q's shape");
    FA_CHECK(
        lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.device() == q_in.device(),
        "flash_attn: softmax_lse must be a contiguous float32 tensor on q's device");
    const std::vector<int64_t> lse_shape =
        pb.varlen ? std::vector<int64_t>{pb.nheads, pb.total_q}
                  : std::vector<int64_t>{pb.batch, pb.nheads, pb.seqlen_q};
    FA_CHECK(lse.sizes() == at::IntArrayRef(lse_shape), "flash_attn: softmax_lse has shape ",
             lse.sizes(), ", expected ", at::IntArrayRef(lse_shape));
    at::cuda::CUDAGuard guard(q_in.device());
    const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
    const at::Tensor out = kernel_ready(out_in), dout = kernel_ready(dout_in);
    // Dropout runs on the SM80 backward, which draws the mask as the SM80 forward did.
    const auto& entry = find_kernel(Kind::kBwd, dtype_of(q), pb.headdim, dropout_p <= 0.0);
    check_grid(pb);

    // Rows outside every varlen sequence get no kernel writes: start them at zero.
    auto alloc = [&](at::IntArrayRef shape) {
        return pb.varlen ? at::zeros(shape, q.options()) : at::empty(shape, q.options());
    };
    auto given = [&](std::optional<at::Tensor>& t, const at::Tensor& like, const char* name) {
        check_cuda_tensor(*t, name, q);
        FA_CHECK(t->sizes() == like.sizes(), "flash_attn: ", name, " must have shape ",
                 like.sizes());
        FA_CHECK(is_kernel_ready(*t), "flash_attn: ", name,
                 " must be 16-byte aligned with strides that are multiples of 8");
        if (pb.varlen) t->zero_();
        return *t;
    };
    at::Tensor dq = dq_.has_value() ? given(dq_, q, "dq") : alloc(q.sizes());
    at::Tensor dk = dk_.has_value() ? given(dk_, k, "dk") : alloc(k.sizes());
    at::Tensor dv = dv_.has_value() ? given(dv_, v, "dv") : alloc(v.sizes());
    if (pb.batch == 0 || pb.total_q == 0 || pb.total_k == 0) {
        dq.zero_();
        dk.zero_();
        dv.zero_();
        return {dq, dk, dv};
    }

    // The kernel writes dK, dV per query head; GQA groups are summed below.
    const bool grouped = pb.nheads != pb.nheads_k;
    std::vector<int64_t> expanded_shape = k.sizes().vec();
    expanded_shape[expanded_shape.size() - 2] = pb.nheads;
    at::Tensor dk_x = grouped ? alloc(expanded_shape) : dk;
    at::Tensor dv_x = grouped ? alloc(expanded_shape) : dv;

    // The SM80 kernels' scratch: dq_accum follows lse's row order, a row of `tier` floats each
    // (a query tile's rows are contiguous, so the kernel addresses them from one pointer with
    // constant offsets). The SM90 kernels take theirs, and both their turn counters, from the
    // workspace.
    at::Tensor dq_accum, softmax_d;
    if (entry.arch == 80) {
        std::vector<int64_t> dq_accum_shape = lse.sizes().vec();
        dq_accum_shape.push_back(flash::headdim_tier(pb.headdim));
        dq_accum = at::zeros(dq_accum_shape, q.options().dtype(at::kFloat));
        softmax_d = at::empty_like(lse);
    }

    flash::BwdParams p;
    fill_shape(p, pb, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right,
               softcap);
    set_alibi(p, alibi_slopes, pb, q);
    set_dropout(p, dropout_p, rng_state, q);
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.o = out.data_ptr();
    p.dout = dout.data_ptr();
    p.lse = lse.data_ptr<float>();
    p.dq = dq.data_ptr();
    p.dk = dk_x.data_ptr();
    p.dv = dv_x.data_ptr();
    if (entry.arch == 80) {
        p.dq_accum = dq_accum.data_ptr<float>();
        p.softmax_d = softmax_d.data_ptr<float>();
    }
    p.q_stride = strides_of(q, pb.varlen);
    p.k_stride = strides_of(k, pb.varlen);
    p.v_stride = strides_of(v, pb.varlen);
    p.o_stride = strides_of(out, pb.varlen);
    p.do_stride = strides_of(dout, pb.varlen);
    p.dq_stride = strides_of(dq, pb.varlen);
    p.dk_stride = strides_of(dk_x, pb.varlen);
    p.dv_stride = strides_of(dv_x, pb.varlen);
    p.deterministic = deterministic;
    Workspace workspace{q.options(), {}};
    p.workspace = {&allocate_workspace, &workspace};
    entry.bwd(p, at::cuda::getCurrentCUDAStream());
    check_launch();

    if (grouped) {
        std::vector<int64_t> grouped_shape = k.sizes().vec();
        grouped_shape.insert(grouped_shape.end() - 1, pb.nheads / pb.nheads_k);
        dk.copy_(dk_x.view(grouped_shape).sum(-2, false, at::kFloat));
        dv.copy_(dv_x.view(grouped_shape).sum(-2, false, at::kFloat));
    }
    return {dq, dk, dv};
}

flash::Strides4 strides4(const at::Tensor& t) {
    return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// flash_attn_with_kvcache's update (csrc/common/kvcache_update.h): k/v written into the caches in
// place, q rotated into q_rot (given exactly when the rotary tables are), and the attention's
// seqused_k returned. Any strides; the Python layer validates values and shapes first.
at::Tensor kvcache_update(at::Tensor k_cache, at::Tensor v_cache, std::optional<at::Tensor> q_rot,
                          const at::Tensor& q, std::optional<at::Tensor> k,
                          std::optional<at::Tensor> v, std::optional<at::Tensor> cache_seqlens,
                          int64_t seqlen_offset, std::optional<at::Tensor> cache_batch_idx,
                          std::optional<at::Tensor> rotary_cos,
                          std::optional<at::Tensor> rotary_sin, bool rotary_interleaved,
                          bool q_rows_advance, std::optional<at::Tensor> block_table,
                          std::optional<at::Tensor> cache_leftpad) {
    const Dtype dtype = dtype_of(q);
    FA_CHECK(q.is_cuda() && q.dim() == 4, "flash_attn: q must be a 4-D CUDA tensor");
    check_cuda_tensor(k_cache, "k_cache", q);
    check_cuda_tensor(v_cache, "v_cache", q);
    FA_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                 k_cache.size(3) == q.size(3) && k_cache.size(2) > 0 &&
                 q.size(2) % k_cache.size(2) == 0,
             "flash_attn: k_cache and v_cache must have shape (batch_cache, seqlen_cache, "
             "nheads_k, headdim) with q's headdim and nheads_k dividing q's nheads");
    // Written in place by many threads: no element may be written twice.
    at::assert_no_internal_overlap(k_cache);
    at::assert_no_internal_overlap(v_cache);
    at::assert_no_overlap(k_cache, v_cache);
    const int64_t batch = q.size(0);
    check_batch_ints(cache_seqlens, "cache_seqlens", batch, q);
    check_batch_ints(cache_batch_idx, "cache_batch_idx", batch, q);
    check_batch_ints(cache_leftpad, "cache_leftpad", batch, q);
    int64_t seqlen_cache = k_cache.size(1);
    if (block_table.has_value()) {
        FA_CHECK(!cache_batch_idx.has_value(),
                 "flash_attn: cache_batch_idx and block_table cannot be used together");
        seqlen_cache = check_block_table(*block_table, batch, k_cache, q);
    } else {
        FA_CHECK(cache_batch_idx.has_value() ? (batch == 0 || k_cache.size(0) > 0)
                                             : k_cache.size(0) >= batch,
                 "flash_attn: k_cache holds ", k_cache.size(0), " sequences for batch ", batch);
    }
    FA_CHECK(k.has_value() == v.has_value(), "flash_attn: k and v must be given together");
    int64_t seqlen_new = 0;
    if (k.has_value()) {
        check_cuda_tensor(*k, "k", q);
        check_cuda_tensor(*v, "v", q);
        FA_CHECK(k->dim() == 4 && k->sizes() == v->sizes() && k->size(0) == batch &&
                     k->size(2) == k_cache.size(2) && k->size(3) == q.size(3),
                 "flash_attn: k and v must have shape (batch, seqlen_new, nheads_k, headdim)");
        seqlen_new = k->size(1);
    }
    const bool rotary = rotary_cos.has_value();
    FA_CHECK(rotary == rotary_sin.has_value() && rotary == q_rot.has_value() &&
                 (!rotary || k.has_value()),
             "flash_attn: rotary_cos, rotary_sin and q_rot go together, and need k and v");
    at::Tensor cos, sin;
    if (rotary) {
        check_cuda_tensor(*q_rot, "q_rot", q);
        FA_CHECK(q_rot->sizes() == q.sizes(), "flash_attn: q_rot must have q's shape");
        cos = rotary_cos->contiguous();
        sin = rotary_sin->contiguous();
        FA_CHECK(cos.device() == q.device() && sin.device() == q.device() &&
                     cos.scalar_type() == sin.scalar_type() &&
                     (cos.scalar_type() == q.scalar_type() || cos.scalar_type() == at::kFloat),
                 "flash_attn: rotary_cos and rotary_sin must be on q's device, with q's dtype "
                 "or float32");
        FA_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) > 0 &&
                     cos.size(1) > 0 && 2 * cos.size(1) <= q.size(3),
                 "flash_attn: rotary_cos and rotary_sin must have shape (seqlen_ro, "
                 "rotary_dim / 2) with 0 < rotary_dim <= headdim");
    }
    const int64_t most = std::numeric_limits<int32_t>::max();
    FA_CHECK(q.size(1) <= most && k_cache.size(0) <= most && seqlen_cache <= most &&
                 seqlen_new <= most && (!rotary || cos.size(0) <= most) &&
                 seqlen_offset >= -most && seqlen_offset <= most,
             "flash_attn: sizes and cache_seqlens must fit in int32");

    at::cuda::CUDAGuard guard(q.device());
    at::Tensor seqused_k = at::empty({batch}, q.options().dtype(at::kInt));
    if (batch == 0) return seqused_k;
    flash::KVCacheUpdateParams p;
    p.k_cache = k_cache.data_ptr();
    p.v_cache = v_cache.data_ptr();
    p.k_cache_stride = strides4(k_cache);
    p.v_cache_stride = strides4(v_cache);
    if (k.has_value()) {
        p.k = k->data_ptr();
        p.v = v->data_ptr();
        p.k_stride = strides4(*k);
        p.v_stride = strides4(*v);
    }
    p.q = q.data_ptr();
    p.q_stride = strides4(q);
    if (rotary) {
        p.q_rot = q_rot->data_ptr();
        p.q_rot_stride = strides4(*q_rot);
        p.rotary_cos = cos.data_ptr();
        p.rotary_sin = sin.data_ptr();
        p.table_fp32 = cos.scalar_type() == at::kFloat;
        p.rotary_dim = int(2 * cos.size(1));
        p.seqlen_ro = int(cos.size(0));
    }
    p.cache_seqlens = cache_seqlens.has_value() ? cache_seqlens->data_ptr<int>() : nullptr;
    p.seqlen_offset = int(seqlen_offset);
    p.cache_batch_idx = cache_batch_idx.has_value() ? cache_batch_idx->data_ptr<int>() : nullptr;
    p.cache_leftpad = cache_leftpad.has_value() ? cache_leftpad->data_ptr<int>() : nullptr;
    p.interleaved = rotary_interleaved;
    p.q_rows_advance = q_rows_advance;
    p.batch = int(batch);
    p.batch_cache = int(k_cache.size(0));
    p.seqlen_cache = int(seqlen_cache);
    if (block_table.has_value()) {
        p.block_table = block_table->data_ptr<int>();
        p.block_table_stride = block_table->stride(0);
        p.page_size = int(k_cache.size(1));
    }
    p.seqlen_new = int(seqlen_new);
    p.seqlen_q = int(q.size(1));
    p.nheads = int(q.size(2));
    p.nheads_k = int(k_cache.size(2));
    p.headdim = int(q.size(3));
    p.seqused_k = seqused_k.data_ptr<int>();
    p.bad_input = current_bad_input_word();
    flash::run_kvcache_update(p, dtype, at::cuda::getCurrentCUDAStream());
    check_launch();
    return seqused_k;
}

// The host address of device `device`'s bad-input word for flash_attn/_bad_input.py to read,
// or 0 while it does not exist (no launch has recorded into it).
uint64_t bad_input_word_address(int64_t device) {
    std::lock_guard<std::mutex> lock(bad_input_mutex());
    const auto& words = bad_input_words();
    if (device < 0 || size_t(device) >= words.size()) return 0;
    return reinterpret_cast<uint64_t>(words[size_t(device)].host);
}

// The word's value, swapped for 0 in one atomic exchange: a report landing while the Python
// layer clears the word is kept for the next read, and two threads never both take one.
uint64_t take_bad_input(int64_t device) {
    const uint64_t address = bad_input_word_address(device);
    if (address == 0) return 0;
    return __atomic_exchange_n(reinterpret_cast<unsigned long long*>(address), 0ull,
                               __ATOMIC_SEQ_CST);
}

pybind11::dict build_info() {
    pybind11::dict info;
    pybind11::list kernels;
    std::vector<int> archs;
    for (const auto& e : flash::kernel_registry()) {
        pybind11::dict k;
        k["kind"] = e.kind == Kind::kFwd ? "fwd" : "bwd";
        k["arch"] = e.arch;
        k["dtype"] = dtype_name(e.dtype);
        k["headdim"] = e.headdim;
        kernels.append(k);
        if (std::find(archs.begin(), archs.end(), e.arch) == archs.end()) archs.push_back(e.arch);
    }
    std::sort(archs.begin(), archs.end());
    info["archs"] = archs;
    info["kernels"] = kernels;
    info["cuda"] =
        std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
    info["sass_archs"] = FLASH_ATTN_SASS_ARCHS;  // from setup.py: SASS targets, e.g. "80,90"
    info["cutlass"] = std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." +
                      std::to_string(CUTLASS_PATCH);
    return info;
}

// Stream memory operations for ring attention's copy-engine transfers: the current stream
// waits until a 32-bit word in device memory reaches a value, or writes one (after the work
// before it). Neither occupies an SM, which a spinning kernel would take from the attention
// kernels; the word may be a peer GPU's, mapped into this device's address space. The driver
// functions come through the runtime's entry-point query, so the extension needs no libcuda
// at link time.
using StreamValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

StreamValue32Fn driver_stream_value32(const char* name) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status);
    TORCH_CHECK(err == cudaSuccess && status == cudaDriverEntryPointSuccess && fn != nullptr,
                "flash_attn: the CUDA driver does not provide ", name);
    return reinterpret_cast<StreamValue32Fn>(fn);
}

void stream_value32(const at::Tensor& word, int64_t value, bool wait) {
    TORCH_CHECK(word.is_cuda() && word.scalar_type() == at::kInt && word.numel() == 1,
                "flash_attn: stream_value32 takes a CUDA int32 tensor of one element");
    static const StreamValue32Fn wait_fn = driver_stream_value32("cuStreamWaitValue32");
    static const StreamValue32Fn write_fn = driver_stream_value32("cuStreamWriteValue32");
    const CUstream stream = at::cuda::getCurrentCUDAStream(word.device().index()).stream();
    const auto address = reinterpret_cast<CUdeviceptr>(word.data_ptr());
    const auto v = static_cast<cuuint32_t>(value);
    // GEQ compares (int32)(*word - value) >= 0, so counters may wrap.
    const CUresult r = wait ? wait_fn(stream, address, v, CU_STREAM_WAIT_VALUE_GEQ)
                            : write_fn(stream, address, v, CU_STREAM_WRITE_VALUE_DEFAULT);
    TORCH_CHECK(r == CUDA_SUCCESS, "flash_attn: ",
                wait ? "cuStreamWaitValue32" : "cuStreamWriteValue32", " failed with CUresult ",
                int(r));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashAttention kernels (CUDA)";
    namespace py = pybind11;
    m.def("fwd", &fwd, "attention forward", py::arg("q"), py::arg("k"), py::arg("v"),
          py::arg("out"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("seqused_k"),
          py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("softmax_scale"),
          py::arg("causal"), py::arg("window_left"), py::arg("window_right"),
          py::arg("softcap"), py::arg("kv_batch_idx") = py::none(),
          py::arg("block_table") = py::none(), py::arg("leftpad_k") = py::none(),
          py::arg("alibi_slopes") = py::none(), py::arg("sink") = py::none(),
          py::arg("dropout_p") = 0.0, py::arg("rng_state") = py::none(),
          py::arg("sm_margin") = 0);
    m.def("bwd", &bwd, "attention backward", py::arg("dout"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("out"), py::arg("softmax_lse"), py::arg("dq"), py::arg("dk"),
          py::arg("dv"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
          py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("softmax_scale"),
          py::arg("causal"), py::arg("window_left"), py::arg("window_right"),
          py::arg("softcap"), py::arg("deterministic"), py::arg("alibi_slopes") = py::none(),
          py::arg("dropout_p") = 0.0, py::arg("rng_state") = py::none());
    m.def("kvcache_update", &kvcache_update, "flash_attn_with_kvcache's cache update",
          py::arg("k_cache"), py::arg("v_cache"), py::arg("q_rot"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("cache_seqlens"), py::arg("seqlen_offset"),
          py::arg("cache_batch_idx"), py::arg("rotary_cos"), py::arg("rotary_sin"),
          py::arg("rotary_interleaved"), py::arg("q_rows_advance"),
          py::arg("block_table") = py::none(), py::arg("cache_leftpad") = py::none());
    m.def("build_info", &build_info, "what this build compiled");
    m.def("bad_input_word_address", &bad_input_word_address,
          "host address of a device's bad-input word (common/bad_input.h), 0 if none yet",
          py::arg("device"));
    m.def("take_bad_input", &take_bad_input,
          "a device's bad-input word, atomically swapped for 0", py::arg("device"));
    m.def("stream_value32", &stream_value32,
          "the current stream waits until word >= value (wait) or writes value to word",
          py::arg("word"), py::arg("value"), py::arg("wait"));
}
