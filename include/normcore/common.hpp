// normcore: types shared by every layer: saved statistics and gradients.
#pragma once

#include <vector>

#include <unsupported/Eigen/CXX11/Tensor>

#include "normcore/detail/tensor.hpp"

namespace normcore {

/// Per-row statistics saved by a forward pass for the backward pass, as
/// PyTorch's native_layer_norm returns them: mean and 1/sqrt(var + eps), one
/// entry per normalized row (BatchNorm: per channel). RMSNorm fills only rstd.
/// The forward resizes them when their size differs, so reusing one object
/// across calls allocates once.
template <typename T>
struct NormStats {
  Eigen::Tensor<T, 1> mean;
  Eigen::Tensor<T, 1> rstd;
};

/// All gradients of a layer, as returned by the allocating backward. A
/// gradient the layer does not have (no weight, no bias) is left empty.
/// T is the parameters' type, D the input's (they differ when a float layer
/// takes 16-bit tensors, or a 16-bit layer takes float ones).
template <typename T, int Rank, int Layout, typename D = T>
struct Gradients {
  Eigen::Tensor<D, Rank, Layout> dx;
  Eigen::Tensor<T, 1> dweight;
  Eigen::Tensor<T, 1> dbias;
};

namespace detail {

template <typename T>
void resize_vector(Eigen::Tensor<T, 1>& v, Index n) {
  if (v.dimension(0) != n) v.resize(n);
}

/// A parameter gradient from per-group partial sums: part holds `groups`
/// rows of n doubles; column c becomes 0 + part[0][c] + part[1][c] + ... in
/// group order (so the result does not depend on threads), rounded to P and
/// stored at out(perm[c]) (out(c) without perm). part is overwritten. The
/// loops run along c, so they vectorize.
template <typename P>
void emit_group_sums(double* part, Index groups, Index n, const std::vector<Index>* perm,
                     Eigen::Tensor<P, 1>& out) {
  resize_vector(out, n);
  double* t = part;
  for (Index c = 0; c < n; ++c) t[c] = 0.0 + t[c];
  for (Index gi = 1; gi < groups; ++gi) {
    const double* g = part + gi * n;
    for (Index c = 0; c < n; ++c) t[c] += g[c];
  }
  if (perm) {
    for (Index c = 0; c < n; ++c) out((*perm)[static_cast<std::size_t>(c)]) = static_cast<P>(t[c]);
  } else {
    P* o = out.data();
    for (Index c = 0; c < n; ++c) o[c] = static_cast<P>(t[c]);
  }
}

/// A parameter gradient from the T sums of one block of rows in one group:
/// what those sums added into zeroed double sums and emit_group_sums of the
/// one group give, the same bits (0.0 + each sum, rounded to P), without
/// the double sums (the row-wise backwards on fewer rows than one block).
template <typename T, typename P>
void emit_block_sums(const std::vector<T>& sums, Eigen::Tensor<P, 1>& out) {
  resize_vector(out, static_cast<Index>(sums.size()));
  P* o = out.data();
  for (std::size_t c = 0; c < sums.size(); ++c) o[c] = static_cast<P>(0.0 + static_cast<double>(sums[c]));
}

/// check_stats' error.
[[noreturn]] NORMCORE_COLD inline void fail_stats(const char* who, const char* what, Index n, Index got) {
  fail(std::string(who) + ": expected saved " + what + " of shape [" + std::to_string(n) + "], got [" +
       std::to_string(got) + "]");
}

template <typename T>
void check_stats(const char* who, const Eigen::Tensor<T, 1>& v, const char* what, Index n) {
  if (v.dimension(0) != n) fail_stats(who, what, n, v.dimension(0));
}

/// Makes the output tensor of a functor forward: same dims and layout as x.
template <typename X>
auto make_like(const X& x) {
  using Tr = tensor_traits<X>;
  Eigen::Tensor<typename Tr::Scalar, Tr::rank, Tr::layout> y;
  y.resize(x.dimensions());
  return y;
}

template <typename X, typename Y>
constexpr void check_layouts() {
  static_assert(tensor_traits<X>::layout == tensor_traits<Y>::layout,
                "normcore: input and output tensors must have the same layout");
  static_assert(tensor_traits<X>::rank == tensor_traits<Y>::rank,
                "normcore: input and output tensors must have the same rank");
}

}  // namespace detail
}  // namespace normcore
