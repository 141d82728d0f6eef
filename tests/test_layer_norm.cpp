// LayerNorm against the reference path, finite differences and closed forms.
#include "test_util.hpp"

namespace {

using namespace nctest;
using normcore::LayerNorm;
using normcore::LayerNormOptions;
using normcore::NormStats;

template <typename T>
class LayerNormTest : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(LayerNormTest, Types, );

template <typename T, int Layout>
using Mat = Eigen::Tensor<T, 2, Layout>;
template <typename T, int Layout>
using MapC = Eigen::TensorMap<const Eigen::Tensor<T, 2, Layout>>;
template <typename T, int Layout>
using Map = Eigen::TensorMap<Eigen::Tensor<T, 2, Layout>>;

template <typename T>
void randomize_params(LayerNorm<T>& ln, unsigned seed) {
  auto g = randn<T>(static_cast<std::size_t>(ln.normalized_size()), seed, 1.0, 0.5);
  auto b = randn<T>(static_cast<std::size_t>(ln.normalized_size()), seed + 1, 0.0, 0.5);
  std::copy(g.begin(), g.end(), ln.weight().data());
  std::copy(b.begin(), b.end(), ln.bias().data());
}

// Forward, saved statistics and every gradient against the reference, for
// one layout. Data are given in logical (row-major) order.
template <typename T, int Layout>
void check_against_reference(Index rows, Index n, unsigned seed, double offset) {
  SCOPED_TRACE(::testing::Message() << "rows=" << rows << " n=" << n
                                    << (Layout == Eigen::RowMajor ? " RowMajor" : " ColMajor"));
  LayerNorm<T> ln(LayerNormOptions({n}));
  randomize_params(ln, seed);
  const auto xl = randn<T>(static_cast<std::size_t>(rows * n), seed + 2, offset, 2.0);
  const auto dyl = randn<T>(static_cast<std::size_t>(rows * n), seed + 3);
  const bool rm = Layout == Eigen::RowMajor;
  const auto xs = rm ? xl : to_colmajor(xl, rows, n);
  const auto dys = rm ? dyl : to_colmajor(dyl, rows, n);
  MapC<T, Layout> x(xs.data(), rows, n);
  MapC<T, Layout> dy(dys.data(), rows, n);

  Mat<T, Layout> y(rows, n);
  NormStats<T> stats;
  ln.forward(x, y, stats);
  normcore::reference::RowStats rs;
  const auto yref = normcore::reference::layer_norm_forward(
      xl.data(), rows, n, ln.weight().data(), ln.bias().data(), 1e-5, &rs);
  const auto yl = rm ? std::vector<T>(y.data(), y.data() + y.size()) : from_colmajor(y.data(), rows, n);
  // The reference itself rounds x - mean at ulp(offset): |offset| * rstd is
  // part of the magnitude.
  double rmax = 0;
  for (double r : rs.rstd) rmax = std::max(rmax, r);
  const double quant = std::fabs(offset) * rmax;
  EXPECT_LE(max_diff(yl.data(), yref), tol_elem<T>(max_abs(yref) + 1.0 + 2 * quant, double(n)));
  for (Index r = 0; r < rows; ++r) {
    const double rstd = rs.rstd[static_cast<std::size_t>(r)];
    EXPECT_NEAR(stats.mean(r), rs.mean[static_cast<std::size_t>(r)],
                tol_elem<T>(std::fabs(offset) + 1.0 / rstd, double(n)));
    EXPECT_NEAR(stats.rstd(r), rstd, tol_elem<T>(rstd, double(n)));
  }

  const auto gref = normcore::reference::layer_norm_backward(xl.data(), dyl.data(), rows, n,
                                                             ln.weight().data(), 1e-5);
  Mat<T, Layout> dx(rows, n);
  Eigen::Tensor<T, 1> dw, db;
  ln.backward(x, dy, &dx, &dw, &db, &stats);
  const auto dxl = rm ? std::vector<T>(dx.data(), dx.data() + dx.size()) : from_colmajor(dx.data(), rows, n);
  double gmax = 0;
  for (Index i = 0; i < rows * n; ++i)
    gmax = std::max(gmax, std::fabs(double(dyl[static_cast<std::size_t>(i)]) * double(ln.weight()(i % n))));
  EXPECT_LE(max_diff(dxl.data(), gref.dx), tol_elem<T>(rmax * (gmax + 1.0) * (1 + quant), double(n)));
  // dweight/dbias sum over rows: |dy * x_hat| per term, `rows` terms.
  const double xhat_max = 4.0;  // |x_hat| <= sqrt(n) in general; normal data stay below 4-5
  EXPECT_LE(max_diff(dw.data(), gref.dweight),
            tol<T>(max_abs(gref.dweight) + (xhat_max + quant) * 4, double(rows) + 8));
  EXPECT_LE(max_diff(db.data(), gref.dbias), tol<T>(max_abs(gref.dbias) + 4, double(rows) + 8));

  // Backward without saved statistics recomputes exactly what forward saved.
  Mat<T, Layout> dx2(rows, n);
  ln.backward(x, dy, &dx2, nullptr, nullptr);
  EXPECT_TRUE(bit_equal(dx.data(), dx2.data(), static_cast<std::size_t>(dx.size())));
}

TYPED_TEST(LayerNormTest, MatchesReferenceOnAwkwardLengthsBothLayouts) {
  using T = TypeParam;
  unsigned seed = 1;
  for (Index n : awkward_lengths()) {
    for (Index rows : {Index(1), Index(3), Index(20)}) {
      check_against_reference<T, Eigen::RowMajor>(rows, n, seed, 0.5);
      check_against_reference<T, Eigen::ColMajor>(rows, n, seed, 0.5);
      seed += 7;
    }
  }
}

TYPED_TEST(LayerNormTest, MatchesReferenceWithLargeOffset) {
  using T = TypeParam;
  for (Index n : {Index(64), Index(768), Index(1000)}) {
    check_against_reference<T, Eigen::RowMajor>(6, n, 11, 1e4);
    check_against_reference<T, Eigen::ColMajor>(19, n, 12, 1e4);
  }
}

// Finite differences in double: the backward is the derivative of the forward.
TEST(LayerNormGradient, MatchesCentralDifferences) {
  for (Index n : {Index(1), Index(2), Index(5), Index(17), Index(40)}) {
    for (bool affine : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " affine=" << affine);
      const Index rows = 3;
      LayerNorm<double> ln(LayerNormOptions({n}).elementwise_affine(affine).eps(1e-3));
      if (affine) randomize_params(ln, 5);
      auto x = randn<double>(static_cast<std::size_t>(rows * n), 6, 0.3, 1.5);
      const auto w = randn<double>(static_cast<std::size_t>(rows * n), 7);  // loss = sum(w * y)
      Eigen::TensorMap<Eigen::Tensor<double, 2, Eigen::RowMajor>> xm(x.data(), rows, n);
      Eigen::TensorMap<const Eigen::Tensor<double, 2, Eigen::RowMajor>> wm(w.data(), rows, n);
      auto loss = [&]() {
        Eigen::Tensor<double, 2, Eigen::RowMajor> y = ln(xm);
        double s = 0;
        for (Index i = 0; i < rows * n; ++i) s += y.data()[i] * w[static_cast<std::size_t>(i)];
        return s;
      };
      const auto g = ln.backward(xm, wm);
      const double h = 1e-6;
      for (Index i = 0; i < rows * n; ++i) {
        const double keep = x[static_cast<std::size_t>(i)];
        x[static_cast<std::size_t>(i)] = keep + h;
        const double lp = loss();
        x[static_cast<std::size_t>(i)] = keep - h;
        const double lm = loss();
        x[static_cast<std::size_t>(i)] = keep;
        // Central difference: truncation O(h^2 f'''), rounding O(eps |f| / h).
        EXPECT_NEAR(g.dx.data()[i], (lp - lm) / (2 * h), 1e-6 * (1 + std::fabs(g.dx.data()[i])));
      }
      if (!affine) continue;
      for (Index j = 0; j < n; ++j) {
        for (int which = 0; which < 2; ++which) {
          double& p = which == 0 ? ln.weight()(j) : ln.bias()(j);
          const double keep = p;
          p = keep + h;
          const double lp = loss();
          p = keep - h;
          const double lm = loss();
          p = keep;
          const double got = which == 0 ? g.dweight(j) : g.dbias(j);
          EXPECT_NEAR(got, (lp - lm) / (2 * h), 1e-6 * (1 + std::fabs(got)));
        }
      }
    }
  }
}

TYPED_TEST(LayerNormTest, WorkedExample) {
  using T = TypeParam;
  Eigen::Tensor<T, 2, Eigen::RowMajor> x(1, 4);
  x.setValues({{2, 4, 4, 6}});
  LayerNorm<T> ln(LayerNormOptions({4}).eps(0.0));
  NormStats<T> s;
  Eigen::Tensor<T, 2, Eigen::RowMajor> y(1, 4);
  ln.forward(x, y, s);
  EXPECT_EQ(s.mean(0), T(4));
  EXPECT_NEAR(1.0 / (double(s.rstd(0)) * double(s.rstd(0))), 2.0, 4 * eps<T>());
  const double k = 1.0 / std::sqrt(2.0);  // (x - 4) / sqrt(2)
  EXPECT_NEAR(y(0, 0), -2 * k, 4 * eps<T>());
  EXPECT_EQ(y(0, 1), T(0));
  EXPECT_EQ(y(0, 2), T(0));
  EXPECT_NEAR(y(0, 3), 2 * k, 4 * eps<T>());
}

TYPED_TEST(LayerNormTest, ConstantRowGivesExactlyBeta) {
  using T = TypeParam;
  for (Index n : {Index(1), Index(7), Index(768), Index(1000)}) {
    for (T value : {T(1234.5), T(-3e6), T(0), T(1e-3)}) {
      LayerNorm<T> ln(LayerNormOptions({n}));
      ln.bias().setConstant(T(0.25));
      ln.weight().setConstant(T(3));
      Eigen::Tensor<T, 2, Eigen::RowMajor> x(2, n);
      x.setConstant(value);
      Eigen::Tensor<T, 2, Eigen::RowMajor> y = ln(x);
      Eigen::Tensor<T, 2, Eigen::ColMajor> xc(2, n);
      xc.setConstant(value);
      Eigen::Tensor<T, 2, Eigen::ColMajor> yc = ln(xc);
      for (Index i = 0; i < y.size(); ++i) {
        ASSERT_EQ(y.data()[i], T(0.25)) << "n=" << n << " value=" << value;
        ASSERT_EQ(yc.data()[i], T(0.25)) << "n=" << n << " value=" << value;
      }
    }
  }
}

// A row's output depends only on the row: alone, inside a batch, at an
// unaligned address: bit for bit.
template <typename T, int Layout>
void check_batch_independence(Index n) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << (Layout == Eigen::RowMajor ? " RowMajor" : " ColMajor"));
  const Index rows = 37, pick = 21;
  LayerNorm<T> ln(LayerNormOptions({n}));
  randomize_params(ln, 3);
  const auto xl = randn<T>(static_cast<std::size_t>(rows * n), 9, 3.0, 2.0);
  const auto dyl = randn<T>(static_cast<std::size_t>(rows * n), 10);
  const bool rm = Layout == Eigen::RowMajor;
  // y and dx of `count` rows (x and dy given RowMajor) as one batch.
  const auto batch = [&](const std::vector<T>& xr, const std::vector<T>& dyr, Index count) {
    const auto xs = rm ? xr : to_colmajor(xr, count, n);
    const auto dys = rm ? dyr : to_colmajor(dyr, count, n);
    MapC<T, Layout> x(xs.data(), count, n), dy(dys.data(), count, n);
    std::pair<Mat<T, Layout>, Mat<T, Layout>> out{ln(x), Mat<T, Layout>(count, n)};
    ln.backward(x, dy, &out.second, nullptr, nullptr);
    return out;
  };
  const auto [y, dx] = batch(xl, dyl, rows);
  // The picked row alone, stored one element past an aligned address.
  std::vector<T> one(static_cast<std::size_t>(n + 1)), gone(static_cast<std::size_t>(n + 1));
  std::copy(xl.begin() + pick * n, xl.begin() + (pick + 1) * n, one.begin() + 1);
  std::copy(dyl.begin() + pick * n, dyl.begin() + (pick + 1) * n, gone.begin() + 1);
  MapC<T, Layout> x1(one.data() + 1, 1, n), dy1(gone.data() + 1, 1, n);
  Mat<T, Layout> y1 = ln(x1);
  Mat<T, Layout> dx1(1, n);
  ln.backward(x1, dy1, &dx1, nullptr, nullptr);
  for (Index j = 0; j < n; ++j) {
    ASSERT_EQ(std::memcmp(&y1(0, j), &y(pick, j), sizeof(T)), 0) << "y, j=" << j;
    ASSERT_EQ(std::memcmp(&dx1(0, j), &dx(pick, j), sizeof(T)), 0) << "dx, j=" << j;
  }
  // Batches of 2 and 3 rows starting at the picked one (the short-row
  // kernels run only the chains a partial group needs).
  for (const Index count : {Index(2), Index(3)}) {
    SCOPED_TRACE(::testing::Message() << count << " rows");
    const auto first = static_cast<std::ptrdiff_t>(pick * n), last = static_cast<std::ptrdiff_t>((pick + count) * n);
    const auto [yc, dxc] = batch(std::vector<T>(xl.begin() + first, xl.begin() + last),
                                 std::vector<T>(dyl.begin() + first, dyl.begin() + last), count);
    for (Index i = 0; i < count; ++i) {
      for (Index j = 0; j < n; ++j) {
        ASSERT_EQ(std::memcmp(&yc(i, j), &y(pick + i, j), sizeof(T)), 0) << "y, i=" << i << " j=" << j;
        ASSERT_EQ(std::memcmp(&dxc(i, j), &dx(pick + i, j), sizeof(T)), 0) << "dx, i=" << i << " j=" << j;
      }
    }
  }
}

TYPED_TEST(LayerNormTest, BatchSizeIndependenceBitForBit) {
  // Around the shortest long row too: one row alone takes its own path
  // from there on (LayerNorm::forward_rows), rows of a batch their groups'.
  // With both sets of path choices (LayerNorm::intel_streaming).
  constexpr Index kLong = normcore::detail::kShortMomentsValues<TypeParam>;
  for (int tuning : {0, 1}) {
    const nctest::IntelTuning paths(tuning);
    SCOPED_TRACE(::testing::Message() << "Intel tuning " << tuning);
    for (Index n : {Index(1), Index(17), Index(64), kLong - 1, kLong, Index(768), Index(1000)}) {
      check_batch_independence<TypeParam, Eigen::RowMajor>(n);
      check_batch_independence<TypeParam, Eigen::ColMajor>(n);
    }
  }
}

// The picked rows of a ColMajor batch of `rows` random rows (x from seed,
// dy from seed + 1): y and dx (with saved statistics, and recomputed) the
// same bits as each row normalized alone.
template <typename T>
void colmajor_rows_match_alone(const LayerNorm<T>& ln, Index rows, unsigned seed, const std::vector<Index>& picks,
                               bool streams = false) {
  const Index n = ln.normalized_size();
  const auto xl = randn<T>(static_cast<std::size_t>(rows * n), seed, 3.0, 2.0);
  const auto dyl = randn<T>(static_cast<std::size_t>(rows * n), seed + 1);
  const auto xc = to_colmajor(xl, rows, n), dyc = to_colmajor(dyl, rows, n);
  MapC<T, Eigen::ColMajor> x(xc.data(), rows, n), dy(dyc.data(), rows, n);
  Mat<T, Eigen::ColMajor> y(rows, n), dx(rows, n), dxs(rows, n);
  NormStats<T> st;
  ln.forward(x, y, st);
  if (streams) {
    ASSERT_TRUE(normcore::detail::can_stream_colmajor(xc.data(), y.data(), rows, n));
  }
  ln.backward(x, dy, &dxs, nullptr, nullptr, &st);
  ln.backward(x, dy, &dx, nullptr, nullptr);
  for (const Index i : picks) {
    MapC<T, Eigen::ColMajor> x1(xl.data() + i * n, 1, n), dy1(dyl.data() + i * n, 1, n);
    const Mat<T, Eigen::ColMajor> y1 = ln(x1);
    Mat<T, Eigen::ColMajor> dx1(1, n);
    ln.backward(x1, dy1, &dx1, nullptr, nullptr);
    for (Index j = 0; j < n; ++j) {
      ASSERT_EQ(std::memcmp(&y1(0, j), &y(i, j), sizeof(T)), 0) << "y, row " << i << " j=" << j;
      ASSERT_EQ(std::memcmp(&dx1(0, j), &dxs(i, j), sizeof(T)), 0) << "dx (saved), row " << i << " j=" << j;
      ASSERT_EQ(std::memcmp(&dx1(0, j), &dx(i, j), sizeof(T)), 0) << "dx, row " << i << " j=" << j;
    }
  }
}

// ColMajor kernels take up to four packets of rows side by side (forward:
// whole blocks of 4, then 2, then 1 packets, then padded leftovers;
// backward: the same within each chunk of rows): a
// row's y and dx must not depend on which block, or which packet of it, it
// lands in. Every row of 700- and 1130-row batches against the row alone
// (with 16-, 8- and 4-value packets these batches reach every block size
// in both passes), and the reference on them (dweight and dbias too, within
// tolerance: their bits are covered by the thread tests).
TYPED_TEST(LayerNormTest, ColMajorPacketBlocksBitForBit) {
  using T = TypeParam;
  const Index n = 17;
  LayerNorm<T> ln(LayerNormOptions({n}));
  randomize_params(ln, 5);
  for (const Index rows : {Index(700), Index(1130)}) {
    SCOPED_TRACE(::testing::Message() << rows << " rows");
    colmajor_rows_match_alone(ln, rows, 16, every_row(rows, 1));
  }
  check_against_reference<T, Eigen::ColMajor>(1130, 17, 41, 0.5);
  check_against_reference<T, Eigen::ColMajor>(700, 40, 43, 0.5);
}

// Where the row count times the value's size is a multiple of 2 KB
// (detail::colmajor_column_walk) the forward normalizes a feature at a time
// through runs of rows (one run of 512 rows; two of 2048 rows of float,
// four of double) instead of blocks of packets down all the features:
// every row's y, and dx of the backward that recomputes the statistics,
// the bits of the row alone (blocks), and the reference.
TYPED_TEST(LayerNormTest, ColMajorColumnWalkBitForBit) {
  using T = TypeParam;
  ASSERT_TRUE(normcore::detail::colmajor_column_walk<T>(512, false));
  ASSERT_FALSE(normcore::detail::colmajor_column_walk<T>(528, false));
  const Index n = 50;
  LayerNorm<T> ln(LayerNormOptions({n}));
  randomize_params(ln, 7);
  for (const Index rows : {Index(512), Index(2048)}) {
    SCOPED_TRACE(::testing::Message() << rows << " rows");
    colmajor_rows_match_alone(ln, rows, 18, every_row(rows, 1));
    check_against_reference<T, Eigen::ColMajor>(rows, n, 45, 0.5);
  }
}

// ColMajor inputs of detail::kStreamingBytes or more write y with
// streaming stores with AVX-512 (detail::can_stream_colmajor, asserted; the
// threshold set to that gate so that they do on any CPU), and a backward without
// saved statistics takes them for all of a part's rows at once, as the
// forward does. Rows of such an input, and long rows (600 features: three
// chunks of detail::kChunk in the lane statistics), must give the bits of
// the row alone; the long rows also the reference (check_against_reference:
// its backward without saved statistics must match the one with them bit
// for bit).
TYPED_TEST(LayerNormTest, ColMajorLargeInputsAndLongRowsBitForBit) {
  using T = TypeParam;
  const nctest::StreamThreshold streaming(normcore::detail::kStreamingBytes);
  for (const auto& [shape, streams] : colmajor_large_shapes<T>()) {
    const auto [rows, n] = shape;
    SCOPED_TRACE(::testing::Message() << rows << "x" << n);
    LayerNorm<T> ln(LayerNormOptions({n}));
    randomize_params(ln, 9);
    colmajor_rows_match_alone(ln, rows, 20, every_row(rows, 37), streams);
  }
  check_against_reference<T, Eigen::ColMajor>(1130, 600, 51, 0.5);
}

// The ColMajor backward takes a part's rows in chunks of
// detail::kLanePackets packets that cross row groups, in segments of
// several chunks (detail::colmajor_backward_chunk; RMSNormTest's test of
// the same name, whose layer also tiles, has the same shapes): short rows
// (2500x64, with leftover rows), longer ones (700x300), a power-of-two
// row count (512x300) and rows of 1100 (100 rows, leftover rows). Every
// 7th row's y and dx the bits of the row alone, and the reference (dweight
// and dbias within tolerance). The forward takes the first two in segments
// of rows (detail::colmajor_forward_segment, asserted), the last two whole.
TYPED_TEST(LayerNormTest, ColMajorBackwardWaysBitForBit) {
  using T = TypeParam;
  const Index seg = normcore::detail::colmajor_forward_segment<T>(2500, 64);
  ASSERT_TRUE(seg > 0 && seg < 2500) << seg;
  ASSERT_EQ(normcore::detail::colmajor_forward_segment<T>(512, 300), 0);
  for (const auto& [rows, n] : {std::pair<Index, Index>{2500, 64}, {700, 300}, {512, 300}, {100, 1100}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << n);
    LayerNorm<T> ln(LayerNormOptions({n}));
    randomize_params(ln, 11);
    colmajor_rows_match_alone(ln, rows, 28, every_row(rows, 7));
    check_against_reference<T, Eigen::ColMajor>(rows, n, 53, 0.5);
  }
}

// Fewer rows than one block of the parameter sums (64) write dweight and
// dbias straight from their T sums; more rows go through the double group
// sums. Rows of dy = 0 added after the real ones change no sum (x + 0 = x,
// and a zero sum ends as +0 either way), so the same rows padded to 130
// must give the same dweight, dbias and dx bits. Short and long rows, and
// the fused residual backward.
TYPED_TEST(LayerNormTest, OneBlockBackwardSameBitsAsPaddedBatch) {
  using T = TypeParam;
  const Index padded = 130;
  for (Index n : {Index(50), Index(768)}) {
    LayerNorm<T> ln(LayerNormOptions({n}));
    randomize_params(ln, 3);
    const auto xs = randn<T>(static_cast<std::size_t>(padded * n), 21, 0.5, 2.0);
    auto gs = randn<T>(static_cast<std::size_t>(padded * n), 22);
    for (Index rows : {Index(1), Index(7), Index(63)}) {
      SCOPED_TRACE(::testing::Message() << rows << "x" << n);
      std::vector<T> g(gs);
      std::fill(g.begin() + rows * n, g.end(), T(0));
      MapC<T, Eigen::RowMajor> xa(xs.data(), rows, n), ga(g.data(), rows, n), xp(xs.data(), padded, n),
          gp(g.data(), padded, n);
      NormStats<T> sa, sp;
      Mat<T, Eigen::RowMajor> ya(rows, n), yp(padded, n), dxa(rows, n), dxp(padded, n);
      ln.forward(xa, ya, sa);
      ln.forward(xp, yp, sp);
      Eigen::Tensor<T, 1> dwa, dba, dwp, dbp;
      ln.backward(xa, ga, &dxa, &dwa, &dba, &sa);
      ln.backward(xp, gp, &dxp, &dwp, &dbp, &sp);
      const auto un = static_cast<std::size_t>(n);
      EXPECT_TRUE(bit_equal(dwa.data(), dwp.data(), un));
      EXPECT_TRUE(bit_equal(dba.data(), dbp.data(), un));
      EXPECT_TRUE(bit_equal(dxa.data(), dxp.data(), static_cast<std::size_t>(rows * n)));
      // The fused residual backward (dh_next added to dx) takes the same sums.
      Mat<T, Eigen::RowMajor> ha(rows, n), hp(padded, n);
      Eigen::Tensor<T, 1> hwa, hba, hwp, hbp;
      ln.backward_add(xa, ga, &ga, &ha, &hwa, &hba, &sa);
      ln.backward_add(xp, gp, &gp, &hp, &hwp, &hbp, &sp);
      EXPECT_TRUE(bit_equal(hwa.data(), dwa.data(), un));
      EXPECT_TRUE(bit_equal(hwp.data(), dwp.data(), un));
      EXPECT_TRUE(bit_equal(hba.data(), hbp.data(), un));
      EXPECT_TRUE(bit_equal(ha.data(), hp.data(), static_cast<std::size_t>(rows * n)));
    }
  }
}

// Full groups of short rows with weight and bias are normalized a packet
// column at a time where the build has 32 vector registers
// (detail::normalize_group: masked tail for AVX-512 floats, a scalar tail
// otherwise); other rows one at a time. Every row of two full groups and a
// partial one, out of place and in place, against the same row alone: the
// same y, mean and rstd, bit for bit, on lengths around the packet size.
template <typename T>
void check_group_normalize_same_bits_as_row_alone() {
  constexpr Index L = normcore::detail::simd<T>::L;
  const Index rows = 19;
  // Long rows too, from the shortest: a row alone takes its own path there
  // (LayerNorm::forward_rows), its mean and rstd included.
  constexpr Index kLong = normcore::detail::kShortMomentsValues<T>;
  for (Index n : {Index(1), L - 1, L + 1, 2 * L + 1, 4 * L - 1, 4 * L, 4 * L + 1, kLong, kLong + 1}) {
    if (n < 1) continue;
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    LayerNorm<T> ln(LayerNormOptions({n}));
    randomize_params(ln, 5);
    const auto xs = randn<T>(static_cast<std::size_t>(rows * n), 11, 1.5, 2.0);
    MapC<T, Eigen::RowMajor> x(xs.data(), rows, n);
    Mat<T, Eigen::RowMajor> y(rows, n);
    NormStats<T> st;
    ln.forward(x, y, st);
    auto buf = xs;
    Map<T, Eigen::RowMajor> inplace(buf.data(), rows, n);
    ln.forward(inplace, inplace);
    for (Index r = 0; r < rows; ++r) {
      MapC<T, Eigen::RowMajor> x1(xs.data() + r * n, 1, n);
      Mat<T, Eigen::RowMajor> y1(1, n);
      NormStats<T> s1;
      ln.forward(x1, y1, s1);
      ASSERT_EQ(std::memcmp(&s1.mean(0), &st.mean(r), sizeof(T)), 0) << "mean, row " << r;
      ASSERT_EQ(std::memcmp(&s1.rstd(0), &st.rstd(r), sizeof(T)), 0) << "rstd, row " << r;
      for (Index j = 0; j < n; ++j) {
        ASSERT_EQ(std::memcmp(&y1(0, j), &y(r, j), sizeof(T)), 0) << "y, row " << r << " j=" << j;
        ASSERT_EQ(std::memcmp(&y1(0, j), &buf[static_cast<std::size_t>(r * n + j)], sizeof(T)), 0)
            << "in place, row " << r << " j=" << j;
      }
    }
  }
}

// With both sets of path choices: on Intel CPUs (LayerNorm::intel_streaming)
// the 19 long rows take the streaming path, elsewhere groups.
TYPED_TEST(LayerNormTest, GroupNormalizeSameBitsAsRowAlone) {
  for (int tuning : {0, 1}) {
    const nctest::IntelTuning paths(tuning);
    SCOPED_TRACE(::testing::Message() << "Intel tuning " << tuning);
    check_group_normalize_same_bits_as_row_alone<TypeParam>();
  }
}

// In place (y is x): the same bits as into a separate y, on lengths with and
// without a tail after the last full packet (a kernel that reads a row's x
// after writing part of its y fails here).
TYPED_TEST(LayerNormTest, InPlaceForwardMatchesOutOfPlaceBitForBit) {
  using T = TypeParam;
  for (Index n : {Index(7), Index(50), Index(64), Index(100), Index(1000)}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    const Index rows = 11;
    LayerNorm<T> ln(LayerNormOptions({n}));
    const auto gv = randn<T>(static_cast<std::size_t>(n), 7, 1.0, 0.5);
    const auto bv = randn<T>(static_cast<std::size_t>(n), 8, 0.0, 0.5);
    std::copy(gv.begin(), gv.end(), ln.weight().data());
    std::copy(bv.begin(), bv.end(), ln.bias().data());
    auto buf = randn<T>(static_cast<std::size_t>(rows * n), 9, 0.5, 2.0);
    const auto xs = buf;
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x(xs.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::RowMajor> y(rows, n);
    ln.forward(x, y);
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>> inplace(buf.data(), rows, n);
    ln.forward(inplace, inplace);
    for (Index i = 0; i < rows * n; ++i) ASSERT_EQ(buf[static_cast<std::size_t>(i)], y.data()[i]) << "at " << i;
  }
}

// forward_stream_threshold(): the default is the streaming gate (with the
// Intel path choices, a sixteenth of the L3 the OS reports when that is
// more); a set value holds until a negative one restores the default.
TEST(ForwardStreamThreshold, SetAndRestore) {
  for (int choices : {0, 2, 3}) {
    const nctest::IntelTuning tuning(choices);
    EXPECT_EQ(normcore::forward_stream_threshold(), normcore::detail::kStreamingBytes) << choices;
  }
  {
    const nctest::IntelTuning intel(1);
    EXPECT_EQ(normcore::forward_stream_threshold(),
              std::max(normcore::detail::kStreamingBytes, normcore::detail::l3_cache_bytes() / 16));
  }
  const Index def = normcore::forward_stream_threshold();
  EXPECT_GE(def, normcore::detail::kStreamingBytes);
  EXPECT_FALSE(normcore::detail::stream_forward_output(def - 1));
  EXPECT_TRUE(normcore::detail::stream_forward_output(def));
  normcore::set_forward_stream_threshold(12345);
  EXPECT_EQ(normcore::forward_stream_threshold(), 12345);
  EXPECT_FALSE(normcore::detail::stream_forward_output(12344));
  EXPECT_TRUE(normcore::detail::stream_forward_output(12345));
  normcore::set_forward_stream_threshold(0);
  EXPECT_EQ(normcore::forward_stream_threshold(), 0);
  EXPECT_TRUE(normcore::detail::stream_forward_output(0));
  normcore::set_forward_stream_threshold(-5);
  EXPECT_EQ(normcore::forward_stream_threshold(), def);
}

// Inputs of normcore::detail::kStreamingBytes or more take other forward paths:
// short rows in groups that prefetch the next group, long rows one at a
// time. The same bits as the same rows in calls below the threshold (in
// groups, without prefetch, with the other CPUs' path choices; with the
// Intel ones, which take the streaming path below the threshold too, see
// LayerNorm::intel_streaming, the rows taken alone are the independent
// check), for short rows (groups of 8) and long rows
// that leave a tail (groups of 4 below the threshold) or not (rows of 1024,
// whose output takes streaming stores), and rows of 1500 (float: rows of
// 4-8 KB, whose normalize pass requests the next row,
// detail::forward_requests; with a tail), in place too. Long rows there
// that are not requested take each row's moments in the loop that
// normalizes the row before (detail::moments_normalizing; LayerNorm's
// interleave_long_rows: rows of up to 4 KB, and longer than 8 KB without
// bias, in builds with 32 vector registers; rows of 2560, over 8 KB with
// weight and bias and whole packets, are requested with the Intel path
// choices, and into the L1 with the AMD Zen 5 ones, which request rows of
// 1500 doubles into the L1 too): with weight and bias, weight
// only and neither (affine 2, 1, 0; 500, 3000 and 3001 for double rows; odd
// lengths for a tail on every ISA), and with a row whose squares overflow T
// (row 3, scaled as in ExtremeRowLeavesItsGroupsBitsAlone: the exact path).
// Random weight (affine 1 or 2) and bias (affine 2) for a LayerNorm over
// rows of n, from seeds `seed` and `seed + 1`.
template <typename T>
void set_random_affine(LayerNorm<T>& ln, Index n, int affine, unsigned seed) {
  if (affine > 0) {
    const auto gv = randn<T>(static_cast<std::size_t>(n), seed, 1.0, 0.5);
    std::copy(gv.begin(), gv.end(), ln.weight().data());
  }
  if (affine > 1) {
    const auto bv = randn<T>(static_cast<std::size_t>(n), seed + 1, 0.0, 0.5);
    std::copy(bv.begin(), bv.end(), ln.bias().data());
  }
}

// Calls of `chunk` rows over the rows x n values at `data` give, bit for
// bit, the y, mean and rstd of one call over them all (y, st).
template <typename T>
void check_chunks_same_bits(const LayerNorm<T>& ln, const T* data, Index rows, Index n, Index chunk,
                            const Eigen::Tensor<T, 2, Eigen::RowMajor>& y, const NormStats<T>& st) {
  const auto row_bytes = static_cast<std::size_t>(n) * sizeof(T);
  for (Index r0 = 0; r0 < rows; r0 += chunk) {
    const Index m = std::min(chunk, rows - r0);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> xs(data + r0 * n, m, n);
    Eigen::Tensor<T, 2, Eigen::RowMajor> ys(m, n);
    NormStats<T> ss;
    ln.forward(xs, ys, ss);
    ASSERT_EQ(std::memcmp(ys.data(), y.data() + r0 * n, static_cast<std::size_t>(m) * row_bytes), 0)
        << "rows " << r0 << ".." << r0 + m;
    ASSERT_EQ(std::memcmp(ss.mean.data(), st.mean.data() + r0, static_cast<std::size_t>(m) * sizeof(T)), 0);
    ASSERT_EQ(std::memcmp(ss.rstd.data(), st.rstd.data() + r0, static_cast<std::size_t>(m) * sizeof(T)), 0);
  }
}

template <typename T>
void check_large_input_forward_same_bits_as_small_calls() {
  // Streaming stores from the streaming gate on (the default threshold may
  // be higher on a machine with a large L3), then, once a case, none.
  const nctest::StreamThreshold streams(normcore::detail::kStreamingBytes);
  struct Case {
    Index n;
    int affine;
  };
  // Rows of 20, 50 (a tail after the last packet) and 64: with ordinary
  // stores the software-pipelined groups (forward_short_pipelined, requests
  // two groups ahead), with streaming stores a row at a time; the huge row
  // 3 leaves the group path.
  for (const Case c : {Case{20, 2}, Case{50, 2}, Case{64, 2}, Case{500, 2}, Case{1001, 2}, Case{1024, 2},
                       Case{1500, 2}, Case{2560, 2}, Case{1000, 1}, Case{3000, 1}, Case{1024, 0}, Case{3001, 0}}) {
    const Index n = c.n;
    SCOPED_TRACE(::testing::Message() << "n=" << n << " affine=" << c.affine);
    const Index row_bytes = n * static_cast<Index>(sizeof(T));
    const Index rows = normcore::detail::kStreamingBytes / row_bytes + 5;  // a partial last group
    LayerNorm<T> ln(LayerNormOptions({n}).elementwise_affine(c.affine > 0).bias(c.affine > 1));
    set_random_affine(ln, n, c.affine, 7);
    auto buf = randn<T>(static_cast<std::size_t>(rows * n), 21, 0.5, 2.0);
    const T huge = std::is_same<T, float>::value ? T(1e25) : T(1e200);
    for (Index j = 0; j < n; ++j) buf[static_cast<std::size_t>(3 * n + j)] *= huge;
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x(buf.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::RowMajor> y(rows, n);
    NormStats<T> st;
    ln.forward(x, y, st);
    ASSERT_TRUE(nctest::same_bits_with_ordinary_stores(ln, x, y));
    const Index chunk = normcore::detail::kStreamingBytes / (4 * row_bytes);  // far below the threshold
    ASSERT_LT(chunk * row_bytes, normcore::detail::kStreamingBytes);
    check_chunks_same_bits(ln, buf.data(), rows, n, chunk, y, st);
    if (::testing::Test::HasFatalFailure()) return;
    // Rows alone too (with the Intel path choices the chunks above take the
    // streaming path as well: LayerNorm::intel_streaming): the first two
    // groups, and rows spread over the rest.
    for (Index r = 0; r < rows; r += r < 16 ? 1 : 997) {
      Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x1(buf.data() + r * n, 1, n);
      Eigen::Tensor<T, 2, Eigen::RowMajor> y1(1, n);
      NormStats<T> s1;
      ln.forward(x1, y1, s1);
      ASSERT_EQ(std::memcmp(y1.data(), y.data() + r * n, static_cast<std::size_t>(row_bytes)), 0) << "row " << r;
      ASSERT_EQ(std::memcmp(&s1.mean(0), &st.mean(r), sizeof(T)), 0) << "mean, row " << r;
      ASSERT_EQ(std::memcmp(&s1.rstd(0), &st.rstd(r), sizeof(T)), 0) << "rstd, row " << r;
    }
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>> inplace(buf.data(), rows, n);
    ln.forward(inplace, inplace);
    ASSERT_EQ(std::memcmp(buf.data(), y.data(), static_cast<std::size_t>(rows * row_bytes)), 0) << "in place";
  }
}

TYPED_TEST(LayerNormTest, LargeInputForwardSameBitsAsSmallCalls) {
  for (int tuning : {0, 1, 2, 3}) {
    const nctest::IntelTuning paths(tuning);
    SCOPED_TRACE(::testing::Message() << "Intel tuning " << tuning);
    check_large_input_forward_same_bits_as_small_calls<TypeParam>();
  }
}

// Inputs of half the streaming gate up to it (6-12 MiB) take the
// streaming path's kernels without streaming stores under the other CPUs'
// path choices (set 0, float, AVX-512 builds: LayerNorm::mid_streaming):
// the same bits, mean and rstd as calls of 1 MB, which take the group
// kernels there. Rows of 512 (the shortest that qualify), 1024 and 769 (a
// tail), and 2048 with weight and bias (requested as the next row is
// normalized); with weight only, and neither. Under every set of path
// choices: under the Intel set both sizes take the streaming kernels
// (LayerNorm::intel_streaming), under the others, and in builds without
// AVX-512, both take the groups.
TYPED_TEST(LayerNormTest, MidSizeInputForwardSameBitsAsSmallCalls) {
  using T = TypeParam;
  struct Case {
    Index n;
    int affine;
  };
  for (int tuning : {0, 1, 2, 3}) {
    const nctest::IntelTuning paths(tuning);
    for (const Case c : {Case{512, 2}, Case{769, 2}, Case{1024, 2}, Case{2048, 2}, Case{1024, 1}, Case{1024, 0}}) {
      const Index n = c.n;
      SCOPED_TRACE(::testing::Message() << "tuning " << tuning << " n=" << n << " affine=" << c.affine);
      const Index row_bytes = n * static_cast<Index>(sizeof(T));
      const Index rows = (normcore::detail::kStreamingBytes / 2 + normcore::detail::kStreamingBytes / 4) / row_bytes;
      ASSERT_LT(rows * row_bytes, normcore::detail::kStreamingBytes);
      LayerNorm<T> ln(LayerNormOptions({n}).elementwise_affine(c.affine > 0).bias(c.affine > 1));
      set_random_affine(ln, n, c.affine, 17);
      const auto buf = randn<T>(static_cast<std::size_t>(rows * n), 23, 0.5, 2.0);
      Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x(buf.data(), rows, n);
      Eigen::Tensor<T, 2, Eigen::RowMajor> y(rows, n);
      NormStats<T> st;
      ln.forward(x, y, st);
      check_chunks_same_bits(ln, buf.data(), rows, n, (Index(1) << 20) / row_bytes, y, st);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// Inputs the caches hold, rows of 768 to 1536 values: under the Zen 4 path
// choices (AVX-512 builds, float, weight and bias) the forward takes each
// row's moments while the row before is normalized
// (LayerNorm::cached_interleave), except where the output lies so that
// those loads would wait on its stores (4K aliasing): there it keeps the
// groups. Outputs at several distances from the input, both sides of that
// check for every length, and in place, under all four sets of path
// choices, with weight and
// bias, weight only and neither, and one row scaled past float's range for
// its M2 (the exact path): every row's y, mean and rstd are those of the row
// alone bit for bit, y without the statistics saved is the same, and y is
// the reference's.
TYPED_TEST(LayerNormTest, CachedForwardSameBitsWhereverTheOutputLies) {
  using T = TypeParam;
  const Index rows = 13;
  constexpr Index page = 4096 / static_cast<Index>(sizeof(T));  // values in 4 KB
  const Index line = 64 / static_cast<Index>(sizeof(T));        // values in 64 bytes
  // The first value of v at a 4 KB boundary.
  const auto on_page = [](std::vector<T>& v) {
    const auto off = static_cast<Index>(reinterpret_cast<std::uintptr_t>(v.data()) % 4096 / sizeof(T));
    return v.data() + (page - off) % page;
  };
  for (int tuning : {0, 1, 2, 3}) {
    const nctest::IntelTuning paths(tuning);
    for (const Index n : {Index(768), Index(1024), Index(1536)}) {
      for (int affine : {2, 1, 0}) {
        LayerNorm<T> ln(LayerNormOptions({n}).elementwise_affine(affine > 0).bias(affine > 1));
        set_random_affine(ln, n, affine, 31);
        auto xs = randn<T>(static_cast<std::size_t>(rows * n), 37, 0.5, 2.0);
        for (Index j = 0; j < n; ++j) xs[static_cast<std::size_t>(5 * n + j)] *= T(1e18);  // M2 past float's range
        std::vector<T> xbuf(static_cast<std::size_t>(rows * n + page));
        T* const xp = on_page(xbuf);
        std::copy(xs.begin(), xs.end(), xp);
        Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x(xp, rows, n);
        const auto want = normcore::reference::layer_norm_forward(xp, rows, n, affine > 0 ? ln.weight().data() : nullptr,
                                                                  affine > 1 ? ln.bias().data() : nullptr, 1e-5);
        // Each row alone, and that row's share of the reference's magnitude.
        std::vector<T> alone(static_cast<std::size_t>(rows * n)), mean1(static_cast<std::size_t>(rows)),
            rstd1(static_cast<std::size_t>(rows));
        for (Index r = 0; r < rows; ++r) {
          Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x1(xp + r * n, 1, n);
          Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>> y1(alone.data() + r * n, 1, n);
          NormStats<T> s1;
          ln.forward(x1, y1, s1);
          mean1[static_cast<std::size_t>(r)] = s1.mean(0);
          rstd1[static_cast<std::size_t>(r)] = s1.rstd(0);
        }
        EXPECT_LE(max_diff(alone.data(), want), tol_elem<T>(max_abs(want) + 1.0, double(n)));
        std::vector<T> ybuf(static_cast<std::size_t>(rows * n + 4 * page));
        T* const ybase = on_page(ybuf);
        // y at `at` values past a 4 KB boundary (-1: in place, over a copy of
        // x). With x on one too, y at n modulo 4 KB (`next`) is the next row's
        // place: there and a line after it the loads alias the stores, a line
        // before it and two lines after it they do not.
        const Index next = page + n % page;
        for (const Index at : {Index(0), line, 2 * line, 5 * line, next, next + line, next + 2 * line, next - line,
                               Index(-1)}) {
          SCOPED_TRACE(::testing::Message() << "tuning " << tuning << " n=" << n << " affine=" << affine
                                            << " y at " << at);
          if (at >= 0) {  // the places above, as the check sees them
            const Index ahead = ((at - n) % page + page) % page;  // y past the next row, in values mod 4 KB
            EXPECT_EQ(normcore::detail::next_row_loads_alias_stores(xp, ybase + at, n), ahead == 0 || ahead == line);
          }
          T* const yp = at < 0 ? ybase : ybase + at;
          if (at < 0) std::copy(xs.begin(), xs.end(), yp);
          const T* const xin = at < 0 ? yp : xp;
          Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> xi(xin, rows, n);
          Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>> y(yp, rows, n);
          NormStats<T> st;
          ln.forward(xi, y, st);
          ASSERT_EQ(std::memcmp(alone.data(), yp, static_cast<std::size_t>(rows * n) * sizeof(T)), 0);
          ASSERT_EQ(std::memcmp(mean1.data(), st.mean.data(), static_cast<std::size_t>(rows) * sizeof(T)), 0);
          ASSERT_EQ(std::memcmp(rstd1.data(), st.rstd.data(), static_cast<std::size_t>(rows) * sizeof(T)), 0);
          if (at < 0) std::copy(xs.begin(), xs.end(), yp);
          else std::fill(yp, yp + rows * n, T(7));
          ln.forward(xi, y);  // without the statistics
          ASSERT_EQ(std::memcmp(alone.data(), yp, static_cast<std::size_t>(rows * n) * sizeof(T)), 0);
        }
      }
    }
  }
}

// Short rows (up to four packets with 32 vector registers, two otherwise)
// take a backward kernel that keeps gamma and the block's dweight/dbias sums
// in registers and stores a row's last packet whole (its lanes before the
// tail recomputed) unless dx lies over an input. On lengths around each
// packet count, 70 rows (a full 64-row block of the parameter sums and a
// partial one): the reference, and dx written over dy, over x or (through
// backward_add) over dh_next is the out-of-place dx bit for bit, with
// dweight and dbias unchanged.
TYPED_TEST(LayerNormTest, ShortRowBackwardInPlaceSameBits) {
  using T = TypeParam;
  constexpr Index L = normcore::detail::simd<T>::L;
  const Index rows = 70;
  unsigned seed = 40;
  for (Index n : {L - 1, L, L + 1, 2 * L - 1, 2 * L + 3, 3 * L, 4 * L - 1, 4 * L, 4 * L + 1,
                  Index(50), Index(100), Index(1000)}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    check_against_reference<T, Eigen::RowMajor>(rows, n, seed += 3, 0.5);
    LayerNorm<T> ln(LayerNormOptions({n}));
    randomize_params(ln, seed);
    const auto xs = randn<T>(static_cast<std::size_t>(rows * n), seed + 1, 1.5, 2.0);
    const auto dys = randn<T>(static_cast<std::size_t>(rows * n), seed + 2);
    const auto dhs = randn<T>(static_cast<std::size_t>(rows * n), seed + 3);
    MapC<T, Eigen::RowMajor> x(xs.data(), rows, n), dy(dys.data(), rows, n), dh(dhs.data(), rows, n);
    Mat<T, Eigen::RowMajor> dx(rows, n), dxh(rows, n);
    Eigen::Tensor<T, 1> dw, db, dw2, db2;
    ln.backward(x, dy, &dx, &dw, &db);
    ln.backward_add(x, dy, &dh, &dxh, nullptr, nullptr);
    const auto same = [&](const T* a, const T* b, const char* what) {
      for (Index i = 0; i < rows * n; ++i)
        ASSERT_EQ(std::memcmp(a + i, b + i, sizeof(T)), 0) << what << ", row " << i / n << " j=" << i % n;
    };
    auto buf = dys;  // dx over dy
    Map<T, Eigen::RowMajor> over_dy(buf.data(), rows, n);
    ln.backward(x, over_dy, &over_dy, &dw2, &db2);
    same(dx.data(), buf.data(), "dx over dy");
    ASSERT_TRUE(bit_equal(dw.data(), dw2.data(), static_cast<std::size_t>(n)));
    ASSERT_TRUE(bit_equal(db.data(), db2.data(), static_cast<std::size_t>(n)));
    buf = xs;  // dx over x (statistics saved first)
    NormStats<T> st;
    Mat<T, Eigen::RowMajor> y(rows, n);
    ln.forward(x, y, st);
    Map<T, Eigen::RowMajor> over_x(buf.data(), rows, n);
    ln.backward(over_x, dy, &over_x, nullptr, nullptr, &st);
    same(dx.data(), buf.data(), "dx over x");
    buf = dhs;  // backward_add's dx over dh
    Map<T, Eigen::RowMajor> over_dh(buf.data(), rows, n);
    ln.backward_add(x, dy, &over_dh, &over_dh, nullptr, nullptr);
    same(dxh.data(), buf.data(), "dx over dh");
  }
}

// ColMajor rows (the lane kernels): dx over dy, over x with saved
// statistics, and backward_add's dx over dh_next (added in a second pass,
// from a copy of dh_next where dx lies over it) give the out-of-place dx bit
// for bit, the parameter gradients unchanged.
TYPED_TEST(LayerNormTest, ColMajorBackwardInPlaceSameBits) {
  using T = TypeParam;
  for (const auto& [rows, n] : {std::pair<Index, Index>{37, 7}, {37, 50}, {37, 1000}, {512, 300}, {2500, 64}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << n);
    LayerNorm<T> ln(LayerNormOptions({n}));
    randomize_params(ln, 3);
    const auto xs = randn<T>(static_cast<std::size_t>(rows * n), 21, 1.5, 2.0);
    const auto dys = randn<T>(static_cast<std::size_t>(rows * n), 22);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::ColMajor>> x(xs.data(), rows, n), dy(dys.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::ColMajor> dx(rows, n), y(rows, n);
    Eigen::Tensor<T, 1> dw, db, dw2, db2;
    ln.backward(x, dy, &dx, &dw, &db);
    auto buf = dys;
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::ColMajor>> over_dy(buf.data(), rows, n);
    ln.backward(x, over_dy, &over_dy, &dw2, &db2);
    EXPECT_TRUE(bit_equal(dx.data(), buf.data(), static_cast<std::size_t>(rows * n))) << "dx over dy";
    EXPECT_TRUE(bit_equal(dw.data(), dw2.data(), static_cast<std::size_t>(n)));
    EXPECT_TRUE(bit_equal(db.data(), db2.data(), static_cast<std::size_t>(n)));
    NormStats<T> st;
    ln.forward(x, y, st);
    buf = xs;
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::ColMajor>> over_x(buf.data(), rows, n);
    ln.backward(over_x, dy, &over_x, nullptr, nullptr, &st);
    EXPECT_TRUE(bit_equal(dx.data(), buf.data(), static_cast<std::size_t>(rows * n))) << "dx over x";
    const auto dhs = randn<T>(static_cast<std::size_t>(rows * n), 23);
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::ColMajor>> dh(dhs.data(), rows, n);
    Eigen::Tensor<T, 2, Eigen::ColMajor> dxh(rows, n);
    ln.backward_add(x, dy, &dh, &dxh, nullptr, nullptr);
    buf = dhs;
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::ColMajor>> over_dh(buf.data(), rows, n);
    ln.backward_add(x, dy, &over_dh, &over_dh, nullptr, nullptr);
    EXPECT_TRUE(bit_equal(dxh.data(), buf.data(), static_cast<std::size_t>(rows * n))) << "dx over dh";
  }
}

// Large backward inputs: dx with streaming stores (nctest::check_large_backward).
TYPED_TEST(LayerNormTest, LargeInputBackwardSameBitsAsSmallCalls) {
  using T = TypeParam;
  for (Index n : {Index(64), Index(1024)}) {
    LayerNorm<T> ln(LayerNormOptions({n}));
    const auto gv = randn<T>(static_cast<std::size_t>(n), 7, 1.0, 0.5);
    std::copy(gv.begin(), gv.end(), ln.weight().data());
    Eigen::Tensor<T, 1> dw, db;
    check_large_backward<T>(n, [&](const auto& x, const auto& dy, auto& dx, bool grads) {
      ln.backward(x, dy, &dx, grads ? &dw : nullptr, grads ? &db : nullptr);
    });
  }
}

// A streaming backward (x and dy of at least kStreamingBytes) with dx
// aligned takes its long rows of whole packets two at a time under the path
// choices measured on Zen 4 (set 0; LayerNorm::pair_streaming_rows), one at
// a time under the Intel ones (set 1): the same dx, dweight and dbias bits.
// Only where dx can take streaming stores (x86 builds; elsewhere both calls
// go one row at a time, and the test is skipped).
// An odd row count, so that the last row of the last block goes alone.
// (LargeInputBackwardSameBitsAsSmallCalls compares dx with calls the caches
// hold.)
TYPED_TEST(LayerNormTest, StreamingBackwardInPairsSameBitsAsOneRowAtATime) {
  using T = TypeParam;
  using CMap = Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>>;
  const Index n = 1024;
  const Index rows = normcore::detail::kStreamingBytes / (2 * n * Index(sizeof(T))) + 3;
  if (!normcore::detail::kStreamStores) GTEST_SKIP() << "no streaming stores in this build";
  ASSERT_TRUE((normcore::detail::prefetch_next_row<T, T>(rows, n)));
  ASSERT_EQ(rows % 2, 1);
  LayerNorm<T> ln(LayerNormOptions({n}));
  randomize_params(ln, 31);
  const auto N = static_cast<std::size_t>(rows * n);
  const auto xb = randn<T>(N, 41, 0.5, 2.0);
  const auto dyb = randn<T>(N, 42);
  CMap x(xb.data(), rows, n), dy(dyb.data(), rows, n);
  Eigen::Tensor<T, 2, Eigen::RowMajor> dx[2];
  Eigen::Tensor<T, 1> dw[2], db[2];
  for (int tuning : {0, 1}) {
    const nctest::IntelTuning paths(tuning);
    dx[tuning].resize(rows, n);  // Eigen's allocation: aligned, so dx streams
    ln.backward(x, dy, &dx[tuning], &dw[tuning], &db[tuning]);
  }
  EXPECT_TRUE(bit_equal(dx[0].data(), dx[1].data(), N)) << "dx";
  ASSERT_EQ(dw[0].size(), n);
  ASSERT_EQ(db[0].size(), n);
  EXPECT_TRUE(bit_equal(dw[0].data(), dw[1].data(), static_cast<std::size_t>(n))) << "dweight";
  EXPECT_TRUE(bit_equal(db[0].data(), db[1].data(), static_cast<std::size_t>(n))) << "dbias";
  // And against the reference (double, two-pass), with tolerances of
  // check_against_reference's form (offset terms dropped, rstd bounded by
  // 1): the same bits as another path, and the right gradient.
  const auto ref = normcore::reference::layer_norm_backward(xb.data(), dyb.data(), rows, n, ln.weight().data(),
                                                            1e-5);
  double gmax = 0;
  for (std::size_t i = 0; i < N; ++i)
    gmax = std::max(gmax, std::fabs(double(dyb[i]) * double(ln.weight()(static_cast<Index>(i) % n))));
  const double rmax = 1.0;  // rstd of rows with standard deviation 2: about 0.5
  EXPECT_LE(max_diff(dx[0].data(), ref.dx), tol_elem<T>(rmax * (gmax + 1.0), double(n))) << "dx";
  EXPECT_LE(max_diff(dw[0].data(), ref.dweight), tol<T>(max_abs(ref.dweight) + 4.0 * 4, double(rows) + 8));
  EXPECT_LE(max_diff(db[0].data(), ref.dbias), tol<T>(max_abs(ref.dbias) + 4, double(rows) + 8));
}

// Backward inputs over the L2, under the streaming gate: on Intel CPUs and
// AMD Zen 5 dx with streaming stores (nctest::check_l2_backward), with both
// sets of path choices. Rows of 1 KB (the shortest that stream) and 1024
// values.
TYPED_TEST(LayerNormTest, L2SizedBackwardSameBitsAsSmallCalls) {
  using T = TypeParam;
  for (int tuning : {0, 1}) {
    const nctest::IntelTuning paths(tuning);
    SCOPED_TRACE(::testing::Message() << "Intel tuning " << tuning);
    for (Index n : {Index(1024 / sizeof(T)), Index(1024)}) {
      LayerNorm<T> ln(LayerNormOptions({n}));
      randomize_params(ln, 9);
      Eigen::Tensor<T, 1> dw, db;
      check_l2_backward<T>(n, [&](const auto& x, const auto& dy, auto& dx, bool grads) {
        ln.backward(x, dy, &dx, grads ? &dw : nullptr, grads ? &db : nullptr);
      });
    }
  }
}

// Float rows with mean 1e4..1e6 and standard deviation 1. The tolerance is
// the floor set by the input itself (ulp(mean)/2 / std) times 1.5; the naive
// E[x^2] - E[x]^2 formula misses it on the same data, so this test can fail.
TEST(LayerNormStability, LargeMeanStaysAtTheFloorWhereNaiveFails) {
  for (double offset : {1e4, 1e5, 1e6}) {
    const Index rows = 16, n = 768;
    const auto x = randn<float>(static_cast<std::size_t>(rows * n), 21, offset, 1.0);
    LayerNorm<float> ln(LayerNormOptions({n}));
    Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>> xm(x.data(), rows, n);
    Eigen::Tensor<float, 2, Eigen::RowMajor> y = ln(xm);
    const auto ref = normcore::reference::layer_norm_forward(x.data(), rows, n, (const float*)nullptr,
                                                             (const float*)nullptr, 1e-5);
    const float m = static_cast<float>(offset);
    const double floor = (std::nextafter(m, 2 * m) - m) / 2.0;
    EXPECT_LE(max_diff(y.data(), ref), 1.5 * floor) << "offset " << offset;
    // Naive one-pass formula in float, as a careless kernel would do it.
    std::vector<float> naive(static_cast<std::size_t>(rows * n));
    for (Index r = 0; r < rows; ++r) {
      float s = 0, s2 = 0;
      for (Index j = 0; j < n; ++j) {
        s += x[static_cast<std::size_t>(r * n + j)];
        s2 += x[static_cast<std::size_t>(r * n + j)] * x[static_cast<std::size_t>(r * n + j)];
      }
      const float mean = s / float(n);
      const float var = s2 / float(n) - mean * mean;
      for (Index j = 0; j < n; ++j)
        naive[static_cast<std::size_t>(r * n + j)] = (x[static_cast<std::size_t>(r * n + j)] - mean) / std::sqrt(var + 1e-5f);
    }
    EXPECT_GT(max_diff(naive.data(), ref), 1.5 * floor) << "offset " << offset;
  }
}

// normalized_shape over the last three dims, rank 4, both layouts. Weight is
// flattened in row-major order of normalized_shape, whatever the layout.
TYPED_TEST(LayerNormTest, MultiDimNormalizedShapeBothLayouts) {
  using T = TypeParam;
  const Index B = 5, C = 3, H = 4, W = 7, n = C * H * W;
  LayerNorm<T> ln(LayerNormOptions({C, H, W}));
  randomize_params(ln, 8);
  Eigen::Tensor<T, 4, Eigen::RowMajor> x(B, C, H, W), dy(B, C, H, W);
  const auto xv = randn<T>(static_cast<std::size_t>(B * n), 31, 1.0, 3.0);
  const auto dv = randn<T>(static_cast<std::size_t>(B * n), 32);
  std::copy(xv.begin(), xv.end(), x.data());
  std::copy(dv.begin(), dv.end(), dy.data());
  const auto ref = normcore::reference::layer_norm_forward(xv.data(), B, n, ln.weight().data(),
                                                           ln.bias().data(), 1e-5);
  const auto gref = normcore::reference::layer_norm_backward(xv.data(), dv.data(), B, n,
                                                             ln.weight().data(), 1e-5);
  Eigen::Tensor<T, 4, Eigen::RowMajor> y = ln(x);
  EXPECT_LE(max_diff(y.data(), ref), tol_elem<T>(max_abs(ref) + 1, double(n)));
  // The same logical tensor stored ColMajor.
  const Eigen::array<int, 4> rev{{3, 2, 1, 0}};
  Eigen::Tensor<T, 4, Eigen::ColMajor> xc = x.swap_layout().shuffle(rev);
  Eigen::Tensor<T, 4, Eigen::ColMajor> dyc = dy.swap_layout().shuffle(rev);
  ASSERT_EQ(xc.dimension(1), C);
  Eigen::Tensor<T, 4, Eigen::ColMajor> yc = ln(xc);
  Eigen::Tensor<T, 4, Eigen::RowMajor> yc_rm = yc.swap_layout().shuffle(rev);
  EXPECT_LE(max_diff(yc_rm.data(), ref), tol_elem<T>(max_abs(ref) + 1, double(n)));
  auto g = ln.backward(xc, dyc);
  Eigen::Tensor<T, 4, Eigen::RowMajor> dx_rm = g.dx.swap_layout().shuffle(rev);
  EXPECT_LE(max_diff(dx_rm.data(), gref.dx), tol_elem<T>(max_abs(gref.dx) + 4, double(n)));
  EXPECT_LE(max_diff(g.dweight.data(), gref.dweight), tol<T>(max_abs(gref.dweight) + 16, double(B) + 8));
  EXPECT_LE(max_diff(g.dbias.data(), gref.dbias), tol<T>(max_abs(gref.dbias) + 4, double(B) + 8));
}

TYPED_TEST(LayerNormTest, NoAffineAndNoBias) {
  using T = TypeParam;
  const Index rows = 4, n = 33;
  const auto xv = randn<T>(static_cast<std::size_t>(rows * n), 41, 0.0, 1.0);
  Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x(xv.data(), rows, n);
  LayerNorm<T> plain(LayerNormOptions({n}).elementwise_affine(false));
  EXPECT_EQ(plain.weight().size(), 0);
  EXPECT_EQ(plain.bias().size(), 0);
  Eigen::Tensor<T, 2, Eigen::RowMajor> y = plain(x);
  const auto ref = normcore::reference::layer_norm_forward(xv.data(), rows, n, (const T*)nullptr,
                                                           (const T*)nullptr, 1e-5);
  EXPECT_LE(max_diff(y.data(), ref), tol_elem<T>(max_abs(ref), double(n)));
  LayerNorm<T> nobias(LayerNormOptions({n}).bias(false));
  EXPECT_EQ(nobias.weight().size(), n);
  EXPECT_EQ(nobias.bias().size(), 0);
  auto g = nobias.backward(x, x);
  EXPECT_EQ(g.dbias.size(), 0);
  EXPECT_EQ(g.dweight.size(), n);
}

TEST(LayerNormErrors, ShapeMismatchesNameExpectedAndActual) {
  LayerNorm<float> ln(LayerNormOptions({768}));
  Eigen::Tensor<float, 2, Eigen::RowMajor> x(8, 512);
  x.setZero();
  try {
    (void)ln(x);
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[768]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[8, 512]"), std::string::npos) << e.what();
  }
  Eigen::Tensor<float, 2, Eigen::RowMajor> good(8, 768), wrong(4, 768);
  good.setZero();
  try {
    ln.forward(good, wrong);
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[8, 768]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[4, 768]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ln.backward(good, wrong, &good, nullptr, nullptr), std::invalid_argument);
  EXPECT_THROW(ln.backward(good, good, &wrong, nullptr, nullptr), std::invalid_argument);
  NormStats<float> bad;
  bad.mean.resize(3);
  bad.rstd.resize(3);
  EXPECT_THROW(ln.backward(good, good, &good, nullptr, nullptr, &bad), std::invalid_argument);
  LayerNorm<float> plain(LayerNormOptions({768}).elementwise_affine(false));
  Eigen::Tensor<float, 1> dw;
  EXPECT_THROW(plain.backward(good, good, nullptr, &dw, nullptr), std::invalid_argument);
  EXPECT_THROW(LayerNorm<float>(LayerNormOptions(std::vector<Index>{})), std::invalid_argument);
  EXPECT_THROW(LayerNorm<float>(LayerNormOptions({0})), std::invalid_argument);
  EXPECT_THROW(LayerNorm<float>(LayerNormOptions({4}).eps(-1)), std::invalid_argument);
  Eigen::Tensor<float, 1> v(768);  // rank 1 < ... fine; rank-0-row input
  v.setZero();
  EXPECT_NO_THROW((void)ln(v));
}

TYPED_TEST(LayerNormTest, ZeroRowsDoNothingAndNonFiniteStaysInItsRow) {
  using T = TypeParam;
  LayerNorm<T> ln(LayerNormOptions({16}));
  Eigen::Tensor<T, 3, Eigen::RowMajor> empty(0, 4, 16);
  NormStats<T> s;
  Eigen::Tensor<T, 3, Eigen::RowMajor> ey(0, 4, 16);
  ln.forward(empty, ey, s);
  EXPECT_EQ(s.mean.size(), 0);
  for (T bad : {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity()}) {
    Eigen::Tensor<T, 2, Eigen::RowMajor> x(3, 16);
    x.setRandom();
    x(1, 5) = bad;
    Eigen::Tensor<T, 2, Eigen::RowMajor> y = ln(x);
    Eigen::Tensor<T, 2, Eigen::ColMajor> xc = x.swap_layout().shuffle(Eigen::array<int, 2>{{1, 0}});
    Eigen::Tensor<T, 2, Eigen::ColMajor> yc = ln(xc);
    for (Index j = 0; j < 16; ++j) {
      EXPECT_TRUE(std::isfinite(y(0, j)) && std::isfinite(y(2, j)));
      EXPECT_TRUE(std::isnan(y(1, j)));
      EXPECT_TRUE(std::isfinite(yc(0, j)) && std::isfinite(yc(2, j)));
      EXPECT_TRUE(std::isnan(yc(1, j)));
    }
  }
}

// Short rows take their statistics and coefficients a group at a time; a
// group with a row whose squares overflow (or with a non-finite row) goes
// row by row instead. Either way every row gets the bits it gets alone.
TYPED_TEST(LayerNormTest, ExtremeRowLeavesItsGroupsBitsAlone) {
  using T = TypeParam;
  const T huge = std::is_same<T, float>::value ? T(1e25) : T(1e200);
  for (Index n : {Index(16), Index(50), Index(64), Index(300)}) {
    for (T bad : {huge, std::numeric_limits<T>::quiet_NaN()}) {
      SCOPED_TRACE(::testing::Message() << "n " << n << " bad " << bad);
      const Index rows = 19;
      LayerNorm<T> ln(LayerNormOptions({n}));
      randomize_params(ln, 4);
      auto xl = randn<T>(static_cast<std::size_t>(rows * n), 12, 1.0, 2.0);
      for (Index j = 0; j < n; ++j) xl[static_cast<std::size_t>(3 * n + j)] *= huge;
      xl[static_cast<std::size_t>(11 * n + 7)] = bad;
      MapC<T, Eigen::RowMajor> x(xl.data(), rows, n);
      Mat<T, Eigen::RowMajor> y = ln(x);
      for (Index r = 0; r < rows; ++r) {
        MapC<T, Eigen::RowMajor> xr(xl.data() + r * n, 1, n);
        Mat<T, Eigen::RowMajor> yr = ln(xr);
        for (Index j = 0; j < n; ++j) ASSERT_EQ(std::memcmp(&yr(0, j), &y(r, j), sizeof(T)), 0) << "row " << r << " j " << j;
      }
      for (Index j = 0; j < n; ++j) EXPECT_TRUE(std::isfinite(y(3, j)));
    }
  }
}

TEST(LayerNormTensor, RankThreeTensorAndConstMap) {
  const Index B = 2, S = 5, H = 24;
  Eigen::Tensor<float, 3, Eigen::RowMajor> x(B, S, H);
  const auto v = randn<float>(static_cast<std::size_t>(B * S * H), 51, 2.0, 1.0);
  std::copy(v.begin(), v.end(), x.data());
  LayerNorm<float> ln(LayerNormOptions({H}));
  Eigen::Tensor<float, 3, Eigen::RowMajor> y = ln(x);
  const Eigen::Tensor<float, 3, Eigen::RowMajor>& cx = x;
  Eigen::TensorMap<const Eigen::Tensor<float, 3, Eigen::RowMajor>> cm(cx.data(), B, S, H);
  Eigen::Tensor<float, 3, Eigen::RowMajor> y2(B, S, H);
  Eigen::TensorMap<Eigen::Tensor<float, 3, Eigen::RowMajor>> ym(y2.data(), B, S, H);
  ln.forward(cm, ym);
  EXPECT_TRUE(bit_equal(y.data(), y2.data(), static_cast<std::size_t>(y.size())));
  const auto ref = normcore::reference::layer_norm_forward(v.data(), B * S, H, ln.weight().data(),
                                                           ln.bias().data(), 1e-5);
  EXPECT_LE(max_diff(y.data(), ref), tol_elem<float>(max_abs(ref) + 1, double(H)));
}

}  // namespace

namespace {

// Rows whose squares overflow or underflow float: still the right answer
// (forward and backward), in both layouts.
TEST(LayerNormExtremes, HugeAndTinyFloatRows) {
  using nctest::randn;
  for (double scale : {1e25, 1e30, 1e-25}) {
    for (Index n : {Index(7), Index(50), Index(768)}) {
      for (int layout = 0; layout < 2; ++layout) {
        SCOPED_TRACE(::testing::Message() << "scale " << scale << " n " << n << " layout " << layout);
        const Index rows = 3;
        const double eps = scale < 1 ? 0.0 : 1e-5;
        const auto xl = randn<float>(static_cast<std::size_t>(rows * n), 5, 0.5 * scale, scale);
        const auto dyl = randn<float>(xl.size(), 6);
        LayerNorm<float> ln(LayerNormOptions({n}).eps(eps));
        const auto ref = normcore::reference::layer_norm_forward(xl.data(), rows, n, (const float*)nullptr,
                                                                 (const float*)nullptr, eps);
        const auto gref = normcore::reference::layer_norm_backward(xl.data(), dyl.data(), rows, n,
                                                                   (const float*)nullptr, eps);
        std::vector<float> y, dx;
        if (layout == 0) {
          Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>> x(xl.data(), rows, n), dy(dyl.data(), rows, n);
          auto g = ln.backward(x, dy);
          Eigen::Tensor<float, 2, Eigen::RowMajor> yy = ln(x);
          y.assign(yy.data(), yy.data() + yy.size());
          dx.assign(g.dx.data(), g.dx.data() + g.dx.size());
        } else {
          const auto xc = nctest::to_colmajor(xl, rows, n), dyc = nctest::to_colmajor(dyl, rows, n);
          Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::ColMajor>> x(xc.data(), rows, n), dy(dyc.data(), rows, n);
          auto g = ln.backward(x, dy);
          Eigen::Tensor<float, 2, Eigen::ColMajor> yy = ln(x);
          y = nctest::from_colmajor(yy.data(), rows, n);
          dx = nctest::from_colmajor(g.dx.data(), rows, n);
        }
        EXPECT_LE(nctest::max_diff(y.data(), ref), nctest::tol_elem<float>(nctest::max_abs(ref) + 1, double(n)));
        const double dxmag = nctest::max_abs(gref.dx) * 8;  // |dx| ~ rstd * |dy|: the scale of dx itself
        EXPECT_LE(nctest::max_diff(dx.data(), gref.dx), nctest::tol_elem<float>(dxmag, double(n)));
      }
    }
  }
}

TEST(LayerNormEdges, SingleElementAndEpsZero) {
  LayerNorm<float> one(LayerNormOptions({1}));
  one.bias().setConstant(0.5f);
  Eigen::Tensor<float, 2, Eigen::RowMajor> x(3, 1);
  x.setValues({{1e30f}, {-2.0f}, {0.0f}});
  Eigen::Tensor<float, 2, Eigen::RowMajor> y = one(x);
  for (Index r = 0; r < 3; ++r) EXPECT_EQ(y(r, 0), 0.5f);  // x_hat = 0 for a single element
  LayerNorm<float> noeps(LayerNormOptions({4}).eps(0.0));
  Eigen::Tensor<float, 2, Eigen::RowMajor> c(1, 4);
  c.setConstant(3.0f);
  Eigen::Tensor<float, 2, Eigen::RowMajor> yc = noeps(c);
  for (Index j = 0; j < 4; ++j) EXPECT_TRUE(std::isnan(yc(0, j)));  // 0 * inf, as PyTorch
}

}  // namespace
