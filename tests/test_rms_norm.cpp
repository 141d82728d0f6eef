// RMSNorm against the reference path, finite differences and extremes.
#include <tuple>

#include "test_util.hpp"

namespace {

using namespace nctest;
using normcore::NormStats;
using normcore::RMSNorm;
using normcore::RMSNormOptions;

template <typename T>
class RMSNormTest : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(RMSNormTest, Types, );

template <typename T, int Layout>
void check_rms(Index rows, Index n, unsigned seed, double scale) {
  SCOPED_TRACE(::testing::Message() << "rows=" << rows << " n=" << n << " scale=" << scale
                                    << (Layout == Eigen::RowMajor ? " RowMajor" : " ColMajor"));
  RMSNorm<T> rn(RMSNormOptions({n}).eps(1e-6));
  const auto gv = randn<T>(static_cast<std::size_t>(n), seed, 1.0, 0.5);
  std::copy(gv.begin(), gv.end(), rn.weight().data());
  const auto xl = randn<T>(static_cast<std::size_t>(rows * n), seed + 1, 0.3 * scale, scale);
  const auto dyl = randn<T>(static_cast<std::size_t>(rows * n), seed + 2);
  const bool rm = Layout == Eigen::RowMajor;
  const auto xs = rm ? xl : to_colmajor(xl, rows, n);
  const auto dys = rm ? dyl : to_colmajor(dyl, rows, n);
  Eigen::TensorMap<const Eigen::Tensor<T, 2, Layout>> x(xs.data(), rows, n), dy(dys.data(), rows, n);
  Eigen::Tensor<T, 2, Layout> y(rows, n), dx(rows, n);
  NormStats<T> st;
  rn.forward(x, y, st);
  std::vector<long double> rref;
  const auto ref = normcore::reference::rms_norm_forward(xl.data(), rows, n, rn.weight().data(), 1e-6, &rref);
  const auto yl = rm ? std::vector<T>(y.data(), y.data() + y.size()) : from_colmajor(y.data(), rows, n);
  EXPECT_LE(max_diff(yl.data(), ref), tol_elem<T>(max_abs(ref) + 1, double(n)));
  for (Index r = 0; r < rows; ++r)
    EXPECT_NEAR(double(st.rstd(r)) / double(rref[static_cast<std::size_t>(r)]), 1.0, tol_elem<T>(1.0, double(n)));
  Eigen::Tensor<T, 1> dw;
  rn.backward(x, dy, &dx, &dw, &st);
  const auto gref = normcore::reference::rms_norm_backward(xl.data(), dyl.data(), rows, n, rn.weight().data(), 1e-6);
  const auto dxl = rm ? std::vector<T>(dx.data(), dx.data() + dx.size()) : from_colmajor(dx.data(), rows, n);
  double rmax = 0;
  for (long double v : rref) rmax = std::max(rmax, double(v));
  EXPECT_LE(max_diff(dxl.data(), gref.dx), tol_elem<T>(rmax * (max_abs(gref.dx) / rmax + 8), double(n)));
  EXPECT_LE(max_diff(dw.data(), gref.dweight), tol<T>(max_abs(gref.dweight) + 16, double(rows) + 8));
}

TYPED_TEST(RMSNormTest, MatchesReferenceOnAwkwardLengthsBothLayouts) {
  unsigned seed = 3;
  for (Index n : awkward_lengths()) {
    for (Index rows : {Index(1), Index(5), Index(19)}) {
      check_rms<TypeParam, Eigen::RowMajor>(rows, n, seed, 1.0);
      check_rms<TypeParam, Eigen::ColMajor>(rows, n, seed, 1.0);
      seed += 5;
    }
  }
}

// In place (y is x): the same bits as into a separate y (as the LayerNorm
// test of the same name).
TYPED_TEST(RMSNormTest, InPlaceForwardMatchesOutOfPlaceBitForBit) {
  using T = TypeParam;
  for (Index n : {Index(7), Index(50), Index(64), Index(100), Index(1000)}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    const Index rows = 11;
    RMSNorm<T> rn(RMSNormOptions({n}));
    const auto gv = randn<T>(static_cast<std::size_t>(n), 7, 1.0, 0.5);
    std::copy(gv.begin(), gv.end(), rn.weight().data());
    auto buf = randn<T>(static_cast<std::size_t>(rows * n), 9, 0.5, 2.0);
    const auto xs = buf;
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x(xs.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::RowMajor> y(rows, n);
    rn.forward(x, y);
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>> inplace(buf.data(), rows, n);
    rn.forward(inplace, inplace);
    for (Index i = 0; i < rows * n; ++i) ASSERT_EQ(buf[static_cast<std::size_t>(i)], y.data()[i]) << "at " << i;
  }
}

// Squares that overflow or underflow T: still the right answer.
TYPED_TEST(RMSNormTest, ExtremeMagnitudes) {
  using T = TypeParam;
  const double big = std::is_same<T, float>::value ? 1e25 : 1e200;
  const double tiny = std::is_same<T, float>::value ? 1e-25 : 1e-200;
  for (double scale : {big, tiny}) {
    for (Index n : {Index(7), Index(768)}) {
      check_rms<T, Eigen::RowMajor>(3, n, 17, scale);
      check_rms<T, Eigen::ColMajor>(3, n, 17, scale);
    }
  }
  // eps = 0 and denormal inputs: y = x / rms(x) is O(1) and representable.
  RMSNorm<T> rn(RMSNormOptions({4}).eps(0.0));
  Eigen::Tensor<T, 2, Eigen::RowMajor> x(1, 4);
  const T d = std::numeric_limits<T>::denorm_min();
  x.setValues({{d, -d, d, -d}});
  Eigen::Tensor<T, 2, Eigen::RowMajor> y = rn(x);
  for (Index j = 0; j < 4; ++j) EXPECT_EQ(std::fabs(y(0, j)), T(1)) << j;
}

TYPED_TEST(RMSNormTest, DefaultEpsIsMachineEpsilonAndZeroRowIsZero) {
  using T = TypeParam;
  RMSNorm<T> rn(RMSNormOptions({8}));
  EXPECT_EQ(rn.eps(), double(std::numeric_limits<T>::epsilon()));
  Eigen::Tensor<T, 2, Eigen::RowMajor> x(2, 8);
  x.setZero();
  Eigen::Tensor<T, 2, Eigen::RowMajor> y = rn(x);
  for (Index i = 0; i < y.size(); ++i) EXPECT_EQ(y.data()[i], T(0));
}

TEST(RMSNormGradient, MatchesCentralDifferences) {
  for (Index n : {Index(1), Index(3), Index(17), Index(40)}) {
    const Index rows = 3;
    RMSNorm<double> rn(RMSNormOptions({n}).eps(1e-3));
    const auto gv = randn<double>(static_cast<std::size_t>(n), 4, 1.0, 0.5);
    std::copy(gv.begin(), gv.end(), rn.weight().data());
    auto x = randn<double>(static_cast<std::size_t>(rows * n), 5, 0.2, 1.0);
    const auto w = randn<double>(static_cast<std::size_t>(rows * n), 6);
    Eigen::TensorMap<Eigen::Tensor<double, 2, Eigen::RowMajor>> xm(x.data(), rows, n);
    Eigen::TensorMap<const Eigen::Tensor<double, 2, Eigen::RowMajor>> wm(w.data(), rows, n);
    auto loss = [&]() {
      Eigen::Tensor<double, 2, Eigen::RowMajor> y = rn(xm);
      double s = 0;
      for (Index i = 0; i < rows * n; ++i) s += y.data()[i] * w[static_cast<std::size_t>(i)];
      return s;
    };
    const auto g = rn.backward(xm, wm);
    EXPECT_EQ(g.dbias.size(), 0);
    const double h = 1e-6;
    for (Index i = 0; i < rows * n; ++i) {
      double& v = x[static_cast<std::size_t>(i)];
      const double keep = v;
      v = keep + h;
      const double lp = loss();
      v = keep - h;
      const double lm = loss();
      v = keep;
      EXPECT_NEAR(g.dx.data()[i], (lp - lm) / (2 * h), 1e-6 * (1 + std::fabs(g.dx.data()[i]))) << "n=" << n;
    }
    for (Index j = 0; j < n; ++j) {
      double& p = rn.weight()(j);
      const double keep = p;
      p = keep + h;
      const double lp = loss();
      p = keep - h;
      const double lm = loss();
      p = keep;
      EXPECT_NEAR(g.dweight(j), (lp - lm) / (2 * h), 1e-6 * (1 + std::fabs(g.dweight(j)))) << "n=" << n;
    }
  }
}

TEST(RMSNormVsLayerNorm, EqualWhenRowMeanIsZero) {
  const Index n = 64;
  auto v = randn<double>(static_cast<std::size_t>(n), 8);
  double m = 0;
  for (double a : v) m += a;
  for (double& a : v) a -= m / n;  // zero-mean row
  Eigen::TensorMap<const Eigen::Tensor<double, 2, Eigen::RowMajor>> x(v.data(), 1, n);
  normcore::LayerNorm<double> ln(normcore::LayerNormOptions({n}).eps(1e-6));
  RMSNorm<double> rn(RMSNormOptions({n}).eps(1e-6));
  Eigen::Tensor<double, 2, Eigen::RowMajor> a = ln(x), b = rn(x);
  for (Index j = 0; j < n; ++j) EXPECT_NEAR(a(0, j), b(0, j), 1e-12);
}

TEST(RMSNormErrors, ShapesAndMissingWeight) {
  RMSNorm<float> rn(RMSNormOptions({16}));
  Eigen::Tensor<float, 2, Eigen::RowMajor> x(2, 15);
  x.setZero();
  try {
    (void)rn(x);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[16]"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("[2, 15]"), std::string::npos);
  }
  RMSNorm<float> plain(RMSNormOptions({16}).elementwise_affine(false));
  Eigen::Tensor<float, 2, Eigen::RowMajor> ok(2, 16);
  ok.setZero();
  Eigen::Tensor<float, 1> dw;
  EXPECT_THROW(plain.backward(ok, ok, nullptr, &dw), std::invalid_argument);
}

// Inputs of normcore::detail::kStreamingBytes or more take other forward paths:
// short rows in groups that prefetch the next group, long rows one at a
// time, and rows of more than 4 KB (here 1500 values, with a tail) request
// the next row as they are scaled (detail::forward_requests; into the L1 with
// the third set of path choices). The same bits
// as the same rows in calls below the threshold, in place too.
TYPED_TEST(RMSNormTest, LargeInputForwardSameBitsAsSmallCalls) {
  using T = TypeParam;
  // Streaming stores from the streaming gate on (the default threshold may
  // be higher on a machine with a large L3), then, once a case, none.
  const nctest::StreamThreshold streams(normcore::detail::kStreamingBytes);
  // With each set of path choices (Zen 5's requests go into the L1).
  for (int tuning : {0, 1, 2}) {
    const nctest::IntelTuning paths(tuning);
    SCOPED_TRACE(::testing::Message() << "path choices " << tuning);
    for (Index n : {Index(64), Index(1000), Index(1024), Index(1500)}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n);
      const Index row_bytes = n * static_cast<Index>(sizeof(T));
      const Index rows = normcore::detail::kStreamingBytes / row_bytes + 5;
      RMSNorm<T> rn(RMSNormOptions({n}));
      const auto gv = randn<T>(static_cast<std::size_t>(n), 7, 1.0, 0.5);
      std::copy(gv.begin(), gv.end(), rn.weight().data());
      const auto buf = randn<T>(static_cast<std::size_t>(rows * n), 22, 0.5, 2.0);
      Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x(buf.data(), rows, n);
      Eigen::Tensor<T, 2, Eigen::RowMajor> y(rows, n);
      rn.forward(x, y);
      ASSERT_TRUE(nctest::same_bits_with_ordinary_stores(rn, x, y));
      const Index chunk = 1000;
      ASSERT_LT(chunk * row_bytes, normcore::detail::kStreamingBytes);
      for (Index r0 = 0; r0 < rows; r0 += chunk) {
        const Index m = std::min(chunk, rows - r0);
        Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> xs(buf.data() + r0 * n, m, n);
        Eigen::Tensor<T, 2, Eigen::RowMajor> ys(m, n);
        rn.forward(xs, ys);
        ASSERT_EQ(std::memcmp(ys.data(), y.data() + r0 * n, static_cast<std::size_t>(m * row_bytes)), 0)
            << "rows " << r0 << ".." << r0 + m;
      }
      auto copy = buf;
      Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>> inplace(copy.data(), rows, n);
      rn.forward(inplace, inplace);
      ASSERT_EQ(std::memcmp(copy.data(), y.data(), static_cast<std::size_t>(rows * row_bytes)), 0) << "in place";
    }
  }
}

// Fewer rows than one block of dweight's sums (64) write dweight straight
// from the block's T sums, without the zeroed double sums (detail::emit_block_sums),
// unless a row takes the exact path. Against the same rows padded to 130
// with dy = 0, which take the group sums: dweight and dx bit for bit, with
// the statistics saved and recomputed, and with the block's last row made of
// values near T's largest (eps 0: its rstd is not a normal T, and its exact
// path adds into the double sums). The padded call runs first, so the
// scratch the one-block call gets holds its sums.
TYPED_TEST(RMSNormTest, OneBlockBackwardSameBitsAsPaddedBatch) {
  using T = TypeParam;
  using Map = Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>>;
  using Out = Eigen::Tensor<T, 2, Eigen::RowMajor>;
  const Index padded = 130;
  for (Index n : {Index(50), Index(768)}) {
    RMSNorm<T> rn(RMSNormOptions({n}).eps(0.0));
    const auto gv = randn<T>(static_cast<std::size_t>(n), 31, 1.0, 0.5);
    std::copy(gv.begin(), gv.end(), rn.weight().data());
    const auto xs0 = randn<T>(static_cast<std::size_t>(padded * n), 32, 0.5, 2.0);
    const auto gs = randn<T>(static_cast<std::size_t>(padded * n), 33);
    for (Index rows : {Index(1), Index(7), Index(63)}) {
      for (bool extreme : {false, true}) {
        SCOPED_TRACE(::testing::Message() << rows << "x" << n << (extreme ? ", extreme last row" : ""));
        std::vector<T> xs(xs0), g(gs);
        if (extreme) {
          for (Index j = 0; j < n; ++j)
            xs[static_cast<std::size_t>((rows - 1) * n + j)] =
                static_cast<T>((j % 2 ? -0.5 : 0.9) * std::numeric_limits<T>::max());
        }
        std::fill(g.begin() + rows * n, g.end(), T(0));
        Map xa(xs.data(), rows, n), ga(g.data(), rows, n), xp(xs.data(), padded, n), gp(g.data(), padded, n);
        NormStats<T> sa, sp;
        Out ya(rows, n), yp(padded, n);
        rn.forward(xa, ya, sa);
        rn.forward(xp, yp, sp);
        for (bool saved : {true, false}) {
          SCOPED_TRACE(saved ? "saved statistics" : "recomputed statistics");
          Out dxa(rows, n), dxp(padded, n);
          Eigen::Tensor<T, 1> dwa, dwp;
          rn.backward(xp, gp, &dxp, &dwp, saved ? &sp : nullptr);
          rn.backward(xa, ga, &dxa, &dwa, saved ? &sa : nullptr);
          EXPECT_TRUE(bit_equal(dwa.data(), dwp.data(), static_cast<std::size_t>(n)));
          EXPECT_TRUE(bit_equal(dxa.data(), dxp.data(), static_cast<std::size_t>(rows * n)));
        }
        // The reference, for the one-block sums themselves.
        Eigen::Tensor<T, 1> dw;
        rn.backward(xa, ga, nullptr, &dw, &sa);
        const auto ref = normcore::reference::rms_norm_backward(xs.data(), g.data(), rows, n, rn.weight().data(), 0.0);
        for (Index j = 0; j < n; ++j) {
          const double want = ref.dweight[static_cast<std::size_t>(j)];
          EXPECT_NEAR(double(dw(j)), want, 1e-4 * (1.0 + std::fabs(want))) << "j=" << j;
        }
      }
    }
  }
}

// Backward inputs over the L2, under the streaming gate: on Intel CPUs and
// AMD Zen 5 dx with streaming stores (nctest::check_l2_backward), with both
// sets of path choices. Rows of 1 KB (the shortest that stream) and 1024
// values.
TYPED_TEST(RMSNormTest, L2SizedBackwardSameBitsAsSmallCalls) {
  using T = TypeParam;
  for (int tuning : {0, 1}) {
    const nctest::IntelTuning paths(tuning);
    SCOPED_TRACE(::testing::Message() << "Intel tuning " << tuning);
    for (Index n : {Index(1024 / sizeof(T)), Index(1024)}) {
      RMSNorm<T> rn(RMSNormOptions({n}));
      const auto gv = randn<T>(static_cast<std::size_t>(n), 8, 1.0, 0.5);
      std::copy(gv.begin(), gv.end(), rn.weight().data());
      Eigen::Tensor<T, 1> dw;
      check_l2_backward<T>(n, [&](const auto& x, const auto& dy, auto& dx, bool grads) {
        rn.backward(x, dy, &dx, grads ? &dw : nullptr);
      });
    }
  }
}

// Large backward inputs: dx with streaming stores (nctest::check_large_backward).
TYPED_TEST(RMSNormTest, LargeInputBackwardSameBitsAsSmallCalls) {
  using T = TypeParam;
  for (Index n : {Index(64), Index(1024)}) {
    RMSNorm<T> rn(RMSNormOptions({n}));
    const auto gv = randn<T>(static_cast<std::size_t>(n), 7, 1.0, 0.5);
    std::copy(gv.begin(), gv.end(), rn.weight().data());
    Eigen::Tensor<T, 1> dw;
    check_large_backward<T>(n, [&](const auto& x, const auto& dy, auto& dx, bool grads) {
      rn.backward(x, dy, &dx, grads ? &dw : nullptr);
    });
  }
}

// Short rows (up to four packets with 32 vector registers, two otherwise)
// take a backward kernel with gamma and the block's dweight sums in
// registers (LayerNorm's test of the same name): 70 rows (a full 64-row
// block and a partial one), the reference, and dx over dy, over x and over dh the out-of-place
// dx bit for bit, dweight unchanged. A row of values near FLT_MAX / DBL_MAX
// (eps 0: its rstd is below T's normal range) takes the exact path inside
// the kernel: the reference there.
TYPED_TEST(RMSNormTest, ShortRowBackwardInPlaceSameBits) {
  using T = TypeParam;
  constexpr Index L = normcore::detail::simd<T>::L;
  const Index rows = 70;
  unsigned seed = 60;
  for (Index n : {L - 1, L, L + 1, 2 * L - 1, 2 * L + 3, 3 * L, 4 * L - 1, 4 * L, 4 * L + 1,
                  Index(50), Index(100), Index(1000)}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    check_rms<T, Eigen::RowMajor>(rows, n, seed += 3, 1.0);
    RMSNorm<T> rn(RMSNormOptions({n}).eps(0.0));
    const auto gv = randn<T>(static_cast<std::size_t>(n), seed, 1.0, 0.5);
    std::copy(gv.begin(), gv.end(), rn.weight().data());
    auto xs = randn<T>(static_cast<std::size_t>(rows * n), seed + 1, 0.3, 1.0);
    const Index big = 66;  // rstd ~ 0.6 / max: not a normal T
    for (Index j = 0; j < n; ++j)
      xs[static_cast<std::size_t>(big * n + j)] = static_cast<T>((j % 2 ? -0.5 : 0.9) * std::numeric_limits<T>::max());
    const auto dys = randn<T>(static_cast<std::size_t>(rows * n), seed + 2);
    const auto dhs = randn<T>(static_cast<std::size_t>(rows * n), seed + 3);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x(xs.data(), rows, n), dy(dys.data(), rows, n),
        dh(dhs.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::RowMajor> dx(rows, n), dxh(rows, n);
    Eigen::Tensor<T, 1> dw, dw2;
    rn.backward(x, dy, &dx, &dw);
    const auto gref = normcore::reference::rms_norm_backward(xs.data(), dys.data(), rows, n, rn.weight().data(), 0.0);
    for (Index j = 0; j < n; ++j) {  // the extreme row: |dx| ~ rstd |dy|, far below T's normal range
      const double want = gref.dx[static_cast<std::size_t>(big * n + j)];
      EXPECT_NEAR(double(dx(big, j)), want, 1e-5 * std::fabs(want) + 8 * double(std::numeric_limits<T>::denorm_min()))
          << "big row, j=" << j;
    }
    rn.backward_add(x, dy, &dh, &dxh, nullptr);
    const auto same = [&](const T* a, const T* b, const char* what) {
      for (Index i = 0; i < rows * n; ++i)
        ASSERT_EQ(std::memcmp(a + i, b + i, sizeof(T)), 0) << what << ", row " << i / n << " j=" << i % n;
    };
    auto buf = dys;  // dx over dy
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>> over_dy(buf.data(), rows, n);
    rn.backward(x, over_dy, &over_dy, &dw2);
    same(dx.data(), buf.data(), "dx over dy");
    ASSERT_TRUE(bit_equal(dw.data(), dw2.data(), static_cast<std::size_t>(n)));
    buf = xs;  // dx over x (statistics saved first)
    NormStats<T> st;
    Eigen::Tensor<T, 2, Eigen::RowMajor> y(rows, n);
    rn.forward(x, y, st);
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>> over_x(buf.data(), rows, n);
    rn.backward(over_x, dy, &over_x, nullptr, &st);
    same(dx.data(), buf.data(), "dx over x");
    buf = dhs;  // backward_add's dx over dh
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>> over_dh(buf.data(), rows, n);
    rn.backward_add(x, dy, &over_dh, &over_dh, nullptr);
    same(dxh.data(), buf.data(), "dx over dh");
  }
}

// ColMajor rows (the lane kernels): dx over dy, over x with saved
// statistics, and backward_add's dx over dh_next (added in a second pass,
// from a copy of dh_next where dx lies over it) give the out-of-place dx bit
// for bit, the parameter gradients unchanged.
TYPED_TEST(RMSNormTest, ColMajorBackwardInPlaceSameBits) {
  using T = TypeParam;
  for (const auto& [rows, n] : {std::pair<Index, Index>{37, 7}, {37, 50}, {37, 1000}, {512, 300}, {2500, 64}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << n);
    RMSNorm<T> ln(RMSNormOptions({n}));
    const auto gv = randn<T>(static_cast<std::size_t>(n), 3, 1.0, 0.5);
    std::copy(gv.begin(), gv.end(), ln.weight().data());
    const auto xs = randn<T>(static_cast<std::size_t>(rows * n), 21, 1.5, 2.0);
    const auto dys = randn<T>(static_cast<std::size_t>(rows * n), 22);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::ColMajor>> x(xs.data(), rows, n), dy(dys.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::ColMajor> dx(rows, n), y(rows, n);
    Eigen::Tensor<T, 1> dw, dw2;
    ln.backward(x, dy, &dx, &dw);
    auto buf = dys;
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::ColMajor>> over_dy(buf.data(), rows, n);
    ln.backward(x, over_dy, &over_dy, &dw2);
    EXPECT_TRUE(bit_equal(dx.data(), buf.data(), static_cast<std::size_t>(rows * n))) << "dx over dy";
    EXPECT_TRUE(bit_equal(dw.data(), dw2.data(), static_cast<std::size_t>(n)));
    NormStats<T> st;
    ln.forward(x, y, st);
    buf = xs;
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::ColMajor>> over_x(buf.data(), rows, n);
    ln.backward(over_x, dy, &over_x, nullptr, &st);
    EXPECT_TRUE(bit_equal(dx.data(), buf.data(), static_cast<std::size_t>(rows * n))) << "dx over x";
    const auto dhs = randn<T>(static_cast<std::size_t>(rows * n), 23);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::ColMajor>> dh(dhs.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::ColMajor> dxh(rows, n);
    ln.backward_add(x, dy, &dh, &dxh, nullptr);
    buf = dhs;
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::ColMajor>> over_dh(buf.data(), rows, n);
    ln.backward_add(x, dy, &over_dh, &over_dh, nullptr);
    EXPECT_TRUE(bit_equal(dxh.data(), buf.data(), static_cast<std::size_t>(rows * n))) << "dx over dh";
  }
}

// The picked rows of a ColMajor batch of `rows` rows (xl and dyl, row by
// row): y and dx (with saved statistics, and recomputed) the same bits as
// each row normalized alone. With `streams`, the batch's y must take the
// streaming stores.
template <typename T>
void colmajor_rows_match_alone(const RMSNorm<T>& rn, const std::vector<T>& xl, const std::vector<T>& dyl, Index rows,
                               const std::vector<Index>& picks, bool streams = false) {
  const Index n = rn.normalized_size();
  const auto xc = to_colmajor(xl, rows, n), dyc = to_colmajor(dyl, rows, n);
  Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::ColMajor>> x(xc.data(), rows, n), dy(dyc.data(), rows, n);
  Eigen::Tensor<T, 2, Eigen::ColMajor> y(rows, n), dx(rows, n);
  NormStats<T> st;
  rn.forward(x, y, st);
  if (streams) {
    ASSERT_TRUE(normcore::detail::can_stream_colmajor(xc.data(), y.data(), rows, n));
  }
  rn.backward(x, dy, &dx, nullptr, &st);
  const auto g = rn.backward(x, dy);  // statistics recomputed
  for (const Index i : picks) {
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::ColMajor>> x1(xl.data() + i * n, 1, n),
        dy1(dyl.data() + i * n, 1, n);
    const Eigen::Tensor<T, 2, Eigen::ColMajor> y1 = rn(x1);
    const auto g1 = rn.backward(x1, dy1);
    for (Index j = 0; j < n; ++j) {
      ASSERT_EQ(std::memcmp(&y(i, j), &y1(0, j), sizeof(T)), 0) << "y, row " << i << " j=" << j;
      ASSERT_EQ(std::memcmp(&dx(i, j), &g1.dx(0, j), sizeof(T)), 0) << "dx (saved), row " << i << " j=" << j;
      ASSERT_EQ(std::memcmp(&g.dx(i, j), &g1.dx(0, j), sizeof(T)), 0) << "dx, row " << i << " j=" << j;
    }
  }
}

// The same for random rows (x from seed, dy from seed + 1).
template <typename T>
void colmajor_rows_match_alone(const RMSNorm<T>& rn, Index rows, unsigned seed, const std::vector<Index>& picks,
                               bool streams = false) {
  const Index n = rn.normalized_size();
  colmajor_rows_match_alone(rn, randn<T>(static_cast<std::size_t>(rows * n), seed, 0.5, 2.0),
                            randn<T>(static_cast<std::size_t>(rows * n), seed + 1), rows, picks, streams);
}

// ColMajor kernels take up to four packets of rows side by side (see the
// LayerNorm test of the same name): against the reference with many rows,
// and every row's y and dx the same bits as the row alone.
TYPED_TEST(RMSNormTest, ColMajorPacketBlocksBitForBit) {
  using T = TypeParam;
  check_rms<T, Eigen::ColMajor>(1130, 17, 31, 1.0);
  check_rms<T, Eigen::ColMajor>(700, 40, 37, 1.0);
  const Index n = 17;
  RMSNorm<T> rn(RMSNormOptions({n}));
  const auto gv = randn<T>(static_cast<std::size_t>(n), 5, 1.0, 0.5);
  std::copy(gv.begin(), gv.end(), rn.weight().data());
  for (const Index rows : {Index(700), Index(1130)}) {
    SCOPED_TRACE(::testing::Message() << rows << " rows");
    colmajor_rows_match_alone(rn, rows, 14, every_row(rows, 1));
  }
}

// Where the row count times the value's size is a multiple of 2 KB
// (detail::colmajor_column_walk) the forward scales a feature at a time
// through runs of rows (see the LayerNorm test of the same name), and the
// rstd of a packet of rows comes from packets of divisions and square
// roots: every row's y and dx (statistics saved and recomputed) the bits
// of the row alone, and the reference.
TYPED_TEST(RMSNormTest, ColMajorColumnWalkBitForBit) {
  using T = TypeParam;
  ASSERT_TRUE(normcore::detail::colmajor_column_walk<T>(512, false));
  ASSERT_FALSE(normcore::detail::colmajor_column_walk<T>(528, false));
  const Index n = 50;
  RMSNorm<T> rn(RMSNormOptions({n}));
  const auto gv = randn<T>(static_cast<std::size_t>(n), 8, 1.0, 0.5);
  std::copy(gv.begin(), gv.end(), rn.weight().data());
  for (const Index rows : {Index(512), Index(2048)}) {
    SCOPED_TRACE(::testing::Message() << rows << " rows");
    colmajor_rows_match_alone(rn, rows, 19, every_row(rows, 1));
    check_rms<T, Eigen::ColMajor>(rows, n, 47, 1.0);
  }
}

// ColMajor inputs of detail::kStreamingBytes or more write y with
// streaming stores with AVX-512 (asserted; the threshold set to that gate
// so that they do on any CPU); the lane sums of squares go a tile of features at a
// time in blocks of up to detail::kRegisterLanePackets packets of rows.
// Rows of such an input and long rows (600 features: three chunks of
// detail::kChunk) must give the bits of the row alone (forward, and a
// backward without saved statistics, which sums them again); the long rows
// also the reference.
TYPED_TEST(RMSNormTest, ColMajorLargeInputsAndLongRowsBitForBit) {
  using T = TypeParam;
  const nctest::StreamThreshold streaming(normcore::detail::kStreamingBytes);
  for (const auto& [shape, streams] : colmajor_large_shapes<T>()) {
    const auto [rows, n] = shape;
    SCOPED_TRACE(::testing::Message() << rows << "x" << n);
    RMSNorm<T> rn(RMSNormOptions({n}));
    const auto gv = randn<T>(static_cast<std::size_t>(n), 7, 1.0, 0.5);
    std::copy(gv.begin(), gv.end(), rn.weight().data());
    colmajor_rows_match_alone(rn, rows, 22, every_row(rows, 37), streams);
  }
  check_rms<T, Eigen::ColMajor>(1130, 600, 41, 1.0);
}

// A ColMajor row whose rstd is below T's normal range (values near T's
// maximum, eps 0) is redone exactly after the packet passes, in whichever
// row group and segment holds it: row 66 of 70 sits in a later group (and
// in the padded leftover rows where a packet holds 16 floats); row 2100 of
// 2500 in a later segment of a part (RMSNorm::backward_colmajor). Its y and
// dx, with and without saved statistics, must be the bits of the row alone,
// and its neighbour's too; the others' dweight terms the reference's.
TYPED_TEST(RMSNormTest, ColMajorSubnormalRstdInLaterGroupBitForBit) {
  using T = TypeParam;
  for (const auto& [rows, n, pick] : {std::tuple<Index, Index, Index>{70, 40, 66}, {2500, 64, 2100}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << n << ", row " << pick);
    RMSNorm<T> rn(RMSNormOptions({n}).eps(0));
    auto xl = randn<T>(static_cast<std::size_t>(rows * n), 24, 0.5, 2.0);
    const auto dyl = randn<T>(static_cast<std::size_t>(rows * n), 25);
    const double big = 0.55 * static_cast<double>(std::numeric_limits<T>::max());
    for (Index j = 0; j < n; ++j)
      xl[static_cast<std::size_t>(pick * n + j)] = static_cast<T>(big * (1.0 + 0.01 * double(j)));
    NormStats<T> st;
    const auto xc = to_colmajor(xl, rows, n);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::ColMajor>> x(xc.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::ColMajor> y(rows, n);
    rn.forward(x, y, st);
    ASSERT_FALSE(normcore::detail::normal_in<T>(static_cast<double>(st.rstd(pick))));
    colmajor_rows_match_alone(rn, xl, dyl, rows, {pick - 1, pick, pick + 1});
    // In place: dx over dy (with dweight) and over x (saved statistics) give
    // the out-of-place bits; the row is redone from copies of its x and dy.
    const auto dyc = to_colmajor(dyl, rows, n);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::ColMajor>> dy(dyc.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::ColMajor> dx(rows, n);
    Eigen::Tensor<T, 1> dw, dw2;
    rn.backward(x, dy, &dx, &dw);
    auto buf = dyc;
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::ColMajor>> over_dy(buf.data(), rows, n);
    rn.backward(x, over_dy, &over_dy, &dw2);
    EXPECT_TRUE(bit_equal(dx.data(), buf.data(), static_cast<std::size_t>(rows * n))) << "dx over dy";
    EXPECT_TRUE(bit_equal(dw.data(), dw2.data(), static_cast<std::size_t>(n))) << "dweight, dx over dy";
    rn.backward(x, dy, &dx, nullptr, &st);
    buf = xc;
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::ColMajor>> over_x(buf.data(), rows, n);
    rn.backward(over_x, dy, &over_x, nullptr, &st);
    EXPECT_TRUE(bit_equal(dx.data(), buf.data(), static_cast<std::size_t>(rows * n))) << "dx over x";
  }
}

// The ColMajor backward takes each part's rows in one of four ways
// (detail::colmajor_backward_chunk): rows of at most 1 KB in chunks of 1 KB of
// each feature's values, segments of several chunks (2500x64, with
// leftover rows), or of 4 KB where the row count times the value's size is
// a multiple of 4 KB (3072x50: three chunks of float, six of double);
// longer rows in chunks of detail::kLanePackets packets
// (700x300); or the whole part at once, where the row count times the
// value's size is a multiple of 1 KB (512x300) or a chunk would take more
// than 512 KB (100x1100, with leftover rows: so with AVX-512's packets;
// with narrower packets a chunk is smaller and it takes chunks). Each
// way: every 7th row's y and dx the bits of the row alone, and y, dx and
// dweight the reference's. The forward takes the first three in segments
// of rows (detail::colmajor_forward_segment, asserted), 512x300 whole.
TYPED_TEST(RMSNormTest, ColMajorBackwardWaysBitForBit) {
  using T = TypeParam;
  for (const auto& [rows, n] : {std::pair<Index, Index>{2500, 64}, {3072, 50}, {700, 300}}) {
    const Index seg = normcore::detail::colmajor_forward_segment<T>(rows, n);
    ASSERT_TRUE(seg > 0 && seg < rows) << rows << "x" << n << ": " << seg;
  }
  ASSERT_EQ(normcore::detail::colmajor_forward_segment<T>(512, 300), 0);
  ASSERT_EQ(normcore::detail::colmajor_backward_chunk<T>(3072, 50, true), Index(4096 / sizeof(T)));
  ASSERT_EQ(normcore::detail::colmajor_backward_chunk<T>(2500, 64, true), Index(1024 / sizeof(T)));
  for (const auto& [rows, n] :
       {std::pair<Index, Index>{2500, 64}, {3072, 50}, {700, 300}, {512, 300}, {100, 1100}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << n);
    RMSNorm<T> rn(RMSNormOptions({n}));
    const auto gv = randn<T>(static_cast<std::size_t>(n), 9, 1.0, 0.5);
    std::copy(gv.begin(), gv.end(), rn.weight().data());
    colmajor_rows_match_alone(rn, rows, 26, every_row(rows, 7));
    check_rms<T, Eigen::ColMajor>(rows, n, 43, 1.0);
  }
}

TYPED_TEST(RMSNormTest, BatchIndependenceBitForBit) {
  using T = TypeParam;
  // n = 100: short rows, grouped by packet lanes, and in the forward up to
  // 40 rows at a time (two such groups here, the pick in the second one's
  // partial lane group); n = 768: long rows, grouped by rows_per_group.
  // Either way a row's result is its own.
  for (const Index n : {Index(100), Index(768)}) {
    const Index rows = 70, pick = 66;
    RMSNorm<T> rn(RMSNormOptions({n}));
    const auto xl = randn<T>(static_cast<std::size_t>(rows * n), 12);
    const auto xc = to_colmajor(xl, rows, n);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::ColMajor>> x(xc.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::ColMajor> y = rn(x);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::ColMajor>> x1(xl.data() + pick * n, 1, n);
    Eigen::Tensor<T, 2, Eigen::ColMajor> y1 = rn(x1);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> xr(xl.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::RowMajor> yr = rn(xr);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> xr1(xl.data() + pick * n, 1, n);
    Eigen::Tensor<T, 2, Eigen::RowMajor> yr1 = rn(xr1);
    // The backward's dx too.
    const auto dyl = randn<T>(static_cast<std::size_t>(rows * n), 13);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> dyr(dyl.data(), rows, n);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> dyr1(dyl.data() + pick * n, 1, n);
    const auto gb = rn.backward(xr, dyr);
    const auto g1 = rn.backward(xr1, dyr1);
    for (Index j = 0; j < n; ++j) {
      ASSERT_EQ(std::memcmp(&y(pick, j), &y1(0, j), sizeof(T)), 0);
      ASSERT_EQ(std::memcmp(&yr(pick, j), &yr1(0, j), sizeof(T)), 0);
      ASSERT_EQ(std::memcmp(&gb.dx(pick, j), &g1.dx(0, j), sizeof(T)), 0) << "dx, n=" << n << " j=" << j;
    }
  }
}

}  // namespace
