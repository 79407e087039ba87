// The torch binding, on PyTorch's stable C ABI (docs/stable_abi.md): the ops
// torch.ops.flash_attn_cuda.{fwd,bwd,kvcache_update} check what the kernels rely on, fill the
// params, pick a registered kernel for the GPU's code path and launch it. Only torch's stable
// headers are included, so the library needs no torch C++ symbol (only aoti_torch_* / torch_*
// C functions) and one build runs on later torch releases. Users' mistakes are caught (with
// friendlier messages) by flash_attn/_validation.py first; these checks keep direct callers
// safe.
#include <cuda.h>
#include <cuda_runtime.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "binding.h"
#include "common/bad_input.h"
#include "common/kvcache_update.h"
#include "common/params.h"
#include "common/registry.h"
#include "common/tiers.h"
#include "hopper/tile_size.h"

// libtorch_cuda's current CUDA stream, from the AOTI shim: the stable headers give a
// cudaStream_t only from 2.13 on (Stream::nativeHandle). Weak, so that the library also loads
// where libtorch_cuda is absent (a CPU torch); it is null there and no launch is reached.
extern "C" AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index,
                                                             void** ret_stream)
    __attribute__((weak));

namespace {

using flash::Dtype;
using flash::Kind;
using torch::headeronly::ScalarType;
using torch::stable::Device;
using torch::stable::Tensor;
using IntArrayRef = torch::headeronly::IntHeaderOnlyArrayRef;

// Error messages are built without C++ streams: some GCC installs link only a static libstdc++,
// so this module carries a second copy of the stream/locale code next to torch's, and formatting
// a number through a stream here crashed the process instead of raising. (STD_TORCH_CHECK
// formats __LINE__ through a stream, hence FA_CHECK below.)
void append(std::string& s, const char* v) { s += v; }
void append(std::string& s, ScalarType t) { s += torch::headeronly::toString(t); }

void append(std::string& s, const Device& d) {
    switch (d.type()) {
        case torch::headeronly::DeviceType::CPU: s += "cpu"; break;
        case torch::headeronly::DeviceType::CUDA: s += "cuda"; break;
        default: s += "device type " + std::to_string(int(d.type())); break;
    }
    if (d.index() >= 0) s += ":" + std::to_string(d.index());
}

void append(std::string& s, IntArrayRef a) {
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

// Throws std::runtime_error, which the dispatcher hands to Python as a RuntimeError carrying
// the message; the message is the one STD_TORCH_CHECK would carry, built by str_of.
#define FA_CHECK(cond, ...)                                               \
    do {                                                                  \
        if (!(cond)) throw std::runtime_error(str_of(__VA_ARGS__));       \
    } while (0)

// A dim counted from the end as in ATen (-1 the last), resolved here: the shim's size and
// stride getters are not documented to wrap negative dims.
// Shapes compared element by element: IntHeaderOnlyArrayRef has no operator== in torch 2.11.
bool same_sizes(IntArrayRef a, IntArrayRef b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
        if (a[i] != b[i]) return false;
    }
    return true;
}

int64_t size_at(const Tensor& t, int64_t dim) { return t.size(dim < 0 ? dim + t.dim() : dim); }
int64_t stride_at(const Tensor& t, int64_t dim) {
    return t.stride(dim < 0 ? dim + t.dim() : dim);
}

// A typed data pointer; the callers check the dtype first.
template <class T>
T* ptr(const Tensor& t) {
    return static_cast<T*>(t.data_ptr());
}

// `e4m3`: float8_e4m3fn is an input of this op (the forward's, and the cache update's).
Dtype dtype_of(const Tensor& t, bool e4m3 = false) {
    if (t.scalar_type() == ScalarType::Half) return Dtype::kFp16;
    if (t.scalar_type() == ScalarType::BFloat16) return Dtype::kBf16;
    if (e4m3 && t.scalar_type() == ScalarType::Float8_e4m3fn) return Dtype::kE4m3;
    throw std::runtime_error(str_of("flash_attn: expected float16 or bfloat16 tensors, got ",
                                    t.scalar_type(),
                                    e4m3 ? " (this op also takes float8_e4m3fn)" : ""));
}

using flash::dtype_name;

// A valid request this build cannot serve. The stable ABI carries no Python exception type, so
// this is a RuntimeError; flash_attn.ops.require_kernel raises the NotImplementedError first for
// every Python entry point.
template <class... Args>
[[noreturn]] void raise_not_implemented(const Args&... args) {
    throw std::runtime_error(str_of(args...));
}

// cudaGetDeviceProperties once per device: it queries the driver for every attribute, far too
// slow for each call.
const cudaDeviceProp& device_properties(int device) {
    static std::mutex mutex;
    static std::vector<std::unique_ptr<cudaDeviceProp>> cache;
    std::lock_guard<std::mutex> lock(mutex);
    if (cache.size() <= size_t(device)) cache.resize(size_t(device) + 1);
    auto& slot = cache[size_t(device)];
    if (!slot) {
        auto props = std::make_unique<cudaDeviceProp>();
        const cudaError_t err = cudaGetDeviceProperties(props.get(), device);
        FA_CHECK(err == cudaSuccess, "flash_attn: cudaGetDeviceProperties failed: ",
                 cudaGetErrorString(err));
        slot = std::move(props);
    }
    return *slot;
}

const cudaDeviceProp& current_device_properties() {
    int device = -1;
    const cudaError_t err = cudaGetDevice(&device);
    FA_CHECK(err == cudaSuccess, "flash_attn: cudaGetDevice failed: ", cudaGetErrorString(err));
    return device_properties(device);
}

// torch's current stream on q's device (the caller's DeviceGuard has made it current).
cudaStream_t current_stream(const Tensor& q) {
    FA_CHECK(aoti_torch_get_current_cuda_stream != nullptr,
             "flash_attn: torch's CUDA library (libtorch_cuda) is not loaded");
    void* stream = nullptr;
    FA_CHECK(aoti_torch_get_current_cuda_stream(q.get_device_index(), &stream) ==
                 AOTI_TORCH_SUCCESS,
             "flash_attn: could not get the current CUDA stream of ", q.device());
    return static_cast<cudaStream_t>(stream);
}

// An uninitialized contiguous tensor on `like`'s device, of `like`'s dtype unless given. By the
// C shim's empty_strided, one call into libtorch: torch::stable::new_empty goes through the
// boxed dispatcher by the op's name from TORCH_TARGET_VERSION 2.10 on, about 1.0 us an
// allocation against 0.45 us (CPU machine, a stable op with fwd's schema, 2026-11-27).
Tensor empty_on(const Tensor& like, IntArrayRef shape, std::optional<ScalarType> dtype = {}) {
    constexpr size_t kMaxDims = 8;
    FA_CHECK(shape.size() <= kMaxDims, "flash_attn: a tensor of more than 8 dimensions");
    int64_t sizes[kMaxDims], strides[kMaxDims];
    int64_t stride = 1;
    for (size_t i = shape.size(); i-- > 0;) {
        sizes[i] = shape[i];
        strides[i] = stride;
        stride *= shape[i];
    }
    int32_t dt = 0, device_type = 0, device_index = 0;
    if (dtype.has_value()) {
        dt = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype.value()));
    } else {
        FA_CHECK(aoti_torch_get_dtype(like.get(), &dt) == AOTI_TORCH_SUCCESS,
                 "flash_attn: could not read a tensor's dtype");
    }
    FA_CHECK(aoti_torch_get_device_type(like.get(), &device_type) == AOTI_TORCH_SUCCESS &&
                 aoti_torch_get_device_index(like.get(), &device_index) == AOTI_TORCH_SUCCESS,
             "flash_attn: could not read a tensor's device");
    AtenTensorHandle handle = nullptr;
    FA_CHECK(aoti_torch_empty_strided(int64_t(shape.size()), sizes, strides, dt, device_type,
                                      device_index, &handle) == AOTI_TORCH_SUCCESS,
             "flash_attn: could not allocate a tensor of ", shape.size(), " dimensions");
    return Tensor(handle);
}

Tensor zeros_on(const Tensor& like, IntArrayRef shape, std::optional<ScalarType> dtype = {}) {
    return torch::stable::new_zeros(like, shape, dtype);
}
// The code path for this GPU: 80 (mma.sync kernels) on compute capability 8.x and 9.x; the SM90
// kernels take 9.0 once registered unless FLASH_ATTN_FORCE_SM80=1 or `sm90_ok` is false (a
// request they do not serve).
int code_path(Kind kind, Dtype dtype, int tier, bool sm90_ok) {
    const cudaDeviceProp* props = &current_device_properties();
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
// multiple of 16 bytes and the base 16-byte aligned.
// Strides must also be positive where the extent is above 1: an expanded (stride 0) K or V is
// copied, since TMA descriptors take no zero or negative strides.
bool is_kernel_ready(const Tensor& t) {
    bool ok = stride_at(t, -1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    for (int i = 0; i + 1 < t.dim(); ++i) {
        ok = ok && (t.size(i) == 1 ||
                    (t.stride(i) > 0 && t.stride(i) * int64_t(t.element_size()) % 16 == 0));
    }
    return ok;
}

// Inputs that are not kernel-ready are copied once into fresh (aligned, contiguous) memory;
// contiguous() would hand back a misaligned contiguous view unchanged, and the stable clone()
// keeps a dense input's (possibly unready) strides.
Tensor kernel_ready(const Tensor& t) {
    if (is_kernel_ready(t)) return t;
    Tensor copy = empty_on(t, t.sizes());
    torch::stable::copy_(copy, t);
    return copy;
}

flash::TensorStrides strides_of(const Tensor& t, bool varlen) {
    if (varlen) return {0, t.stride(0), t.stride(1)};
    return {t.stride(0), t.stride(1), t.stride(2)};
}

void check_cuda_tensor(const Tensor& t, const char* name, const Tensor& q) {
    FA_CHECK(t.is_cuda(), "flash_attn: ", name, " must be a CUDA tensor");
    FA_CHECK(t.device() == q.device(), "flash_attn: ", name, " is on ", t.device(), ", q on ",
             q.device());
    FA_CHECK(t.scalar_type() == q.scalar_type(), "flash_attn: ", name, " has dtype ",
             t.scalar_type(), ", q has ", q.scalar_type());
}

// An optional per-sequence int32 tensor (seqused_k, kv_batch_idx, cache_seqlens, ...).
void check_batch_ints(const std::optional<Tensor>& t, const char* name, int64_t batch,
                      const Tensor& q) {
    FA_CHECK(!t.has_value() ||
                 (t->scalar_type() == ScalarType::Int && t->dim() == 1 && t->is_contiguous() &&
                  t->numel() == batch && t->device() == q.device()),
             "flash_attn: ", name, " must be a contiguous int32 tensor of shape (batch,) on q's "
             "device");
}

// A paged K/V `k` (num_pages >= 1, page_size, nheads_k, d) and its block_table (batch,
// max_num_blocks_per_seq >= 1), last dim contiguous; pages of any size >= 1.
// Returns the keys a sequence can hold.
int64_t check_block_table(const Tensor& bt, int64_t batch, const Tensor& k,
                          const Tensor& q) {
    FA_CHECK(bt.scalar_type() == ScalarType::Int && bt.dim() == 2 && bt.size(0) == batch &&
                 bt.size(1) > 0 && bt.stride(1) == 1 && bt.device() == q.device(),
             "flash_attn: block_table must be an int32 tensor of shape (batch, "
             "max_num_blocks_per_seq) on q's device with a contiguous last dim");
    FA_CHECK(k.size(0) > 0 && k.size(1) > 0,
             "flash_attn: a paged K/V needs at least one page of at least one row, got a cache "
             "of shape ", k.sizes());
    return bt.size(1) * k.size(1);
}

void check_cu_seqlens(const std::optional<Tensor>& t, const char* name, int64_t batch,
                      const Tensor& q) {
    FA_CHECK(t.has_value(), "flash_attn: ", name, " is required for varlen inputs");
    FA_CHECK(t->scalar_type() == ScalarType::Int && t->dim() == 1 && t->is_contiguous(),
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

Problem describe(const Tensor& q, const Tensor& k, const Tensor& v,
                 const std::optional<Tensor>& cu_seqlens_q,
                 const std::optional<Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                 int64_t max_seqlen_k, const std::optional<Tensor>& kv_batch_idx = {},
                 const std::optional<Tensor>& block_table = {}) {
    dtype_of(q, /*e4m3=*/true);
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
    FA_CHECK(same_sizes(k.sizes(), v.sizes()), "flash_attn: k and v must have the same shape");
    pb.headdim = size_at(q, -1);
    pb.nheads = size_at(q, -2);
    pb.nheads_k = size_at(k, -2);
    FA_CHECK(size_at(k, -1) == pb.headdim, "flash_attn: q and k head dims differ");
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

unsigned long long* current_bad_input_word(cudaStream_t stream) {
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
    }
    return bad_input_word_for_launch(device, stream);
}

void fill_shape(flash::AttnShape& s, const Problem& pb,
                const std::optional<Tensor>& cu_seqlens_q,
                const std::optional<Tensor>& cu_seqlens_k, double softmax_scale, bool causal,
                int64_t window_left, int64_t window_right, double softcap,
                cudaStream_t stream) {
    FA_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0,
             "flash_attn: softmax_scale must be finite and > 0, got ", softmax_scale);
    FA_CHECK(std::isfinite(softcap) && softcap >= 0, "flash_attn: softcap must be >= 0, got ",
             softcap);
    FA_CHECK(window_left >= -1 && window_right >= -1,
             "flash_attn: window_size entries must be >= -1");
    s.bad_input = current_bad_input_word(stream);
    s.batch = pb.batch;
    s.batch_k = pb.batch_k;
    s.nheads = pb.nheads;
    s.nheads_k = pb.nheads_k;
    s.headdim = pb.headdim;
    s.seqlen_q = pb.seqlen_q;
    s.seqlen_k = pb.seqlen_k;
    s.total_q = pb.total_q;
    s.total_k = pb.total_k;
    s.cu_seqlens_q = pb.varlen ? ptr<int>(*cu_seqlens_q) : nullptr;
    s.cu_seqlens_k = pb.varlen ? ptr<int>(*cu_seqlens_k) : nullptr;
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
// fill_shape first (the unit depends on the scale and softcap). `offset`:
// AttnShape::alibi_offset.
void set_alibi(flash::AttnShape& s, const std::optional<Tensor>& slopes, int64_t offset,
               const Problem& pb, const Tensor& q) {
    if (!slopes.has_value()) return;
    // The kernels add it to seqlen_k - seqlen_q in 32-bit ints.
    FA_CHECK(std::abs(offset) + std::max(pb.seqlen_q, pb.seqlen_k) < (int64_t(1) << 31),
             "flash_attn: alibi_offset plus the sequence lengths must stay below 2^31, got ",
             offset);
    s.alibi_offset = int(offset);
    const Tensor& a = *slopes;
    FA_CHECK(a.scalar_type() == ScalarType::Float && a.device() == q.device() &&
                 stride_at(a, -1) == 1 &&
                 ((a.dim() == 1 && a.size(0) == pb.nheads) ||
                  (a.dim() == 2 && a.size(0) == pb.batch && a.size(1) == pb.nheads)),
             "flash_attn: alibi_slopes must be a float32 tensor of shape (nheads,) or (batch, "
             "nheads) on q's device with a contiguous last dim");
    s.alibi_slopes = ptr<float>(a);
    s.alibi_batch_stride = a.dim() == 2 ? a.stride(0) : 0;
    s.alibi_unit = s.softcap > 0.f ? 1.f / s.softcap : 1.f / s.softmax_scale;
}

// Dropout (dropout_p > 0): the mask's (seed, offset) come from rng_state, int64 (2,) on q's device,
// which the kernels read, so that a replayed CUDA graph uses the values its capture wrote there;
// (5,) adds the call's place in a larger attention (AttnShape::rng_positions). The SM80 kernels
// draw it (common/dropout.h).
void set_dropout(flash::AttnShape& s, double dropout_p, const std::optional<Tensor>& rng_state,
                 const Tensor& q) {
    if (dropout_p <= 0.0) return;
    FA_CHECK(dropout_p < 1.0, "flash_attn: dropout_p must be in [0, 1), got ", dropout_p);
    FA_CHECK(rng_state.has_value() && rng_state->scalar_type() == ScalarType::Long &&
                 (rng_state->numel() == 2 || rng_state->numel() == 5) &&
                 rng_state->is_contiguous() && rng_state->device() == q.device(),
             "flash_attn: dropout needs rng_state, a contiguous int64 tensor of 2 elements "
             "(seed, offset) or 5 (seed, offset, entry0, row0, col0) on q's device");
    s.rng_state = ptr<int64_t>(*rng_state);
    s.rng_positions = rng_state->numel() == 5;
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
    Tensor like;  // the device to allocate on
    std::optional<Tensor> bytes;
};

void* allocate_workspace(void* context, flash::index_t bytes) {
    auto* w = static_cast<Workspace*>(context);
    const int64_t shape[] = {int64_t(bytes)};
    w->bytes = empty_on(w->like, shape, ScalarType::Byte);
    return w->bytes->data_ptr();
}

void check_launch() {
    const cudaError_t err = cudaGetLastError();
    FA_CHECK(err == cudaSuccess, "flash_attn: kernel launch failed: ", cudaGetErrorString(err));
}

// Whether t's elements occupy numel() distinct, gap-free slots (ATen's
// is_non_overlapping_and_dense): its non-trivial dims, by increasing stride, tile memory.
bool is_non_overlapping_and_dense(const Tensor& t) {
    std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
    for (int64_t i = 0; i < t.dim(); ++i) {
        if (t.size(i) != 1) dims.emplace_back(t.stride(i), t.size(i));
    }
    std::sort(dims.begin(), dims.end());
    int64_t expected = 1;
    for (const auto& [stride, size] : dims) {
        if (stride != expected) return false;
        expected *= size;
    }
    return true;
}

// ATen's assert_no_internal_overlap, which the stable ABI lacks: refuses a tensor that is
// certain to write one element twice (a stride 0 over an extent above 1); other layouts that
// are not dense are let through, as ATen does.
void assert_no_internal_overlap(const Tensor& t) {
    if (is_non_overlapping_and_dense(t)) return;
    for (int64_t i = 0; i < t.dim(); ++i) {
        FA_CHECK(!(t.stride(i) == 0 && t.size(i) > 1),
                 "unsupported operation: more than one element of the written-to tensor refers "
                 "to a single memory location. Please clone() the tensor before performing the "
                 "operation.");
    }
}

// ATen's assert_no_overlap: two dense tensors whose bytes intersect (in one process, only
// views of one allocation can) may not both be written. Layouts that are not dense are let
// through, as ATen does.
void assert_no_overlap(const Tensor& a, const Tensor& b) {
    if (a.numel() == 0 || b.numel() == 0) return;
    if (!is_non_overlapping_and_dense(a) || !is_non_overlapping_and_dense(b)) return;
    const auto* a_begin = static_cast<const char*>(a.data_ptr());
    const auto* b_begin = static_cast<const char*>(b.data_ptr());
    const auto* a_end = a_begin + a.numel() * int64_t(a.element_size());
    const auto* b_end = b_begin + b.numel() * int64_t(b.element_size());
    FA_CHECK(!(a_begin < b_end && b_begin < a_end),
             "unsupported operation: some elements of the input tensor and the written-to tensor "
             "refer to a single memory location. Please clone() the tensor before performing the "
             "operation.");
}

// An e4m3 forward's extra arguments and what it does not support (the Python layer raises the
// same NotImplementedError first); any other call must pass no descale. `sm90_ok`: fwd's rule
// for whether the call's pages, left pad and dropout fit the SM90 kernels.
void check_e4m3(bool e4m3, const Tensor& q, const Problem& pb,
                std::initializer_list<std::optional<Tensor>> descales, bool sm90_ok,
                const std::optional<Tensor>& alibi_slopes, double dropout_p) {
    for (const auto& d : descales) {
        if (!d.has_value()) continue;
        FA_CHECK(e4m3, "flash_attn: q_descale, k_descale and v_descale are for float8_e4m3fn "
                       "inputs; q is ", q.scalar_type());
        FA_CHECK(d->scalar_type() == ScalarType::Float && d->dim() == 2 &&
                     d->size(0) == pb.batch && d->size(1) == pb.nheads_k && d->is_contiguous() &&
                     d->device() == q.device(),
                 "flash_attn: a descale must be a contiguous float32 tensor of shape (batch, "
                 "nheads_k) = (", pb.batch, ", ", pb.nheads_k, ") on q's device");
    }
    if (!e4m3) return;
    FA_CHECK(pb.headdim % 16 == 0, "flash_attn: float8_e4m3fn inputs need a head dim that is a "
                                   "multiple of 16 (rows of whole 16-byte pieces), got ",
             pb.headdim);
    if (!sm90_ok || alibi_slopes.has_value()) {
        raise_not_implemented("flash_attn: float8_e4m3fn inputs run the SM90 forward without ",
                              dropout_p > 0.0            ? "dropout"
                              : alibi_slopes.has_value() ? "ALiBi"
                                                         : "pages that are not a multiple of 8 "
                                                           "rows, or leftpad_k with pages");
    }
    const cudaDeviceProp* props = &current_device_properties();
    if (props->major != 9 || props->minor != 0) {
        raise_not_implemented("flash_attn: float8_e4m3fn inputs need the SM90 kernels (compute "
                              "capability 9.0); this GPU is ", props->major, ".", props->minor);
    }
}

// The preallocated `out` of the pybind11 binding is gone: the Python layer never passed one.
std::tuple<Tensor, Tensor> fwd(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                               const std::optional<Tensor>& cu_seqlens_q,
                               const std::optional<Tensor>& cu_seqlens_k,
                               const std::optional<Tensor>& seqused_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, double softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right, double softcap,
                               const std::optional<Tensor>& kv_batch_idx,
                               const std::optional<Tensor>& block_table,
                               const std::optional<Tensor>& leftpad_k,
                               const std::optional<Tensor>& alibi_slopes,
                               const std::optional<Tensor>& sink, double dropout_p,
                               const std::optional<Tensor>& rng_state, int64_t sm_margin,
                               const std::optional<Tensor>& q_descale,
                               const std::optional<Tensor>& k_descale,
                               const std::optional<Tensor>& v_descale, int64_t alibi_offset) {
    FA_CHECK(sm_margin >= 0, "flash_attn: sm_margin must be >= 0, got ", sm_margin);
    const Problem pb = describe(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, kv_batch_idx, block_table);
    const Dtype dtype = dtype_of(q_in, /*e4m3=*/true);
    const bool e4m3 = dtype == Dtype::kE4m3;
    // The SM90 kernels read a paged K/V by TMA, a key block at a time where pages hold whole
    // key blocks, else in boxes of as many rows as the page allows (8 to 64: whole swizzle
    // atoms); pages of other sizes, and a left pad with pages (which moves the rows off those
    // boundaries), run on the SM80 kernels, which gather a paged block row by row. So does
    // dropout, which only they draw.
    const bool sm90_ok =
        dropout_p <= 0.0 &&
        (pb.page_size == 0 || (pb.page_size % 8 == 0 && !leftpad_k.has_value()));
    check_e4m3(e4m3, q_in, pb, {q_descale, k_descale, v_descale}, sm90_ok, alibi_slopes,
               dropout_p);
    if (sink.has_value()) {
        FA_CHECK(sink->scalar_type() == ScalarType::Float && sink->dim() == 1 &&
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
    torch::stable::accelerator::DeviceGuard guard(q_in.get_device_index());
    const cudaStream_t stream = current_stream(q_in);
    const Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
    const auto& entry = find_kernel(Kind::kFwd, dtype, pb.headdim, sm90_ok);
    check_grid(pb);

    Tensor out = e4m3 ? empty_on(q, q.sizes(), ScalarType::BFloat16) : empty_on(q, q.sizes());
    const std::vector<int64_t> lse_shape =
        pb.varlen ? std::vector<int64_t>{pb.nheads, pb.total_q}
                  : std::vector<int64_t>{pb.batch, pb.nheads, pb.seqlen_q};
    Tensor lse = empty_on(q, lse_shape, ScalarType::Float);
    // Rows that get no kernel writes read as attending to nothing, like the reference: varlen
    // rows outside every sequence (or past max_seqlen_q), and every row when there are no keys
    // at all (no kernel runs then: a TMA view cannot be empty).
    const bool no_keys = pb.seqlen_k == 0 || pb.total_k == 0;
    if (pb.varlen || no_keys) {
        torch::stable::zero_(out);
        torch::stable::fill_(lse, std::numeric_limits<double>::infinity());
    }
    if (pb.batch == 0 || pb.seqlen_q == 0 || pb.total_q == 0 || no_keys) return {out, lse};

    flash::FwdParams p;
    fill_shape(p, pb, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right,
               softcap, stream);
    check_batch_ints(seqused_k, "seqused_k", pb.batch, q);
    if (seqused_k.has_value()) p.seqused_k = ptr<int>(*seqused_k);
    if (kv_batch_idx.has_value()) p.kv_batch_idx = ptr<int>(*kv_batch_idx);
    if (leftpad_k.has_value()) p.leftpad_k = ptr<int>(*leftpad_k);
    set_alibi(p, alibi_slopes, alibi_offset, pb, q);
    set_dropout(p, dropout_p, rng_state, q);
    p.sm_margin = int(std::min<int64_t>(sm_margin, 1 << 20));
    if (sink.has_value()) p.sink = ptr<float>(*sink);
    if (q_descale.has_value()) p.q_descale = ptr<float>(*q_descale);
    if (k_descale.has_value()) p.k_descale = ptr<float>(*k_descale);
    if (v_descale.has_value()) p.v_descale = ptr<float>(*v_descale);
    if (block_table.has_value()) {
        p.block_table = ptr<int>(*block_table);
        p.block_table_stride = block_table->stride(0);
        p.page_size = int(pb.page_size);
        p.num_pages = int(pb.batch_k);
    }
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.o = out.data_ptr();
    p.lse = ptr<float>(lse);
    p.q_stride = strides_of(q, pb.varlen);
    // Pages have batched strides (page, row, head), varlen or not.
    p.k_stride = strides_of(k, pb.varlen && pb.page_size == 0);
    p.v_stride = strides_of(v, pb.varlen && pb.page_size == 0);
    p.o_stride = strides_of(out, pb.varlen);
    Workspace workspace{q, {}};
    p.workspace = {&allocate_workspace, &workspace};
    entry.fwd(p, stream);
    check_launch();
    return {out, lse};
}

// The preallocated `dq`, `dk`, `dv` of the pybind11 binding are gone: the Python layer never
// passed them.
std::tuple<Tensor, Tensor, Tensor> bwd(
    const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const Tensor& out_in, const Tensor& lse, const std::optional<Tensor>& cu_seqlens_q,
    const std::optional<Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, bool deterministic, const std::optional<Tensor>& alibi_slopes,
    double dropout_p, const std::optional<Tensor>& rng_state, int64_t alibi_offset) {
    const Problem pb =
        describe(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    check_cuda_tensor(dout_in, "dout", q_in);
    check_cuda_tensor(out_in, "out", q_in);
    FA_CHECK(same_sizes(dout_in.sizes(), q_in.sizes()) && same_sizes(out_in.sizes(), q_in.sizes()),
             "flash_attn: dout and out must have q's shape");
    FA_CHECK(
        lse.scalar_type() == ScalarType::Float && lse.is_contiguous() &&
            lse.device() == q_in.device(),
        "flash_attn: softmax_lse must be a contiguous float32 tensor on q's device");
    const std::vector<int64_t> lse_shape =
        pb.varlen ? std::vector<int64_t>{pb.nheads, pb.total_q}
                  : std::vector<int64_t>{pb.batch, pb.nheads, pb.seqlen_q};
    FA_CHECK(same_sizes(lse.sizes(), IntArrayRef(lse_shape)), "flash_attn: softmax_lse has shape ",
             lse.sizes(), ", expected ", IntArrayRef(lse_shape));
    torch::stable::accelerator::DeviceGuard guard(q_in.get_device_index());
    const cudaStream_t stream = current_stream(q_in);
    const Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
    const Tensor out = kernel_ready(out_in), dout = kernel_ready(dout_in);
    // Dropout runs on the SM80 backward, which draws the mask as the SM80 forward did.
    const auto& entry = find_kernel(Kind::kBwd, dtype_of(q), pb.headdim, dropout_p <= 0.0);
    check_grid(pb);

    // Rows outside every varlen sequence get no kernel writes: start them at zero.
    auto alloc = [&](IntArrayRef shape) {
        return pb.varlen ? zeros_on(q, shape) : empty_on(q, shape);
    };
    Tensor dq = alloc(q.sizes());
    if (pb.batch == 0 || pb.total_q == 0 || pb.total_k == 0) {
        torch::stable::zero_(dq);
        Tensor dk = alloc(k.sizes()), dv = alloc(v.sizes());
        torch::stable::zero_(dk);
        torch::stable::zero_(dv);
        return {dq, dk, dv};
    }

    // The kernel writes dK, dV per query head; GQA groups are summed below.
    const bool grouped = pb.nheads != pb.nheads_k;
    std::vector<int64_t> expanded_shape = k.sizes().vec();
    expanded_shape[expanded_shape.size() - 2] = pb.nheads;
    Tensor dk_x = alloc(grouped ? IntArrayRef(expanded_shape) : k.sizes());
    Tensor dv_x = alloc(grouped ? IntArrayRef(expanded_shape) : v.sizes());

    // The SM80 kernels' scratch: dq_accum follows lse's row order, a row of `tier` floats each
    // (a query tile's rows are contiguous, so the kernel addresses them from one pointer with
    // constant offsets). The SM90 kernels take theirs, and both their turn counters, from the
    // workspace.
    Tensor dq_accum, softmax_d;
    if (entry.arch == 80) {
        std::vector<int64_t> dq_accum_shape = lse.sizes().vec();
        dq_accum_shape.push_back(flash::headdim_tier(pb.headdim));
        dq_accum = zeros_on(q, dq_accum_shape, ScalarType::Float);
        softmax_d = torch::stable::empty_like(lse);
    }

    flash::BwdParams p;
    fill_shape(p, pb, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_left, window_right,
               softcap, stream);
    set_alibi(p, alibi_slopes, alibi_offset, pb, q);
    set_dropout(p, dropout_p, rng_state, q);
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.o = out.data_ptr();
    p.dout = dout.data_ptr();
    p.lse = ptr<float>(lse);
    p.dq = dq.data_ptr();
    p.dk = dk_x.data_ptr();
    p.dv = dv_x.data_ptr();
    if (entry.arch == 80) {
        p.dq_accum = ptr<float>(dq_accum);
        p.softmax_d = ptr<float>(softmax_d);
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
    Workspace workspace{q, {}};
    p.workspace = {&allocate_workspace, &workspace};
    entry.bwd(p, stream);
    check_launch();

    if (!grouped) return {dq, dk_x, dv_x};
    // Each KV head's gradient is the sum over its group of query heads. The reduction
    // accumulates in float and writes the inputs' dtype in the same pass, with no float
    // intermediate.
    std::vector<int64_t> grouped_shape = k.sizes().vec();
    grouped_shape.insert(grouped_shape.end() - 1, pb.nheads / pb.nheads_k);
    const int64_t group_dim = -2;
    auto group_sum = [&](const Tensor& x) {
        return torch::stable::sum(torch::stable::view(x, grouped_shape), IntArrayRef(group_dim),
                                  false, q.scalar_type());
    };
    return {dq, group_sum(dk_x), group_sum(dv_x)};
}

flash::Strides4 strides4(const Tensor& t) {
    return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// flash_attn_with_kvcache's update (csrc/common/kvcache_update.h): k/v written into the caches in
// place, q rotated into q_rot (given exactly when the rotary tables are), and the attention's
// seqused_k returned. Any strides; the Python layer validates values and shapes first.
Tensor kvcache_update(const Tensor& k_cache, const Tensor& v_cache,
                      const std::optional<Tensor>& q_rot, const Tensor& q,
                      const std::optional<Tensor>& k, const std::optional<Tensor>& v,
                      const std::optional<Tensor>& cache_seqlens, int64_t seqlen_offset,
                      const std::optional<Tensor>& cache_batch_idx,
                      const std::optional<Tensor>& rotary_cos,
                      const std::optional<Tensor>& rotary_sin, bool rotary_interleaved,
                      bool q_rows_advance, const std::optional<Tensor>& block_table,
                      const std::optional<Tensor>& cache_leftpad) {
    const Dtype dtype = dtype_of(q, /*e4m3=*/true);
    FA_CHECK(q.is_cuda() && q.dim() == 4, "flash_attn: q must be a 4-D CUDA tensor");
    check_cuda_tensor(k_cache, "k_cache", q);
    check_cuda_tensor(v_cache, "v_cache", q);
    FA_CHECK(k_cache.dim() == 4 && same_sizes(k_cache.sizes(), v_cache.sizes()) &&
                 k_cache.size(3) == q.size(3) && k_cache.size(2) > 0 &&
                 q.size(2) % k_cache.size(2) == 0,
             "flash_attn: k_cache and v_cache must have shape (batch_cache, seqlen_cache, "
             "nheads_k, headdim) with q's headdim and nheads_k dividing q's nheads");
    // Written in place by many threads: no element may be written twice.
    assert_no_internal_overlap(k_cache);
    assert_no_internal_overlap(v_cache);
    assert_no_overlap(k_cache, v_cache);
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
        FA_CHECK(k->dim() == 4 && same_sizes(k->sizes(), v->sizes()) && k->size(0) == batch &&
                     k->size(2) == k_cache.size(2) && k->size(3) == q.size(3),
                 "flash_attn: k and v must have shape (batch, seqlen_new, nheads_k, headdim)");
        seqlen_new = k->size(1);
    }
    const bool rotary = rotary_cos.has_value();
    FA_CHECK(rotary == rotary_sin.has_value() && rotary == q_rot.has_value() &&
                 (!rotary || k.has_value()),
             "flash_attn: rotary_cos, rotary_sin and q_rot go together, and need k and v");
    FA_CHECK(!rotary || dtype != Dtype::kE4m3,
             "flash_attn: float8_e4m3fn caches take no rotary tables (rows would be requantized)");
    Tensor cos, sin;
    if (rotary) {
        check_cuda_tensor(*q_rot, "q_rot", q);
        FA_CHECK(same_sizes(q_rot->sizes(), q.sizes()), "flash_attn: q_rot must have q's shape");
        cos = torch::stable::contiguous(*rotary_cos);
        sin = torch::stable::contiguous(*rotary_sin);
        FA_CHECK(cos.device() == q.device() && sin.device() == q.device() &&
                     cos.scalar_type() == sin.scalar_type() &&
                     (cos.scalar_type() == q.scalar_type() ||
                      cos.scalar_type() == ScalarType::Float),
                 "flash_attn: rotary_cos and rotary_sin must be on q's device, with q's dtype "
                 "or float32");
        FA_CHECK(cos.dim() == 2 && same_sizes(cos.sizes(), sin.sizes()) && cos.size(0) > 0 &&
                     cos.size(1) > 0 && 2 * cos.size(1) <= q.size(3),
                 "flash_attn: rotary_cos and rotary_sin must have shape (seqlen_ro, "
                 "rotary_dim / 2) with 0 < rotary_dim <= headdim");
    }
    const int64_t most = std::numeric_limits<int32_t>::max();
    FA_CHECK(q.size(1) <= most && k_cache.size(0) <= most && seqlen_cache <= most &&
                 seqlen_new <= most && (!rotary || cos.size(0) <= most) &&
                 seqlen_offset >= -most && seqlen_offset <= most,
             "flash_attn: sizes and cache_seqlens must fit in int32");

    torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
    const cudaStream_t stream = current_stream(q);
    Tensor seqused_k = empty_on(q, IntArrayRef(batch), ScalarType::Int);
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
        p.table_fp32 = cos.scalar_type() == ScalarType::Float;
        p.rotary_dim = int(2 * cos.size(1));
        p.seqlen_ro = int(cos.size(0));
    }
    p.cache_seqlens = cache_seqlens.has_value() ? ptr<int>(*cache_seqlens) : nullptr;
    p.seqlen_offset = int(seqlen_offset);
    p.cache_batch_idx = cache_batch_idx.has_value() ? ptr<int>(*cache_batch_idx) : nullptr;
    p.cache_leftpad = cache_leftpad.has_value() ? ptr<int>(*cache_leftpad) : nullptr;
    p.interleaved = rotary_interleaved;
    p.q_rows_advance = q_rows_advance;
    p.batch = int(batch);
    p.batch_cache = int(k_cache.size(0));
    p.seqlen_cache = int(seqlen_cache);
    if (block_table.has_value()) {
        p.block_table = ptr<int>(*block_table);
        p.block_table_stride = block_table->stride(0);
        p.page_size = int(k_cache.size(1));
    }
    p.seqlen_new = int(seqlen_new);
    p.seqlen_q = int(q.size(1));
    p.nheads = int(q.size(2));
    p.nheads_k = int(k_cache.size(2));
    p.headdim = int(q.size(3));
    p.seqused_k = ptr<int>(seqused_k);
    p.bad_input = current_bad_input_word(stream);
    flash::run_kvcache_update(p, dtype, stream);
    check_launch();
    return seqused_k;
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
    FA_CHECK(err == cudaSuccess && status == cudaDriverEntryPointSuccess && fn != nullptr,
             "flash_attn: the CUDA driver does not provide ", name);
    return reinterpret_cast<StreamValue32Fn>(fn);
}

void stream_value32(const Tensor& word, int64_t value, bool wait) {
    FA_CHECK(word.is_cuda() && word.scalar_type() == ScalarType::Int && word.numel() == 1,
             "flash_attn: stream_value32 takes a CUDA int32 tensor of one element");
    static const StreamValue32Fn wait_fn = driver_stream_value32("cuStreamWaitValue32");
    static const StreamValue32Fn write_fn = driver_stream_value32("cuStreamWriteValue32");
    torch::stable::accelerator::DeviceGuard guard(word.get_device_index());
    const auto stream = reinterpret_cast<CUstream>(current_stream(word));
    const auto address = reinterpret_cast<CUdeviceptr>(word.data_ptr());
    const auto v = static_cast<cuuint32_t>(value);
    // GEQ compares (int32)(*word - value) >= 0, so counters may wrap.
    const CUresult r = wait ? wait_fn(stream, address, v, CU_STREAM_WAIT_VALUE_GEQ)
                            : write_fn(stream, address, v, CU_STREAM_WRITE_VALUE_DEFAULT);
    FA_CHECK(r == CUDA_SUCCESS, "flash_attn: ",
             wait ? "cuStreamWaitValue32" : "cuStreamWriteValue32", " failed with CUresult ",
             int(r));
}

}  // namespace

namespace flash_binding {

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

}  // namespace flash_binding

// The registration macros paste their namespace argument without expanding it: these expand
// FLASH_ATTN_OP_NAMESPACE first.
#define FLASH_ATTN_LIBRARY(ns, m) STABLE_TORCH_LIBRARY(ns, m)
#define FLASH_ATTN_LIBRARY_IMPL(ns, k, m) STABLE_TORCH_LIBRARY_IMPL(ns, k, m)

// Only the CUDA key: a CPU or meta tensor gets the dispatcher's "could not run" error, and the
// Python layer's custom ops (flash_attn/ops) give the CPU reference and fake implementations.
// fwd and bwd for the common call, with none of the optional tensors and no dropout, the
// scalars in one float list. A stable op's call costs about 0.16 us per argument (converted
// from Python and boxed twice; CPU machine, 2026-11-27): fwd_plain takes 4 where fwd takes 25,
// bwd_plain 7 where bwd takes 20. Integers up to 2^53 are exact in a double.
std::tuple<Tensor, Tensor> fwd_plain(const Tensor& q, const Tensor& k, const Tensor& v,
                                     std::vector<double> nums) {
    FA_CHECK(nums.size() == 8,
             "flash_attn: fwd_plain takes [max_seqlen_q, max_seqlen_k, softmax_scale, causal, "
             "window_left, window_right, softcap, sm_margin], got ", nums.size(), " numbers");
    auto integer = [&](size_t i) { return static_cast<int64_t>(nums[i]); };
    return fwd(q, k, v, std::nullopt, std::nullopt, std::nullopt, integer(0), integer(1),
               nums[2], nums[3] != 0.0, integer(4), integer(5), nums[6], std::nullopt,
               std::nullopt, std::nullopt, std::nullopt, std::nullopt, 0.0, std::nullopt,
               integer(7), std::nullopt, std::nullopt, std::nullopt, 0);
}

std::tuple<Tensor, Tensor, Tensor> bwd_plain(const Tensor& dout, const Tensor& q,
                                             const Tensor& k, const Tensor& v, const Tensor& out,
                                             const Tensor& lse, std::vector<double> nums) {
    FA_CHECK(nums.size() == 8,
             "flash_attn: bwd_plain takes [max_seqlen_q, max_seqlen_k, softmax_scale, causal, "
             "window_left, window_right, softcap, deterministic], got ", nums.size(),
             " numbers");
    auto integer = [&](size_t i) { return static_cast<int64_t>(nums[i]); };
    return bwd(dout, q, k, v, out, lse, std::nullopt, std::nullopt, integer(0), integer(1),
               nums[2], nums[3] != 0.0, integer(4), integer(5), nums[6], nums[7] != 0.0,
               std::nullopt, 0.0, std::nullopt, 0);
}

FLASH_ATTN_LIBRARY(FLASH_ATTN_OP_NAMESPACE, m) {
    m.def(
        "fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
        "Tensor? seqused_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
        "bool causal, int window_left, int window_right, float softcap, "
        "Tensor? kv_batch_idx=None, Tensor? block_table=None, Tensor? leftpad_k=None, "
        "Tensor? alibi_slopes=None, Tensor? sink=None, float dropout_p=0.0, "
        "Tensor? rng_state=None, int sm_margin=0, Tensor? q_descale=None, "
        "Tensor? k_descale=None, Tensor? v_descale=None, int alibi_offset=0) -> (Tensor, "
        "Tensor)");
    m.def(
        "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
        "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
        "float softmax_scale, bool causal, int window_left, int window_right, float softcap, "
        "bool deterministic, Tensor? alibi_slopes=None, float dropout_p=0.0, "
        "Tensor? rng_state=None, int alibi_offset=0) -> (Tensor, Tensor, Tensor)");
    m.def("fwd_plain(Tensor q, Tensor k, Tensor v, float[] nums) -> (Tensor, Tensor)");
    m.def(
        "bwd_plain(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
        "float[] nums) -> (Tensor, Tensor, Tensor)");
    m.def(
        "kvcache_update(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? q_rot, Tensor q, "
        "Tensor? k, Tensor? v, Tensor? cache_seqlens, int seqlen_offset, "
        "Tensor? cache_batch_idx, Tensor? rotary_cos, Tensor? rotary_sin, "
        "bool rotary_interleaved, bool q_rows_advance, Tensor? block_table=None, "
        "Tensor? cache_leftpad=None) -> Tensor");
    m.def("stream_value32(Tensor word, int value, bool wait) -> ()");
}

FLASH_ATTN_LIBRARY_IMPL(FLASH_ATTN_OP_NAMESPACE, CUDA, m) {
    m.impl("fwd", TORCH_BOX(&fwd));
    m.impl("bwd", TORCH_BOX(&bwd));
    m.impl("fwd_plain", TORCH_BOX(&fwd_plain));
    m.impl("bwd_plain", TORCH_BOX(&bwd_plain));
    m.impl("kvcache_update", TORCH_BOX(&kvcache_update));
    m.impl("stream_value32", TORCH_BOX(&stream_value32));
}
