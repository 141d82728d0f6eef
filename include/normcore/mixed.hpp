// normcore: 16-bit storage (Eigen::bfloat16, Eigen::half) for the float layers.
//
// A float layer (LayerNorm<float>, RMSNorm<float>, BatchNorm<float>) accepts
// tensors of Eigen::bfloat16 or Eigen::half for its inputs and outputs. The
// values are widened to float before any statistic is taken (nothing is ever
// accumulated in 16 bits), the float kernels run, and each output is rounded
// once to the storage type. Weights and saved statistics stay in float.
//
// This first implementation widens whole tensors into float temporaries: it
// allocates rows x n floats per input and output and makes one extra pass
// over each; a row-wise fused widening is future work.
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include <unsupported/Eigen/CXX11/Tensor>

#include "normcore/common.hpp"
#include "normcore/detail/tensor.hpp"

namespace normcore {
namespace detail {

template <typename S>
struct is_storage16
    : std::integral_constant<bool, std::is_same<S, Eigen::bfloat16>::value ||
                                       std::is_same<S, Eigen::half>::value> {};

template <typename X>
constexpr bool is_16bit() {
  return is_storage16<typename tensor_traits<X>::Scalar>::value;
}

/// A float copy of a 16-bit tensor, same dims and layout.
template <typename X>
auto widen(const X& x) {
  using Tr = tensor_traits<X>;
  Eigen::Tensor<float, Tr::rank, Tr::layout> f(x.dimensions());
  const auto* p = x.data();
  for (Index i = 0; i < f.size(); ++i) f.data()[i] = static_cast<float>(p[i]);
  return f;
}

/// Rounds a float tensor once into a 16-bit tensor or map of the same size.
template <typename F, typename Y>
void narrow(const F& f, Y& y) {
  using S = typename tensor_traits<Y>::Scalar;
  auto* p = y.data();
  for (Index i = 0; i < f.size(); ++i) p[i] = static_cast<S>(f.data()[i]);
}

template <typename X>
auto float_like(const X& x) {
  using Tr = tensor_traits<X>;
  return Eigen::Tensor<float, Tr::rank, Tr::layout>(x.dimensions());
}

}  // namespace detail
}  // namespace normcore

namespace normcore {
namespace detail {

/// Fused residual add and norm: h = x + residual (summed in float, rounded
/// once to the storage type; h may alias residual for an in-place update),
/// then y = norm(h) through forward(h_block, y_block, stats). With a single
/// normalized dim and RowMajor data, rows go in blocks of about 32 KiB so the
/// norm reads h back from cache: memory sees one read of x and residual and
/// one write of h and y.
template <typename Layer, typename X, typename R, typename H, typename Y, typename Stats>
void fused_add_norm(const Layer& layer, const char* who, const std::vector<Index>& shape, const X& x,
                    const R& residual, H& h, Y& y, Stats* saved) {
  using S = typename tensor_traits<X>::Scalar;
  static_assert(std::is_same<S, typename tensor_traits<R>::Scalar>::value &&
                    std::is_same<S, typename tensor_traits<H>::Scalar>::value &&
                    std::is_same<S, typename tensor_traits<Y>::Scalar>::value,
                "normcore: x, residual, h and y must have the same scalar type");
  check_layouts<X, R>();
  check_layouts<X, H>();
  check_layouts<X, Y>();
  check_same_shape(who, "residual", x, residual);
  check_same_shape(who, "h", x, h);
  check_same_shape(who, "output", x, y);
  const auto v = split_view<S>(who, "input", x, shape);
  const S* xp = x.data();
  const S* rp = residual.data();
  S* hp = h.data();
  auto add = [&](Index b, Index e) {
    for (Index i = b; i < e; ++i) hp[i] = static_cast<S>(static_cast<float>(xp[i]) + static_cast<float>(rp[i]));
  };
  if (!v.row_major || shape.size() != 1 || v.rows == 0) {
    add(0, v.rows * v.cols);
    if (saved) {
      layer.forward(h, y, *saved);
    } else {
      layer.forward(h, y);
    }
    return;
  }
  const Index n = v.cols;
  const Index block = std::max<Index>(1, (Index(1) << 13) / n);
  Stats part;
  if (saved) {
    saved->mean.resize(0);
    saved->rstd.resize(v.rows);
  }
  for (Index r0 = 0; r0 < v.rows; r0 += block) {
    const Index r1 = std::min(v.rows, r0 + block);
    add(r0 * n, r1 * n);
    Eigen::TensorMap<const Eigen::Tensor<S, 2, Eigen::RowMajor>> hb(hp + r0 * n, r1 - r0, n);
    Eigen::TensorMap<Eigen::Tensor<S, 2, Eigen::RowMajor>> yb(y.data() + r0 * n, r1 - r0, n);
    if (!saved) {
      layer.forward(hb, yb);
      continue;
    }
    layer.forward(hb, yb, part);
    if (part.mean.size()) {
      if (saved->mean.size() != v.rows) saved->mean.resize(v.rows);
      for (Index r = r0; r < r1; ++r) saved->mean(r) = part.mean(r - r0);
    }
    for (Index r = r0; r < r1; ++r) saved->rstd(r) = part.rstd(r - r0);
  }
}

/// dx += dh_next, summed in float and rounded once (the gradient of the
/// residual stream flowing past the norm).
template <typename DX, typename DH>
void add_into(DX& dx, const DH& dh) {
  using S = typename tensor_traits<DX>::Scalar;
  auto* p = dx.data();
  const auto* q = dh.data();
  for (Index i = 0; i < dx.size(); ++i) p[i] = static_cast<S>(static_cast<float>(p[i]) + static_cast<float>(q[i]));
}

}  // namespace detail
}  // namespace normcore
