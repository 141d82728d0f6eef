// normcore::LayerNorm: PyTorch's nn.LayerNorm over Eigen tensors.
//
//   normcore::LayerNorm<float> ln(normcore::LayerNormOptions({768}).eps(1e-6));
//   Eigen::Tensor<float, 2, Eigen::RowMajor> y = ln(x);         // allocating
//   ln.forward(x, y, stats);                                     // into y, saves mean/rstd
//   ln.backward(x, dy, &dx, &dweight, &dbias, &stats);           // any subset
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "normcore/common.hpp"
#include "normcore/detail/lanes.hpp"
#include "normcore/detail/normalize.hpp"
#include "normcore/detail/scratch.hpp"
#include "normcore/detail/short_rows.hpp"
#include "normcore/mixed.hpp"
#include "normcore/parallel.hpp"
#include "normcore/statistics.hpp"

namespace normcore {

/// Options of LayerNorm, named as in the libtorch C++ frontend: each setter
/// returns *this, each getter has the same name without an argument.
class LayerNormOptions {
 public:
  /* implicit */ LayerNormOptions(std::vector<Index> normalized_shape)
      : normalized_shape_(std::move(normalized_shape)) {}

  LayerNormOptions& normalized_shape(std::vector<Index> v) {
    normalized_shape_ = std::move(v);
    return *this;
  }
  const std::vector<Index>& normalized_shape() const { return normalized_shape_; }
  /// Added to the variance before the square root. Default 1e-5.
  LayerNormOptions& eps(double v) {
    eps_ = v;
    return *this;
  }
  double eps() const { return eps_; }
  /// Learnable weight (and bias, unless bias(false)). Default true.
  LayerNormOptions& elementwise_affine(bool v) {
    elementwise_affine_ = v;
    return *this;
  }
  bool elementwise_affine() const { return elementwise_affine_; }
  /// Learnable bias when elementwise_affine. Default true.
  LayerNormOptions& bias(bool v) {
    bias_ = v;
    return *this;
  }
  bool bias() const { return bias_; }

 private:
  std::vector<Index> normalized_shape_;
  double eps_ = 1e-5;
  bool elementwise_affine_ = true;
  bool bias_ = true;
};

namespace detail {

inline Index checked_normalized_size(const char* who, const std::vector<Index>& shape, double eps) {
  if (shape.empty()) fail(std::string(who) + ": expected a non-empty normalized_shape, got []");
  for (Index d : shape) {
    if (d <= 0) {
      fail(std::string(who) + ": expected positive normalized_shape dims, got " +
           shape_string(shape));
    }
  }
  if (!(eps >= 0.0) || !std::isfinite(eps)) {
    fail(std::string(who) + ": expected eps >= 0 and finite, got " + std::to_string(eps));
  }
  return product(shape, 0, shape.size());
}

/// Parameters as the kernels need them: in memory order of the normalized
/// block (permuted for ColMajor inputs with several normalized dims).
template <typename T>
struct ParamView {
  const T* gamma = nullptr;
  const T* beta = nullptr;
  std::vector<T> storage;
};

template <typename T>
ParamView<T> param_view(bool colmajor, const std::vector<Index>& shape, const T* gamma,
                        const T* beta, Index n) {
  ParamView<T> p;
  if (!colmajor || shape.size() == 1 || (!gamma && !beta)) {
    p.gamma = gamma;
    p.beta = beta;
    return p;
  }
  const std::vector<Index> perm = colmajor_to_rowmajor(shape);
  p.storage.resize(static_cast<std::size_t>(2 * n));
  for (Index c = 0; c < n; ++c) {
    if (gamma) p.storage[static_cast<std::size_t>(c)] = gamma[perm[static_cast<std::size_t>(c)]];
    if (beta) p.storage[static_cast<std::size_t>(n + c)] = beta[perm[static_cast<std::size_t>(c)]];
  }
  p.gamma = gamma ? p.storage.data() : nullptr;
  p.beta = beta ? p.storage.data() + n : nullptr;
  return p;
}

/// Per-row constants of the LayerNorm backward from the three sums of its
/// first pass (sg = sum g, sgd = sum g*d, sd = sum d, with d = x - mean_saved):
/// dx = fma(g, rstd, -fma(d, k3, k4)), x_hat = fma(d, rstd, xs). One function
/// for every code path, so that each row gets the same arithmetic wherever
/// it sits in the batch.
template <typename T>
struct BackwardCoeffs {
  T k3, k4, xs;
};

/// dx = fma(g, rstd, -fma(x_hat, k3, k4)) with x_hat = fma(d, rstd, xs):
/// written on x_hat rather than on d so that no rstd^2 appears (it would
/// leave T's range for rows of magnitude ~1e19 in float).
template <typename T>
BackwardCoeffs<T> backward_coeffs(double sg, double sgd, double sd, Index n, T rstd) {
  const double inv_n = 1.0 / static_cast<double>(n);
  const double r = static_cast<double>(rstd);
  const double delta = sd * inv_n;  // true mean - saved mean
  const double mean_g = sg * inv_n;
  const double mean_gx = r * (sgd - delta * sg) * inv_n;  // mean(g * x_hat)
  BackwardCoeffs<T> c;
  c.k3 = static_cast<T>(r * mean_gx);
  c.k4 = static_cast<T>(r * mean_g);
  c.xs = static_cast<T>(-delta * r);
  return c;
}

}  // namespace detail

/// Layer normalization over the trailing dims given by normalized_shape:
/// y = (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance
/// of each row. P, the parameters' type, is float or double, or
/// Eigen::bfloat16 / Eigen::half (weights stored in 16 bits, arithmetic and
/// saved statistics in float). Float and 16-bit layers take float,
/// bfloat16 or half tensors.
template <typename P>
class LayerNorm {
  static_assert(std::is_same<P, float>::value || std::is_same<P, double>::value ||
                    detail::is_storage16<P>::value,
                "normcore::LayerNorm<P>: P must be float, double, Eigen::bfloat16 or Eigen::half");

 public:
  /// The parameters' type.
  using Scalar = P;
  /// The arithmetic type: float for the 16-bit layers, P otherwise. Saved
  /// statistics (NormStats<Compute>) are kept in it.
  using Compute = detail::compute_t<P>;

 private:
  using T = Compute;

 public:
  explicit LayerNorm(LayerNormOptions options)
      : options_(std::move(options)),
        size_(detail::checked_normalized_size("normcore::LayerNorm", options_.normalized_shape(),
                                              options_.eps())) {
    if (options_.elementwise_affine()) {
      weight_.resize(size_);
      weight_.setConstant(P(1));
      if (options_.bias()) {
        bias_.resize(size_);
        bias_.setConstant(P(0));
      }
    }
  }

  const LayerNormOptions& options() const { return options_; }
  /// Product of normalized_shape: the length of one normalized row.
  Index normalized_size() const { return size_; }
  /// Weight (gamma), flattened in row-major order of normalized_shape (as
  /// PyTorch's weight.flatten()); empty without elementwise_affine.
  Eigen::Tensor<P, 1>& weight() { return weight_; }
  const Eigen::Tensor<P, 1>& weight() const { return weight_; }
  /// Bias (beta), flattened like weight; empty without it.
  Eigen::Tensor<P, 1>& bias() { return bias_; }
  const Eigen::Tensor<P, 1>& bias() const { return bias_; }

  /// Allocating forward: returns a tensor with x's dims, layout and scalar type.
  template <typename X>
  auto operator()(const X& x) const {
    auto y = detail::make_like(x);
    forward(x, y);
    return y;
  }

  /// Non-allocating forward into y (a Tensor or TensorMap of x's dims).
  template <typename X, typename Y>
  void forward(const X& x, Y&& y) const {
    forward_impl(Serial(), x, y, nullptr);
  }

  /// Forward that also saves the per-row mean and rstd for backward.
  template <typename X, typename Y>
  void forward(const X& x, Y&& y, NormStats<T>& saved) const {
    forward_impl(Serial(), x, y, &saved);
  }

  /// The same on a device's threads (e.g. an Eigen::ThreadPoolDevice).
  template <typename Device, typename X, typename Y, typename = std::enable_if_t<detail::is_device<Device>::value>>
  void forward(const Device& device, const X& x, Y&& y) const {
    if (detail::to_serial(device, x.size())) return forward_impl(Serial(), x, y, nullptr);
    forward_impl(device, x, y, nullptr);
  }
  template <typename Device, typename X, typename Y, typename = std::enable_if_t<detail::is_device<Device>::value>>
  void forward(const Device& device, const X& x, Y&& y, NormStats<T>& saved) const {
    if (detail::to_serial(device, x.size())) return forward_impl(Serial(), x, y, &saved);
    forward_impl(device, x, y, &saved);
  }

  /// Backward: computes any subset of dx, dweight, dbias (pass nullptr for
  /// the ones not wanted) from x, dy and the statistics saved by forward; with
  /// saved == nullptr they are recomputed from x. dx has x's dims and layout;
  /// dweight and dbias are resized to normalized_size() if needed.
  template <typename X, typename DY, typename DX>
  void backward(const X& x, const DY& dy, DX dx, Eigen::Tensor<P, 1>* dweight,
                Eigen::Tensor<P, 1>* dbias, const NormStats<T>* saved = nullptr) const {
    backward_entry(Serial(), x, dy, dx, static_cast<const X*>(nullptr), dweight, dbias, saved);
  }

  /// The same on a device's threads; bit-identical for any thread count.
  template <typename Device, typename X, typename DY, typename DX,
            typename = std::enable_if_t<detail::is_device<Device>::value>>
  void backward(const Device& device, const X& x, const DY& dy, DX dx, Eigen::Tensor<P, 1>* dweight,
                Eigen::Tensor<P, 1>* dbias, const NormStats<T>* saved = nullptr) const {
    if (detail::to_serial(device, x.size()))
      return backward_entry(Serial(), x, dy, dx, static_cast<const X*>(nullptr), dweight, dbias, saved);
    backward_entry(device, x, dy, dx, static_cast<const X*>(nullptr), dweight, dbias, saved);
  }

  /// Fused residual add: h = x + residual (h may be residual itself, for an
  /// in-place update; 16-bit storage sums in float and rounds once), then
  /// y = LayerNorm(h), optionally saving the statistics. As vLLM's
  /// fused_add_rms_norm and ONNX Runtime's SkipLayerNormalization. RowMajor
  /// rows go in small blocks: memory sees one read of x and residual and one
  /// write of h and y.
  template <typename X, typename R, typename H, typename Y>
  void forward_add(const X& x, const R& residual, H&& h, Y&& y, NormStats<T>* saved = nullptr) const {
    forward_add(Serial(), x, residual, h, y, saved);
  }
  template <typename Device, typename X, typename R, typename H, typename Y,
            typename = std::enable_if_t<detail::is_device<Device>::value>>
  void forward_add(const Device& device, const X& x, const R& residual, H&& h, Y&& y,
                   NormStats<T>* saved = nullptr) const {
    if (detail::to_serial(device, x.size())) return forward_add(Serial(), x, residual, h, y, saved);
    detail::fused_add_norm(device, kWho, options_.normalized_shape(), x, residual, h, y, saved,
                           [this, &device](auto& hh, auto& yy, NormStats<T>* st) {
                             this->forward_impl(device, hh, yy, st);
                           },
                           [&](const auto* xb, auto* yb, Index count, Index r0, NormStats<T>* st,
                               const detail::ParamPtrs<T>& prm) {
                             T* mean = st ? st->mean.data() + r0 : nullptr;
                             T* rstd = st ? st->rstd.data() + r0 : nullptr;
                             if constexpr (std::is_same<std::decay_t<decltype(*yb)>, T>::value) {
                               forward_rows(xb, yb, size_, count, mean, rstd, prm.gamma, prm.beta);
                             } else {  // 16-bit rows, from h itself
                               forward_rows_widened(xb, yb, size_, count, mean, rstd, prm.gamma, prm.beta, false);
                             }
                           },
                           detail::kShortMomentsValues<T>,
                           [&](const T* xb, const T* rb, T* hb, T* yb, Index count, Index r0, NormStats<T>* st,
                               const detail::ParamPtrs<T>& prm, auto stream_h, auto stream_y) {
                             forward_add_rows<decltype(stream_h)::value, decltype(stream_y)::value>(
                                 xb, rb, hb, yb, size_, count, st ? st->mean.data() + r0 : nullptr,
                                 st ? st->rstd.data() + r0 : nullptr, prm.gamma, prm.beta);
                           },
                           detail::param_ptrs<T>(weight_, bias_), true);
  }

  /// Backward of forward_add: the gradient for both x and residual is
  /// dx = LayerNorm'(h) dy + dh_next (dh_next: the gradient reaching h from
  /// the rest of the residual stream; nullptr if none), in one pass over
  /// RowMajor rows. dx must not be null.
  template <typename H, typename DY, typename DH, typename DX>
  void backward_add(const H& h, const DY& dy, const DH* dh_next, DX* dx, Eigen::Tensor<P, 1>* dweight,
                    Eigen::Tensor<P, 1>* dbias, const NormStats<T>* saved = nullptr) const {
    backward_add(Serial(), h, dy, dh_next, dx, dweight, dbias, saved);
  }
  template <typename Device, typename H, typename DY, typename DH, typename DX,
            typename = std::enable_if_t<detail::is_device<Device>::value>>
  void backward_add(const Device& device, const H& h, const DY& dy, const DH* dh_next, DX* dx,
                    Eigen::Tensor<P, 1>* dweight, Eigen::Tensor<P, 1>* dbias,
                    const NormStats<T>* saved = nullptr) const {
    if (!dx) detail::fail(std::string(kWho) + ": backward_add needs dx, got nullptr");
    if (detail::to_serial(device, h.size()))
      return backward_entry(Serial(), h, dy, dx, dh_next, dweight, dbias, saved);
    backward_entry(device, h, dy, dx, dh_next, dweight, dbias, saved);
  }

  /// Allocating backward: every gradient the layer has (dx in x's scalar
  /// type, dweight and dbias in P).
  template <typename X, typename DY>
  auto backward(const X& x, const DY& dy, const NormStats<T>* saved = nullptr) const {
    using Tr = detail::tensor_traits<X>;
    Gradients<P, Tr::rank, Tr::layout, typename Tr::Scalar> g;
    g.dx = detail::make_like(x);
    backward(x, dy, &g.dx, weight_.size() ? &g.dweight : nullptr,
             bias_.size() ? &g.dbias : nullptr, saved);
    return g;
  }

 private:
  static constexpr const char* kWho = "normcore::LayerNorm";

  template <typename Device, typename X, typename Y>
  void forward_impl(const Device& device, const X& x, Y& y, NormStats<T>* saved) const {
    using S = typename detail::tensor_traits<X>::Scalar;
    detail::check_storage<T, X>();
    detail::check_same_scalar<X, Y>();
    detail::check_layouts<X, Y>();
    static_assert(detail::tensor_traits<Y>::writable, "normcore: the output must be writable");
    const auto xv = detail::split_view<S>(kWho, "input", x, options_.normalized_shape());
    detail::check_same_shape(kWho, "output", x, y);
    S* out = y.data();
    T* mean = nullptr;
    T* rstd = nullptr;
    if (saved) {
      detail::resize_vector(saved->mean, xv.rows);
      detail::resize_vector(saved->rstd, xv.rows);
      mean = saved->mean.data();
      rstd = saved->rstd.data();
    }
    if (xv.rows == 0) return;
    const auto prm = detail::param_ptrs<T>(weight_, bias_);
    constexpr int L = detail::simd<T>::L;
    const Index n = xv.cols, rows = xv.rows;
    const Index align = xv.row_major ? 1 : L;
    // (Units of rows without a division by a variable: a 64-bit idiv was a
    // visible part of a one-row call.)
    const Index parts = detail::row_parts_for(device, rows * n, xv.row_major ? rows : (rows + L - 1) / L);
    const detail::Split split{rows, parts, align};
    const bool large = detail::streaming_input<S, T>(rows, n);
    const bool streaming = large || intel_streaming<S>(rows, n) || mid_streaming<S>(rows, n);
    const bool stream_out = large && detail::stream_forward_output(rows * n * static_cast<Index>(sizeof(T)));
    if (xv.row_major) {
      detail::run_parts(device, parts, [this, &xv, &out, &n, &split, &mean, &rstd, &prm, &rows, &streaming,
                                        &stream_out](Index p) {
        static_cast<void>(rows);  // (read by 16-bit rows read as packets only)
        if constexpr (!std::is_same<S, T>::value && detail::packet_io<S, L>()) {
          if (n > 0) {  // 16-bit rows, read as they are
            const Index b0 = split.begin(p);
            forward_rows_widened(xv.data + b0 * n, out + b0 * n, n, split.begin(p + 1) - b0,
                                 mean ? mean + b0 : nullptr, rstd ? rstd + b0 : nullptr, prm.gamma, prm.beta,
                                 rows * n * static_cast<Index>(sizeof(T)) >= detail::kStreamingBytes);
            return;
          }
        }
        // Rows stored as T; and 16-bit rows in builds without packet
        // conversions: widened a block at a time, normalized in float,
        // rounded once on the way out.
        detail::rows_in_compute_type<T>(xv.data, out, n, split.begin(p), split.begin(p + 1),
                                        [this, &n, &mean, &rstd, &prm, &streaming, &stream_out](
                                            const T* xb, T* yb, Index m, Index r0) {
                                          forward_rows(xb, yb, n, m, mean ? mean + r0 : nullptr,
                                                       rstd ? rstd + r0 : nullptr, prm.gamma, prm.beta, streaming,
                                                       stream_out);
                                        });
      });
    } else {
      const auto pv = detail::param_view(true, options_.normalized_shape(), prm.gamma, prm.beta, n);
      detail::run_parts(device, parts, [this, &xv, &out, &mean, &rstd, &split, &pv, &rows, &n](Index p) {
        static_cast<void>(rows);  // (rows and n: read by 16-bit data only)
        static_cast<void>(n);
        if constexpr (std::is_same<S, T>::value) {
          forward_colmajor(xv, out, mean, rstd, split.begin(p), split.begin(p + 1), pv.gamma, pv.beta, true);
        } else {
          // 16-bit: blocks of rows widened into float (no streaming stores
          // into the block's buffer, read back at once).
          detail::colmajor_in_compute_type<T>(
              xv.data, out, rows, n, split.begin(p), split.begin(p + 1), detail::colmajor_stage_rows<T>(n),
              [this, &mean, &rstd, &pv](const detail::Matrix2D<T>& v, T* yb, Index r0) {
                forward_colmajor(v, yb, mean ? mean + r0 : nullptr, rstd ? rstd + r0 : nullptr, 0, v.rows, pv.gamma,
                                 pv.beta, false);
              });
        }
      });
    }
  }

  // `count` rows of n contiguous values; mean/rstd (optional) per row.
  // Statistics for a group of rows (up to kCoeffGroup, at most
  // detail::kGroupBytes), then their normalization while the group is
  // still in L1. On `streaming` inputs (detail::streaming_input, on Intel
  // CPUs smaller ones: intel_streaming, and under the other CPUs' path
  // choices inputs from 6 MiB: mid_streaming) long rows go one at a time,
  // each row of the next group of short rows is requested as a row of this
  // one is normalized (detail::forward_group, detail::rows_ahead), rows of
  // 4-8 KB request the next row as they are normalized
  // (detail::forward_requests; with weight and bias, on Intel CPUs and AMD
  // Zen 3 rows of any length, on AMD Zen 5 up to 16 KB and into the L1:
  // request_max_row_bytes), rows of up to 4 KB (and longer ones without
  // bias) take the next row's moments as they are normalized
  // (forward_long_rows, interleave_long_rows), and the output takes
  // streaming stores when it can (detail::can_stream_rows) and `stream_out`
  // (an input of at least detail::kStreamingBytes and at least
  // forward_stream_threshold()). Other inputs take a loop that only
  // normalizes (0.91-0.97x the time on short rows without the per-row
  // tests). Full groups of short rows with weight and bias are normalized a
  // packet column at a time (detail::normalize_group): on any input without
  // streaming stores, on streaming ones only rows shorter than four
  // packets. One long row alone (not streaming) skips the group's arrays:
  // forward_long_rows with a count of one, its coefficients and then its
  // normalize. Under the Zen 4 path choices, long float rows the caches
  // hold take forward_long_rows too, where its loads do not alias its
  // stores (cached_interleave).
  // The longest rows whose normalize pass requests the next row
  // (detail::forward_requests): on Zen 4, with gamma and beta, longer rows
  // lost (rows of 4096 and 8192 floats: 1.12-1.21x the time). On an Intel
  // Xeon guest (AVX-512, float, one input every call) every length gained:
  // 0.73x at 8192x4096, 0.76-0.77x at 16384x4096 and 8192x8192, 0.96x at
  // 2048x8192 and 1.02x (within its spread) at 4096x4096; so on Intel CPUs
  // (detail::intel_cpu) rows with gamma and beta have no limit. (Longer
  // rows without bias keep interleave_long_rows, measured on Zen 4 only.)
  static constexpr Index kRequestMaxRowBytes = 8192;
  // On Intel CPUs (detail::intel_tuned), in builds with 32 vector
  // registers (detail::kWideRegisterFile: AVX-512 on x86), forward_rows
  // takes its streaming path on inputs the caches hold as well (only its
  // streaming stores keep their gate): rows of float of at least
  // detail::kShortMomentsValues whenever there are two or more (one row at
  // a time: each row's moments taken while the row before is normalized,
  // or, rows of more than 4 KB with weight and bias, the next row requested
  // as this one is normalized), shorter rows from kIntelShortStreamingBytes
  // (each group requesting rows ahead, forward_short_pipelined). Measured
  // on an Intel Xeon guest (AVX-512, float, the same input every call),
  // against groups: rows of 768 floats 0.93x the time at 8x768, 0.96x at
  // 32x768 to 128x768, 0.88-0.92x at 384x768 to 2048x768; 0.86x at
  // 256x1024, 0.96x at 64x4096. Short rows (with the streaming path's
  // group normalize): 0.92x at 8192x50, 0.84-0.87x at 16384x64, but
  // 1.05x at 2048x50 (400 KB), hence their gate. One row alone, RMSNorm,
  // doubles and 16-bit rows: unchanged (RMSNorm lost, 1.09x at 8x768;
  // doubles were not measured).
  static constexpr Index kIntelShortStreamingBytes = Index(1) << 20;
  // What both gates below the streaming one require (intel_streaming,
  // mid_streaming): two rows or more, of float stored as float, in a build
  // with 32 vector registers.
  template <typename S>
  static constexpr bool streaming_kernels_below_gate(Index rows) {
    return std::is_same<S, float>::value && std::is_same<T, float>::value && detail::kWideRegisterFile && rows >= 2;
  }
  template <typename S>
  static bool intel_streaming(Index rows, Index n) {
    if (!streaming_kernels_below_gate<S>(rows) || !detail::intel_tuned()) return false;
    return n >= detail::kShortMomentsValues<T> || rows * n * static_cast<Index>(sizeof(T)) >= kIntelShortStreamingBytes;
  }
  // Under the other CPUs' path choices (detail::path_choices() 0, measured
  // on Zen 4), in AVX-512 builds (not measured on Arm), float inputs of half of
  // detail::kStreamingBytes (6 MiB) up to it take forward_rows' streaming
  // path too (rows of at least detail::kShortMomentsValues one at a time,
  // interleaved or requested as on larger inputs; no streaming stores,
  // which keep their gate). Measured on a Zen 4 guest in session 53 (32 MB
  // of L3, float, both choices alternating in one process, 9 shuffled
  // rounds, the same bits), against the group kernels: 0.67x the time at
  // 2048x768, 0.70x at 3072x768, 0.73x at 3900x768, 0.79-0.82x at
  // 1536x1024 to 3000x1024, 0.67-0.68x at 3072x512 and 4096x512, 0.91-0.94x
  // at 1024x2048 and 1500x2048; 2 threads 0.64-0.90x; with mean and rstd
  // saved 0.59x and 0.78x at 2048x768 and 2048x1024. There inputs of 6-12
  // MB took up to 1.8x the time of a streaming 12 MB one (LayerNorm forward
  // 3072x768 against 4096x768): the caches this guest gets hold less than
  // its 32 MB of L3. Smaller inputs lost or tied (1.03-1.11x at 256x1024
  // and 1024x1024, 1.08x with a wide spread at 1280x1024), and rows under
  // kShortMomentsValues through the streaming path lost (1.03-1.08x at
  // 16384x64, 24000x64 and 8192x50). The other sets were not measured.
  // RMSNorm's forward gained less (0.87-0.99x) and is left alone.
  template <typename S>
  static bool mid_streaming(Index rows, Index n) {
    return zen4_kernels_below_gate<S>(rows) && n >= detail::kShortMomentsValues<T> &&
           rows * n * static_cast<Index>(sizeof(T)) >= detail::kStreamingBytes / 2;
  }
  // What the Zen 4 choices below the streaming gate (mid_streaming,
  // cached_interleave) add to streaming_kernels_below_gate: an AVX-512 build
  // (where they were measured; not on Arm) and the other CPUs' path choices
  // (detail::path_choices() 0).
  template <typename S>
  static bool zen4_kernels_below_gate(Index rows) {
#if defined(EIGEN_VECTORIZE_AVX512)
    return streaming_kernels_below_gate<S>(rows) && detail::path_choices() == 0;
#else
    (void)rows;
    return false;
#endif
  }
  // On AMD Zen 5 (detail::zen5_tuned) rows with gamma and beta are
  // requested up to 16 KB, into the L1 (detail::request_next<true>).
  // Measured on a Zen 5 guest (48 KB of L1d, AVX-512, float, both sets of
  // choices alternating in one process, the same bits), against the Zen 4
  // choices (rows over 8 KB not requested, shorter ones into the L2), each
  // process's median ratio: 0.63-0.70x the time at 4096x2560, 0.73x at
  // 4096x3072, 0.89-0.93x at 8192x2048, 0.93-0.98x at 16384x1536; rows of
  // 16 KB, whose row, next row, gamma and beta overflow the L1, gained less
  // and unevenly: 0.74-1.01x at 4096x4096 (median of five processes 0.97x)
  // and 0.89-1.03x at 16384x4096 (0.94x). On 2 threads 0.64-0.70x,
  // 0.83-0.89x, 0.87-0.88x and 0.89-0.98x at 4096x2560, 8192x2048,
  // 4096x4096 and 16384x4096. Rows of 32 and 64 KB took 0.96-1.05x and keep
  // the Zen 4 choice; into the L2 instead, rows over 8 KB took 1.00-1.14x,
  // as on Zen 4.
  static constexpr Index kZen5RequestMaxRowBytes = 16384;
  // On AMD Zen 3 (detail::zen3_tuned) rows with gamma and beta are
  // requested whatever their length, into the L2, as on Intel CPUs.
  // Measured on a Zen 3 guest (AVX2, 32 KB of L1d, float, the sets of
  // choices alternating in one process, 11 and 15 shuffled rounds, the same
  // bits), against the Zen 4 choices: 0.81-0.83x the time at 8192x3072,
  // 0.82-0.88x at 2048x8192, 0.89x at 1024x16384, 0.90-0.93x at 4096x4096,
  // 0.91-0.93x at 16384x4096, 0.94x at 8192x8192; 2 threads 0.83-0.95x;
  // 0.96-1.05x on rows it leaves alone (4096x2048, 4096x1024). The Zen 5
  // choices (into the L1, up to 16 KB) did as well on rows of 3072 and 4096
  // floats, 0.97-1.00x on longer ones; the Intel set's other choices lost
  // on Zen 3 (LayerNorm backward at 512x768: 1.21x, its streaming dx).
  static Index request_max_row_bytes(const T* g, const T* b) {
    if (!g || !b) return kRequestMaxRowBytes;
    const int set = detail::path_choices();
    if (set == 1 || set == 3) return std::numeric_limits<Index>::max();
    return set == 2 ? kZen5RequestMaxRowBytes : kRequestMaxRowBytes;
  }
  void forward_rows(const T* x, T* out, Index n, Index count, T* mean, T* rstd, const T* g,
                    const T* b, bool streaming = false, bool stream_out = false) const {
    // One long row (the latency case, as 1x768): the same bits as in a
    // group; a short row keeps the group kernel, whose bits differ. On Zen 3
    // (AVX2) 0.82-0.85x the time at 1x768 in a standalone driver, 0.96x in
    // the bench.
    // The rest is a function of its own (not inlined), so that this path
    // does not pay for its frame: 1.03x the time at 1x768 on an Intel Xeon
    // with it inlined.
    if (count == 1 && !streaming && n >= detail::kShortMomentsValues<T>) {
      forward_long_rows<false>(x, out, n, count, mean, rstd, g, b);
      return;
    }
    forward_row_groups(x, out, n, count, mean, rstd, g, b, streaming, stream_out);
  }
  EIGEN_DONT_INLINE void forward_row_groups(const T* x, T* out, Index n, Index count, T* mean, T* rstd,
                                            const T* g, const T* b, bool streaming, bool stream_out) const {
    const Index group =
        detail::forward_group(streaming, n, sizeof(T), kCoeffGroup, detail::kShortMomentsValues<T>);
    detail::CoeffGroup<T> k;
    const bool stream = stream_out && detail::can_stream_rows(x, out, n, count);
    const bool request = detail::forward_requests(streaming, n, sizeof(T), request_max_row_bytes(g, b));
    const bool into_l1 = request && g && b && detail::zen5_tuned();
    if ((streaming && group == 1 && interleave_long_rows(n, request, g, b)) ||
        (!streaming && cached_interleave(x, out, n, count, g, b))) {
      if (stream) {
        forward_long_rows<true>(x, out, n, count, mean, rstd, g, b);
      } else {
        forward_long_rows<false>(x, out, n, count, mean, rstd, g, b);
      }
      return;
    }
    if (!stream && n > 0 && n < detail::kShortMomentsValues<T> && group == kCoeffGroup && count >= kCoeffGroup &&
        (!streaming || detail::kWideRegisterFile || n * static_cast<Index>(sizeof(T)) < kPipelinedStreamingRowBytes)) {
      forward_short_pipelined(x, out, n, count, mean, rstd, g, b, streaming);
      return;
    }
    for (Index r0 = 0; r0 < count; r0 += group) {
      const Index m = std::min(group, count - r0);
      row_coeffs(x + r0 * n, n, m, k);
      if (mean) std::copy(k.mean, k.mean + m, mean + r0);
      if (rstd) std::copy(k.rstd, k.rstd + m, rstd + r0);
      if (!streaming) {  // rows the caches hold: no requests, no streaming stores
        if (m == kCoeffGroup && g && b && n <= detail::kGroupNormalizeValues<T>) {
          detail::normalize_group<kCoeffGroup>(x + r0 * n, out + r0 * n, n, k, g, b);
        } else {
          for (Index i = 0; i < m; ++i)
            detail::normalize_values(detail::RowValues<T>{x + (r0 + i) * n}, out + (r0 + i) * n, n, k[i], g, b);
        }
        continue;
      }
      // Full groups of short rows with ordinary stores went to
      // forward_short_pipelined (with 32 vector registers, whose group
      // normalize they take).
      const Index ahead = detail::rows_ahead(streaming, group, count - r0 - m);
      for (Index i = 0; i < m; ++i) {
        if (i < ahead) detail::prefetch_span(x + (r0 + m + i) * n, n * static_cast<Index>(sizeof(T)));
        const detail::RowValues<T> row{x + (r0 + i) * n};
        const auto normalize = [&](const auto& src) {
          if (stream) {
            detail::normalize_values<true>(src, out + (r0 + i) * n, n, k[i], g, b);
          } else {
            detail::normalize_values(src, out + (r0 + i) * n, n, k[i], g, b);
          }
        };
        if (request && r0 + i + 1 < count) {
          if (into_l1) {
            normalize(detail::request_next<true>(row, x + (r0 + i + 1) * n));
          } else {
            normalize(detail::request_next(row, x + (r0 + i + 1) * n));
          }
        } else {
          normalize(row);
        }
      }
    }
    if (stream) detail::stream_fence();
  }

  // Rows shorter than this (bytes) of a streaming input take the pipelined
  // loop below in builds with 16 vector registers (AVX2 measured on the
  // Xeon: 0.77x the time at 131072x32, 0.99x at 65536x50, but 1.04-1.11x at
  // 65536x64, which has no group normalize there); with 32, every short row
  // does.
  static constexpr Index kPipelinedStreamingRowBytes = 256;

  // Short rows (at least one full group), software-pipelined: the moments of group
  // j + 1 are taken between the coefficients of group j (two divisions and
  // a square root per four rows, long latency) and its normalize, so the
  // out-of-order core runs them side by side instead of the normalize
  // waiting for the divider. The same functions on the same rows, so the
  // same bits as row_coeffs then the normalize, a group at a time. On an
  // Intel Xeon (AVX-512, float, weight and bias) against that loop: 0.84x
  // the time at 2048x50, 0.86-0.88x at 2048x64, 0.88-0.90x at 1024x100,
  // 0.95x at 512x256, 0.87-0.89x at 16x50 and 9x30. (Normalizing group
  // j - 1 after the coefficients of group j instead took 0.98-1.04x.)
  // Streaming inputs with ordinary stores (on the Xeon: short rows from
  // 1 MB) take it too, requesting group j + 2 while group j is normalized,
  // and the group normalize for rows of 64 as well: 0.93-0.95x the time at
  // 65536x64 and 16384x64, 0.90-0.92x at 8192x50 and 32768x50, 0.78-0.79x
  // at 16384x32 and 20000x20. Streaming stores keep the loop below.
  void forward_short_pipelined(const T* x, T* out, Index n, Index count, T* mean, T* rstd, const T* g,
                               const T* b, bool streaming) const {
    constexpr Index G = kCoeffGroup;
    alignas(64) double mu[2][G];
    alignas(64) double q[2][G];
    alignas(64) T pivot[2][G];
    detail::CoeffGroup<T> k;
    const auto moments = [&G, &count, &x, &n, &mu, &q, &pivot](Index r0, int s) {
      const Index m = std::min(G, count - r0);
      detail::short_rows_moments_split<G>(x + r0 * n, n, n, m, mu[s], q[s]);
      for (Index i = 0; i < m; ++i) pivot[s][i] = x[(r0 + i) * n];
      for (Index i = m; i < G; ++i) pivot[s][i] = pivot[s][m - 1];
    };
    // Streaming inputs: the rows of group j + 2 are requested while group j
    // is normalized (group 1 before group 0's moments).
    const auto request = [&](Index r) {
      if (!streaming) return;
      for (Index i = r; i < std::min(r + G, count); ++i)
        detail::prefetch_span(x + i * n, n * static_cast<Index>(sizeof(T)));
    };
    request(G);
    moments(0, 0);
    int s = 0;
    for (Index r0 = 0; r0 < count; r0 += G, s ^= 1) {
      const Index m = std::min(G, count - r0);
      const bool fine = detail::moments_all_fine<T>(mu[s], q[s], n, options_.eps());
      if (fine) detail::coeffs_group(pivot[s], mu[s], q[s], n, options_.eps(), k);
      if (r0 + G < count) moments(r0 + G, s ^ 1);
      if (!fine) row_coeffs(x + r0 * n, n, m, k);
      if (mean) std::copy(k.mean, k.mean + m, mean + r0);
      if (rstd) std::copy(k.rstd, k.rstd + m, rstd + r0);
      request(r0 + 2 * G);
      if (m == G && g && b && n <= detail::kGroupNormalizeValues<T>) {
        detail::normalize_group<G>(x + r0 * n, out + r0 * n, n, k, g, b);
      } else {
        for (Index i = 0; i < m; ++i)
          detail::normalize_values(detail::RowValues<T>{x + (r0 + i) * n}, out + (r0 + i) * n, n, k[i], g, b);
      }
    }
  }

  // forward_rows' long rows of a streaming input (one-row groups), long
  // float rows the caches hold under the Zen 4 path choices
  // (cached_interleave), and one long row alone on any input (count 1: no
  // interleaving), one at a time:
  // the moments of row r + 1 are taken in the loop that normalizes
  // row r (detail::moments_normalizing), so that reads from memory stay in
  // flight while the row is written. The same bits as a row at a time.
  // Measured on Zen 4 (AVX-512, float) against the row-at-a-time loop, on
  // inputs of 64 MB: with weight and bias 0.83-0.87x the time on rows of
  // 512-1024 floats, 1.10-1.15x on rows of 1536-2048 (those request the
  // next row instead, forward_requests), 0.99-1.03x on rows of 3072-8192;
  // without bias 0.94-0.97x, and without weight and bias 0.77x (1024) and
  // 0.81x (4096-8192). Hence: rows not requested, except long ones with
  // both. The interleaving only where the build has 32 vector registers:
  // the loop keeps the kernel's 16 accumulators and the normalize's 3
  // coefficients in registers, which 16 (SSE, AVX2) would spill; not
  // measured there.
  static bool interleave_long_rows(Index n, bool request, const T* g, const T* b) {
    return detail::kWideRegisterFile && !request &&
           !(g && b && n * static_cast<Index>(sizeof(T)) > kRequestMaxRowBytes);
  }
  // Under the other CPUs' path choices (detail::path_choices() 0, measured
  // on Zen 4), in AVX-512 builds, inputs the caches hold (below the
  // streaming gates: no requests, no streaming stores) of two or more float
  // rows of at least kCachedInterleaveRowBytes, with weight and bias, go
  // through forward_long_rows too, each row's moments taken while the row
  // before it is normalized, unless that loop's loads of row r + 1 would
  // wait on its stores to row r
  // (detail::next_row_loads_alias_stores): those keep the groups. The same
  // bits either way. Measured on a Zen 4 guest (AVX-512, float, both
  // choices alternating in one process on the same buffers, 11 rounds,
  // medians), against the groups, with weight and bias: 0.94-0.98x the
  // time at 512x768, 0.95-0.98x at 64x768, 0.96-0.98x at 8x768, 0.90-0.92x
  // at 100x1536, 0.98x at 256x1024 and 0.96x at 300x1000 where they do not
  // alias; where they alias (output and next row on the same 4 KB offset)
  // 1.13-1.21x. Rows of 2048 floats (8 KB) tied (1.00x). Shorter rows lost
  // or tied (1.04x at 1024x512, 1.01-1.04x at 512x576, 1.00-1.03x at
  // 512x640), and rows of 704 floats gained no more than rows of 768
  // (0.95-0.99x), so the gate starts at 768. Without bias, or without
  // weight and bias: 0.93-0.98x at 512x768 and 100x1536 but 1.01-1.03x at
  // 64x768, so those keep the groups. forward_add's blocks (h normalized
  // into y) took 0.93-0.98x at 64x768, 512x768 and 100x1536, 1.00x at
  // 4096x768 and 0.98x (a spread of 0.93-1.12x) at 4096x1024. Rows over
  // 8 KB keep the groups (interleave_long_rows). The Intel set already
  // takes the large-input paths on such inputs (intel_streaming); the Zen 5
  // and Zen 3 sets were not measured.
  static constexpr Index kCachedInterleaveRowBytes = 3072;
  static bool cached_interleave(const T* x, const T* out, Index n, Index count, const T* g, const T* b) {
    return zen4_kernels_below_gate<T>(count) && g && b &&
           n * static_cast<Index>(sizeof(T)) >= kCachedInterleaveRowBytes && interleave_long_rows(n, false, g, b) &&
           !detail::next_row_loads_alias_stores(x, out, n);
  }
  template <bool Stream>
  void forward_long_rows(const T* x, T* out, Index n, Index count, T* mean, T* rstd, const T* g,
                         const T* b) const {
    if (count <= 0) return;
    detail::NormCoeffs<T> c;
    row_coeffs(x, n, 1, &c);
    for (Index r = 0;; ++r) {
      const T* xr = x + r * n;
      if (mean) mean[r] = c.mean;
      if (rstd) rstd[r] = c.rstd;
      if (r + 1 == count) {
        detail::normalize_values<Stream>(detail::RowValues<T>{xr}, out + r * n, n, c, g, b);
        break;
      }
      const T* next = xr + n;
      Welford<double> w = detail::moments_normalizing<Stream>(next, xr, out + r * n, n, c, g, b);
      const T pivot = next[0];
      coeffs_from_moments(next, n, 1, &pivot, &w, &c);
    }
    if (Stream) detail::stream_fence();
  }

  // 16-bit rows (T float) where the build converts whole packets
  // (detail::packet_io): forward_rows' groups on the rows themselves, each
  // packet widened as it is read (detail::WidenValues, and the short-row
  // kernels on 16-bit rows) and y rounded as it is stored, instead of
  // blocks widened into float buffers. The same statistics and bits as
  // forward_rows on the widened rows.
  // `large`: an input of at least detail::kStreamingBytes as T; its long
  // rows go one at a time, as forward_rows' long rows of a streaming input
  // (measured on bf16 rows: 0.90-0.98x the time at 4096x1024 to
  // 16384x1024, 1.13x at 512x768).
  template <typename S>
  void forward_rows_widened(const S* x, S* out, Index n, Index count, T* mean, T* rstd, const T* g,
                            const T* b, bool large) const {
    const bool short_rows = n < detail::kShortMomentsValues<T>;
    const Index group = large && !short_rows ? 1 : detail::rows_per_group(n, sizeof(T), kCoeffGroup);
    std::vector<T> row;  // rows widened when row_coeffs asks for them
    auto widened = [&](Index r, Index m) {
      row.resize(static_cast<std::size_t>(m * n));
      detail::convert_n(x + r * n, row.data(), m * n);
      return static_cast<const T*>(row.data());
    };
    detail::CoeffGroup<T> k;
    for (Index r0 = 0; r0 < count; r0 += group) {
      const Index m = std::min(group, count - r0);
      const S* xg = x + r0 * n;
      row_coeffs(xg, n, m, k, [&](Index i, Index rows) { return widened(r0 + i, rows); });
      for (Index i = 0; i < m; ++i) {
        if (mean) mean[r0 + i] = k.mean[i];
        if (rstd) rstd[r0 + i] = k.rstd[i];
        detail::normalize_values(detail::WidenValues<S, T>{xg + i * n}, out + (r0 + i) * n, n, k[i], g, b);
      }
    }
  }

  // Normalization coefficients of count <= kCoeffGroup contiguous rows of
  // n values (pivot: each row's first value). row_coeffs(..., CoeffGroup&)
  // is the one place the forward and the backward's recomputation get their
  // statistics, so they agree bit for bit. Its group path (coeffs_group,
  // moments_all_fine) repeats the operations of the row-by-row one below
  // (norm_coeffs_r, needs_exact_moments); LayerNormTest's
  // ExtremeRowLeavesItsGroupsBitsAlone checks the two give the same bits.
  static constexpr Index kCoeffGroup = 8;
  static_assert(kCoeffGroup == detail::kInvSqrtGroup, "a group of rows is one CoeffGroup");
  // Short rows (detail::kShortMomentsValues), whose moments come a group at
  // a time: their coefficients too, in arrays (detail::coeffs_group), unless
  // a row needs the exact path; then row by row, as longer rows. Rows of T:
  // the template below with S = T, which never asks for widened rows.
  void row_coeffs(const T* x, Index n, Index count, detail::CoeffGroup<T>& k) const {
    row_coeffs(x, n, count, k, [](Index, Index) -> const T* { return nullptr; });
  }
  // The same for rows stored as S: T, or a 16-bit type (T float), whose
  // packets the kernels widen as they read them where the build converts
  // whole packets (detail::packet_io). widen(i, m) returns rows i .. i + m - 1
  // as T, asked for only for 16-bit rows: short rows whose group leaves the
  // group path (or all short rows in builds without 16-bit packets as narrow
  // as the short-row kernels'), and rows whose moments left T's range. The
  // same bits as on the rows widened beforehand.
  template <typename S, typename Widen>
  void row_coeffs(const S* x, Index n, Index count, detail::CoeffGroup<T>& k, Widen&& widen) const {
    constexpr bool wide = !std::is_same<S, T>::value;
    const bool short_rows = n > 0 && n < detail::kShortMomentsValues<T>;
    if constexpr (!wide || detail::packet_io<S, detail::narrow_simd<T>::L>()) {
      if (short_rows) {
        alignas(64) double mu[kCoeffGroup];
        alignas(64) double q[kCoeffGroup];
        alignas(64) T pivot[kCoeffGroup];
        detail::short_rows_moments_split<kCoeffGroup>(x, n, n, count, mu, q);
        // Two loops, not x[min(i, count - 1) * n]: GCC made that a gather.
        for (Index i = 0; i < count; ++i) pivot[i] = static_cast<T>(x[i * n]);
        for (Index i = count; i < kCoeffGroup; ++i) pivot[i] = pivot[count - 1];
        if (detail::moments_all_fine<T>(mu, q, n, options_.eps())) {
          detail::coeffs_group(pivot, mu, q, n, options_.eps(), k);
          return;
        }
      }
    }
    if constexpr (wide) {
      if (short_rows) {  // the group as T: the group path, or row by row
        row_coeffs(widen(0, count), n, count, k);
        return;
      }
    }
    detail::NormCoeffs<T> c[kCoeffGroup];
    if constexpr (wide) {  // long 16-bit rows, each packet widened as it is read
      Welford<double> w[kCoeffGroup];
      T pivot[kCoeffGroup] = {};
      for (Index i = 0; i < count; ++i) {
        const S* xr = x + i * n;
        pivot[i] = static_cast<T>(xr[0]);
        w[i] = detail::moments_of<T>(detail::WidenValues<S, T>{xr}, n, pivot[i]);
      }
      coeffs_of_rows([&](Index i) { return widen(i, 1); }, n, count, pivot, w, c);
    } else {
      row_coeffs(x, n, count, c);
    }
    for (Index i = 0; i < count; ++i) {
      k.mean[i] = c[i].mean;
      k.rstd[i] = c[i].rstd;
      k.pivot[i] = c[i].pivot;
      k.shift[i] = c[i].shift;
    }
  }
  void row_coeffs(const T* x, Index n, Index count, detail::NormCoeffs<T>* k) const {
    Welford<double> w[kCoeffGroup];
    T pivot[kCoeffGroup] = {};
    rows_moments(x, n, n, count, w);
    for (Index i = 0; i < count; ++i) pivot[i] = x[i * n];
    coeffs_from_moments(x, n, count, pivot, w, k);
  }
  // row_coeffs from the rows' moments w (shifted by pivot[i], their first
  // values); x is read again only for rows whose moments left T's range.
  void coeffs_from_moments(const T* x, Index n, Index count, const T* pivot, Welford<double>* w,
                           detail::NormCoeffs<T>* k) const {
    coeffs_of_rows([&](Index i) { return x + i * n; }, n, count, pivot, w, k);
  }
  // The same, row i as T from row_of(i), asked for only when its moments
  // left T's range (16-bit rows are widened then).
  template <typename RowOf>
  void coeffs_of_rows(RowOf&& row_of, Index n, Index count, const T* pivot, Welford<double>* w,
                           detail::NormCoeffs<T>* k) const {
    const double eps = options_.eps();
    double var[kCoeffGroup];
    double r[kCoeffGroup];
    for (Index i = 0; i < count; ++i) {
      if (!detail::moments_in_range<T>(w[i], n, eps)) {
        const T* xr = row_of(i);
        if (detail::needs_exact_moments(w[i], xr, n, 1, eps)) w[i] = exact_moments(xr, n, 1, pivot[i]);
      }
      var[i] = w[i].variance();
    }
    detail::inv_sqrt_eps(var, eps, count, r);
    for (Index i = 0; i < count; ++i) k[i] = detail::norm_coeffs_r<T>(pivot[i], w[i].mean(), var[i], r[i]);
  }

  // forward_add's rows on streaming inputs (detail::fused_add_norm's first
  // path), one at a time: the statistics pass stores h = x + r as it reads
  // it (StreamH: streaming stores), then the row is normalized from h, in
  // L1, or, with StreamH, from x + r made again (the same bits). StreamY:
  // streaming stores for y. The same statistics and bits as forward_rows
  // on h.
  template <bool StreamH, bool StreamY>
  void forward_add_rows(const T* x, const T* r, T* h, T* out, Index n, Index count, T* mean, T* rstd,
                        const T* g, const T* b) const {
    detail::each_add_row(x, r, h, out, n, count, [&](Index i, const T* xr, const T* rr, T* hr, T* yr) {
      const T pivot = xr[0] + rr[0];
      Welford<double> w = detail::moments_of(detail::AddStoreValues<T, StreamH>{xr, rr, hr}, n, pivot);
      detail::add_tail(xr, rr, hr, n);
      detail::NormCoeffs<T> k;
      coeffs_from_moments(hr, n, 1, &pivot, &w, &k);
      if (mean) mean[i] = k.mean;
      if (rstd) rstd[i] = k.rstd;
      if constexpr (StreamH) {
        detail::normalize_values<StreamY>(detail::SumValues<T>{xr, rr}, yr, n, k, g, b);
      } else {
        detail::normalize_values<StreamY>(detail::RowValues<T>{hr}, yr, n, k, g, b);
      }
    });
  }

  // Checks the backward's arguments and takes views; 16-bit ColMajor data
  // go through whole float copies.
  template <typename Device, typename X, typename DY, typename DX, typename DH>
  void backward_entry(const Device& device, const X& x, const DY& dy, DX dx, const DH* dh,
                      Eigen::Tensor<P, 1>* dweight, Eigen::Tensor<P, 1>* dbias,
                      const NormStats<T>* saved) const {
    detail::row_backward_entry<T>(kWho, options_.normalized_shape(), x, dy, dx, dh,
                                  [this, &device, &dweight, &dbias, &saved](const auto& v, const auto* dyp,
                                                                            auto* dxp, const auto* dhp) {
                                    this->backward_impl(device, v, dyp, dxp, dhp, dweight, dbias, saved);
                                  });
  }

  // ColMajor: element (r, j) at data[j * rows + r]; rows are SIMD lanes.
  // Handles rows [r0, r1), r0 a multiple of the packet size.
  // Segments of rows (detail::colmajor_forward_segment), each its
  // statistics and then its normalize while its x is in the cache.
  void forward_colmajor(const detail::Matrix2D<T>& xv, T* out, T* mean, T* rstd, Index r0,
                        Index r1, const T* g, const T* b, bool may_stream) const {
    detail::for_colmajor_segments<T>(xv.rows, xv.cols, r0, r1,
                                     [this, &xv, &out, &mean, &rstd, &g, &b, &may_stream](Index s0, Index s1) {
      forward_colmajor_rows(xv, out, mean, rstd, s0, s1, g, b, may_stream);
    });
  }
  void forward_colmajor_rows(const detail::Matrix2D<T>& xv, T* out, T* mean, T* rstd, Index r0,
                             Index r1, const T* g, const T* b, bool may_stream) const {
    constexpr int L = detail::simd<T>::L;
    const Index rows = xv.rows, n = xv.cols, m = r1 - r0;
    // The temporaries: the calling thread's scratch (detail::Scratch).
    detail::Scratch<Welford<double>> w(static_cast<std::size_t>(m), false);
    detail::Scratch<double> ri(static_cast<std::size_t>(m), false);
    detail::Scratch<T> coef(static_cast<std::size_t>(3 * m), false);
    colmajor_moments(xv, r0, r1, w.data());
    colmajor_inv_sqrt(w.data(), m, ri.data());
    T* piv = coef.data();
    T* rs = piv + m;
    T* sh = rs + m;
    for (Index i = 0; i < m; ++i) {
      const auto& wr = w.data()[i];
      const auto k = detail::norm_coeffs_r<T>(xv.data[r0 + i], wr.mean(), wr.variance(), ri.data()[i]);
      piv[i] = k.pivot;
      rs[i] = k.rstd;
      sh[i] = -k.shift;
      if (mean) {
        mean[r0 + i] = k.mean;
        rstd[r0 + i] = k.rstd;
      }
    }
    const bool stream = may_stream && detail::can_stream_colmajor(xv.data, out, rows, n);
    Index i0 = m / L * L;
    if (detail::colmajor_column_walk<T>(rows, stream)) {
      normalize_columns(xv.data + r0, out + r0, rows, i0, n, piv, rs, sh, g, b);
    } else {
      i0 = detail::for_lane_blocks<detail::kLanePackets>(0, m, L, [&](auto k_c, Index i) {
        constexpr int K = decltype(k_c)::value;
        if (stream)
          normalize_lanes<K, true>(xv.data + r0 + i, out + r0 + i, rows, n, piv + i, rs + i, sh + i, g, b);
        else
          normalize_lanes<K, false>(xv.data + r0 + i, out + r0 + i, rows, n, piv + i, rs + i, sh + i, g, b);
      });
    }
    if (stream) detail::stream_fence();  // (this part's stores done)
    if (i0 < m) {
      // Leftover rows go through the same packet code on a padded copy, so a
      // row's result never depends on where it sits in the batch.
      const Index k = m - i0;
      std::vector<T> tmp(static_cast<std::size_t>(2 * L * n + 3 * L));
      T* tx = tmp.data();
      T* ty = tx + L * n;
      T* tc = ty + L * n;
      detail::gather_lanes(xv.data, rows, r0 + i0, k, n, Index(L), tx);
      detail::gather_values(piv, i0, k, Index(L), tc);
      detail::gather_values(rs, i0, k, Index(L), tc + L);
      detail::gather_values(sh, i0, k, Index(L), tc + 2 * L);
      normalize_lanes<1, false>(tx, ty, L, n, tc, tc + L, tc + 2 * L, g, b);
      detail::scatter_lanes(ty, rows, r0 + i0, k, n, Index(L), out);
    }
  }

  // Packets of rows side by side in the ColMajor backward (three sums a
  // packet in its first pass): detail::kLanePackets with 32 vector
  // registers, else 2.
  static constexpr int kBackwardLanePackets =
      EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 ? detail::kLanePackets : 2;

  // normalize_lanes' arithmetic for m rows (whole packets) of a ColMajor
  // block, a feature at a time (detail::colmajor_column_walk): each
  // feature's values of a run of detail::kColumnRunBytes rows front to
  // back, the run's coefficients loaded with every packet.
  static void normalize_columns(const T* x, T* out, Index ld, Index m, Index n, const T* piv, const T* rs,
                                const T* sh, const T* gamma, const T* beta) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    constexpr Index seg = detail::kColumnRunBytes / Index(sizeof(T));
    for (Index s0 = 0; s0 < m; s0 += seg) {
      const Index s1 = std::min(m, s0 + seg);
      for (Index j = 0; j < n; ++j) {
        const T* const xj = x + j * ld;
        T* const oj = out + j * ld;
        const Packet gj = pset1<Packet>(gamma ? gamma[j] : T(1)), bj = pset1<Packet>(beta ? beta[j] : T(0));
        detail::for_packets<L>(s0, s1, [&](Index i) NORMCORE_INLINE_LAMBDA {
          const Packet d = psub(ploadu<Packet>(xj + i), ploadu<Packet>(piv + i));
          Packet v = pmadd(d, ploadu<Packet>(rs + i), ploadu<Packet>(sh + i));
          if (gamma) v = beta ? pmadd(v, gj, bj) : pmul(v, gj);
          pstoreu(oj + i, v);
        });
      }
    }
  }

  // K packets of rows (lanes) of a ColMajor block with leading dimension ld;
  // each lane's arithmetic is the same whatever K. Stream: streaming stores
  // (detail::can_stream_colmajor).
  template <int K, bool Stream>
  static void normalize_lanes(const T* x, T* out, Index ld, Index n, const T* piv, const T* rs,
                              const T* sh, const T* gamma, const T* beta) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    Packet pp[K], pr[K], pc[K];
    NORMCORE_UNROLL
    for (int k = 0; k < K; ++k) {
      pp[k] = ploadu<Packet>(piv + k * L);
      pr[k] = ploadu<Packet>(rs + k * L);
      pc[k] = ploadu<Packet>(sh + k * L);
    }
    for (Index j = 0; j < n; ++j) {
      const T* xj = x + j * ld;
      T* oj = out + j * ld;
      const Packet gj = pset1<Packet>(gamma ? gamma[j] : T(1)), bj = pset1<Packet>(beta ? beta[j] : T(0));
      NORMCORE_UNROLL
      for (int k = 0; k < K; ++k) {
        Packet v = pmadd(psub(ploadu<Packet>(xj + k * L), pp[k]), pr[k], pc[k]);
        if (gamma) v = beta ? pmadd(v, gj, bj) : pmul(v, gj);
        detail::store_packet<Stream>(oj + k * L, v);
      }
    }
  }

  template <typename Device, typename S>
  void backward_impl(const Device& device, const detail::Matrix2D<S>& xv, const S* dyp, S* dxp,
                     const S* dhp, Eigen::Tensor<P, 1>* dweight, Eigen::Tensor<P, 1>* dbias,
                     const NormStats<T>* saved) const {
    if (dweight && !weight_.size()) {
      detail::fail(std::string(kWho) + ": dweight requested but the layer has no weight "
                                       "(elementwise_affine is false)");
    }
    if (dbias && !bias_.size()) {
      detail::fail(std::string(kWho) + ": dbias requested but the layer has no bias");
    }
    if (saved) {
      detail::check_stats(kWho, saved->mean, "mean", xv.rows);
      detail::check_stats(kWho, saved->rstd, "rstd", xv.rows);
    }
    constexpr int L = detail::simd<T>::L;
    constexpr bool wide = !std::is_same<S, T>::value;  // 16-bit RowMajor rows
    constexpr bool staged = wide && !detail::packet_io<S, L>();
    const Index n = xv.cols, rows = xv.rows;
    // Fixed groups of rows (boundaries on kRowBlock, or for ColMajor on
    // blocks of detail::kLanePackets packets, which the lane kernels never
    // split between groups), at most kGroups: parameter gradients are summed
    // per group and the groups added in order, whatever the number of
    // threads.
    constexpr Index kLaneBlock = Index(detail::kLanePackets) * L;
    const Index align = xv.row_major ? kRowBlock : kLaneBlock;
    const Index units = xv.row_major ? (rows + kRowBlock - 1) / kRowBlock : (rows + kLaneBlock - 1) / kLaneBlock;
    const Index groups = std::max<Index>(1, std::min<Index>(units, kGroups));
    const detail::Split gsplit{rows, groups, align};
    const Index parts = detail::row_parts_for(device, rows * n, groups);
    const detail::Split psplit{groups, parts, 1};  // groups per thread
    // Statistics: saved, or recomputed exactly as forward computes them.
    detail::Scratch<T> stat(saved ? 0 : static_cast<std::size_t>(2 * rows), false);
    const T* mean;
    const T* rstd;
    if (saved) {
      mean = saved->mean.data();
      rstd = saved->rstd.data();
    } else {
      T* sm = stat.data();
      T* sr = stat.data() + rows;
      detail::run_parts(device, parts, [this, &gsplit, &psplit, &xv, &rows, &n, &sm, &sr](Index p) {
        static_cast<void>(rows);  // (read by 16-bit data only)
        const Index r0 = gsplit.begin(psplit.begin(p)), r1 = gsplit.begin(psplit.begin(p + 1));
        if (!xv.row_major) {
          if constexpr (wide) {  // 16-bit: blocks of rows widened into float
            detail::colmajor_in_compute_type<T>(
                xv.data, static_cast<S*>(nullptr), rows, n, r0, r1, detail::colmajor_stage_rows<T>(n),
                [this, &sm, &sr](const detail::Matrix2D<T>& v, T*, Index b) {
                  colmajor_stats(v, 0, v.rows, sm + b, sr + b);
                });
          } else {
            colmajor_stats(xv, r0, r1, sm, sr);
          }
          return;
        }
        std::vector<T> row;  // 16-bit rows widened when row_coeffs asks for them
        detail::CoeffGroup<T> k;
        for (Index r = r0; r < r1;) {
          Index m = 1;
          if constexpr (wide) {
            const auto widened = [&](Index i, Index count) {
              row.resize(static_cast<std::size_t>(count * n));
              detail::convert_n(xv.data + (r + i) * n, row.data(), count * n);
              return static_cast<const T*>(row.data());
            };
            if constexpr (detail::packet_io<S, L>()) {  // groups, as the forward's
              m = std::min(kCoeffGroup, r1 - r);
              row_coeffs(xv.data + r * n, n, m, k, widened);
            } else {
              row_coeffs(widened(0, 1), n, 1, k);
            }
          } else {
            m = std::min(kCoeffGroup, r1 - r);
            row_coeffs(xv.data + r * n, n, m, k);
          }
          for (Index i = 0; i < m; ++i, ++r) {
            sm[r] = k.mean[i];
            sr[r] = k.rstd[i];
          }
        }
      });
      mean = sm;
      rstd = sr;
    }
    const std::size_t gn = static_cast<std::size_t>(groups * n);
    // Fewer rows than one block (RowMajor, read as stored): the block's T
    // sums go straight to dweight and dbias (GradAcc::emit), as the group
    // sums would give them, and the double sums below are never written
    // (their pointers only say which gradients to accumulate), so they are
    // not zeroed.
    const bool one_block = xv.row_major && !staged && rows < kRowBlock;
    // Per-group sums of dweight and dbias (detail::Scratch: kept between calls).
    detail::Scratch<double> part((dweight ? gn : 0) + (dbias ? gn : 0), !one_block);
    double* const dw_part = part.data();
    double* const db_part = part.data() + (dweight ? gn : 0);
    const bool stream_dx = xv.row_major && detail::stream_gradient<S, T>(xv.data, dyp, dhp, dxp, rows, n,
                                                                         detail::threads_for(device, parts));
    const bool ahead = detail::prefetch_next_row<S, T>(rows, n);
    const auto prm = detail::param_ptrs<T>(weight_, Eigen::Tensor<P, 1>());
    const auto pv = detail::param_view(!xv.row_major, options_.normalized_shape(), prm.gamma,
                                       static_cast<const T*>(nullptr), n);
    detail::run_parts(device, parts, [&xv, &gsplit, &psplit, &dweight, &dw_part, &dbias, &db_part, &dyp, &dxp, &dhp,
                                      &rows, &n, &mean, &rstd, &pv, &ahead, &stream_dx, &one_block](Index p) {
      static_cast<void>(ahead);  // (ahead and one_block: read by rows that are not staged only)
      static_cast<void>(one_block);
      if (!xv.row_major) {
        const Index R0 = gsplit.begin(psplit.begin(p)), R1 = gsplit.begin(psplit.begin(p + 1));
        double* const dwp = dweight ? dw_part : nullptr;
        double* const dbp = dbias ? db_part : nullptr;
        if constexpr (wide) {
          // 16-bit: blocks of rows widened into float, on whole blocks of
          // gsplit's alignment from the part's start (the float path's lane
          // blocks, so its sums).
          detail::colmajor_backward_in_compute_type<T>(
              xv.data, dyp, dxp, dhp, rows, n, R0, R1, detail::colmajor_stage_rows<T>(n),
              [&](const T* bx, const T* bdy, T* bdx, const T* bdh, Index m, Index b) {
                backward_colmajor(bx, bdy, bdx, bdh, m, b, n, gsplit, b, b + m, mean, rstd, pv.gamma, dwp, dbp);
              });
        } else {
          backward_colmajor(xv.data, dyp, dxp, dhp, rows, 0, n, gsplit, R0, R1, mean, rstd, pv.gamma, dwp, dbp);
        }
        return;
      }
      // 16-bit rows: each packet widened as it is loaded where the build
      // converts whole packets (detail::packet_io); else sub-blocks widened
      // into float buffers (whole kRowBlock blocks when they are small, so
      // the sums match the float path).
      const Index sb = staged ? detail::backward_stage_rows(n, kRowBlock) : 0;
      std::vector<T> buf(static_cast<std::size_t>(4 * sb * n));
      GradAcc acc(xv.row_major ? n : 0, dweight != nullptr, dbias != nullptr);
      for (Index gi = psplit.begin(p); gi < psplit.begin(p + 1); ++gi) {
        const Index r0 = gsplit.begin(gi), r1 = gsplit.begin(gi + 1);
        double* dw = dweight ? dw_part + gi * n : nullptr;
        double* db = dbias ? db_part + gi * n : nullptr;
        if constexpr (staged) {
          T* bx = buf.data();
          T* bdy = bx + sb * n;
          T* bdx = bdy + sb * n;
          T* bdh = bdx + sb * n;
          for (Index b0 = r0; b0 < r1; b0 += sb) {
            const Index m = std::min(sb, r1 - b0);
            detail::convert_n(xv.data + b0 * n, bx, m * n);
            detail::convert_n(dyp + b0 * n, bdy, m * n);
            if (dhp) detail::convert_n(dhp + b0 * n, bdh, m * n);
            backward_rows(bx, bdy, dxp ? bdx : nullptr, m, n, mean + b0, rstd + b0, pv.gamma, dw, db,
                          dhp ? bdh : nullptr, acc);
            if (dxp) detail::convert_n(bdx, dxp + b0 * n, m * n);
          }
          if (acc.rows) acc.flush(dw, db);
        } else {
          const auto rows_of = [&](auto stream) {
            backward_rows<decltype(stream)::value>(xv.data + r0 * n, dyp + r0 * n, dxp ? dxp + r0 * n : nullptr,
                                                   r1 - r0, n, mean + r0, rstd + r0, pv.gamma, dw, db,
                                                   dhp ? dhp + r0 * n : nullptr, acc, ahead);
          };
          if (stream_dx) {
            rows_of(std::true_type());
          } else {
            rows_of(std::false_type());
          }
          if (one_block) {
            acc.emit(dweight, dbias);
          } else if (acc.rows) {
            acc.flush(dw, db);
          }
        }
      }
      if (stream_dx) detail::stream_fence();
    });
    if (one_block) return;  // (GradAcc::emit wrote them)
    // Groups in order, then back to PyTorch's (row-major) flattening.
    std::vector<Index> perm;
    const bool permute = !xv.row_major && options_.normalized_shape().size() > 1;
    if (permute) perm = detail::colmajor_to_rowmajor(options_.normalized_shape());
    if (dweight) detail::emit_group_sums(dw_part, groups, n, permute ? &perm : nullptr, *dweight);
    if (dbias) detail::emit_group_sums(db_part, groups, n, permute ? &perm : nullptr, *dbias);
  }

  static constexpr Index kGroups = 16;

  // The moments of ColMajor rows [r0, r1), each shifted by its first
  // value (the pivot, data[r]): all at once, lane by lane (lane_moments;
  // a row's moments do not depend on the rows beside it), with the exact
  // path for the rows detail::needs_exact_moments picks.
  void colmajor_moments(const detail::Matrix2D<T>& xv, Index r0, Index r1, Welford<double>* w) const {
    const Index m = r1 - r0, rows = xv.rows, n = xv.cols;
    lane_moments(xv.data + r0, rows, n, m, xv.data + r0, w);
    for (Index i = 0; i < m; ++i) {
      auto& wi = w[i];
      const T* xr = xv.data + r0 + i;
      if (detail::needs_exact_moments(wi, xr, n, rows, options_.eps())) wi = exact_moments(xr, n, rows, xr[0]);
    }
  }

  // 1 / sqrt(variance + eps) of each row's moments, in packets of
  // divisions and square roots (detail::inv_sqrt_eps: the same bits as
  // norm_coeffs' scalar ones). Measured on the Zen 5 guest against one
  // scalar square root and division a row (the forward, float, 1 thread,
  // 5 shuffled rounds): 0.87x the time at 2064x50, 0.92x at 2048x50 and
  // 8208x100, 0.97x at 65552x64.
  void colmajor_inv_sqrt(const Welford<double>* w, Index m, double* r) const {
    for (Index i = 0; i < m; ++i) r[i] = w[i].variance();
    detail::inv_sqrt_eps(r, options_.eps(), m, r);
  }

  // The backward's statistics of ColMajor rows [r0, r1) when none were
  // saved, as forward_colmajor computes them. (Row by row, each row read
  // one value per stride, this took 7x the time of the rest of the
  // backward at 4096x1024.)
  void colmajor_stats(const detail::Matrix2D<T>& xv, Index r0, Index r1, T* mean, T* rstd) const {
    detail::Scratch<Welford<double>> w(static_cast<std::size_t>(r1 - r0), false);
    detail::Scratch<double> ri(static_cast<std::size_t>(r1 - r0), false);
    colmajor_moments(xv, r0, r1, w.data());
    colmajor_inv_sqrt(w.data(), r1 - r0, ri.data());
    for (Index i = r0; i < r1; ++i) {
      const auto& wi = w.data()[i - r0];
      const auto c = detail::norm_coeffs_r<T>(xv.data[i], wi.mean(), wi.variance(), ri.data()[i - r0]);
      mean[i] = c.mean;
      rstd[i] = c.rstd;
    }
  }

  // Rows of n contiguous values. For each row, with d = x - mean_saved and
  // g = dy * gamma, one pass sums g, g*d and d; delta = sum(d)/n corrects the
  // saved (rounded) mean, so x_hat = (d - delta) * rstd is nearly exact even
  // when the mean is large. Then
  //   dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
  //      = fma(g, rstd, -fma(d, k3, k4))   (one rounding on the large term).
  // Parameter gradients are summed in T over blocks of kRowBlock rows, then
  // added in double, block by block in order.
  static constexpr Index kRowBlock = 64;

  // The T accumulators of dweight/dbias and the rows they hold; flushed into
  // the group's double sums every kRowBlock rows counted from the group's
  // start, however the rows arrive (whole groups, or 16-bit sub-blocks).
  struct GradAcc {
    std::vector<T> w, b;
    Index rows = 0;
    GradAcc(Index n, bool want_w, bool want_b)
        : w(want_w ? static_cast<std::size_t>(n) : 0, T(0)), b(want_b ? static_cast<std::size_t>(n) : 0, T(0)) {}
    void flush(double* dw, double* db) {
      for (std::size_t j = 0; j < w.size(); ++j) {
        dw[j] += static_cast<double>(w[j]);
        w[j] = T(0);
      }
      for (std::size_t j = 0; j < b.size(); ++j) {
        db[j] += static_cast<double>(b[j]);
        b[j] = T(0);
      }
      rows = 0;
    }
    // The gradients of one group of one block (detail::emit_block_sums).
    void emit(Eigen::Tensor<P, 1>* dweight, Eigen::Tensor<P, 1>* dbias) const {
      if (dweight) detail::emit_block_sums(w, *dweight);
      if (dbias) detail::emit_block_sums(b, *dbias);
    }
  };

  // backward_rows for rows of K packets at most (n in ((K - 1) L, K L]),
  // everything the rows share held in registers: gamma, and the block's
  // dweight/dbias sums (loaded from acc at the block's start, stored at its
  // end: per column the same multiply-adds in the same order as
  // backward_rows's). Each row's x and dy are read once, for both passes.
  // A row's last packet covers its last L values (offset n - L); its lanes
  // before the tail (those of packet K - 2) are masked out of the sums, and
  // its dx is stored whole (those lanes recomputed, the same bits) where dx
  // is apart from x, dy and dh, else value by value.
  template <int K, bool Stream, typename S>
  static void backward_rows_short(const S* x, const S* dy, S* dx, Index rows, Index n, const T* mean,
                                  const T* rstd, const T* gamma, double* dw, double* db, const S* dh,
                                  GradAcc& acc) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    const auto ld = [](const S* q) { return detail::load_widened<Packet>(q); };
    const auto v = [](S s) { return static_cast<T>(s); };
    T* const accw = acc.w.data();
    T* const accb = acc.b.data();
    const detail::ShortRow<T, K> row(n);
    const Index last = row.last, fresh = row.fresh;
    const Packet mask = row.mask;
    const auto at = [&](int k) { return row.at(k); };
    const bool whole_dx = row.whole_dx(x, dy, dx, dh, rows, n);
    Packet G[K];
    NORMCORE_UNROLL
    for (int k = 0; k < K; ++k) G[k] = gamma ? ploadu<Packet>(gamma + at(k)) : pset1<Packet>(T(1));
    for (Index r0 = 0; r0 < rows;) {
      const Index r1 = std::min(rows, r0 + (kRowBlock - acc.rows));
      Packet W[K], B[K];
      NORMCORE_UNROLL
      for (int k = 0; k < K; ++k) {
        W[k] = dw ? ploadu<Packet>(accw + at(k)) : pset1<Packet>(T(0));
        B[k] = db ? ploadu<Packet>(accb + at(k)) : pset1<Packet>(T(0));
      }
      W[K - 1] = pand(W[K - 1], mask);
      B[K - 1] = pand(B[K - 1], mask);
      for (Index r = r0; r < r1; ++r) {
        const S* xr = x + r * n;
        const S* gr = dy + r * n;
        const T p = mean[r];
        const T rs = rstd[r];
        const Packet pp = pset1<Packet>(p);
        Packet Y[K], D[K], Gd[K];
        NORMCORE_UNROLL
        for (int k = 0; k < K; ++k) {
          Y[k] = ld(gr + at(k));
          D[k] = psub(ld(xr + at(k)), pp);
          Gd[k] = gamma ? pmul(Y[k], G[k]) : Y[k];
        }
        // The three sums: packets added in a fixed tree, the last one masked.
        const Packet gm = pand(Gd[K - 1], mask), dm = pand(D[K - 1], mask);
        Packet sg = gm, sgd = pmul(gm, dm), sd = dm;
        NORMCORE_UNROLL
        for (int k = 0; k < K - 1; ++k) {
          sg = padd(sg, Gd[k]);
          sgd = pmadd(Gd[k], D[k], sgd);
          sd = padd(sd, D[k]);
        }
        const auto bc = detail::backward_coeffs<T>(static_cast<double>(predux(sg)), static_cast<double>(predux(sgd)),
                                                   static_cast<double>(predux(sd)), n, rs);
        const Packet pr = pset1<Packet>(rs), p3 = pset1<Packet>(bc.k3), p4 = pset1<Packet>(bc.k4),
                     pxs = pset1<Packet>(bc.xs);
        const Packet ym = pand(Y[K - 1], mask);
        NORMCORE_UNROLL
        for (int k = 0; k < K; ++k) {
          const Packet xh = pmadd(D[k], pr, pxs);
          if (dx && (k < K - 1 || whole_dx)) {
            Packet o = pmadd(Gd[k], pr, pnegate(pmadd(xh, p3, p4)));
            if (dh) o = padd(o, ld(dh + r * n + at(k)));
            detail::store_packet<Stream>(dx + r * n + at(k), o);
          }
          const Packet yk = k == K - 1 ? ym : Y[k];
          if (dw) W[k] = pmadd(yk, xh, W[k]);
          if (db) B[k] = padd(B[k], yk);
        }
        if (dx && !whole_dx) {  // the tail's dx value by value (dx over an input)
          for (Index j = n - fresh; j < n; ++j) {
            const T xh = detail::madd(v(xr[j]) - p, rs, bc.xs);
            const T g = gamma ? v(gr[j]) * gamma[j] : v(gr[j]);
            const T o = detail::madd(g, rs, -detail::madd(xh, bc.k3, bc.k4));
            dx[r * n + j] = static_cast<S>(dh ? o + v(dh[r * n + j]) : o);
          }
        }
      }
      NORMCORE_UNROLL
      for (int k = 0; k < K - 1; ++k) {
        if (dw) pstoreu(accw + at(k), W[k]);
        if (db) pstoreu(accb + at(k), B[k]);
      }
      if (dw) pstoreu(accw + last, pselect(mask, W[K - 1], ploadu<Packet>(accw + last)));
      if (db) pstoreu(accb + last, pselect(mask, B[K - 1], ploadu<Packet>(accb + last)));
      acc.rows += r1 - r0;
      if (acc.rows == kRowBlock) acc.flush(dw, db);
      r0 = r1;
    }
  }

  // Whether backward_rows takes the rows of a streaming backward (those
  // that request the next row as they go: detail::prefetch_next_row) two at
  // a time, as it takes rows the caches hold: the first passes of two rows,
  // then one second pass over both, which loads and stores the block's
  // dweight and dbias sums once for the two and requests the two rows after
  // them. The same bits (each row's terms added in row order). Under the
  // path choices measured on Zen 4 (not the Intel or the Zen 5 ones), for
  // rows of at least kPairStreamingRowBytes with dx streamed (Stream:
  // detail::stream_gradient, so x86 builds, rows stored as T in whole
  // packets, dx aligned and apart from x, dy and dh). Measured on a Zen 4
  // guest (AVX-512, 1 thread, both versions in one process, 15-21
  // alternating rounds, medians) against one row at a time: float 0.85-0.94x the time at 4096x1024, 0.87-0.90x at
  // 4096x4096, 0.88x at 16384x4096, 0.79-0.80x at 2048x1024, 0.91x at
  // 8192x2048, 0.93x at 4096x2048, 0.84x at 1024x16384, 0.87-0.92x at
  // 2730x1536, 3200x1280 and 3900x1040; double 0.84x at 2048x4096, 0.78x at
  // 1024x2048, 0.89-0.93x at 2048x1024, 4096x512 and 8192x768. Shorter rows
  // lost (float 1.03-1.07x at 32768x512, 16384x768, 8192x768 and 6144x640),
  // as did rows with a tail (1.02-1.09x at 4000x1000, 4096x1016 and
  // 4096x1032; 0.93x at 2048x3000), and 2000x2000 was a tie (1.02x).
  // RMSNorm's backward, in pairs the same way, lost as often as it gained
  // (0.89-1.15x), and keeps one row at a time.
  static constexpr Index kPairStreamingRowBytes = 4096;
  template <bool Stream>
  static bool pair_streaming_rows(Index n) {
    return Stream && !detail::intel_tuned() && !detail::zen5_tuned() &&
           n * static_cast<Index>(sizeof(T)) >= kPairStreamingRowBytes;
  }

  // S is T, or a 16-bit type (T float) where detail::packet_io says the
  // build converts whole packets: each packet is widened as it is loaded and
  // dx rounded as it is stored, the same values and bits as the rows widened
  // into float buffers first.
  template <bool Stream = false, typename S = T>
  static void backward_rows(const S* x, const S* dy, S* dx, Index rows, Index n, const T* mean,
                            const T* rstd, const T* gamma, double* dw, double* db, const S* dh,
                            GradAcc& acc, bool ahead = false) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    if (n >= L && n <= detail::kShortBackwardPackets * L) {  // backward_rows_short<ceil(n / L)>
      const Index k = (n + L - 1) / L;
      if (k == 1) return backward_rows_short<1, Stream>(x, dy, dx, rows, n, mean, rstd, gamma, dw, db, dh, acc);
      if (k == 2) return backward_rows_short<2, Stream>(x, dy, dx, rows, n, mean, rstd, gamma, dw, db, dh, acc);
      if constexpr (detail::kShortBackwardPackets >= 4) {
        if (k == 3) return backward_rows_short<3, Stream>(x, dy, dx, rows, n, mean, rstd, gamma, dw, db, dh, acc);
        return backward_rows_short<4, Stream>(x, dy, dx, rows, n, mean, rstd, gamma, dw, db, dh, acc);
      }
    }
    const auto ld = [](const S* q) { return detail::load_widened<Packet>(q); };
    const auto v = [](S s) { return static_cast<T>(s); };
    // Raw pointers: through the vectors, every store would make the
    // compiler reload their data pointers.
    T* const accw = acc.w.data();
    T* const accb = acc.b.data();
    // First pass: row r's three sums, then its constants.
    const auto coeffs = [&](Index r) {
      const S* xr = x + r * n;
      const S* gr = dy + r * n;
      const T p = mean[r];
      const Packet pp = pset1<Packet>(p);
      Packet sg0 = pset1<Packet>(T(0)), sgd0 = sg0, sd0 = sg0, sg1 = sg0, sgd1 = sg0, sd1 = sg0;
      Index j = 0;
      for (; j + 2 * L <= n; j += 2 * L) {
        Packet g0 = ld(gr + j), g1 = ld(gr + j + L);
        if (gamma) {
          g0 = pmul(g0, ploadu<Packet>(gamma + j));
          g1 = pmul(g1, ploadu<Packet>(gamma + j + L));
        }
        const Packet d0 = psub(ld(xr + j), pp);
        const Packet d1 = psub(ld(xr + j + L), pp);
        sg0 = padd(sg0, g0);
        sg1 = padd(sg1, g1);
        sgd0 = pmadd(g0, d0, sgd0);
        sgd1 = pmadd(g1, d1, sgd1);
        sd0 = padd(sd0, d0);
        sd1 = padd(sd1, d1);
      }
      for (; j + L <= n; j += L) {
        Packet g0 = ld(gr + j);
        if (gamma) g0 = pmul(g0, ploadu<Packet>(gamma + j));
        const Packet d0 = psub(ld(xr + j), pp);
        sg0 = padd(sg0, g0);
        sgd0 = pmadd(g0, d0, sgd0);
        sd0 = padd(sd0, d0);
      }
      double sg = static_cast<double>(predux(padd(sg0, sg1)));
      double sgd = static_cast<double>(predux(padd(sgd0, sgd1)));
      double sd = static_cast<double>(predux(padd(sd0, sd1)));
      for (; j < n; ++j) {
        const double g = static_cast<double>(gamma ? v(gr[j]) * gamma[j] : v(gr[j]));
        const double d = static_cast<double>(v(xr[j]) - p);
        sg += g;
        sgd += g * d;
        sd += d;
      }
      return detail::backward_coeffs<T>(sg, sgd, sd, n, rstd[r]);
    };
    // Second pass over R rows from row r (R = 1, or 2 side by side: the
    // block's dweight/dbias sums loaded and stored once for both, each row's
    // terms added in row order, so the same bits as one row at a time).
    const bool into_l1 = ahead && detail::backward_requests_into_l1();
    // Full: the usual training call (dx, gamma, dweight and dbias, no dh),
    // its tests fixed at compile time; other calls test them per packet.
    const bool full = dx && gamma && !dh && dw && db;
    const auto second_of = [&](auto rows_c, auto full_c, Index r, const detail::BackwardCoeffs<T>* c) {
      constexpr int R = decltype(rows_c)::value;
      constexpr bool F = decltype(full_c)::value;
      // Locals, not the captured references: the packet stores may alias
      // anything, so the compiler would reload every captured value after
      // each of them.
      const S* const xl = x;
      const S* const dyl = dy;
      S* const dxl = dx;
      const T* const gl = gamma;
      const S* const dhl = F ? nullptr : dh;
      T* const aw = accw;
      T* const ab = accb;
      const Index nl = n;
      const bool want_dx = F || dx != nullptr, want_g = F || gamma != nullptr;
      const bool want_w = F || dw != nullptr, want_b = F || db != nullptr;
      const S* xr[R];
      const S* gr[R];
      Packet pp[R], pr[R], p3[R], p4[R], pxs[R];
      NORMCORE_UNROLL
      for (int i = 0; i < R; ++i) {
        xr[i] = xl + (r + i) * nl;
        gr[i] = dyl + (r + i) * nl;
        pp[i] = pset1<Packet>(mean[r + i]);
        pr[i] = pset1<Packet>(rstd[r + i]);
        p3[i] = pset1<Packet>(c[i].k3);
        p4[i] = pset1<Packet>(c[i].k4);
        pxs[i] = pset1<Packet>(c[i].xs);
      }
      // detail::prefetch_next_row: the R rows after these, row i's lines
      // requested as row i's are read.
      const bool l1 = into_l1;
      bool next[R];
      NORMCORE_UNROLL
      for (int i = 0; i < R; ++i) next[i] = ahead && r + R + i < rows;
      Index j = 0;
      for (; j + L <= nl; j += L) {
        NORMCORE_UNROLL
        for (int i = 0; i < R; ++i)
          if (next[i]) detail::request_next_row<L>(xr[i] + R * nl, gr[i] + R * nl, j, l1);
        Packet dyv[R], xh[R];
        NORMCORE_UNROLL
        for (int i = 0; i < R; ++i) {
          dyv[i] = ld(gr[i] + j);
          xh[i] = pmadd(psub(ld(xr[i] + j), pp[i]), pr[i], pxs[i]);
        }
        if (want_dx) {
          const Packet gm = want_g ? ploadu<Packet>(gl + j) : pset1<Packet>(T(1));
          NORMCORE_UNROLL
          for (int i = 0; i < R; ++i) {
            const Packet g = want_g ? pmul(dyv[i], gm) : dyv[i];
            Packet o = pmadd(g, pr[i], pnegate(pmadd(xh[i], p3[i], p4[i])));
            if (dhl) o = padd(o, ld(dhl + (r + i) * nl + j));
            detail::store_packet<Stream>(dxl + (r + i) * nl + j, o);
          }
        }
        if (want_w) {
          Packet a = ploadu<Packet>(aw + j);
          NORMCORE_UNROLL
          for (int i = 0; i < R; ++i) a = pmadd(dyv[i], xh[i], a);
          pstoreu(aw + j, a);
        }
        if (want_b) {
          Packet b = ploadu<Packet>(ab + j);
          NORMCORE_UNROLL
          for (int i = 0; i < R; ++i) b = padd(dyv[i], b);
          pstoreu(ab + j, b);
        }
      }
      NORMCORE_UNROLL
      for (int i = 0; i < R; ++i) {
        const T p = mean[r + i], rs = rstd[r + i];
        for (Index t = j; t < nl; ++t) {
          const T dyj = v(gr[i][t]);  // read before dx is written: dx may be dy
          const T xh1 = detail::madd(v(xr[i][t]) - p, rs, c[i].xs);
          if (want_dx) {
            const T g = want_g ? dyj * gl[t] : dyj;
            const T o = detail::madd(g, rs, -detail::madd(xh1, c[i].k3, c[i].k4));
            dxl[(r + i) * nl + t] = static_cast<S>(dhl ? o + v(dhl[(r + i) * nl + t]) : o);
          }
          if (want_w) aw[t] = detail::madd(dyj, xh1, aw[t]);
          if (want_b) ab[t] += dyj;
        }
      }
    };
    const auto second = [&full, &second_of](auto rows_c, Index r, const detail::BackwardCoeffs<T>* c) {
      if (full) return second_of(rows_c, std::true_type(), r, c);
      second_of(rows_c, std::false_type(), r, c);
    };
    const bool pairs = !ahead || pair_streaming_rows<Stream>(n);
    for (Index r0 = 0; r0 < rows;) {
      const Index r1 = std::min(rows, r0 + (kRowBlock - acc.rows));
      for (Index r = r0; r < r1;) {
        if (pairs && r + 1 < r1) {  // two at a time
          const detail::BackwardCoeffs<T> c[2] = {coeffs(r), coeffs(r + 1)};
          second(std::integral_constant<int, 2>(), r, c);
          r += 2;
        } else {
          const detail::BackwardCoeffs<T> c = coeffs(r);
          second(std::integral_constant<int, 1>(), r, &c);
          ++r;
        }
      }
      acc.rows += r1 - r0;
      if (acc.rows == kRowBlock) acc.flush(dw, db);
      r0 = r1;
    }
  }

  // ColMajor rows [R0, R1) (on whole groups of gsplit's blocks), element
  // (r, j) at [j * ld + r - o]: dx, plus dh (optional, added after), and each
  // group's dweight and dbias sums at dw_part and db_part + group * n (null:
  // not wanted). Chunks of detail::kLanePackets packets of rows, crossing
  // row groups (detail::colmajor_backward_chunk, untiled), in segments of up
  // to detail::kSegmentBytes of x, each with its dh; whole packets of rows
  // through lane_passes, fewer than L rows left over through the same passes
  // on a padded copy whose padding lanes repeat the last row and are masked
  // out of the sums.
  static void backward_colmajor(const T* x, const T* dy, T* dx, const T* dh, Index ld, Index o, Index n,
                                const detail::Split& gsplit, Index R0, Index R1, const T* mean, const T* rstd,
                                const T* gamma, double* dw_part, double* db_part) {
    constexpr int L = detail::simd<T>::L;
    const Index chunk = detail::colmajor_backward_chunk<T>(ld, n, false);
    const Index seg = chunk ? detail::colmajor_segment_rows<T>(chunk, n) : R1 - R0;
    // Per packet of a segment, its group; per row of a chunk, the passes'
    // sums and coefficients (lane_passes).
    const Index sp = (std::min(seg, R1 - R0) + L - 1) / L;
    detail::Scratch<Index> group(static_cast<std::size_t>(sp), false);
    detail::Scratch<T> work(static_cast<std::size_t>(4 * std::max<Index>(chunk ? chunk : sp * L, L)), false);
    // Where the leading dimension puts a chunk's lines of all the features
    // into a few cache sets (detail::colmajor_aliasing), the first pass also
    // copies the chunk's x and dy side by side, for the second to read.
    const bool copy = detail::colmajor_aliasing<T>(ld);
    detail::Scratch<T> copies(copy ? static_cast<std::size_t>(2 * chunk * n) : 0, false);
    T* const cx = copy ? copies.data() : nullptr;
    Index gi = 0;
    for (Index s0 = R0; s0 < R1; s0 += seg) {
      const Index s1 = std::min(R1, s0 + seg), m = s1 - s0, mw = m / L * L;
      const detail::ColMajorResidual<T> residual(dx, dh, ld, n, s0 - o, s1 - o);  // added after
      for (Index p = 0; p * L < m; ++p) {
        while (gsplit.begin(gi + 1) <= s0 + p * L) ++gi;
        group.data()[p] = gi;
      }
      for (Index c0 = 0; c0 < mw; c0 += chunk ? chunk : mw) {
        const Index c1 = chunk ? std::min(mw, c0 + chunk) : mw;
        const Index i = s0 + c0;
        lane_passes(x + (i - o), dy + (i - o), dx ? dx + (i - o) : nullptr, ld, c1 - c0, n, mean + i, rstd + i, gamma,
                    group.data() + c0 / L, dw_part, db_part, c1 - c0, work.data(), cx);
      }
      if (mw < m) {
        const Index k = m - mw, i0 = s0 + mw;
        std::vector<T> tmp(static_cast<std::size_t>(3 * L * n + 2 * L));
        T* tx = tmp.data();
        T* tdy = tx + L * n;
        T* tdx = tdy + L * n;
        T* ts = tdx + L * n;
        detail::gather_lanes(x, ld, i0 - o, k, n, Index(L), tx);
        detail::gather_lanes(dy, ld, i0 - o, k, n, Index(L), tdy);
        detail::gather_values(mean, i0, k, Index(L), ts);
        detail::gather_values(rstd, i0, k, Index(L), ts + L);
        lane_passes(tx, tdy, dx ? tdx : nullptr, L, L, n, ts, ts + L, gamma, group.data() + mw / L, dw_part,
                    db_part, k, work.data());
        if (dx) detail::scatter_lanes(tdx, ld, i0 - o, k, n, Index(L), dx);
      }
      residual.add_to(dx);
    }
  }

  // The two passes over m rows (whole packets) of a ColMajor block with
  // leading dimension ld; only the first `active` rows count in dweight
  // and dbias. The first sums each row's g, g * (x - mean) and x - mean
  // (g = dy * gamma) in T, features in order; the second writes dx and,
  // feature by feature, sums each block's terms in T, packets in row order,
  // and adds that block sum to its group's sums (group: one per packet, a
  // block's packets in one group; the sums at dw_part and db_part + group *
  // n, null: none), blocks in row order; `work` holds 4 * m values (the
  // rows' sums, then coefficients, and mask); `copy` (null: none) 2 * m * n,
  // where the first pass puts x and dy (leading dimension m) for the second
  // to read. Blocks of kBackwardLanePackets packets go down a tile of
  // features (detail::lane_tile) in both passes. A lane's arithmetic, and so
  // dx, does not depend on the blocks, tiles or copy: the same bits for any
  // row count, part or chunk; dweight and dbias depend on the blocks, which
  // for_lane_blocks takes alike for any thread count (backward_impl puts the
  // groups' boundaries on whole blocks).
  static void lane_passes(const T* x, const T* dy, T* dx, Index ld, Index m, Index n, const T* mean,
                          const T* rstd, const T* gamma, const Index* group, double* dw_part, double* db_part,
                          Index active, T* work, T* copy = nullptr) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const Index tile = detail::lane_tile<T>(m, Index(kBackwardLanePackets) * L, n);
    // Per row: the three sums, then the coefficients of the second pass.
    std::fill(work, work + 3 * m, T(0));
    T* const sg = work;
    T* const sgd = sg + m;
    T* const sd = sgd + m;
    T* const mk = sd + m;
    for (Index t0 = 0; t0 < n; t0 += tile) {
      const Index t1 = std::min(n, t0 + tile);
      detail::for_lane_blocks<kBackwardLanePackets>(0, m, L, [&](auto k_c, Index c0) {
        constexpr int K = decltype(k_c)::value;
        const T* const xb = x + c0;
        const T* const yb = dy + c0;
        T* const cxb = copy ? copy + c0 : nullptr;
        T* const cyb = copy ? copy + m * n + c0 : nullptr;
        Packet pp[K], a[K], b[K], c[K];
        NORMCORE_UNROLL
        for (int k = 0; k < K; ++k) {
          pp[k] = ploadu<Packet>(mean + c0 + k * L);
          a[k] = ploadu<Packet>(sg + c0 + k * L);
          b[k] = ploadu<Packet>(sgd + c0 + k * L);
          c[k] = ploadu<Packet>(sd + c0 + k * L);
        }
        for (Index j = t0; j < t1; ++j) {
          const Packet gmj = pset1<Packet>(gamma ? gamma[j] : T(1));
          NORMCORE_UNROLL
          for (int k = 0; k < K; ++k) {
            Packet g = ploadu<Packet>(yb + j * ld + k * L);
            const Packet xv = ploadu<Packet>(xb + j * ld + k * L);
            if (cxb) {
              pstoreu(cxb + j * m + k * L, xv);
              pstoreu(cyb + j * m + k * L, g);
            }
            if (gamma) g = pmul(g, gmj);
            const Packet d = psub(xv, pp[k]);
            a[k] = padd(a[k], g);
            b[k] = pmadd(g, d, b[k]);
            c[k] = padd(c[k], d);
          }
        }
        NORMCORE_UNROLL
        for (int k = 0; k < K; ++k) {
          pstoreu(sg + c0 + k * L, a[k]);
          pstoreu(sgd + c0 + k * L, b[k]);
          pstoreu(sd + c0 + k * L, c[k]);
        }
      });
    }
    // The coefficients, in place: sg -> k3, sgd -> k4, sd -> xs.
    for (Index l = 0; l < m; ++l) {
      const auto bc = detail::backward_coeffs<T>(static_cast<double>(sg[l]), static_cast<double>(sgd[l]),
                                                 static_cast<double>(sd[l]), n, rstd[l]);
      sg[l] = bc.k3;
      sgd[l] = bc.k4;
      sd[l] = bc.xs;
      mk[l] = l < active ? T(1) : T(0);
    }
    for (Index t0 = 0; t0 < n; t0 += tile) {
      const Index t1 = std::min(n, t0 + tile);
      detail::for_lane_blocks<kBackwardLanePackets>(0, m, L, [&](auto k_c, Index c0) {
        constexpr int K = decltype(k_c)::value;
        const Index gi = group[c0 / L];  // (a block lies in one group: see backward_impl)
        eigen_assert(group[c0 / L + K - 1] == gi);
        // Locals, not the captured references: Eigen's packet stores may
        // alias anything, so the compiler would reload those after each one.
        const T* const xb = copy ? copy + c0 : x + c0;
        const T* const yb = copy ? copy + m * n + c0 : dy + c0;
        T* const db = dx ? dx + c0 : nullptr;
        const T* const gl = gamma;
        const Index ldl = copy ? m : ld, ldo = ld, j0 = t0, j1 = t1;
        double* const dwl = dw_part ? dw_part + gi * n : nullptr;
        double* const dbl = db_part ? db_part + gi * n : nullptr;
        Packet pp[K], pr[K], p3[K], p4[K], pxs[K], pm[K];
        NORMCORE_UNROLL
        for (int k = 0; k < K; ++k) {
          pp[k] = ploadu<Packet>(mean + c0 + k * L);
          pr[k] = ploadu<Packet>(rstd + c0 + k * L);
          p3[k] = ploadu<Packet>(sg + c0 + k * L);
          p4[k] = ploadu<Packet>(sgd + c0 + k * L);
          pxs[k] = ploadu<Packet>(sd + c0 + k * L);
          pm[k] = ploadu<Packet>(mk + c0 + k * L);
        }
        for (Index j = j0; j < j1; ++j) {
          const Packet gmj = pset1<Packet>(gl ? gl[j] : T(1));
          // The block's terms of feature j, summed in T across its packets
          // (as the RowMajor kernels sum a block of rows), then one
          // horizontal sum each into the group's double sums.
          Packet tw = pzero(gmj), tb = pzero(gmj);
          NORMCORE_UNROLL
          for (int k = 0; k < K; ++k) {
            const Packet dyv = ploadu<Packet>(yb + j * ldl + k * L);
            const Packet xh = pmadd(psub(ploadu<Packet>(xb + j * ldl + k * L), pp[k]), pr[k], pxs[k]);
            if (db) {
              const Packet g = gl ? pmul(dyv, gmj) : dyv;
              pstoreu(db + j * ldo + k * L, pmadd(g, pr[k], pnegate(pmadd(xh, p3[k], p4[k]))));
            }
            const Packet dym = pmul(dyv, pm[k]);
            if (dwl) tw = k == 0 ? pmul(dym, xh) : pmadd(dym, xh, tw);
            if (dbl) tb = k == 0 ? dym : padd(tb, dym);
          }
          if (dwl) dwl[j] += static_cast<double>(predux(tw));
          if (dbl) dbl[j] += static_cast<double>(predux(tb));
        }
      });
    }
  }

  LayerNormOptions options_;
  Index size_;
  Eigen::Tensor<P, 1> weight_;
  Eigen::Tensor<P, 1> bias_;
};

}  // namespace normcore
