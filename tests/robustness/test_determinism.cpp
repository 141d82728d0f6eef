// Determinism: the output for a row (BatchNorm: a channel) depends only on
// its values and the layer's options: not on its address (misaligned
// TensorMaps), not on its position in the batch, not on the batch size or the
// other rows. Checked bit for bit against the same row run alone.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include <normcore/normcore.hpp>

namespace {

using normcore::Index;

template <typename T>
std::vector<T> random_values(std::size_t n, unsigned seed, double offset, double scale = 1.0) {
  std::mt19937 g(seed);
  std::normal_distribution<double> d(offset, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(g));
  return v;
}

template <typename T>
bool same_bits(const T* a, const T* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0;  // no memcmp on null (empty) data
}

const std::vector<Index>& lengths() {
  static const std::vector<Index> v = {1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 65, 129, 257, 768, 1000};
  return v;
}

/// Element (r, j) of a rows x n matrix stored in Layout.
template <int Layout>
Index at(Index rows, Index n, Index r, Index j) {
  return Layout == Eigen::RowMajor ? r * n + j : j * rows + r;
}

/// Runs `layer` (forward with saved statistics, then backward) on a batch of
/// `rows` rows held in a buffer at element offset `offset`, with the target
/// row at `pos`; returns that row's y and dx.
template <typename T, int Layout, typename Layer>
std::pair<std::vector<T>, std::vector<T>> run_row(const Layer& layer, const std::vector<T>& row,
                                                  const std::vector<T>& drow, Index rows, Index pos,
                                                  Index offset, unsigned seed) {
  const Index n = static_cast<Index>(row.size());
  const std::size_t total = static_cast<std::size_t>(rows * n);
  std::vector<T> xb(total + static_cast<std::size_t>(offset)), db(total + static_cast<std::size_t>(offset)),
      yb(total + static_cast<std::size_t>(offset) + 1), dxb(total + static_cast<std::size_t>(offset) + 3);
  const auto others = random_values<T>(total, seed, 3.0, 2.0);
  const auto dothers = random_values<T>(total, seed + 1, 0.0);
  T* x = xb.data() + offset;
  T* dy = db.data() + offset;
  for (Index r = 0; r < rows; ++r)
    for (Index j = 0; j < n; ++j) {
      const bool target = r == pos;
      x[at<Layout>(rows, n, r, j)] = target ? row[static_cast<std::size_t>(j)] : others[static_cast<std::size_t>(r * n + j)];
      dy[at<Layout>(rows, n, r, j)] = target ? drow[static_cast<std::size_t>(j)] : dothers[static_cast<std::size_t>(r * n + j)];
    }
  using Map = Eigen::TensorMap<Eigen::Tensor<T, 2, Layout>>;
  Map xm(x, rows, n), dym(dy, rows, n), ym(yb.data() + 1, rows, n), dxm(dxb.data() + 3, rows, n);
  normcore::NormStats<T> st;
  layer.forward(xm, ym, st);
  layer.backward(xm, dym, &dxm, nullptr, st);
  std::vector<T> y(static_cast<std::size_t>(n)), dx(static_cast<std::size_t>(n));
  for (Index j = 0; j < n; ++j) {
    y[static_cast<std::size_t>(j)] = ym.data()[at<Layout>(rows, n, pos, j)];
    dx[static_cast<std::size_t>(j)] = dxm.data()[at<Layout>(rows, n, pos, j)];
  }
  return {y, dx};
}

// Adapters giving both layers one backward signature.
template <typename T>
struct LN {
  normcore::LayerNorm<T> layer;
  template <typename X, typename Y>
  void forward(const X& x, Y& y, normcore::NormStats<T>& s) const { layer.forward(x, y, s); }
  template <typename X, typename D>
  void backward(const X& x, const D& dy, D* dx, std::nullptr_t, const normcore::NormStats<T>& s) const {
    layer.backward(x, dy, dx, nullptr, nullptr, &s);
  }
};
template <typename T>
struct RMS {
  normcore::RMSNorm<T> layer;
  template <typename X, typename Y>
  void forward(const X& x, Y& y, normcore::NormStats<T>& s) const { layer.forward(x, y, s); }
  template <typename X, typename D>
  void backward(const X& x, const D& dy, D* dx, std::nullptr_t, const normcore::NormStats<T>& s) const {
    layer.backward(x, dy, dx, nullptr, &s);
  }
};

template <typename T, int Layout, typename Make>
void check_rows(Make make, double offset, double scale) {
  for (Index n : lengths()) {
    const auto layer = make(n);
    const auto row = random_values<T>(static_cast<std::size_t>(n), static_cast<unsigned>(n), offset, scale);
    const auto drow = random_values<T>(static_cast<std::size_t>(n), static_cast<unsigned>(n) + 7, 0.0);
    const auto alone = run_row<T, Layout>(layer, row, drow, 1, 0, 0, 1);
    for (Index rows : {2, 5, 9, 17, 33}) {
      for (Index pos : {Index(0), rows / 2, rows - 1}) {
        for (Index off : {0, 3}) {
          SCOPED_TRACE(::testing::Message() << "n=" << n << " rows=" << rows << " pos=" << pos << " offset=" << off);
          const auto got = run_row<T, Layout>(layer, row, drow, rows, pos, off, static_cast<unsigned>(rows * 31 + pos));
          EXPECT_TRUE(same_bits(got.first.data(), alone.first.data(), got.first.size())) << "forward";
          EXPECT_TRUE(same_bits(got.second.data(), alone.second.data(), got.second.size())) << "backward dx";
        }
      }
    }
  }
}

template <typename T>
LN<T> make_ln(Index n) {
  LN<T> l{normcore::LayerNorm<T>(normcore::LayerNormOptions({n}))};
  const auto w = random_values<T>(static_cast<std::size_t>(n), 5, 1.0), b = random_values<T>(static_cast<std::size_t>(n), 6, 0.0);
  std::copy(w.begin(), w.end(), l.layer.weight().data());
  std::copy(b.begin(), b.end(), l.layer.bias().data());
  return l;
}
template <typename T>
RMS<T> make_rms(Index n) {
  RMS<T> l{normcore::RMSNorm<T>(normcore::RMSNormOptions({n}))};
  const auto w = random_values<T>(static_cast<std::size_t>(n), 5, 1.0);
  std::copy(w.begin(), w.end(), l.layer.weight().data());
  return l;
}

TEST(Determinism, LayerNormFloatRowMajor) { check_rows<float, Eigen::RowMajor>(make_ln<float>, 0.0, 1.0); }
TEST(Determinism, LayerNormFloatColMajor) { check_rows<float, Eigen::ColMajor>(make_ln<float>, 0.0, 1.0); }
TEST(Determinism, LayerNormFloatColMajorOffset) { check_rows<float, Eigen::ColMajor>(make_ln<float>, 1e4, 1.0); }
TEST(Determinism, LayerNormDoubleRowMajor) { check_rows<double, Eigen::RowMajor>(make_ln<double>, 1e6, 1.0); }
TEST(Determinism, LayerNormDoubleColMajor) { check_rows<double, Eigen::ColMajor>(make_ln<double>, 0.0, 1.0); }
TEST(Determinism, RMSNormFloatRowMajor) { check_rows<float, Eigen::RowMajor>(make_rms<float>, 0.0, 1.0); }
TEST(Determinism, RMSNormFloatColMajor) { check_rows<float, Eigen::ColMajor>(make_rms<float>, 0.0, 1.0); }
TEST(Determinism, RMSNormFloatColMajorHuge) { check_rows<float, Eigen::ColMajor>(make_rms<float>, 0.0, 1e25); }
TEST(Determinism, RMSNormDoubleRowMajorTiny) { check_rows<double, Eigen::RowMajor>(make_rms<double>, 0.0, 1e-200); }
TEST(Determinism, RMSNormDoubleColMajor) { check_rows<double, Eigen::ColMajor>(make_rms<double>, 0.0, 1.0); }

// BatchNorm: one channel's output (training statistics, forward and backward)
// is the same alone (C = 1) and at any position among C channels, at any
// address, in (N, C, L) and channels-last (N, L, C) layouts.
template <typename T, int Layout>
void check_channels(int axis) {
  const Index N = 3;
  for (Index L : {1, 2, 7, 16, 33, 100}) {
    const auto xc = random_values<T>(static_cast<std::size_t>(N * L), static_cast<unsigned>(L), 2.0, 1.5);
    const auto dc = random_values<T>(static_cast<std::size_t>(N * L), static_cast<unsigned>(L) + 1, 0.0);
    auto run = [&](Index C, Index pos, Index off, std::vector<T>& y, std::vector<T>& dx) {
      normcore::BatchNorm<T> bn(normcore::BatchNormOptions(C).channel_axis(axis));
      bn.weight().setConstant(T(1.25));
      bn.bias().setConstant(T(-0.5));
      const Index total = N * L * C;
      const auto others = random_values<T>(static_cast<std::size_t>(total), static_cast<unsigned>(C * 7 + pos), -1.0, 3.0);
      std::vector<T> xb(static_cast<std::size_t>(total + off)), db(static_cast<std::size_t>(total + off)),
          yb(static_cast<std::size_t>(total + 1)), dxb(static_cast<std::size_t>(total + 2));
      using Map = Eigen::TensorMap<Eigen::Tensor<T, 3, Layout>>;
      const Eigen::array<Index, 3> dims = axis == 1 ? Eigen::array<Index, 3>{{N, C, L}} : Eigen::array<Index, 3>{{N, L, C}};
      Map x(xb.data() + off, dims), dy(db.data() + off, dims), ym(yb.data() + 1, dims), dxm(dxb.data() + 2, dims);
      Index k = 0;
      for (Index o = 0; o < N; ++o)
        for (Index c = 0; c < C; ++c)
          for (Index l = 0; l < L; ++l, ++k) {
            const bool t = c == pos;
            const T xv = t ? xc[static_cast<std::size_t>(o * L + l)] : others[static_cast<std::size_t>(k)];
            const T dv = t ? dc[static_cast<std::size_t>(o * L + l)] : T(0.25);
            if (axis == 1) {
              x(o, c, l) = xv;
              dy(o, c, l) = dv;
            } else {
              x(o, l, c) = xv;
              dy(o, l, c) = dv;
            }
          }
      normcore::NormStats<T> st;
      bn.forward(x, ym, st);
      bn.backward(x, dy, &dxm, nullptr, nullptr, &st);
      y.clear();
      dx.clear();
      for (Index o = 0; o < N; ++o)
        for (Index l = 0; l < L; ++l) {
          y.push_back(axis == 1 ? ym(o, pos, l) : ym(o, l, pos));
          dx.push_back(axis == 1 ? dxm(o, pos, l) : dxm(o, l, pos));
        }
    };
    std::vector<T> y1, dx1, y, dx;
    run(1, 0, 0, y1, dx1);
    for (Index C : {2, 5, 8, 13, 16, 19}) {
      for (Index pos : {Index(0), C / 2, C - 1}) {
        for (Index off : {0, 1, 5}) {
          SCOPED_TRACE(::testing::Message() << "L=" << L << " C=" << C << " pos=" << pos << " offset=" << off);
          run(C, pos, off, y, dx);
          EXPECT_TRUE(same_bits(y.data(), y1.data(), y.size())) << "forward";
          EXPECT_TRUE(same_bits(dx.data(), dx1.data(), dx.size())) << "backward dx";
        }
      }
    }
  }
}

TEST(Determinism, BatchNormChannelFloatNCL) { check_channels<float, Eigen::RowMajor>(1); }
TEST(Determinism, BatchNormChannelFloatChannelsLast) { check_channels<float, Eigen::RowMajor>(-1); }
TEST(Determinism, BatchNormChannelDoubleColMajor) { check_channels<double, Eigen::ColMajor>(1); }
TEST(Determinism, BatchNormChannelDoubleChannelsLast) { check_channels<double, Eigen::RowMajor>(-1); }

}  // namespace
