// normcore::RMSNorm: PyTorch's nn.RMSNorm over Eigen tensors.
//
//   normcore::RMSNorm<float> rn(normcore::RMSNormOptions({4096}).eps(1e-6));
//   Eigen::Tensor<float, 2, Eigen::RowMajor> y = rn(x);
//   rn.forward(x, y, stats);                       // stats.rstd per row
//   rn.backward(x, dy, &dx, &dweight, &stats);     // any subset
//
// y = x / sqrt(mean(x^2) + eps) * weight. The mean of squares is one
// vectorized pass in T with the lanes summed in double. Rows whose squares
// overflow or underflow T (|x| beyond ~1e19 or below ~1e-19 in float) are
// detected from that sum and recomputed exactly on values scaled by a power
// of two, so they still get the right answer wherever it is representable.
#pragma once

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "normcore/common.hpp"
#include "normcore/detail/lanes.hpp"
#include "normcore/detail/scratch.hpp"
#include "normcore/detail/short_rows.hpp"
#include "normcore/mixed.hpp"
#include "normcore/layer_norm.hpp"
#include "normcore/parallel.hpp"
#include "normcore/statistics.hpp"

namespace normcore {

/// Options of RMSNorm, named as in the libtorch C++ frontend.
class RMSNormOptions {
 public:
  /* implicit */ RMSNormOptions(std::vector<Index> normalized_shape)
      : normalized_shape_(std::move(normalized_shape)) {}
  RMSNormOptions& normalized_shape(std::vector<Index> v) {
    normalized_shape_ = std::move(v);
    return *this;
  }
  const std::vector<Index>& normalized_shape() const { return normalized_shape_; }
  /// Added to mean(x^2). Unset (the default) means
  /// std::numeric_limits<T>::epsilon(), as PyTorch's eps=None.
  RMSNormOptions& eps(std::optional<double> v) {
    eps_ = v;
    return *this;
  }
  const std::optional<double>& eps() const { return eps_; }
  /// Learnable weight (no bias). Default true.
  RMSNormOptions& elementwise_affine(bool v) {
    elementwise_affine_ = v;
    return *this;
  }
  bool elementwise_affine() const { return elementwise_affine_; }

 private:
  std::vector<Index> normalized_shape_;
  std::optional<double> eps_;
  bool elementwise_affine_ = true;
};

namespace detail {

/// The type rstd is computed and carried in before it is rounded to T:
/// double for float rows (its 53 bits are ample for a result rounded to 24,
/// its range holds every float row's scaled sums, and its sqrt and division
/// are several times faster), long double for double rows.
template <typename T>
using rstd_t = std::conditional_t<(std::numeric_limits<T>::digits < 53), double, long double>;

/// 1/sqrt(sum_sq/n + eps) for a row whose squares were summed in T (sum_sq).
/// If that sum overflowed, or is so small that squares may have lost bits to
/// underflow, the row is summed again exactly: scaled by 2^-ilogb(max|x|) in
/// rstd_t<T>. The result may lie outside T's range.
/// True when a row's sum of squares in T neither overflowed nor lost bits
/// to underflow: rstd follows from it directly.
template <typename T>
bool rms_sum_in_range(double sum_sq) {
  return std::isfinite(sum_sq) && sum_sq >= detail::kSafeLow<T>;
}

template <typename T>
rstd_t<T> rms_rstd(const T* x, Index n, Index stride, double sum_sq, double eps) {
  using W = rstd_t<T>;
  const W w_eps = static_cast<W>(eps);
  if (rms_sum_in_range<T>(sum_sq)) {
    return W(1) / std::sqrt(static_cast<W>(sum_sq) / static_cast<W>(n) + w_eps);
  }
  const T amax = max_abs(x, n, stride);
  if (!std::isfinite(amax)) return W(1) / std::sqrt(static_cast<W>(sum_sq) + w_eps);
  if (amax == T(0)) return W(1) / std::sqrt(w_eps);
  const int e = std::ilogb(amax);
  W ss = 0;
  for (Index i = 0; i < n; ++i) {
    const W v = std::ldexp(static_cast<W>(x[i * stride]), -e);
    ss += v * v;
  }
  // mean(x^2) = ss/n * 2^(2e); eps is added at that scale.
  const W ms = ss / static_cast<W>(n);
  const W scaled = ms + std::ldexp(w_eps, -2 * e);
  return std::ldexp(W(1) / std::sqrt(scaled), -e);
}

/// True when r, rounded to T, is a normal number (so x * r is safe in T).
template <typename T, typename W>
bool normal_in(W r) {
  const W a = std::fabs(r);
  return a >= static_cast<W>(std::numeric_limits<T>::min()) &&
         a <= static_cast<W>(std::numeric_limits<T>::max());
}

}  // namespace detail

/// Root-mean-square normalization over the trailing dims given by
/// normalized_shape: y = x / sqrt(mean(x^2) + eps) * weight. P, the weight's
/// type, is float, double, Eigen::bfloat16 or Eigen::half (the 16-bit
/// layers compute in float); see LayerNorm for the tensor types accepted.
template <typename P>
class RMSNorm {
  static_assert(std::is_same<P, float>::value || std::is_same<P, double>::value ||
                    detail::is_storage16<P>::value,
                "normcore::RMSNorm<P>: P must be float, double, Eigen::bfloat16 or Eigen::half");

 public:
  using Scalar = P;
  using Compute = detail::compute_t<P>;

 private:
  using T = Compute;

 public:
  explicit RMSNorm(RMSNormOptions options)
      : options_(std::move(options)),
        eps_(options_.eps() ? *options_.eps()
                            : static_cast<double>(std::numeric_limits<T>::epsilon())),
        size_(detail::checked_normalized_size("normcore::RMSNorm", options_.normalized_shape(),
                                              eps_)) {
    if (options_.elementwise_affine()) {
      weight_.resize(size_);
      weight_.setConstant(P(1));
    }
  }

  const RMSNormOptions& options() const { return options_; }
  /// The eps in use (epsilon of the arithmetic type when the option is
  /// unset: float's for the 16-bit layers, as PyTorch's opmath type).
  double eps() const { return eps_; }
  Index normalized_size() const { return size_; }
  /// Weight, flattened in row-major order of normalized_shape; empty without
  /// elementwise_affine.
  Eigen::Tensor<P, 1>& weight() { return weight_; }
  const Eigen::Tensor<P, 1>& weight() const { return weight_; }

  template <typename X>
  auto operator()(const X& x) const {
    auto y = detail::make_like(x);
    forward(x, y);
    return y;
  }

  template <typename X, typename Y>
  void forward(const X& x, Y&& y) const {
    forward_impl(Serial(), x, y, nullptr);
  }

  /// Also saves rstd per row (saved.mean is left empty). An rstd outside T's
  /// range saturates to 0 or inf; backward recomputes such rows from x.
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

  /// Any subset of dx and dweight (a pointer, or nullptr for the ones not wanted).
  template <typename X, typename DY, typename DX>
  void backward(const X& x, const DY& dy, DX dx, Eigen::Tensor<P, 1>* dweight,
                const NormStats<T>* saved = nullptr) const {
    backward_entry(Serial(), x, dy, dx, static_cast<const X*>(nullptr), dweight, saved);
  }

  /// The same on a device's threads; bit-identical for any thread count.
  template <typename Device, typename X, typename DY, typename DX,
            typename = std::enable_if_t<detail::is_device<Device>::value>>
  void backward(const Device& device, const X& x, const DY& dy, DX dx, Eigen::Tensor<P, 1>* dweight,
                const NormStats<T>* saved = nullptr) const {
    if (detail::to_serial(device, x.size()))
      return backward_entry(Serial(), x, dy, dx, static_cast<const X*>(nullptr), dweight, saved);
    backward_entry(device, x, dy, dx, static_cast<const X*>(nullptr), dweight, saved);
  }

  /// Fused residual add: h = x + residual (h may be residual itself, for an
  /// in-place update; 16-bit storage sums in float and rounds once), then
  /// y = RMSNorm(h), optionally saving rstd. As vLLM's fused_add_rms_norm:
  /// one read of x and residual and one write of h and y (RowMajor).
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
                             T* rstd = st ? st->rstd.data() + r0 : nullptr;
                             if constexpr (std::is_same<std::decay_t<decltype(*yb)>, T>::value) {
                               forward_rows(xb, yb, size_, count, rstd, prm.gamma);
                             } else {  // 16-bit rows, from h itself
                               forward_rows_widened(xb, yb, size_, count, rstd, prm.gamma, false);
                             }
                           },
                           detail::kShortRowPackets * detail::simd<T>::L,
                           [&](const T* xb, const T* rb, T* hb, T* yb, Index count, Index r0, NormStats<T>* st,
                               const detail::ParamPtrs<T>& prm, auto stream_h, auto stream_y) {
                             forward_add_rows<decltype(stream_h)::value, decltype(stream_y)::value>(
                                 xb, rb, hb, yb, size_, count, st ? st->rstd.data() + r0 : nullptr, prm.gamma);
                           },
                           detail::param_ptrs<T>(weight_, Eigen::Tensor<P, 1>()), false);
  }

  /// Backward of forward_add: dx = RMSNorm'(h) dy + dh_next (nullptr if none),
  /// the gradient for both x and residual, in one pass over RowMajor rows.
  /// dx must not be null.
  template <typename H, typename DY, typename DH, typename DX>
  void backward_add(const H& h, const DY& dy, const DH* dh_next, DX* dx, Eigen::Tensor<P, 1>* dweight,
                    const NormStats<T>* saved = nullptr) const {
    backward_add(Serial(), h, dy, dh_next, dx, dweight, saved);
  }
  template <typename Device, typename H, typename DY, typename DH, typename DX,
            typename = std::enable_if_t<detail::is_device<Device>::value>>
  void backward_add(const Device& device, const H& h, const DY& dy, const DH* dh_next, DX* dx,
                    Eigen::Tensor<P, 1>* dweight, const NormStats<T>* saved = nullptr) const {
    if (!dx) detail::fail(std::string(kWho) + ": backward_add needs dx, got nullptr");
    if (detail::to_serial(device, h.size())) return backward_entry(Serial(), h, dy, dx, dh_next, dweight, saved);
    backward_entry(device, h, dy, dx, dh_next, dweight, saved);
  }

  /// Allocating backward: dx and (with a weight) dweight; dbias stays empty.
  template <typename X, typename DY>
  auto backward(const X& x, const DY& dy, const NormStats<T>* saved = nullptr) const {
    using Tr = detail::tensor_traits<X>;
    Gradients<P, Tr::rank, Tr::layout, typename Tr::Scalar> g;
    g.dx = detail::make_like(x);
    backward(x, dy, &g.dx, weight_.size() ? &g.dweight : nullptr, saved);
    return g;
  }

 private:
  static constexpr const char* kWho = "normcore::RMSNorm";
  static constexpr Index kRowBlock = 64;
  static constexpr Index kGroups = 16;
  using W = detail::rstd_t<T>;  // rstd before rounding to T

  /// rstd of ColMajor rows [r0, r1) into r[0..r1 - r0), in W (exact
  /// path for extreme rows).
  void lane_rstd(const detail::Matrix2D<T>& xv, Index r0, Index r1, W* r) const {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const Index rows = xv.rows, n = xv.cols;
    // The sums of squares of one packet of rows (leftover rows, padded):
    // sequential in T within chunks of kChunk features, chunks added in
    // double.
    auto lanes = [&](const T* x, Index ld, double* out) {
      for (int l = 0; l < L; ++l) out[l] = 0;
      for (Index j0 = 0; j0 < n; j0 += detail::kChunk) {
        const Index j1 = std::min<Index>(n, j0 + detail::kChunk);
        Packet acc = pset1<Packet>(T(0));
        for (Index j = j0; j < j1; ++j) {
          const Packet v = ploadu<Packet>(x + j * ld);
          acc = pmadd(v, v, acc);
        }
        alignas(64) T tmp[L];
        pstoreu(tmp, acc);
        for (int l = 0; l < L; ++l) out[l] += static_cast<double>(tmp[l]);
      }
    };
    const Index i0 = r0 + (r1 - r0) / L * L;
    if (i0 > r0) {
      // The whole packets of rows: each lane's sums exactly as `lanes`
      // takes them (a chunk's FMAs in feature order, chunks added in
      // double), in blocks of up to detail::kRegisterLanePackets packets
      // whose sums stay in registers for a tile of features
      // (detail::kLaneTileBytes, at least 4), then the next block, then the
      // next tile: each feature's values of those rows are read front to
      // back, a tile at a time.
      const Index m = i0 - r0;
      constexpr Index kBlock = Index(detail::kRegisterLanePackets) * L;
      const Index tile = detail::lane_tile<T>(m, kBlock, detail::kChunk);
      detail::Scratch<T> acc(static_cast<std::size_t>(m), false);
      detail::Scratch<double> sum(static_cast<std::size_t>(m), true);
      for (Index j0 = 0; j0 < n; j0 += detail::kChunk) {
        const Index j1 = std::min<Index>(n, j0 + detail::kChunk);
        std::fill(acc.data(), acc.data() + m, T(0));
        for (Index t0 = j0; t0 < j1; t0 += tile) {
          const Index t1 = std::min(j1, t0 + tile);
          for (Index c0 = 0; c0 < m; c0 += kBlock) {
            const int np = static_cast<int>(std::min(kBlock, m - c0) / L);
            detail::with_register_packets(np, [&](auto k_c) {
              constexpr int K = decltype(k_c)::value;
              const T* xb = xv.data + r0 + c0;
              Packet a[K];
              NORMCORE_UNROLL
              for (int k = 0; k < K; ++k) a[k] = ploadu<Packet>(acc.data() + c0 + k * L);
              for (Index j = t0; j < t1; ++j) {
                NORMCORE_UNROLL
                for (int k = 0; k < K; ++k) {
                  const Packet v = ploadu<Packet>(xb + j * rows + k * L);
                  a[k] = pmadd(v, v, a[k]);
                }
              }
              NORMCORE_UNROLL
              for (int k = 0; k < K; ++k) pstoreu(acc.data() + c0 + k * L, a[k]);
            });
          }
        }
        for (Index l = 0; l < m; ++l)
          sum.data()[l] += static_cast<double>(acc.data()[l]);
      }
      // rstd: in packets of divisions and square roots where W is double
      // (detail::inv_sqrt_mean_eps, the same bits as rms_rstd's), each row
      // whose sum left T's range then again through rms_rstd.
      if constexpr (std::is_same<W, double>::value) {
        detail::inv_sqrt_mean_eps(sum.data(), static_cast<double>(n), eps_, m, r);
        for (Index l = 0; l < m; ++l)
          if (!detail::rms_sum_in_range<T>(sum.data()[l]))
            r[l] = detail::rms_rstd(xv.data + r0 + l, n, rows, sum.data()[l], eps_);
      } else {
        for (Index l = 0; l < m; ++l)
          r[l] = detail::rms_rstd(xv.data + r0 + l, n, rows, sum.data()[l], eps_);
      }
    }
    if (i0 < r1) {
      double ss[L];
      const Index m = r1 - i0;
      std::vector<T> tx(static_cast<std::size_t>(L * n));
      detail::gather_lanes(xv.data, rows, i0, m, n, Index(L), tx.data());
      lanes(tx.data(), L, ss);
      for (Index l = 0; l < m; ++l) r[i0 - r0 + l] = detail::rms_rstd(xv.data + i0 + l, n, rows, ss[l], eps_);
    }
  }

  // rstd of count contiguous rows of n values: the one place the forward
  // and the backward's recomputation get it, so they agree bit for bit.
  // Short rows are summed a group at a time (rows_sum_squares).
  static constexpr Index kRstdGroup = 8;
  void rows_rstd(const T* x, Index n, Index count, W* r) const {
    rows_rstd(x, n, count, r, [&](Index i) { return x + i * n; });
  }
  // The same for rows stored as S: T, or a 16-bit type whose packets
  // rows_sum_squares widens as it reads them (where the build converts
  // packets as narrow as its short-row kernel's: detail::packet_io);
  // row_of(i) gives row i as T, asked for only when its sum left T's range.
  template <typename S, typename RowOf>
  void rows_rstd(const S* x, Index n, Index count, W* r, RowOf&& row_of) const {
    double ss[kRstdGroup];
    for (Index r0 = 0; r0 < count; r0 += kRstdGroup) {
      const Index m = std::min(kRstdGroup, count - r0);
      rows_sum_squares(x + r0 * n, n, n, m, ss);
      rstd_of_sums(ss, n, m, [&](Index i) { return row_of(r0 + i); }, r + r0);
    }
  }
  // rstd of m <= kRstdGroup rows from their sums of squares ss; row i as T
  // from row_of(i), asked for only when its sum is out of range (16-bit
  // rows are widened then).
  template <typename RowOf>
  void rstd_of_sums(const double* ss, Index n, Index m, RowOf&& row_of, W* r) const {
    if constexpr (std::is_same<W, double>::value) {
      // The common case, every row's sum in range: vector divisions and
      // sqrt for the group, the same bits as rms_rstd's.
      bool plain = true;
      for (Index i = 0; i < m; ++i) plain = plain && detail::rms_sum_in_range<T>(ss[i]);
      if (plain) {
        detail::inv_sqrt_mean_eps(ss, static_cast<double>(n), eps_, m, r);
        return;
      }
    }
    for (Index i = 0; i < m; ++i) r[i] = detail::rms_rstd(row_of(i), n, 1, ss[i], eps_);
  }
  // rows_rstd of one row from its sum of squares ss; x is read again only
  // when ss left T's range.
  W rstd_from_sum(const T* x, Index n, double ss) const {
    if constexpr (std::is_same<W, double>::value) {
      if (detail::rms_sum_in_range<T>(ss)) {
        W r;
        detail::inv_sqrt_mean_eps(&ss, static_cast<double>(n), eps_, 1, &r);
        return r;
      }
    }
    return detail::rms_rstd(x, n, 1, ss, eps_);
  }
  W row_rstd(const T* xr, Index n) const {  // rows_rstd of one row
    double ss;
    rows_sum_squares(xr, n, n, 1, &ss);
    return rstd_from_sum(xr, n, ss);
  }

  template <typename Device, typename X, typename Y>
  void forward_impl(const Device& device, const X& x, Y& y, NormStats<T>* saved) const {
    constexpr int L = detail::simd<T>::L;
    using S = typename detail::tensor_traits<X>::Scalar;
    detail::check_storage<T, X>();
    detail::check_same_scalar<X, Y>();
    detail::check_layouts<X, Y>();
    static_assert(detail::tensor_traits<Y>::writable, "normcore: the output must be writable");
    const auto xv = detail::split_view<S>(kWho, "input", x, options_.normalized_shape());
    detail::check_same_shape(kWho, "output", x, y);
    if (saved) {
      saved->mean.resize(0);
      detail::resize_vector(saved->rstd, xv.rows);
    }
    if (xv.rows == 0) return;
    const Index rows = xv.rows, n = xv.cols;
    const auto prm = detail::param_ptrs<T>(weight_, Eigen::Tensor<P, 1>());
    S* out = y.data();
    T* rsave = saved ? saved->rstd.data() : nullptr;
    const Index align = xv.row_major ? 1 : L;
    const Index parts = detail::row_parts_for(device, rows * n, xv.row_major ? rows : (rows + L - 1) / L);
    const detail::Split split{rows, parts, align};
    const bool streaming = detail::streaming_input<S, T>(rows, n);
    const bool stream_out = streaming && detail::stream_forward_output(rows * n * static_cast<Index>(sizeof(T)));
    if (xv.row_major) {
      detail::run_parts(device, parts, [this, &xv, &out, &n, &split, &rsave, &prm, &rows, &streaming,
                                        &stream_out](Index p) {
        static_cast<void>(rows);  // (read by 16-bit rows read as packets only)
        if constexpr (!std::is_same<S, T>::value && detail::packet_io<S, L>()) {
          if (n > 0) {  // 16-bit rows, read as they are
            const Index b0 = split.begin(p);
            forward_rows_widened(xv.data + b0 * n, out + b0 * n, n, split.begin(p + 1) - b0,
                                 rsave ? rsave + b0 : nullptr, prm.gamma,
                                 rows * n * static_cast<Index>(sizeof(T)) >= detail::kStreamingBytes);
            return;
          }
        }
        detail::rows_in_compute_type<T>(xv.data, out, n, split.begin(p), split.begin(p + 1),
                                        [this, &n, &rsave, &prm, &streaming, &stream_out](const T* xb, T* yb,
                                                                                          Index m, Index r0) {
                                          forward_rows(xb, yb, n, m, rsave ? rsave + r0 : nullptr, prm.gamma, streaming,
                                                       stream_out);
                                        });
      });
      return;
    }
    const auto pv = detail::param_view(true, options_.normalized_shape(), prm.gamma,
                                       static_cast<const T*>(nullptr), n);
    detail::run_parts(device, parts, [this, &xv, &out, &rsave, &split, &pv, &rows, &n](Index p) {
      static_cast<void>(rows);  // (rows and n: read by 16-bit data only)
      static_cast<void>(n);
      if constexpr (std::is_same<S, T>::value) {
        forward_colmajor(xv, out, rsave, split.begin(p), split.begin(p + 1), pv.gamma, true);
      } else {
        // 16-bit: blocks of rows widened into float (no streaming stores
        // into the block's buffer, read back at once).
        detail::colmajor_in_compute_type<T>(xv.data, out, rows, n, split.begin(p), split.begin(p + 1),
                                            detail::colmajor_stage_rows<T>(n),
                                            [this, &rsave, &pv](const detail::Matrix2D<T>& v, T* yb, Index r0) {
                                              forward_colmajor(v, yb, rsave ? rsave + r0 : nullptr, 0, v.rows,
                                                               pv.gamma, false);
                                            });
      }
    });
  }

  // ColMajor: element (r, j) at data[j * rows + r]; rows are SIMD lanes.
  // Rows [r0, r1), r0 a multiple of the packet size, in segments of rows
  // (detail::colmajor_forward_segment, as LayerNorm's), each its rstd and
  // then its normalize while its x is in the cache. rsave (optional): rstd.
  void forward_colmajor(const detail::Matrix2D<T>& xv, T* out, T* rsave, Index r0, Index r1, const T* g,
                        bool may_stream) const {
    detail::for_colmajor_segments<T>(xv.rows, xv.cols, r0, r1,
                                     [this, &xv, &out, &rsave, &g, &may_stream](Index s0, Index s1) {
      forward_colmajor_rows(xv, out, rsave, s0, s1, g, may_stream);
    });
  }
  void forward_colmajor_rows(const detail::Matrix2D<T>& xv, T* out, T* rsave, Index r0, Index r1, const T* g,
                             bool may_stream) const {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const Index rows = xv.rows, n = xv.cols;
    detail::Scratch<W> r(static_cast<std::size_t>(r1 - r0), false);  // the calling thread's (kept between calls)
    const bool stream = may_stream && detail::can_stream_colmajor(xv.data, out, rows, n);
    // Rows whose rstd is not a normal T: exact scalar path in long double.
    auto exact_row = [&](Index i) {
      const W ri = r.data()[i - r0];
      for (Index j = 0; j < n; ++j) {
        long double v = static_cast<long double>(xv.data[i + j * rows]) * ri;
        if (g) v *= static_cast<long double>(g[j]);
        out[i + j * rows] = static_cast<T>(v);
      }
    };
    lane_rstd(xv, r0, r1, r.data());
    if (rsave)
      for (Index i = r0; i < r1; ++i) rsave[i] = static_cast<T>(r.data()[i - r0]);
    // Packets of rows; leftover rows padded; abnormal rows redone.
    detail::Scratch<T> rt(static_cast<std::size_t>(r1 - r0), false);
    for (Index i = r0; i < r1; ++i) {
      const W ri = r.data()[i - r0];
      rt.data()[i - r0] = detail::normal_in<T>(ri) ? static_cast<T>(ri) : T(0);
    }
    // K packets of rows side by side (detail::for_lane_blocks); each
    // lane's arithmetic is the same whatever K. s_c: streaming stores
    // (detail::can_stream_colmajor).
    auto lanes = [&](auto k_c, auto s_c, const T* xb, T* yb, Index ld, const T* rb) {
      constexpr int K = decltype(k_c)::value;
      const Index nl = n;  // locals: the packet stores may alias anything
      const T* const gl = g;
      Packet pr[K];
      NORMCORE_UNROLL
      for (int k = 0; k < K; ++k) pr[k] = ploadu<Packet>(rb + k * L);
      for (Index j = 0; j < nl; ++j) {
        const T* xj = xb + j * ld;
        T* yj = yb + j * ld;
        const Packet gj = pset1<Packet>(gl ? gl[j] : T(1));
        NORMCORE_UNROLL
        for (int k = 0; k < K; ++k) {
          Packet v = pmul(ploadu<Packet>(xj + k * L), pr[k]);
          if (gl) v = pmul(v, gj);
          detail::store_packet<decltype(s_c)::value>(yj + k * L, v);
        }
      }
    };
    Index i0 = r0 + (r1 - r0) / L * L;
    if (detail::colmajor_column_walk<T>(rows, stream)) {
      // A feature at a time through runs of rows (as LayerNorm's
      // normalize_columns): the same arithmetic a lane. Locals, not the
      // captured references (the packet stores may alias anything).
      constexpr Index seg = detail::kColumnRunBytes / Index(sizeof(T));
      const T* const gl = g;
      const T* const xd = xv.data;
      T* const od = out;
      const T* const rb = rt.data();
      const Index nl = n, ld = rows, first = r0, end = i0;
      for (Index s0 = first; s0 < end; s0 += seg) {
        const Index s1 = std::min(end, s0 + seg);
        for (Index j = 0; j < nl; ++j) {
          const T* const xj = xd + j * ld;
          T* const yj = od + j * ld;
          const Packet gj = pset1<Packet>(gl ? gl[j] : T(1));
          detail::for_packets<L>(s0, s1, [&](Index i) NORMCORE_INLINE_LAMBDA {
            Packet v = pmul(ploadu<Packet>(xj + i), ploadu<Packet>(rb + (i - first)));
            if (gl) v = pmul(v, gj);
            pstoreu(yj + i, v);
          });
        }
      }
    } else {
      i0 = detail::for_lane_blocks<detail::kLanePackets>(r0, r1, L, [&](auto k_c, Index i) {
        if (stream)
          lanes(k_c, std::true_type(), xv.data + i, out + i, rows, rt.data() + (i - r0));
        else
          lanes(k_c, std::false_type(), xv.data + i, out + i, rows, rt.data() + (i - r0));
      });
    }
    if (stream) detail::stream_fence();  // before the exact rows' stores
    if (i0 < r1) {
      const Index m = r1 - i0;
      std::vector<T> tmp(static_cast<std::size_t>(2 * L * n + L));
      detail::gather_lanes(xv.data, rows, i0, m, n, Index(L), tmp.data());
      detail::gather_values(rt.data(), i0 - r0, m, Index(L), tmp.data() + 2 * L * n);
      lanes(std::integral_constant<int, 1>(), std::false_type(), tmp.data(), tmp.data() + L * n, L,
            tmp.data() + 2 * L * n);
      detail::scatter_lanes(tmp.data() + L * n, rows, i0, m, n, Index(L), out);
    }
    for (Index i = r0; i < r1; ++i)
      if (!detail::normal_in<T>(r.data()[i - r0])) exact_row(i);
  }

  // Rows per group in forward_rows when the rows fit in kResidentBytes
  // (else kRstdGroup), as long as a group stays within detail::kGroupBytes.
  // Short cache-resident rows then take the rstd of several groups of
  // kRstdGroup before normalizing any of them (measured: 2048x50 and 64x50
  // floats in 0.86-0.88x the time). Larger inputs keep groups of
  // kRstdGroup: 65536x64 took 1.16-1.37x the time in groups of 16 to 64.
  // Each row's arithmetic is the same either way, so are its bits.
  static constexpr Index kResidentGroup = 64;
  static constexpr Index kResidentBytes = Index(512) * 1024;

  // `count` RowMajor rows of n values; rsave (optional) gets rstd per row.
  // On `streaming` inputs (detail::streaming_input) long rows go one at a
  // time, each row of the next group of short rows is requested as a row
  // of this one is normalized (detail::forward_group, detail::rows_ahead),
  // rows of more than 4 KB request the next row as they are scaled
  // (detail::forward_requests), and the output takes streaming stores when
  // it can (detail::can_stream_rows) and `stream_out` (a streaming call whose
  // input is at least forward_stream_threshold()), as in LayerNorm's forward; other
  // inputs take a loop that only scales.
  // On AMD Zen 5 (detail::zen5_tuned) the requests go into the L1 as well
  // (detail::request_next<true>). Measured on a Zen 5 guest (48 KB of L1d;
  // AVX-512, float, both kinds in one process, the median of 15 paired
  // ratios in each of two processes) against requests into the L2:
  // 0.88-0.92x the time at 4096x4096, 0.91-0.98x at 16384x4096, 0.90x at
  // 2048x8192 (one process), 0.92-0.95x at 8192x1536, 0.95-1.00x at
  // 4096x2048; on 2 threads 0.89-0.97x at 4096x2048, 4096x4096 and
  // 16384x4096. The same bits: a request only moves lines.
  void forward_rows(const T* x, T* out, Index n, Index count, T* rsave, const T* g, bool streaming = false,
                    bool stream_out = false) const {
    constexpr int L = detail::simd<T>::L;
    const bool resident = count * n * static_cast<Index>(sizeof(T)) <= kResidentBytes;
    const Index group = detail::forward_group(streaming, n, sizeof(T), resident ? kResidentGroup : kRstdGroup,
                                              detail::kShortRowPackets * L);
    W rg[kResidentGroup];
    const bool stream = stream_out && detail::can_stream_rows(x, out, n, count);
    const bool request = detail::forward_requests(streaming, n, sizeof(T), std::numeric_limits<Index>::max());
    const bool into_l1 = request && detail::zen5_tuned();
    for (Index r0 = 0; r0 < count; r0 += group) {
      const Index m = std::min(group, count - r0);
      rows_rstd(x + r0 * n, n, m, rg);
      if (rsave)
        for (Index k = 0; k < m; ++k) rsave[r0 + k] = static_cast<T>(rg[k]);
      if (!streaming) {  // rows the caches hold: no requests, no streaming stores
        for (Index k = 0; k < m; ++k)
          scale_values<false>(detail::RowValues<T>{x + (r0 + k) * n}, out + (r0 + k) * n, n, rg[k], g);
        continue;
      }
      const Index ahead = detail::rows_ahead(streaming, group, count - r0 - m);
      for (Index k = 0; k < m; ++k) {
        const Index i = r0 + k;
        if (k < ahead) detail::prefetch_span(x + (i + m) * n, n * static_cast<Index>(sizeof(T)));
        const W ri = rg[k];
        const detail::RowValues<T> row{x + i * n};
        if (into_l1 && i + 1 < count) {
          if (stream) {
            scale_values<true>(detail::request_next<true>(row, x + (i + 1) * n), out + i * n, n, ri, g);
          } else {
            scale_values<false>(detail::request_next<true>(row, x + (i + 1) * n), out + i * n, n, ri, g);
          }
        } else if (request && i + 1 < count) {
          if (stream) {
            scale_values<true>(detail::request_next(row, x + (i + 1) * n), out + i * n, n, ri, g);
          } else {
            scale_values<false>(detail::request_next(row, x + (i + 1) * n), out + i * n, n, ri, g);
          }
        } else if (stream) {
          scale_values<true>(row, out + i * n, n, ri, g);
        } else {
          scale_values<false>(row, out + i * n, n, ri, g);
        }
      }
    }
    if (stream) detail::stream_fence();
  }

  // y = x * rstd (* g) for the n values of a source (statistics.hpp,
  // RowValues); Stream: streaming stores (detail::can_stream_rows). Y is T,
  // or a 16-bit type (T float; the source detail::WidenValues): each value
  // rounded once as it is stored.
  template <bool Stream, typename Src, typename Y>
  static EIGEN_ALWAYS_INLINE void scale_values(const Src src, Y* yr, Index n, W ri, const T* g) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    if (!detail::normal_in<T>(ri)) {  // exact scalar path in long double
      for (Index j = 0; j < n; ++j) {
        long double v = static_cast<long double>(src.value(j)) * ri;
        if (g) v *= static_cast<long double>(g[j]);
        yr[j] = static_cast<Y>(static_cast<T>(v));
      }
      return;
    }
    const T rt = static_cast<T>(ri);
    const Packet pr = pset1<Packet>(rt);
    Index j = 0;
    if (g) {
      j = detail::for_packets<L>(j, n, [&](Index i) NORMCORE_INLINE_LAMBDA {
        detail::store_packet<Stream>(yr + i, pmul(pmul(src.template packet<Packet>(i), pr), ploadu<Packet>(g + i)));
      });
      for (; j < n; ++j) yr[j] = static_cast<Y>(src.value(j) * rt * g[j]);
    } else {
      j = detail::for_packets<L>(j, n, [&](Index i) NORMCORE_INLINE_LAMBDA {
        detail::store_packet<Stream>(yr + i, pmul(src.template packet<Packet>(i), pr));
      });
      for (; j < n; ++j) yr[j] = static_cast<Y>(src.value(j) * rt);
    }
  }

  // 16-bit rows (T float) where the build converts whole packets
  // (detail::packet_io): read as they are, each packet widened as it is
  // read (detail::WidenValues, and rows_sum_squares' short-row kernel on
  // 16-bit rows) and y rounded as it is stored, instead of blocks widened
  // into float buffers. The same rstd and bits as forward_rows on the
  // widened rows.
  // `large`: an input of at least detail::kStreamingBytes as T; its long
  // rows go one at a time, as forward_rows' long rows of a streaming input.
  template <typename S>
  void forward_rows_widened(const S* x, S* out, Index n, Index count, T* rsave, const T* g, bool large) const {
    const bool short_rows = n < detail::kShortRowPackets * detail::simd<T>::L;
    const Index group = large && !short_rows ? 1 : detail::rows_per_group(n, sizeof(T), kRstdGroup);
    std::vector<T> row;  // rows widened for the exact path (or without narrow packets)
    for (Index r0 = 0; r0 < count; r0 += group) {
      const Index m = std::min(group, count - r0);
      W rg[kRstdGroup];
      const auto widened = [&](Index i) {  // row r0 + i as T, for the exact path
        row.resize(static_cast<std::size_t>(n));
        detail::convert_n(x + (r0 + i) * n, row.data(), n);
        return static_cast<const T*>(row.data());
      };
      if constexpr (detail::packet_io<S, detail::narrow_simd<T>::L>()) {
        rows_rstd(x + r0 * n, n, m, rg, widened);
      } else if (short_rows) {  // no 16-bit packets as narrow as the short-row kernel's
        row.resize(static_cast<std::size_t>(m * n));
        detail::convert_n(x + r0 * n, row.data(), m * n);
        rows_rstd(static_cast<const T*>(row.data()), n, m, rg);
      } else {
        double ss[kRstdGroup];
        for (Index i = 0; i < m; ++i) ss[i] = detail::sum_squares_of<T>(detail::WidenValues<S, T>{x + (r0 + i) * n}, n);
        rstd_of_sums(ss, n, m, widened, rg);
      }
      for (Index k = 0; k < m; ++k) {
        if (rsave) rsave[r0 + k] = static_cast<T>(rg[k]);
        scale_values<false>(detail::WidenValues<S, T>{x + (r0 + k) * n}, out + (r0 + k) * n, n, rg[k], g);
      }
    }
  }

  // forward_add's rows on streaming inputs (detail::fused_add_norm's first
  // path), one at a time, as LayerNorm::forward_add_rows: the sum of
  // squares pass stores h = x + r as it reads it, then the row is scaled
  // from h (in L1) or, with StreamH, from x + r made again. The same bits as
  // forward_rows on h.
  template <bool StreamH, bool StreamY>
  void forward_add_rows(const T* x, const T* r, T* h, T* out, Index n, Index count, T* rsave, const T* g) const {
    detail::each_add_row(x, r, h, out, n, count, [&](Index i, const T* xr, const T* rr, T* hr, T* yr) {
      const double ss = detail::sum_squares_of<T>(detail::AddStoreValues<T, StreamH>{xr, rr, hr}, n);
      detail::add_tail(xr, rr, hr, n);
      const W ri = rstd_from_sum(hr, n, ss);
      if (rsave) rsave[i] = static_cast<T>(ri);
      if constexpr (StreamH) {
        scale_values<StreamY>(detail::SumValues<T>{xr, rr}, yr, n, ri, g);
      } else {
        scale_values<StreamY>(detail::RowValues<T>{hr}, yr, n, ri, g);
      }
    });
  }

  template <typename Device, typename X, typename DY, typename DX, typename DH>
  void backward_entry(const Device& device, const X& x, const DY& dy, DX dx, const DH* dh,
                      Eigen::Tensor<P, 1>* dweight, const NormStats<T>* saved) const {
    detail::row_backward_entry<T>(kWho, options_.normalized_shape(), x, dy, dx, dh,
                                  [this, &device, &dweight, &saved](const auto& v, const auto* dyp, auto* dxp,
                                                                    const auto* dhp) {
                                    this->backward_impl(device, v, dyp, dxp, dhp, dweight, saved);
                                  });
  }

  // dx = rstd * (g - x_hat * mean(g * x_hat)), x_hat = x * rstd, g = dy * weight:
  // no mean-subtraction term. One pass sums g * x; a second writes dx and
  // accumulates dweight = sum over rows of dy * x_hat (blocks of rows in T,
  // blocks added in double in order, fixed groups of blocks per thread).
  template <typename Device, typename S>
  void backward_impl(const Device& device, const detail::Matrix2D<S>& xv, const S* dyp, S* dx,
                     const S* dhp, Eigen::Tensor<P, 1>* dweight, const NormStats<T>* saved) const {
    constexpr int L = detail::simd<T>::L;
    constexpr bool wide = !std::is_same<S, T>::value;
    constexpr bool staged = wide && !detail::packet_io<S, L>();
    if (dweight && !weight_.size()) {
      detail::fail(std::string(kWho) + ": dweight requested but the layer has no weight "
                                       "(elementwise_affine is false)");
    }
    if (saved) detail::check_stats(kWho, saved->rstd, "rstd", xv.rows);
    const Index rows = xv.rows, n = xv.cols;
    // Groups of rows as LayerNorm's backward takes them: on kRowBlock, or
    // for ColMajor on blocks of detail::kLanePackets packets.
    constexpr Index kLaneBlock = Index(detail::kLanePackets) * L;
    const Index align = xv.row_major ? kRowBlock : kLaneBlock;
    const Index units = xv.row_major ? (rows + kRowBlock - 1) / kRowBlock : (rows + kLaneBlock - 1) / kLaneBlock;
    const Index groups = std::max<Index>(1, std::min<Index>(units, kGroups));
    const detail::Split gsplit{rows, groups, align};
    const Index parts = detail::row_parts_for(device, rows * n, groups);
    const detail::Split psplit{groups, parts, 1};
    const auto prm = detail::param_ptrs<T>(weight_, Eigen::Tensor<P, 1>());
    const auto pv = detail::param_view(!xv.row_major, options_.normalized_shape(), prm.gamma,
                                       static_cast<const T*>(nullptr), n);
    const T* g = pv.gamma;
    // Fewer rows than one block (RowMajor, read as stored): as in LayerNorm's
    // backward, the block's T sums go straight to dweight (emit_block_sums) and
    // the double sums are not zeroed, unless a row takes the exact path,
    // which adds its terms into them (they are zeroed then, before it).
    const bool one_block = xv.row_major && !staged && rows < kRowBlock;
    bool exact_rows = false;  // a row of the one block took the exact path
    // Per-group sums of dweight (detail::Scratch: kept between calls).
    detail::Scratch<double> dw_part(dweight ? static_cast<std::size_t>(groups * n) : 0, !one_block);
    const bool stream_dx = xv.row_major && detail::stream_gradient<S, T>(xv.data, dyp, dhp, dx, rows, n,
                                                                         detail::threads_for(device, parts));
    const bool ahead = detail::prefetch_next_row<S, T>(rows, n);

    detail::run_parts(device, parts, [this, &xv, &gsplit, &psplit, &dweight, &dw_part, &dyp, &dx, &dhp, &rows, &n,
                                      &g, &saved, &one_block, &exact_rows, &stream_dx, &ahead](Index p) {
      static_cast<void>(rows);  // (rows: read by 16-bit data only; ahead: not by 16-bit rows read as packets)
      static_cast<void>(ahead);
      // 16-bit rows: each packet widened as it is loaded where the build
      // converts whole packets (detail::packet_io), x staged only to
      // recompute an rstd; else blocks of sb rows widened into float buffers.
      if (!xv.row_major) {
        const Index R0 = gsplit.begin(psplit.begin(p)), R1 = gsplit.begin(psplit.begin(p + 1));
        double* const dwp = dweight ? dw_part.data() : nullptr;
        ExactRows exact;
        if constexpr (wide) {
          // 16-bit: blocks of rows widened into float, on whole blocks of
          // gsplit's alignment from the part's start (the float path's lane
          // blocks, so its sums), the exact rows' dweight terms after all.
          detail::colmajor_backward_in_compute_type<T>(
              xv.data, dyp, dx, dhp, rows, n, R0, R1, detail::colmajor_stage_rows<T>(n),
              [this, &n, &gsplit, &g, &dwp, &saved, &exact](const T* bx, const T* bdy, T* bdx, const T* bdh, Index m,
                                                             Index b) {
                backward_colmajor(detail::colmajor_view(bx, m, n), b, bdy, bdx, bdh, gsplit, b, b + m, g, dwp,
                                  saved, exact);
              });
        } else {
          backward_colmajor(xv, 0, dyp, dx, dhp, gsplit, R0, R1, g, dwp, saved, exact);
        }
        exact.add_dweight(dwp, gsplit, n);
        return;
      }
      const Index sb = wide ? detail::backward_stage_rows(n, kRowBlock) : 0;
      std::vector<T> buf(static_cast<std::size_t>((staged ? 4 : wide ? 1 : 0) * sb * n));
      std::vector<W> r;
      GradAcc gacc(n, dweight != nullptr);
      for (Index gi = psplit.begin(p); gi < psplit.begin(p + 1); ++gi) {
        const Index g0 = gsplit.begin(gi), g1 = gsplit.begin(gi + 1);
        double* dwp = dweight ? dw_part.data() + gi * n : nullptr;
        // Sub-blocks: the whole group for T data; blocks of sb rows for
        // 16-bit data.
        const Index step = wide ? sb : g1 - g0;
        for (Index b0 = g0; b0 < g1; b0 += step) {
          const Index m = std::min(step, g1 - b0);
          // The rows as T (staged, or T data) for rstd, and as the kernel
          // reads them.
          const T* bx = nullptr;
          const T* bdy = nullptr;
          const T* bdh = nullptr;
          T* bdx = nullptr;
          if constexpr (staged) {
            T* wx = buf.data();
            T* wdy = wx + sb * n;
            T* wdx = wdy + sb * n;
            T* wdh = wdx + sb * n;
            detail::convert_n(xv.data + b0 * n, wx, m * n);
            detail::convert_n(dyp + b0 * n, wdy, m * n);
            if (dhp) detail::convert_n(dhp + b0 * n, wdh, m * n);
            bx = wx;
            bdy = wdy;
            bdx = dx ? wdx : nullptr;
            bdh = dhp ? wdh : nullptr;
          } else if constexpr (!wide) {
            bx = xv.data + b0 * n;
            bdy = dyp + b0 * n;
            bdx = dx ? dx + b0 * n : nullptr;
            bdh = dhp ? dhp + b0 * n : nullptr;
          }
          // x as T, widened only when an rstd must be recomputed.
          // (A plain if, not if constexpr: every instantiation then reads
          // all the captures, and none needs a static_cast<void> marker.)
          const auto x_as_t = [&bx, &xv, &b0, &n, &buf, &m]() -> const T* {
            if (wide && !staged) {
              if (!bx) {
                detail::convert_n(xv.data + b0 * n, buf.data(), m * n);
                bx = buf.data();
              }
            }
            return bx;
          };
          // rstd: saved (a saturated one is recomputed exactly), or recomputed.
          r.resize(static_cast<std::size_t>(m));
          if (saved) {
            for (Index i = 0; i < m; ++i) {
              W ri = static_cast<W>(saved->rstd(b0 + i));
              if (!detail::normal_in<T>(ri)) ri = row_rstd(x_as_t() + i * n, n);
              r[static_cast<std::size_t>(i)] = ri;
            }
          } else if constexpr (wide && detail::packet_io<S, detail::narrow_simd<T>::L>()) {
            rows_rstd(xv.data + b0 * n, n, m, r.data(), [&](Index i) { return x_as_t() + i * n; });
          } else {
            rows_rstd(x_as_t(), n, m, r.data());
          }
          if (one_block && dwp && !exact_rows) {
            for (std::size_t i = 0; i < r.size(); ++i) exact_rows = exact_rows || !detail::normal_in<T>(r[i]);
            if (exact_rows) std::fill(dwp, dwp + n, 0.0);
          }
          if constexpr (wide && !staged) {
            backward_rows<false>(xv.data + b0 * n, dyp + b0 * n, dx ? dx + b0 * n : nullptr, m, n, r.data(), g,
                                 dwp, dhp ? dhp + b0 * n : nullptr, gacc);
          } else if (!wide && stream_dx) {
            backward_rows<true>(bx, bdy, bdx, m, n, r.data(), g, dwp, bdh, gacc, ahead);
          } else {
            backward_rows<false>(bx, bdy, bdx, m, n, r.data(), g, dwp, bdh, gacc, ahead);
          }
          if constexpr (staged) {
            if (dx) detail::convert_n(bdx, dx + b0 * n, m * n);
          }
        }
        if (one_block && !exact_rows) {
          if (dweight) detail::emit_block_sums(gacc.w, *dweight);
        } else if (gacc.rows) {
          gacc.flush(dwp);
        }
      }
      if (stream_dx) detail::stream_fence();
    });
    if (dweight && !(one_block && !exact_rows)) {
      std::vector<Index> perm;
      const bool permute = !xv.row_major && options_.normalized_shape().size() > 1;
      if (permute) perm = detail::colmajor_to_rowmajor(options_.normalized_shape());
      detail::emit_group_sums(dw_part.data(), groups, n, permute ? &perm : nullptr, *dweight);
    }
  }

  // `count` RowMajor rows with rstd r (in W; a row whose rstd is not a
  // normal T takes the exact path); dw sums dy * x_hat over blocks of
  // kRowBlock rows in T, each block added into dwp in double; dh (optional)
  // is added to dx.
  // The T accumulator of dweight and the rows it holds; flushed into the
  // group's double sums every kRowBlock rows counted from the group's start.
  struct GradAcc {
    std::vector<T> w;
    Index rows = 0;
    GradAcc(Index n, bool want) : w(want ? static_cast<std::size_t>(n) : 0, T(0)) {}
    void flush(double* dwp) {
      for (std::size_t j = 0; j < w.size(); ++j) {
        dwp[j] += static_cast<double>(w[j]);
        w[j] = T(0);
      }
      rows = 0;
    }
  };

  // A row whose rstd is not a normal T (its sums in long double, dweight's
  // terms added straight into dwp): dxr and dhr are the row's (or null).
  template <typename S>
  static void exact_row(const S* xr, const S* gr, S* dxr, const S* dhr, Index n, W ri, const T* g, double* dwp) {
    const auto v = [](S s) { return static_cast<T>(s); };
    long double sgx = 0;
    for (Index j = 0; j < n; ++j) {
      const long double gj = static_cast<long double>(v(gr[j])) * (g ? static_cast<long double>(g[j]) : 1.0L);
      sgx += gj * static_cast<long double>(v(xr[j])) * ri;
    }
    const long double c = sgx / static_cast<long double>(n);
    for (Index j = 0; j < n; ++j) {
      const long double dyj = static_cast<long double>(v(gr[j]));  // before dxr[j]: dx may be dy
      const long double xh = static_cast<long double>(v(xr[j])) * ri;
      const long double gj = dyj * (g ? static_cast<long double>(g[j]) : 1.0L);
      if (dxr) {
        long double o = ri * (gj - xh * c);
        if (dhr) o += static_cast<long double>(v(dhr[j]));
        dxr[j] = static_cast<S>(static_cast<T>(o));
      }
      if (dwp) dwp[j] += static_cast<double>(dyj * xh);
    }
  }

  // backward_rows for rows of K packets at most (n in ((K - 1) L, K L]),
  // as LayerNorm's backward_rows_short: gamma and the block's dweight sums
  // in registers (per column the same multiply-adds in the same order as
  // backward_rows's), each row's x and dy read once. A row's last packet
  // covers its last L values, its lanes before the tail masked out of the
  // sums; its dx is stored whole where dx is apart from x, dy and dh, else
  // value by value.
  template <int K, bool Stream, typename S>
  static void backward_rows_short(const S* x, const S* dy, S* dx, Index count, Index n, const W* r,
                                  const T* g, double* dwp, const S* dh, GradAcc& gacc) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    const auto ld = [](const S* q) { return detail::load_widened<Packet>(q); };
    const auto v = [](S s) { return static_cast<T>(s); };
    T* const acc = gacc.w.data();
    const detail::ShortRow<T, K> row(n);
    const Index last = row.last, fresh = row.fresh;
    const Packet mask = row.mask;
    const auto at = [&](int k) { return row.at(k); };
    const bool whole_dx = row.whole_dx(x, dy, dx, dh, count, n);
    Packet G[K];
    NORMCORE_UNROLL
    for (int k = 0; k < K; ++k) G[k] = g ? ploadu<Packet>(g + at(k)) : pset1<Packet>(T(1));
    for (Index b0 = 0; b0 < count;) {
      const Index b1 = std::min(count, b0 + (kRowBlock - gacc.rows));
      Packet A[K];
      NORMCORE_UNROLL
      for (int k = 0; k < K; ++k) A[k] = dwp ? ploadu<Packet>(acc + at(k)) : pset1<Packet>(T(0));
      A[K - 1] = pand(A[K - 1], mask);
      for (Index i = b0; i < b1; ++i) {
        const S* xr = x + i * n;
        const S* gr = dy + i * n;
        const W ri = r[i];
        if (!detail::normal_in<T>(ri)) {
          exact_row(xr, gr, dx ? dx + i * n : nullptr, dh ? dh + i * n : nullptr, n, ri, g, dwp);
          continue;
        }
        const T rt = static_cast<T>(ri);
        Packet Y[K], X[K], Gd[K];
        NORMCORE_UNROLL
        for (int k = 0; k < K; ++k) {
          Y[k] = ld(gr + at(k));
          X[k] = ld(xr + at(k));
          Gd[k] = g ? pmul(Y[k], G[k]) : Y[k];
        }
        Packet sgx = pmul(pand(Gd[K - 1], mask), X[K - 1]);
        NORMCORE_UNROLL
        for (int k = 0; k < K - 1; ++k) sgx = pmadd(Gd[k], X[k], sgx);
        const T c = static_cast<T>(static_cast<double>(rt) * static_cast<double>(predux(sgx)) / static_cast<double>(n));
        const Packet pr = pset1<Packet>(rt), pnc = pset1<Packet>(-c);
        const Packet ym = pand(Y[K - 1], mask);
        NORMCORE_UNROLL
        for (int k = 0; k < K; ++k) {
          const Packet xh = pmul(X[k], pr);
          if (dx && (k < K - 1 || whole_dx)) {
            const Packet t = pmadd(xh, pnc, Gd[k]);  // g - xh * c
            const Packet o = dh ? pmadd(pr, t, ld(dh + i * n + at(k))) : pmul(pr, t);
            detail::store_packet<Stream>(dx + i * n + at(k), o);
          }
          if (dwp) A[k] = pmadd(k == K - 1 ? ym : Y[k], xh, A[k]);
        }
        if (dx && !whole_dx) {  // the tail's dx value by value (dx over an input)
          for (Index j = n - fresh; j < n; ++j) {
            const T xh = v(xr[j]) * rt;
            const T t = detail::madd(xh, -c, g ? v(gr[j]) * g[j] : v(gr[j]));
            dx[i * n + j] = static_cast<S>(dh ? detail::madd(rt, t, v(dh[i * n + j])) : rt * t);
          }
        }
      }
      if (dwp) {
        NORMCORE_UNROLL
        for (int k = 0; k < K - 1; ++k) pstoreu(acc + at(k), A[k]);
        pstoreu(acc + last, pselect(mask, A[K - 1], ploadu<Packet>(acc + last)));
      }
      gacc.rows += b1 - b0;
      if (gacc.rows == kRowBlock) gacc.flush(dwp);
      b0 = b1;
    }
  }

  // S is T, or a 16-bit type (T float) where detail::packet_io says the
  // build converts whole packets: each packet is widened as it is loaded and
  // dx rounded as it is stored, the same values and bits as the rows widened
  // into float buffers first.
  template <bool Stream, typename S = T>
  static void backward_rows(const S* x, const S* dy, S* dx, Index count, Index n, const W* r,
                            const T* g, double* dwp, const S* dh, GradAcc& gacc, bool ahead = false) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    if (n >= L && n <= detail::kShortBackwardPackets * L) {  // backward_rows_short<ceil(n / L)>
      const Index k = (n + L - 1) / L;
      if (k == 1) return backward_rows_short<1, Stream>(x, dy, dx, count, n, r, g, dwp, dh, gacc);
      if (k == 2) return backward_rows_short<2, Stream>(x, dy, dx, count, n, r, g, dwp, dh, gacc);
      if constexpr (detail::kShortBackwardPackets >= 4) {
        if (k == 3) return backward_rows_short<3, Stream>(x, dy, dx, count, n, r, g, dwp, dh, gacc);
        return backward_rows_short<4, Stream>(x, dy, dx, count, n, r, g, dwp, dh, gacc);
      }
    }
    const auto ld = [](const S* q) { return detail::load_widened<Packet>(q); };
    const auto v = [](S s) { return static_cast<T>(s); };
    T* const acc = gacc.w.data();  // a raw pointer: no reload after every store
    // sum(g * x) * rstd / n of row i, the constant of its dx.
    auto row_c = [&](Index i, T rt) {
      const S* xr = x + i * n;
      const S* gr = dy + i * n;
      Packet s0 = pset1<Packet>(T(0)), s1 = s0;
      Index j = 0;
      for (; j + 2 * L <= n; j += 2 * L) {
        Packet g0v = ld(gr + j), g1v = ld(gr + j + L);
        if (g) {
          g0v = pmul(g0v, ploadu<Packet>(g + j));
          g1v = pmul(g1v, ploadu<Packet>(g + j + L));
        }
        s0 = pmadd(g0v, ld(xr + j), s0);
        s1 = pmadd(g1v, ld(xr + j + L), s1);
      }
      for (; j + L <= n; j += L) {
        Packet g0v = ld(gr + j);
        if (g) g0v = pmul(g0v, ploadu<Packet>(g + j));
        s0 = pmadd(g0v, ld(xr + j), s0);
      }
      double sgx = static_cast<double>(predux(padd(s0, s1)));
      for (; j < n; ++j)
        sgx += static_cast<double>(g ? v(gr[j]) * g[j] : v(gr[j])) * static_cast<double>(v(xr[j]));
      return static_cast<T>(static_cast<double>(rt) * sgx / static_cast<double>(n));
    };
    // Second pass over R rows from row i with constants c (R = 1, or 2 side
    // by side: the block's dweight sums loaded and stored once for both,
    // each row's terms added in row order, so the same bits as one row at a
    // time).
    const bool into_l1 = ahead && detail::backward_requests_into_l1();
    const auto second = [&](auto rows_c, Index i, const T* c) {
      constexpr int R = decltype(rows_c)::value;
      const S* xr[R];
      const S* gr[R];
      T rt[R];
      Packet pr[R], pnc[R];
      NORMCORE_UNROLL
      for (int k = 0; k < R; ++k) {
        xr[k] = x + (i + k) * n;
        gr[k] = dy + (i + k) * n;
        rt[k] = static_cast<T>(r[i + k]);
        pr[k] = pset1<Packet>(rt[k]);
        pnc[k] = pset1<Packet>(-c[k]);
      }
      const bool next = R == 1 && ahead && i + 1 < count;  // detail::prefetch_next_row
      Index j = 0;
      for (; j + L <= n; j += L) {
        if (next) detail::request_next_row<L>(xr[0] + n, gr[0] + n, j, into_l1);
        Packet dyv[R], xh[R];
        NORMCORE_UNROLL
        for (int k = 0; k < R; ++k) {
          dyv[k] = ld(gr[k] + j);
          xh[k] = pmul(ld(xr[k] + j), pr[k]);
        }
        if (dx) {
          // Every product that meets a sum is an explicit multiply-add
          // (detail::madd in the tail), so the bits do not depend on what
          // the compiler contracts (GCC's -ffp-contract=fast, its default,
          // fuses a * b + c where it sees one, differently in loops it
          // specializes at -O3).
          const Packet gm = g ? ploadu<Packet>(g + j) : pset1<Packet>(T(1));
          NORMCORE_UNROLL
          for (int k = 0; k < R; ++k) {
            const Packet gv = g ? pmul(dyv[k], gm) : dyv[k];
            const Packet t = pmadd(xh[k], pnc[k], gv);  // g - xh * c
            const Packet o = dh ? pmadd(pr[k], t, ld(dh + (i + k) * n + j)) : pmul(pr[k], t);
            detail::store_packet<Stream>(dx + (i + k) * n + j, o);
          }
        }
        if (dwp) {
          Packet a = ploadu<Packet>(acc + j);
          NORMCORE_UNROLL
          for (int k = 0; k < R; ++k) a = pmadd(dyv[k], xh[k], a);
          pstoreu(acc + j, a);
        }
      }
      NORMCORE_UNROLL
      for (int k = 0; k < R; ++k) {
        for (Index t = j; t < n; ++t) {
          const T dyj = v(gr[k][t]);  // read before dx is written: dx may be dy
          const T xh1 = v(xr[k][t]) * rt[k];
          if (dx) {
            const T tt = detail::madd(xh1, -c[k], g ? dyj * g[t] : dyj);
            dx[(i + k) * n + t] = static_cast<S>(dh ? detail::madd(rt[k], tt, v(dh[(i + k) * n + t])) : rt[k] * tt);
          }
          if (dwp) acc[t] = detail::madd(dyj, xh1, acc[t]);
        }
      }
    };
    // Short rows: the constants of a group of rows first, then their dx,
    // so that one row's horizontal sum and division overlap the next row's
    // loads instead of stalling its second pass. Long rows in pairs when in
    // cache (their second passes side by side), else one at a time
    // (grouping them further measured slower).
    const Index group = n < detail::kShortRowPackets * L ? kRstdGroup : ahead ? 1 : 2;
    T cs[kRstdGroup];
    for (Index b0 = 0; b0 < count;) {
      const Index b1 = std::min(count, b0 + (kRowBlock - gacc.rows));
      for (Index i0 = b0; i0 < b1; i0 += group) {
        const Index i1 = std::min(b1, i0 + group);
        for (Index i = i0; i < i1; ++i)
          if (detail::normal_in<T>(r[i])) cs[i - i0] = row_c(i, static_cast<T>(r[i]));
        for (Index i = i0; i < i1;) {
          if (!detail::normal_in<T>(r[i])) {
            exact_row(x + i * n, dy + i * n, dx ? dx + i * n : nullptr, dh ? dh + i * n : nullptr, n, r[i], g, dwp);
            ++i;
          } else if (!ahead && i + 1 < i1 && detail::normal_in<T>(r[i + 1])) {  // in cache: two at a time
            second(std::integral_constant<int, 2>(), i, cs + (i - i0));
            i += 2;
          } else {
            second(std::integral_constant<int, 1>(), i, cs + (i - i0));
            ++i;
          }
        }
      }
      gacc.rows += b1 - b0;
      if (gacc.rows == kRowBlock) gacc.flush(dwp);
      b0 = b1;
    }
  }

  // Rows of a ColMajor backward's part on the exact path (their rstd is not
  // a normal T), redone after the packets: row and rstd, and their x and dy
  // (row e at kept[2 * n * e], dy after x), kept before the passes write
  // dx, which may lie over x or dy.
  struct ExactRows {
    std::vector<std::pair<Index, W>> rows;
    std::vector<T> kept;
    // Their dweight terms, added straight into each row's group's sums
    // (after all the part's packets).
    void add_dweight(double* dw_part, const detail::Split& gsplit, Index n) const {
      for (std::size_t e = 0; dw_part && e < rows.size(); ++e) {
        const auto [r, ri] = rows[e];
        const T* const xr = kept.data() + 2 * static_cast<std::size_t>(n) * e;
        const T* const yr = xr + n;
        Index gi = 0;
        while (gsplit.begin(gi + 1) <= r) ++gi;
        double* const dwp = dw_part + gi * n;
        for (Index j = 0; j < n; ++j) {
          const long double xh = static_cast<long double>(xr[j]) * ri;
          dwp[j] += static_cast<double>(static_cast<long double>(yr[j]) * xh);
        }
      }
    }
  };

  // ColMajor rows [R0, R1) of a part (on whole blocks of gsplit's
  // alignment), row r of feature j at xv.data[j * xv.rows + r - o] (so dy,
  // dx, dh): dx, plus dh (optional, added after), and each group's dweight
  // sums in dw_part + group * n (null: no dweight). Chunks of rows or the whole part
  // (detail::colmajor_backward_chunk), in segments of up to
  // detail::kSegmentBytes of x, each with its rstd (recomputed, without
  // saved statistics, just before the passes read x again) and its dh.
  // Whole packets of rows go through lane_passes; fewer than L rows left
  // over through the same passes on a padded copy. A row whose rstd is not
  // a normal T gets rstd 0 and mask 0 in the passes and is redone exactly:
  // its dx in its segment; its x and dy kept in `exact`, whose dweight
  // terms the caller adds after all the part's packets (as each group's
  // sums always took them: its packets in row order, then its exact rows).
  void backward_colmajor(const detail::Matrix2D<T>& xv, Index o, const T* dyp, T* dx, const T* dhp,
                         const detail::Split& gsplit, Index R0, Index R1, const T* g, double* dw_part,
                         const NormStats<T>* saved, ExactRows& exact) const {
    constexpr int L = detail::simd<T>::L;
    const Index rows = xv.rows, n = xv.cols;  // (rows: the leading dimension)
    const Index chunk = detail::colmajor_backward_chunk<T>(rows, n, true);
    const Index seg = chunk ? detail::colmajor_segment_rows<T>(chunk, n) : R1 - R0;
    const Index sp = (std::min(seg, R1 - R0) + L - 1) / L * L;  // a segment's rows, padded
    const auto at = [](Index i) { return static_cast<std::size_t>(i); };
    // Per row of a segment: rstd in W, rstd in T (0 on the exact path), the
    // passes' coefficient, 1 where the row's dweight terms count; per packet,
    // its group.
    detail::Scratch<W> rg_(at(sp), false);
    detail::Scratch<T> coef(at(3 * sp), false);
    detail::Scratch<Index> group(at(sp / L), false);
    W* const rg = rg_.data();
    T* const rt = coef.data();
    T* const nc = rt + sp;
    T* const mk = nc + sp;
    const auto group_of = [&](Index i, Index gi) {  // the group of row i, from group gi on
      while (gsplit.begin(gi + 1) <= i) ++gi;
      return gi;
    };
    Index gi = 0;
    for (Index s0 = R0; s0 < R1; s0 += seg) {
      const Index s1 = std::min(R1, s0 + seg), m = s1 - s0;
      const detail::ColMajorResidual<T> residual(dx, dhp, rows, n, s0 - o, s1 - o);  // added after
      const std::size_t first_exact = exact.rows.size();
      // rstd: saved (one that is not a normal T recomputed), or recomputed.
      bool abnormal = false;  // a row of the segment takes the exact path
      if (saved) {
        const T* const sr = saved->rstd.data() + s0;
        for (Index i = 0; i < m; ++i) {
          rt[i] = sr[i];
          abnormal = abnormal || !detail::normal_in<T>(sr[i]);
        }
        if (abnormal) {
          lane_rstd(xv, s0 - o, s1 - o, rg);
          for (Index i = 0; i < m; ++i) {
            if (detail::normal_in<T>(rt[i])) {
              rg[i] = rt[i];
            } else {
              rt[i] = static_cast<T>(rg[i]);
            }
          }
        }
      } else {
        lane_rstd(xv, s0 - o, s1 - o, rg);
        for (Index i = 0; i < m; ++i) {
          rt[i] = static_cast<T>(rg[i]);
          abnormal = abnormal || !detail::normal_in<T>(rg[i]);
        }
      }
      std::fill(mk, mk + m, T(1));
      if (abnormal) {
        for (Index i = 0; i < m; ++i) {
          if (detail::normal_in<T>(rg[i])) continue;
          rt[i] = mk[i] = T(0);
          exact.rows.emplace_back(s0 + i, rg[i]);
          for (Index j = 0; j < n; ++j) exact.kept.push_back(xv.data[s0 - o + i + j * rows]);
          for (Index j = 0; j < n; ++j) exact.kept.push_back(dyp[s0 - o + i + j * rows]);
        }
      }
      for (Index p = 0; p * L < m; ++p) {
        gi = group_of(s0 + p * L, gi);
        group.data()[p] = gi;
      }
      const Index mw = m / L * L;
      for (Index c0 = 0; c0 < mw; c0 += chunk ? chunk : mw) {
        const Index c1 = chunk ? std::min(mw, c0 + chunk) : mw;
        const Index i = s0 - o + c0;
        lane_passes(xv.data + i, dyp + i, dx ? dx + i : nullptr, rows, c1 - c0, n, g, rt + c0, nc + c0, mk + c0,
                    group.data() + c0 / L, dw_part);
      }
      if (mw < m) {
        // The leftover rows (the part's last) on a copy padded to a packet:
        // padding lanes repeat the last row and are masked out of dweight.
        const Index k = m - mw, i0 = s0 + mw;
        std::vector<T> tmp(at(3 * L * n));
        T* tx = tmp.data();
        T* tdy = tx + L * n;
        T* tdx = tdy + L * n;
        detail::gather_lanes(xv.data, rows, i0 - o, k, n, Index(L), tx);
        detail::gather_lanes(dyp, rows, i0 - o, k, n, Index(L), tdy);
        for (Index l = k; l < L; ++l) {
          rt[mw + l] = rt[mw + k - 1];
          mk[mw + l] = T(0);
        }
        lane_passes(tx, tdy, dx ? tdx : nullptr, L, L, n, g, rt + mw, nc + mw, mk + mw, group.data() + mw / L,
                    dw_part);
        if (dx) detail::scatter_lanes(tdx, rows, i0 - o, k, n, Index(L), dx);
      }
      // The exact path's dx: the row's sums in long double.
      for (std::size_t e = first_exact; dx && e < exact.rows.size(); ++e) {
        const auto [r, ri] = exact.rows[e];
        const T* const xr = exact.kept.data() + 2 * static_cast<std::size_t>(n) * e;
        const T* const yr = xr + n;
        long double sgx = 0;
        for (Index j = 0; j < n; ++j) {
          const long double gj = static_cast<long double>(yr[j]) * (g ? static_cast<long double>(g[j]) : 1.0L);
          sgx += gj * static_cast<long double>(xr[j]) * ri;
        }
        const long double c = sgx / static_cast<long double>(n);
        for (Index j = 0; j < n; ++j) {
          const long double xh = static_cast<long double>(xr[j]) * ri;
          const long double gj = static_cast<long double>(yr[j]) * (g ? static_cast<long double>(g[j]) : 1.0L);
          dx[r - o + j * rows] = static_cast<T>(ri * (gj - xh * c));
        }
      }
      residual.add_to(dx);
    }
  }

  // The two passes over m rows (whole packets) of a ColMajor block with
  // leading dimension ld, rstd rt (T) and dweight mask mk: the first takes
  // each row's sum of g * x in T, features in order, into nc, then turns it
  // into -rstd * mean(g * x); the second writes dx and, feature by
  // feature, sums each block's dy * x_hat in T, packets in row order, and
  // adds that block sum to its group's dweight sums (group: one per packet,
  // a block's packets in one group; the sums at dw_part + group * n, null:
  // none), blocks in row order. Blocks of packets side by side (up to
  // detail::kRegisterLanePackets in the first pass, detail::kLanePackets in
  // the second) go down a tile of features (detail::lane_tile: all of them
  // for one block). A lane's arithmetic, and so dx, does not depend on the
  // blocks or tiles: the same bits for any row count, part or chunk;
  // dweight depends on the second pass's blocks, taken alike for any thread
  // count (as LayerNorm's).
  static void lane_passes(const T* x, const T* dy, T* dx, Index ld, Index m, Index n, const T* g, const T* rt, T* nc,
                          const T* mk, const Index* group, double* dw_part) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    constexpr Index kBlock = Index(detail::kRegisterLanePackets) * L;
    const Index tile = detail::lane_tile<T>(m, kBlock, n);
    std::fill(nc, nc + m, T(0));
    for (Index t0 = 0; t0 < n; t0 += tile) {
      const Index t1 = std::min(n, t0 + tile);
      for (Index c0 = 0; c0 < m; c0 += kBlock) {
        const int np = static_cast<int>(std::min(kBlock, m - c0) / L);
        detail::with_register_packets(np, [&](auto k_c) {
          constexpr int K = decltype(k_c)::value;
          const T* const xb = x + c0;
          const T* const yb = dy + c0;
          Packet a[K];
          NORMCORE_UNROLL
          for (int k = 0; k < K; ++k) a[k] = ploadu<Packet>(nc + c0 + k * L);
          for (Index j = t0; j < t1; ++j) {
            const Packet gmj = pset1<Packet>(g ? g[j] : T(1));
            NORMCORE_UNROLL
            for (int k = 0; k < K; ++k) {
              Packet gv = ploadu<Packet>(yb + j * ld + k * L);
              if (g) gv = pmul(gv, gmj);
              a[k] = pmadd(gv, ploadu<Packet>(xb + j * ld + k * L), a[k]);
            }
          }
          NORMCORE_UNROLL
          for (int k = 0; k < K; ++k) pstoreu(nc + c0 + k * L, a[k]);
        });
      }
    }
    for (Index i = 0; i < m; ++i)
      nc[i] = -static_cast<T>(static_cast<double>(rt[i]) * static_cast<double>(nc[i]) / static_cast<double>(n));
    for (Index t0 = 0; t0 < n; t0 += tile) {
      const Index t1 = std::min(n, t0 + tile);
      detail::for_lane_blocks<detail::kLanePackets>(0, m, L, [&](auto k_c, Index c0) {
        constexpr int K = decltype(k_c)::value;
        const Index gi = group[c0 / L];  // (a block lies in one group: see backward_impl)
        eigen_assert(group[c0 / L + K - 1] == gi);
        // Locals, not the captured references: Eigen's packet stores may
        // alias anything, so the compiler would reload those after each one.
        const T* const xb = x + c0;
        const T* const yb = dy + c0;
        T* const db = dx ? dx + c0 : nullptr;
        const T* const gl = g;
        const Index ldl = ld, j0 = t0, j1 = t1;
        double* const dwl = dw_part ? dw_part + gi * n : nullptr;
        Packet pr[K], pnc[K], pm[K];
        NORMCORE_UNROLL
        for (int k = 0; k < K; ++k) {
          pr[k] = ploadu<Packet>(rt + c0 + k * L);
          pnc[k] = ploadu<Packet>(nc + c0 + k * L);
          pm[k] = ploadu<Packet>(mk + c0 + k * L);
        }
        for (Index j = j0; j < j1; ++j) {
          const Packet gmj = pset1<Packet>(gl ? gl[j] : T(1));
          Packet tw = pzero(gmj);  // the block's dweight terms of feature j (as LayerNorm's)
          NORMCORE_UNROLL
          for (int k = 0; k < K; ++k) {
            const Packet dyv = ploadu<Packet>(yb + j * ldl + k * L);
            const Packet xh = pmul(ploadu<Packet>(xb + j * ldl + k * L), pr[k]);
            if (db) {
              const Packet gv = gl ? pmul(dyv, gmj) : dyv;
              pstoreu(db + j * ldl + k * L, pmul(pr[k], pmadd(xh, pnc[k], gv)));  // as backward_rows
            }
            if (dwl) {
              const Packet dym = pmul(dyv, pm[k]);
              tw = k == 0 ? pmul(dym, xh) : pmadd(dym, xh, tw);
            }
          }
          if (dwl) dwl[j] += static_cast<double>(predux(tw));
        }
      });
    }
  }

  RMSNormOptions options_;
  double eps_;
  Index size_;
  Eigen::Tensor<P, 1> weight_;
};

}  // namespace normcore
