// Helpers shared by normcore's tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include <normcore/normcore.hpp>
#include <normcore/reference/reference.hpp>

namespace nctest {

using normcore::Index;

template <typename T>
constexpr double eps() {
  return static_cast<double>(std::numeric_limits<T>::epsilon());
}

/// Tolerance for a value of size `magnitude` produced by a reduction over
/// `length` terms: a few roundings per term in the worst case, i.e.
/// eps x magnitude x length (the standard bound for recursive summation).
template <typename T>
double tol(double magnitude, double length) {
  return eps<T>() * magnitude * std::max(1.0, length);
}

/// Tolerance for per-element outputs of a normalization: the row statistics
/// come from a blocked/tree reduction whose error grows like log2(length),
/// plus a few roundings per element.
template <typename T>
double tol_elem(double magnitude, double length) {
  return eps<T>() * magnitude * (4.0 + std::log2(1.0 + length));
}

template <typename T>
std::vector<T> randn(std::size_t n, unsigned seed, double mean = 0.0, double stddev = 1.0) {
  std::mt19937_64 g(seed);
  std::normal_distribution<double> d(mean, stddev);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(g));
  return v;
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

/// Largest |a - b| over n values (NaN counts as infinitely far unless both NaN).
template <typename T>
double max_diff(const T* a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    const double x = static_cast<double>(a[i]);
    if (std::isnan(x) && std::isnan(b[i])) continue;
    const double d = std::fabs(x - b[i]);
    m = std::max(m, std::isnan(d) ? std::numeric_limits<double>::infinity() : d);
  }
  return m;
}

/// Copies a rows x n row-major matrix into ColMajor order (element (r, j) at
/// j * rows + r), which is how a ColMajor tensor of logical dims (rows, n)
/// stores it.
template <typename T>
std::vector<T> to_colmajor(const std::vector<T>& v, Index rows, Index n) {
  std::vector<T> c(v.size());
  for (Index r = 0; r < rows; ++r)
    for (Index j = 0; j < n; ++j) c[static_cast<std::size_t>(j * rows + r)] = v[static_cast<std::size_t>(r * n + j)];
  return c;
}

template <typename T>
std::vector<T> from_colmajor(const T* c, Index rows, Index n) {
  std::vector<T> v(static_cast<std::size_t>(rows * n));
  for (Index r = 0; r < rows; ++r)
    for (Index j = 0; j < n; ++j) v[static_cast<std::size_t>(r * n + j)] = c[j * rows + r];
  return v;
}

template <typename T>
bool bit_equal(const T* a, const T* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0;  // no memcmp on null (empty) data
}

/// The row lengths that break SIMD code: around every packet and block size.
inline const std::vector<Index>& awkward_lengths() {
  // Around every packet and kernel boundary: the short-row kernels end at
  // 128 or 256 values (sums of squares) and 256 or 512 (moments).
  static const std::vector<Index> v = {1,   2,   3,   7,   15,  16,  17,  31,  32,   33,   63,  64,
                                       65,  127, 128, 129, 255, 256, 257, 511, 512,  513,  768, 1000,
                                       1024, 4097};
  return v;
}

/// The ColMajor shapes of the large-input tests, with whether the ColMajor
/// forwards stream their y: 1130 rows of 600 features (three chunks of
/// detail::kChunk in the lane statistics, many tiles) and, where the build
/// streams ColMajor outputs (packets of a whole line: AVX-512), 4096 rows
/// just over detail::kStreamingBytes.
template <typename T>
std::vector<std::pair<std::pair<Index, Index>, bool>> colmajor_large_shapes() {
  std::vector<std::pair<std::pair<Index, Index>, bool>> shapes = {{{1130, 600}, false}};
  if (normcore::detail::kStreamStores && sizeof(typename normcore::detail::simd<T>::Packet) >= 64) {
    const Index rows = 4096;
    shapes.push_back({{rows, normcore::detail::kStreamingBytes / (rows * Index(sizeof(T))) + 1}, true});
  }
  return shapes;
}

/// Every step-th row of `rows` (at least one), and the last.
inline std::vector<Index> every_row(Index rows, Index step) {
  std::vector<Index> picks;
  for (Index i = 0; i < rows; i += step) picks.push_back(i);
  if (picks.back() != rows - 1) picks.push_back(rows - 1);
  return picks;
}

/// A row-wise backward over `rows` rows of n values must write the dx bits
/// of the same rows in calls of `chunk` rows, whichever stores it takes
/// (aligned, one element off alignment, or over dy).
/// backward(x, dy, dx, grads): the layer's backward into dx, with its
/// parameter gradients when grads.
template <typename T, typename Backward>
void check_backward_against_chunks(Index n, Index rows, Index chunk, Backward&& backward) {
  using Map = Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>>;
  using CMap = Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>>;
  SCOPED_TRACE(::testing::Message() << rows << "x" << n << " against chunks of " << chunk);
  const auto N = static_cast<std::size_t>(rows * n);
  const auto xb = randn<T>(N, 23, 0.5, 2.0);
  const auto dyb = randn<T>(N, 24);
  std::vector<T> want(N);
  ASSERT_GT(chunk, 0);
  for (Index r0 = 0; r0 < rows; r0 += chunk) {
    const Index m = std::min(chunk, rows - r0);
    CMap xs(xb.data() + r0 * n, m, n), dys(dyb.data() + r0 * n, m, n);
    Map dxs(want.data() + r0 * n, m, n);
    backward(xs, dys, dxs, false);
  }
  CMap x(xb.data(), rows, n), dy(dyb.data(), rows, n);
  std::vector<T, Eigen::aligned_allocator<T>> dxb(N + 1);
  for (int off = 0; off < 2; ++off) {
    Map dx(dxb.data() + off, rows, n);
    backward(x, dy, dx, true);
    ASSERT_EQ(std::memcmp(dx.data(), want.data(), N * sizeof(T)), 0) << "offset " << off;
  }
  auto dyw = dyb;
  Map over(dyw.data(), rows, n);
  backward(x, over, over, false);
  ASSERT_EQ(std::memcmp(dyw.data(), want.data(), N * sizeof(T)), 0) << "dx over dy";
}

/// A row-wise backward over enough rows of n values to stream
/// (normcore::detail::streaming_backward: x and dy together at least
/// kStreamingBytes) writes dx with streaming stores when dx is aligned,
/// whole packets per row and apart from x and dy: the bits of calls below
/// the threshold (check_backward_against_chunks).
template <typename T, typename Backward>
void check_large_backward(Index n, Backward&& backward) {
  const Index row_bytes = n * static_cast<Index>(sizeof(T));
  const Index rows = normcore::detail::kStreamingBytes / (2 * row_bytes) + 5;
  const Index chunk = normcore::detail::kStreamingBytes / (8 * row_bytes);
  ASSERT_TRUE((normcore::detail::streaming_backward<T, T>(rows, n)));
  ASSERT_FALSE((normcore::detail::streaming_backward<T, T>(chunk, n)));
  check_backward_against_chunks<T>(n, rows, chunk, backward);
}

/// On Intel CPUs and AMD Zen 5 (detail::dx_streams_tuned; or with the
/// Intel path choices forced, IntelTuning), a row-wise backward under the
/// streaming_backward gate whose x, dy and dx overflow the L2 writes dx
/// with streaming stores too
/// (normcore::detail::l2_backward_streams): the bits of calls whose rows the
/// L2 holds (check_backward_against_chunks), with either set of path
/// choices. Rows of n values with n * sizeof(T) >= kL2StreamRowBytes. On a
/// machine whose L2 is so large that the chunks reach the 6 MB gate, the
/// comparison would be streaming against streaming: skipped.
template <typename T, typename Backward>
void check_l2_backward(Index n, Backward&& backward) {
  namespace d = normcore::detail;
  const Index row_bytes = n * static_cast<Index>(sizeof(T));
  const Index l2 = d::backward_l2_bytes();
  const Index rows = l2 / (3 * row_bytes) + 1;
  const Index chunk = std::max<Index>(1, l2 / (6 * row_bytes));
  if (d::streaming_backward<T, T>(chunk, n)) GTEST_SKIP() << "an L2 of " << l2 << " bytes";
  ASSERT_GE(row_bytes, d::kL2StreamRowBytes);
  ASSERT_EQ((d::l2_backward_streams<T, T>(rows, n, 1)), d::dx_streams_tuned());
  ASSERT_FALSE((d::l2_backward_streams<T, T>(chunk, n, 1)));
  ASSERT_FALSE((d::l2_backward_streams<T, T>(rows, n, 2)));  // about half the L2 a thread
  {  // the whole decision, on aligned buffers like the test's offset-0 dx
    std::vector<T, Eigen::aligned_allocator<T>> a(static_cast<std::size_t>(3 * rows * n));
    const T* x = a.data();
    const T* dy = x + rows * n;
    const T* dx = dy + rows * n;
    ASSERT_EQ((d::stream_gradient<T, T>(x, dy, static_cast<const T*>(nullptr), dx, rows, n, 1)),
              d::dx_streams_tuned() && d::kStreamStores);
  }
  check_backward_against_chunks<T>(n, rows, chunk, backward);
}

/// Sets normcore::forward_stream_threshold() for a scope, then puts back the
/// setting it found (also when an assertion ends the test early).
class StreamThreshold {
 public:
  explicit StreamThreshold(Index bytes) : saved_(normcore::detail::forward_stream_setting().load()) {
    normcore::set_forward_stream_threshold(bytes);
  }
  ~StreamThreshold() { normcore::set_forward_stream_threshold(saved_); }
  StreamThreshold(const StreamThreshold&) = delete;
  StreamThreshold& operator=(const StreamThreshold&) = delete;

 private:
  Index saved_;
};

/// Sets normcore::detail::intel_tuning_setting (0: the other CPUs' path
/// choices, 1: the Intel ones, 2: the AMD Zen 5 ones, 3: the AMD Zen 3
/// ones) for its lifetime,
/// then restores it, so that a test checks each set of paths whatever the
/// machine.
class IntelTuning {
 public:
  explicit IntelTuning(int v) : saved_(normcore::detail::intel_tuning_setting().load()) {
    normcore::detail::intel_tuning_setting().store(v);
  }
  ~IntelTuning() { normcore::detail::intel_tuning_setting().store(saved_); }
  IntelTuning(const IntelTuning&) = delete;
  IntelTuning& operator=(const IntelTuning&) = delete;

 private:
  int saved_;
};

/// Whether layer.forward(x) written with ordinary stores only (no streaming
/// stores at any size) gives the bits of `y`.
template <typename Layer, typename X, typename Y>
::testing::AssertionResult same_bits_with_ordinary_stores(const Layer& layer, const X& x, const Y& y) {
  StreamThreshold never(std::numeric_limits<Index>::max());
  Y ordinary(y.dimensions());
  layer.forward(x, ordinary);
  if (std::memcmp(ordinary.data(), y.data(), static_cast<std::size_t>(y.size()) * sizeof(*y.data())) == 0)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "ordinary stores give other bits";
}

}  // namespace nctest
