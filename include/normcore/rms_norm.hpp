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
#include "normcore/layer_norm.hpp"
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

/// 1/sqrt(sum_sq/n + eps) for a row whose squares were summed in T (sum_sq).
/// If that sum overflowed, or is so small that squares may have lost bits to
/// underflow, the row is summed again exactly: scaled by 2^-ilogb(max|x|) in
/// long double. The result is in long double: it may lie outside T's range.
template <typename T>
long double rms_rstd(const T* x, Index n, Index stride, double sum_sq, double eps) {
  constexpr double kSafeLow = static_cast<double>(std::numeric_limits<T>::min()) *
                              static_cast<double>(1ULL << std::numeric_limits<T>::digits);
  const long double ld_eps = static_cast<long double>(eps);
  if (std::isfinite(sum_sq) && sum_sq >= kSafeLow) {
    return 1.0L / std::sqrt(static_cast<long double>(sum_sq) / static_cast<long double>(n) + ld_eps);
  }
  const T amax = max_abs(x, n, stride);
  if (!std::isfinite(amax)) return 1.0L / std::sqrt(static_cast<long double>(sum_sq) + ld_eps);
  if (amax == T(0)) return 1.0L / std::sqrt(ld_eps);
  const int e = std::ilogb(amax);
  long double ss = 0;
  for (Index i = 0; i < n; ++i) {
    const long double v = std::ldexp(static_cast<long double>(x[i * stride]), -e);
    ss += v * v;
  }
  // mean(x^2) = ss/n * 2^(2e); eps is added at that scale.
  const long double ms = ss / static_cast<long double>(n);
  const long double scaled = ms + std::ldexp(ld_eps, -2 * e);
  return std::ldexp(1.0L / std::sqrt(scaled), -e);
}

/// True when r, rounded to T, is a normal number (so x * r is safe in T).
template <typename T>
bool normal_in(long double r) {
  const long double a = std::fabs(r);
  return a >= static_cast<long double>(std::numeric_limits<T>::min()) &&
         a <= static_cast<long double>(std::numeric_limits<T>::max());
}

}  // namespace detail

/// Root-mean-square normalization over the trailing dims given by
/// normalized_shape: y = x / sqrt(mean(x^2) + eps) * weight. T is float or double.
template <typename T>
class RMSNorm {
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                "normcore::RMSNorm<T>: T must be float or double");

 public:
  using Scalar = T;

  explicit RMSNorm(RMSNormOptions options)
      : options_(std::move(options)),
        eps_(options_.eps() ? *options_.eps()
                            : static_cast<double>(std::numeric_limits<T>::epsilon())),
        size_(detail::checked_normalized_size("normcore::RMSNorm", options_.normalized_shape(),
                                              eps_)) {
    if (options_.elementwise_affine()) {
      weight_.resize(size_);
      weight_.setConstant(T(1));
    }
  }

  const RMSNormOptions& options() const { return options_; }
  /// The eps in use (epsilon of T when the option is unset).
  double eps() const { return eps_; }
  Index normalized_size() const { return size_; }
  /// Weight, flattened in row-major order of normalized_shape; empty without
  /// elementwise_affine.
  Eigen::Tensor<T, 1>& weight() { return weight_; }
  const Eigen::Tensor<T, 1>& weight() const { return weight_; }

  template <typename X>
  auto operator()(const X& x) const {
    auto y = detail::make_like(x);
    forward(x, y);
    return y;
  }

  template <typename X, typename Y>
  void forward(const X& x, Y&& y) const {
    forward_impl(x, y, nullptr);
  }

  /// Also saves rstd per row (saved.mean is left empty). An rstd outside T's
  /// range saturates to 0 or inf; backward recomputes such rows from x.
  template <typename X, typename Y>
  void forward(const X& x, Y&& y, NormStats<T>& saved) const {
    forward_impl(x, y, &saved);
  }

  /// Any subset of dx and dweight (nullptr for the ones not wanted).
  template <typename X, typename DY, typename DX>
  void backward(const X& x, const DY& dy, DX* dx, Eigen::Tensor<T, 1>* dweight,
                const NormStats<T>* saved = nullptr) const {
    detail::check_scalar<T, DX>();
    detail::check_layouts<X, DX>();
    static_assert(detail::tensor_traits<DX>::writable, "normcore: dx must be writable");
    detail::Matrix2D<T> dxv;
    if (dx) {
      detail::check_same_shape(kWho, "dx", x, *dx);
      dxv = detail::split_view<T>(kWho, "dx", *dx, options_.normalized_shape());
    }
    backward_impl(x, dy, dx ? &dxv : nullptr, dweight, saved);
  }

  template <typename X, typename DY>
  void backward(const X& x, const DY& dy, std::nullptr_t, Eigen::Tensor<T, 1>* dweight,
                const NormStats<T>* saved = nullptr) const {
    backward_impl(x, dy, nullptr, dweight, saved);
  }

  /// Allocating backward: dx and (with a weight) dweight; dbias stays empty.
  template <typename X, typename DY>
  auto backward(const X& x, const DY& dy, const NormStats<T>* saved = nullptr) const {
    using Tr = detail::tensor_traits<X>;
    Gradients<T, Tr::rank, Tr::layout> g;
    g.dx = detail::make_like(x);
    backward(x, dy, &g.dx, weight_.size() ? &g.dweight : nullptr, saved);
    return g;
  }

 private:
  static constexpr const char* kWho = "normcore::RMSNorm";
  const T* gamma() const { return weight_.size() ? weight_.data() : nullptr; }

  /// rstd of every row, in long double (exact path for extreme rows).
  std::vector<long double> row_rstd(const detail::Matrix2D<T>& xv) const {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const Index rows = xv.rows, n = xv.cols;
    std::vector<long double> r(static_cast<std::size_t>(rows));
    if (xv.row_major) {
      for (Index i = 0; i < rows; ++i) {
        const T* xr = xv.data + i * n;
        r[static_cast<std::size_t>(i)] = detail::rms_rstd(xr, n, 1, row_sum_squares(xr, n), eps_);
      }
      return r;
    }
    // ColMajor: a packet of rows at a time, sequential in T within chunks of
    // kChunk features, chunks added in double. Leftover rows padded.
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
    double ss[L];
    Index r0 = 0;
    for (; r0 + L <= rows; r0 += L) {
      lanes(xv.data + r0, rows, ss);
      for (int l = 0; l < L; ++l)
        r[static_cast<std::size_t>(r0 + l)] = detail::rms_rstd(xv.data + r0 + l, n, rows, ss[l], eps_);
    }
    if (r0 < rows) {
      const Index m = rows - r0;
      std::vector<T> tx(static_cast<std::size_t>(L * n));
      detail::gather_lanes(xv.data, rows, r0, m, n, Index(L), tx.data());
      lanes(tx.data(), L, ss);
      for (Index l = 0; l < m; ++l)
        r[static_cast<std::size_t>(r0 + l)] = detail::rms_rstd(xv.data + r0 + l, n, rows, ss[l], eps_);
    }
    return r;
  }

  template <typename X, typename Y>
  void forward_impl(const X& x, Y& y, NormStats<T>* saved) const {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    detail::check_scalar<T, X>();
    detail::check_scalar<T, Y>();
    detail::check_layouts<X, Y>();
    static_assert(detail::tensor_traits<Y>::writable, "normcore: the output must be writable");
    const auto xv = detail::split_view<T>(kWho, "input", x, options_.normalized_shape());
    detail::check_same_shape(kWho, "output", x, y);
    if (saved) {
      saved->mean.resize(0);
      detail::resize_vector(saved->rstd, xv.rows);
    }
    if (xv.rows == 0) return;
    const Index rows = xv.rows, n = xv.cols;
    const auto pv = detail::param_view(!xv.row_major, options_.normalized_shape(), gamma(),
                                       static_cast<const T*>(nullptr), n);
    const T* g = pv.gamma;
    T* out = y.data();
    const std::vector<long double> r = row_rstd(xv);
    if (saved)
      for (Index i = 0; i < rows; ++i) saved->rstd(i) = static_cast<T>(r[static_cast<std::size_t>(i)]);
    const Index rs = xv.row_major ? n : 1;    // stride between rows
    const Index fs = xv.row_major ? 1 : rows;  // stride between features
    // Rows whose rstd is not a normal T: exact scalar path in long double.
    auto exact_row = [&](Index i) {
      const long double ri = r[static_cast<std::size_t>(i)];
      for (Index j = 0; j < n; ++j) {
        long double v = static_cast<long double>(xv.data[i * rs + j * fs]) * ri;
        if (g) v *= static_cast<long double>(g[j]);
        out[i * rs + j * fs] = static_cast<T>(v);
      }
    };
    if (xv.row_major) {
      for (Index i = 0; i < rows; ++i) {
        const long double ri = r[static_cast<std::size_t>(i)];
        if (!detail::normal_in<T>(ri)) {
          exact_row(i);
          continue;
        }
        const T* xr = xv.data + i * n;
        T* yr = out + i * n;
        const T rt = static_cast<T>(ri);
        const Packet pr = pset1<Packet>(rt);
        Index j = 0;
        if (g) {
          for (; j + L <= n; j += L)
            pstoreu(yr + j, pmul(pmul(ploadu<Packet>(xr + j), pr), ploadu<Packet>(g + j)));
          for (; j < n; ++j) yr[j] = xr[j] * rt * g[j];
        } else {
          for (; j + L <= n; j += L) pstoreu(yr + j, pmul(ploadu<Packet>(xr + j), pr));
          for (; j < n; ++j) yr[j] = xr[j] * rt;
        }
      }
      return;
    }
    // ColMajor: packets of rows; leftover rows padded.
    std::vector<T> rt(static_cast<std::size_t>(rows));
    for (Index i = 0; i < rows; ++i) {
      const long double ri = r[static_cast<std::size_t>(i)];
      rt[static_cast<std::size_t>(i)] = detail::normal_in<T>(ri) ? static_cast<T>(ri) : T(0);
    }
    auto lanes = [&](const T* xb, T* yb, Index ld, const T* rb) {
      const Packet pr = ploadu<Packet>(rb);
      for (Index j = 0; j < n; ++j) {
        Packet v = pmul(ploadu<Packet>(xb + j * ld), pr);
        if (g) v = pmul(v, pset1<Packet>(g[j]));
        pstoreu(yb + j * ld, v);
      }
    };
    Index r0 = 0;
    for (; r0 + L <= rows; r0 += L) lanes(xv.data + r0, out + r0, rows, rt.data() + r0);
    if (r0 < rows) {
      const Index m = rows - r0;
      std::vector<T> tmp(static_cast<std::size_t>(2 * L * n + L));
      detail::gather_lanes(xv.data, rows, r0, m, n, Index(L), tmp.data());
      detail::gather_values(rt.data(), r0, m, Index(L), tmp.data() + 2 * L * n);
      lanes(tmp.data(), tmp.data() + L * n, L, tmp.data() + 2 * L * n);
      detail::scatter_lanes(tmp.data() + L * n, rows, r0, m, n, Index(L), out);
    }
    for (Index i = 0; i < rows; ++i)
      if (!detail::normal_in<T>(r[static_cast<std::size_t>(i)])) exact_row(i);
  }

  // dx = rstd * (g - x_hat * mean(g * x_hat)), x_hat = x * rstd, g = dy * weight:
  // no mean-subtraction term. One pass sums g * x; a second writes dx and
  // accumulates dweight = sum over rows of dy * x_hat (blocks of rows in T,
  // blocks added in double in order).
  template <typename X, typename DY>
  void backward_impl(const X& x, const DY& dy, const detail::Matrix2D<T>* dxv,
                     Eigen::Tensor<T, 1>* dweight, const NormStats<T>* saved) const {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    detail::check_scalar<T, X>();
    detail::check_scalar<T, DY>();
    detail::check_layouts<X, DY>();
    const auto xv = detail::split_view<T>(kWho, "input", x, options_.normalized_shape());
    detail::check_same_shape(kWho, "dy", x, dy);
    if (dweight && !weight_.size()) {
      detail::fail(std::string(kWho) + ": dweight requested but the layer has no weight "
                                       "(elementwise_affine is false)");
    }
    if (saved) detail::check_stats(kWho, saved->rstd, "rstd", xv.rows);
    const Index rows = xv.rows, n = xv.cols;
    std::vector<long double> r;
    if (saved) {
      r.resize(static_cast<std::size_t>(rows));
      for (Index i = 0; i < rows; ++i) r[static_cast<std::size_t>(i)] = saved->rstd(i);
      // A saturated saved rstd: recompute that row's exactly.
      bool any = false;
      for (long double v : r) any = any || !detail::normal_in<T>(v);
      if (any) {
        const auto full = row_rstd(xv);
        for (Index i = 0; i < rows; ++i)
          if (!detail::normal_in<T>(r[static_cast<std::size_t>(i)])) r[static_cast<std::size_t>(i)] = full[static_cast<std::size_t>(i)];
      }
    } else {
      r = row_rstd(xv);
    }
    const auto pv = detail::param_view(!xv.row_major, options_.normalized_shape(), gamma(),
                                       static_cast<const T*>(nullptr), n);
    const T* g = pv.gamma;
    const T* dyp = dy.data();
    T* dx = dxv ? dxv->data : nullptr;
    std::vector<double> dw_total(dweight ? static_cast<std::size_t>(n) : 0, 0.0);
    const Index rs = xv.row_major ? n : 1;
    const Index fs = xv.row_major ? 1 : rows;

    // Exact path for rows whose rstd is not a normal T.
    auto exact_row = [&](Index i) {
      const long double ri = r[static_cast<std::size_t>(i)];
      long double sgx = 0;
      for (Index j = 0; j < n; ++j) {
        const long double gj = static_cast<long double>(dyp[i * rs + j * fs]) * (g ? static_cast<long double>(g[j]) : 1.0L);
        sgx += gj * static_cast<long double>(xv.data[i * rs + j * fs]) * ri;
      }
      const long double c = sgx / static_cast<long double>(n);
      for (Index j = 0; j < n; ++j) {
        const long double xh = static_cast<long double>(xv.data[i * rs + j * fs]) * ri;
        const long double gj = static_cast<long double>(dyp[i * rs + j * fs]) * (g ? static_cast<long double>(g[j]) : 1.0L);
        if (dx) dx[i * rs + j * fs] = static_cast<T>(ri * (gj - xh * c));
        if (dweight) dw_total[static_cast<std::size_t>(j)] += static_cast<double>(static_cast<long double>(dyp[i * rs + j * fs]) * xh);
      }
    };

    if (xv.row_major) {
      constexpr Index kRowBlock = 64;
      std::vector<T> acc(dweight ? static_cast<std::size_t>(n) : 0);
      for (Index b0 = 0; b0 < rows; b0 += kRowBlock) {
        const Index b1 = std::min(rows, b0 + kRowBlock);
        std::fill(acc.begin(), acc.end(), T(0));
        for (Index i = b0; i < b1; ++i) {
          if (!detail::normal_in<T>(r[static_cast<std::size_t>(i)])) {
            exact_row(i);
            continue;
          }
          const T* xr = xv.data + i * n;
          const T* gr = dyp + i * n;
          const T rt = static_cast<T>(r[static_cast<std::size_t>(i)]);
          Packet s0 = pset1<Packet>(T(0)), s1 = s0;
          Index j = 0;
          for (; j + 2 * L <= n; j += 2 * L) {
            Packet g0 = ploadu<Packet>(gr + j), g1 = ploadu<Packet>(gr + j + L);
            if (g) {
              g0 = pmul(g0, ploadu<Packet>(g + j));
              g1 = pmul(g1, ploadu<Packet>(g + j + L));
            }
            s0 = pmadd(g0, ploadu<Packet>(xr + j), s0);
            s1 = pmadd(g1, ploadu<Packet>(xr + j + L), s1);
          }
          for (; j + L <= n; j += L) {
            Packet g0 = ploadu<Packet>(gr + j);
            if (g) g0 = pmul(g0, ploadu<Packet>(g + j));
            s0 = pmadd(g0, ploadu<Packet>(xr + j), s0);
          }
          double sgx = static_cast<double>(predux(padd(s0, s1)));
          for (; j < n; ++j)
            sgx += static_cast<double>(g ? gr[j] * g[j] : gr[j]) * static_cast<double>(xr[j]);
          const T c = static_cast<T>(static_cast<double>(rt) * sgx / static_cast<double>(n));
          const Packet pr = pset1<Packet>(rt), pc = pset1<Packet>(c);
          j = 0;
          for (; j + L <= n; j += L) {
            const Packet dyv = ploadu<Packet>(gr + j);
            const Packet xh = pmul(ploadu<Packet>(xr + j), pr);
            if (dx) {
              const Packet gv = g ? pmul(dyv, ploadu<Packet>(g + j)) : dyv;
              pstoreu(dx + i * n + j, pmul(pr, psub(gv, pmul(xh, pc))));
            }
            if (dweight) pstoreu(acc.data() + j, pmadd(dyv, xh, ploadu<Packet>(acc.data() + j)));
          }
          for (; j < n; ++j) {
            const T xh = xr[j] * rt;
            if (dx) dx[i * n + j] = rt * ((g ? gr[j] * g[j] : gr[j]) - xh * c);
            if (dweight) acc[static_cast<std::size_t>(j)] = detail::madd(gr[j], xh, acc[static_cast<std::size_t>(j)]);
          }
        }
        for (Index j = 0; dweight && j < n; ++j) dw_total[static_cast<std::size_t>(j)] += static_cast<double>(acc[static_cast<std::size_t>(j)]);
      }
    } else {
      // ColMajor: packets of rows, leftover rows padded; rows with an
      // abnormal rstd get rstd 0 in the packet pass and are redone exactly.
      std::vector<T> rt(static_cast<std::size_t>(rows));
      for (Index i = 0; i < rows; ++i) {
        const long double ri = r[static_cast<std::size_t>(i)];
        rt[static_cast<std::size_t>(i)] = detail::normal_in<T>(ri) ? static_cast<T>(ri) : T(0);
      }
      auto lanes = [&](const T* xb, const T* dyb, T* dxb, Index ld, const T* rb, Index active) {
        const Packet pr = ploadu<Packet>(rb);
        Packet s = pset1<Packet>(T(0));
        for (Index j = 0; j < n; ++j) {
          Packet gv = ploadu<Packet>(dyb + j * ld);
          if (g) gv = pmul(gv, pset1<Packet>(g[j]));
          s = pmadd(gv, ploadu<Packet>(xb + j * ld), s);
        }
        alignas(64) T sb[L], cb[L], mask[L];
        pstoreu(sb, s);
        for (int l = 0; l < L; ++l) {
          cb[l] = static_cast<T>(static_cast<double>(rb[l]) * static_cast<double>(sb[l]) / static_cast<double>(n));
          mask[l] = (l < active && rb[l] != T(0)) ? T(1) : T(0);
        }
        const Packet pc = ploadu<Packet>(cb), pm = ploadu<Packet>(mask);
        for (Index j = 0; j < n; ++j) {
          const Packet dyv = ploadu<Packet>(dyb + j * ld);
          const Packet xh = pmul(ploadu<Packet>(xb + j * ld), pr);
          if (dxb) {
            const Packet gv = g ? pmul(dyv, pset1<Packet>(g[j])) : dyv;
            pstoreu(dxb + j * ld, pmul(pr, psub(gv, pmul(xh, pc))));
          }
          if (dweight) dw_total[static_cast<std::size_t>(j)] += static_cast<double>(predux(pmul(pmul(dyv, pm), xh)));
        }
      };
      Index r0 = 0;
      for (; r0 + L <= rows; r0 += L)
        lanes(xv.data + r0, dyp + r0, dx ? dx + r0 : nullptr, rows, rt.data() + r0, L);
      if (r0 < rows) {
        const Index m = rows - r0;
        std::vector<T> tmp(static_cast<std::size_t>(3 * L * n + L));
        T* tx = tmp.data();
        T* tdy = tx + L * n;
        T* tdx = tdy + L * n;
        detail::gather_lanes(xv.data, rows, r0, m, n, Index(L), tx);
        detail::gather_lanes(dyp, rows, r0, m, n, Index(L), tdy);
        detail::gather_values(rt.data(), r0, m, Index(L), tdx + L * n);
        lanes(tx, tdy, dx ? tdx : nullptr, L, tdx + L * n, m);
        if (dx) detail::scatter_lanes(tdx, rows, r0, m, n, Index(L), dx);
      }
      for (Index i = 0; i < rows; ++i)
        if (!detail::normal_in<T>(r[static_cast<std::size_t>(i)])) exact_row(i);
    }
    if (dweight) {
      std::vector<Index> perm;
      const bool permute = !xv.row_major && options_.normalized_shape().size() > 1;
      if (permute) perm = detail::colmajor_to_rowmajor(options_.normalized_shape());
      detail::resize_vector(*dweight, n);
      for (Index c = 0; c < n; ++c)
        (*dweight)(permute ? perm[static_cast<std::size_t>(c)] : c) = static_cast<T>(dw_total[static_cast<std::size_t>(c)]);
    }
  }

  RMSNormOptions options_;
  double eps_;
  Index size_;
  Eigen::Tensor<T, 1> weight_;
};

}  // namespace normcore
