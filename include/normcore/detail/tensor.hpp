// normcore::detail: what normcore needs to know about an Eigen tensor argument,
// and the split of its logical dims into (rows, normalized size).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <unsupported/Eigen/CXX11/Tensor>

#include "normcore/config.hpp"

namespace normcore {

using Index = Eigen::Index;

namespace detail {

template <typename X>
struct is_tensor_like : std::false_type {};
template <typename S, int R, int O, typename I>
struct is_tensor_like<Eigen::Tensor<S, R, O, I>> : std::true_type {};
template <typename P, int O, template <class> class MP>
struct is_tensor_like<Eigen::TensorMap<P, O, MP>> : std::true_type {};

/// Scalar type, rank, layout and writability of a Tensor or TensorMap.
template <typename X>
struct tensor_traits {
  using Plain = std::remove_cv_t<std::remove_reference_t<X>>;
  static_assert(is_tensor_like<Plain>::value,
                "normcore accepts Eigen::Tensor and Eigen::TensorMap arguments "
                "(evaluate an expression into a Tensor first)");
  using EigenTraits = Eigen::internal::traits<Plain>;
  using RawScalar = std::remove_reference_t<decltype(*std::declval<Plain&>().data())>;
  using Scalar = std::remove_const_t<RawScalar>;
  static constexpr int rank = EigenTraits::NumDimensions;
  static constexpr int layout = EigenTraits::Layout;
  static constexpr bool writable = !std::is_const<RawScalar>::value;
};

template <typename X>
std::vector<Index> dims_of(const X& x) {
  std::vector<Index> d(tensor_traits<X>::rank);
  for (int i = 0; i < tensor_traits<X>::rank; ++i) d[i] = x.dimension(i);
  return d;
}

inline Index product(const std::vector<Index>& v, std::size_t from, std::size_t to) {
  Index p = 1;
  for (std::size_t i = from; i < to; ++i) p *= v[i];
  return p;
}

/// A rows x cols matrix in memory: RowMajor means element (r, j) at
/// data[r * cols + j]; ColMajor means data[j * rows + r].
template <typename T>
struct Matrix2D {
  T* data = nullptr;
  Index rows = 0;
  Index cols = 0;
  bool row_major = true;
};

/// A ColMajor rows x cols view of p (element (r, j) at p[j * rows + r]).
template <typename T>
Matrix2D<T> colmajor_view(const T* p, Index rows, Index cols) {
  Matrix2D<T> v;
  v.data = const_cast<T*>(p);
  v.rows = rows;
  v.cols = cols;
  v.row_major = false;
  return v;
}

/// Checks that the scalar type of X is T, at compile time.
template <typename T, typename X>
constexpr void check_scalar() {
  static_assert(std::is_same<typename tensor_traits<X>::Scalar, T>::value,
                "normcore: the tensor's scalar type must match the layer's T");
}

/// split_view's error: x's trailing dims are not `normalized`.
template <typename X>
[[noreturn]] NORMCORE_COLD void fail_trailing_dims(const char* who, const char* what, const X& x,
                                                   const std::vector<Index>& normalized) {
  fail(std::string(who) + ": expected " + what + " whose trailing dims are " + shape_string(normalized) +
       ", got " + what + " of shape " + shape_string(dims_of(x)));
}

/// check_same_shape's error.
template <typename A, typename B>
[[noreturn]] NORMCORE_COLD void fail_shape(const char* who, const char* what, const A& expected_like,
                                           const B& got) {
  fail(std::string(who) + ": expected " + what + " of shape " + shape_string(dims_of(expected_like)) + ", got " +
       shape_string(dims_of(got)));
}

/// Checks that x's trailing dims equal `normalized` and returns the view
/// rows = product of the leading dims, cols = product of the trailing dims.
template <typename T, typename X>
Matrix2D<T> split_view(const char* who, const char* what, X& x,
                       const std::vector<Index>& normalized) {
  using Tr = tensor_traits<X>;
  // No allocation on the way through (this runs on every call): the dims
  // are read in place and copied only for an error message.
  constexpr int R = Tr::rank;
  const int k = static_cast<int>(normalized.size());
  bool ok = R >= k;
  for (int i = 0; ok && i < k; ++i) ok = x.dimension(R - k + i) == normalized[static_cast<std::size_t>(i)];
  if (!ok) fail_trailing_dims(who, what, x, normalized);
  Matrix2D<T> v;
  v.data = const_cast<T*>(x.data());
  v.rows = 1;
  v.cols = 1;
  for (int i = 0; i < R - k; ++i) v.rows *= x.dimension(i);
  for (int i = R - k; i < R; ++i) v.cols *= x.dimension(i);
  v.row_major = Tr::layout == Eigen::RowMajor;
  return v;
}

/// Checks that two tensors have the same dims; names both in the error.
template <typename A, typename B>
void check_same_shape(const char* who, const char* what, const A& expected_like, const B& got) {
  constexpr int RA = tensor_traits<A>::rank, RB = tensor_traits<B>::rank;
  bool same = RA == RB;
  for (int i = 0; same && i < RA; ++i) same = expected_like.dimension(i) == got.dimension(i);
  if (!same) fail_shape(who, what, expected_like, got);
}

/// The permutation from the memory order of a ColMajor normalized block to
/// PyTorch's (row-major) flattening of normalized_shape: perm[col_index] =
/// row_major_index. Identity for a single normalized dim.
inline std::vector<Index> colmajor_to_rowmajor(const std::vector<Index>& shape) {
  const Index n = product(shape, 0, shape.size());
  std::vector<Index> perm(static_cast<std::size_t>(n));
  const std::size_t k = shape.size();
  std::vector<Index> idx(k, 0);
  for (Index c = 0; c < n; ++c) {
    Index r = 0;
    for (std::size_t t = 0; t < k; ++t) r = r * shape[t] + idx[t];
    perm[static_cast<std::size_t>(c)] = r;
    for (std::size_t t = 0; t < k; ++t) {  // ColMajor: first index fastest
      if (++idx[t] < shape[t]) break;
      idx[t] = 0;
    }
  }
  return perm;
}

}  // namespace detail
}  // namespace normcore
