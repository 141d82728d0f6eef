// normcore benchmark suite: what every implementation file shares.
//
// A Case is one operation on one shape. An implementation ("normcore",
// "eigen", "torch", ...) turns a Case and its Inputs into a Runner: the
// runner allocates whatever outputs it needs when it is made, run() is the
// timed call, and collect() copies the results out (untimed) so that they
// can be compared with normcore's reference path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace nbench {

/// Allocator for the suite's data buffers: 64-byte (cache-line) aligned, as
/// the tensors of Eigen (with AVX-512), libtorch and oneDNN are. A plain
/// std::vector<float> is only 16-byte aligned, and with 16 bytes off every
/// 512-bit load straddles two cache lines: streaming kernels, normcore's
/// and the peers' alike, lose 10-35% on large shapes to that alone.
template <typename T>
struct CacheAligned {
  using value_type = T;
  static constexpr std::size_t kAlign = 64;
  CacheAligned() = default;
  template <typename U>
  CacheAligned(const CacheAligned<U>&) noexcept {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    void* p = std::aligned_alloc(kAlign, bytes == 0 ? kAlign : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }
  template <typename U>
  bool operator==(const CacheAligned<U>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const CacheAligned<U>&) const noexcept { return false; }
};

/// A cache-line-aligned float buffer (inputs and timed outputs).
using Buffer = std::vector<float, CacheAligned<float>>;

enum class Op {
  LN_fwd,        // LayerNorm forward, statistics not kept
  LN_fwd_stats,  // LayerNorm forward, mean and rstd saved for backward
  LN_bwd,        // LayerNorm backward: dx, dweight, dbias
  RMS_fwd,       // RMSNorm forward
  RMS_bwd,       // RMSNorm backward: dx, dweight
  BN_train,      // BatchNorm forward in training mode (batch statistics)
  BN_eval,       // BatchNorm forward in eval mode (running statistics)
  BN_bwd,        // BatchNorm backward: dx, dweight, dbias
  ADD_LN_fwd,    // h = x + residual, y = LayerNorm(h) (fused residual norm)
  ADD_RMS_fwd,   // h = x + residual, y = RMSNorm(h)
};

/// Storage type of a case's activations (and of the layer's parameters):
/// arithmetic is in float whatever the storage.
enum class Prec { F32, BF16, F16 };

enum class Layout { Rows, NCHW, NHWC };

inline bool is_backward(Op op) { return op == Op::LN_bwd || op == Op::RMS_bwd || op == Op::BN_bwd; }
inline bool is_batch_norm(Op op) { return op == Op::BN_train || op == Op::BN_eval || op == Op::BN_bwd; }
inline bool is_add(Op op) { return op == Op::ADD_LN_fwd || op == Op::ADD_RMS_fwd; }

struct Case {
  Op op;
  Layout layout;
  // Row norms: {rows, hidden}. BatchNorm: {N, C, H, W} (H = W = 1 for the
  // (N, C) shape), logical order whatever the memory layout.
  std::vector<std::int64_t> dims;
  Prec prec = Prec::F32;

  std::int64_t elements() const {
    std::int64_t n = 1;
    for (auto d : dims) n *= d;
    return n;
  }
  std::int64_t rows() const { return dims[0]; }
  std::int64_t hidden() const { return dims[1]; }
  std::int64_t N() const { return dims[0]; }
  std::int64_t C() const { return dims[1]; }
  std::int64_t HW() const { return dims[2] * dims[3]; }
  bool is_2d_bn() const { return dims[2] == 1 && dims[3] == 1; }
  /// Bytes per stored value.
  double elem_bytes() const { return prec == Prec::F32 ? 4.0 : 2.0; }
  /// Minimum memory traffic in bytes: forward reads x and writes y, backward
  /// reads x and dy and writes dx, the fused residual norms read x and the
  /// residual and write h and y. Parameters and statistics are not counted.
  double bytes() const {
    const double tensors = is_add(op) ? 4.0 : is_backward(op) ? 3.0 : 2.0;
    return tensors * elem_bytes() * static_cast<double>(elements());
  }
  std::string op_name() const;     // e.g. "LN_fwd", "BN_train_nhwc"
  std::string shape_name() const;  // e.g. "512x768", "32x64x56x56", "4096x512"
};

constexpr double kLnEps = 1e-5;
constexpr double kRmsEps = 1e-6;
constexpr double kBnEps = 1e-5;
constexpr double kBnMomentum = 0.1;

/// Inputs of a case, shared (read-only) by every implementation. Data are in
/// memory order of the case's layout: row-major rows x hidden; NCHW or NHWC
/// contiguous for BatchNorm.
/// For 16-bit cases every value is already rounded to the storage type (so
/// that each implementation converts exactly); the residual of the fused
/// ops is dy.
struct Inputs {
  const float* x = nullptr;
  const float* dy = nullptr;
  const float* gamma = nullptr;         // hidden (row norms) or C
  const float* beta = nullptr;          // hidden or C
  const float* running_mean = nullptr;  // C (BatchNorm eval)
  const float* running_var = nullptr;   // C (BatchNorm eval)
};

/// What an implementation produced, for the comparison with the reference.
/// `out` is y (forward) or dx (backward) in the memory order of the inputs.
struct Result {
  std::vector<float> out;
  std::vector<float> dweight;  // empty when the op has none
  std::vector<float> dbias;
  std::vector<float> mean;  // saved statistics when the op saves them
  std::vector<float> rstd;  // (rstd, or invstd for BatchNorm)
  std::vector<float> h;     // the new residual stream of the fused ops
};

class Runner {
 public:
  virtual ~Runner() = default;
  virtual void run() = 0;
  virtual void collect(Result& r) = 0;
};

using RunnerPtr = std::unique_ptr<Runner>;
/// Returns nullptr when the implementation does not support the case.
using Factory = std::function<RunnerPtr(const Case&, const Inputs&)>;

struct Impl {
  std::string name;
  std::function<bool(const Case&)> supports;  // decides registration
  Factory make;
};

/// Registration hooks of the implementation files; each appends what it has.
void add_normcore_impls(std::vector<Impl>& out);  // normcore, reference, eigen
void add_copy_impl(std::vector<Impl>& out);      // memcpy: the roofline
/// The caches as normcore reads them (sysconf) and the path choices they and
/// the CPU give: the streaming-store threshold and the set of path choices.
std::string normcore_cache_info();
#ifdef NORMCORE_BENCH_HAVE_TORCH
void add_torch_impls(std::vector<Impl>& out);
std::string torch_info();  // version and CPU capability, for the context
#endif
#ifdef NORMCORE_BENCH_HAVE_DNNL
void add_dnnl_impls(std::vector<Impl>& out);
std::string dnnl_info();
#endif

/// Threads the peers may use (set once by main before anything runs).
int threads();
void set_threads(int n);

/// Helpers for runners: float copies of double data, and a float buffer
/// whose pages are touched at construction.
std::vector<float> to_float(const std::vector<double>& v);
std::vector<float> copy_of(const float* p, std::size_t n);

}  // namespace nbench
