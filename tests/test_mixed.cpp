// 16-bit storage (bfloat16, half) and the fused residual norms.
#include "test_util.hpp"

namespace {

using namespace nctest;

template <typename S>
constexpr int mantissa_bits() {
  return std::is_same<S, Eigen::bfloat16>::value ? 7 : 10;
}

// Share of outputs equal to the double reference rounded to S, and the
// largest distance in units of S's ulp among outputs off by more than 1e-5.
template <typename S>
struct Agreement {
  double equal_share;
  double worst_ulps;
};

template <typename S>
Agreement<S> agreement(const S* got, const std::vector<double>& ref) {
  std::size_t equal = 0;
  double worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const float want = static_cast<float>(static_cast<S>(static_cast<float>(ref[i])));
    const float g = static_cast<float>(got[i]);
    if (g == want) {
      ++equal;
      continue;
    }
    const double err = std::fabs(double(g) - ref[i]);
    if (err < 1e-5) continue;
    const double ulp = std::ldexp(1.0, std::ilogb(std::fabs(want) > 0 ? want : 1.0f) - mantissa_bits<S>());
    worst = std::max(worst, std::fabs(double(g) - double(want)) / ulp);
  }
  return {double(equal) / double(ref.size()), worst};
}

template <typename S>
std::vector<S> to16(const std::vector<float>& v) {
  std::vector<S> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = static_cast<S>(v[i]);
  return o;
}
template <typename S>
std::vector<float> to32(const std::vector<S>& v) {
  std::vector<float> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = static_cast<float>(v[i]);
  return o;
}

template <typename S>
void check_row_norms(double min_share) {
  const Index rows = 64, n = 768;
  for (double mean : {0.0, 30.0}) {
    SCOPED_TRACE(::testing::Message() << "mean " << mean);
    const auto xs = to16<S>(randn<float>(static_cast<std::size_t>(rows * n), 3, mean, 1.0));
    const auto xw = to32(xs);  // the values as stored
    Eigen::TensorMap<const Eigen::Tensor<S, 2, Eigen::RowMajor>> x(xs.data(), rows, n);
    normcore::LayerNorm<float> ln(normcore::LayerNormOptions({n}));
    Eigen::Tensor<S, 2, Eigen::RowMajor> y = ln(x);
    const auto ref = normcore::reference::layer_norm_forward(xw.data(), rows, n, (const float*)nullptr,
                                                             (const float*)nullptr, 1e-5);
    const auto a = agreement(y.data(), ref);
    std::printf("  %s mean %g: LayerNorm %.4f%% equal to the rounded reference\n",
                mantissa_bits<S>() == 7 ? "bfloat16" : "half", mean, 100 * a.equal_share);
    EXPECT_GE(a.equal_share, min_share) << "LayerNorm";
    EXPECT_LE(a.worst_ulps, 1.0) << "LayerNorm";
    normcore::RMSNorm<float> rn(normcore::RMSNormOptions({n}).eps(1e-6));
    Eigen::Tensor<S, 2, Eigen::RowMajor> z = rn(x);
    const auto rref = normcore::reference::rms_norm_forward(xw.data(), rows, n, (const float*)nullptr, 1e-6);
    const auto b = agreement(z.data(), rref);
    std::printf("  %s mean %g: RMSNorm %.4f%% equal to the rounded reference\n",
                mantissa_bits<S>() == 7 ? "bfloat16" : "half", mean, 100 * b.equal_share);
    EXPECT_GE(b.equal_share, min_share) << "RMSNorm";
    EXPECT_LE(b.worst_ulps, 1.0) << "RMSNorm";
    // Backward: the float path on the widened values, rounded once.
    const auto dys = to16<S>(randn<float>(xs.size(), 4));
    Eigen::TensorMap<const Eigen::Tensor<S, 2, Eigen::RowMajor>> dy(dys.data(), rows, n);
    Eigen::Tensor<S, 2, Eigen::RowMajor> dx(rows, n);
    Eigen::Tensor<float, 1> dw, db;
    ln.backward(x, dy, &dx, &dw, &db);
    const auto dyw = to32(dys);
    const auto gref = normcore::reference::layer_norm_backward(xw.data(), dyw.data(), rows, n,
                                                               (const float*)nullptr, 1e-5);
    EXPECT_GE(agreement(dx.data(), gref.dx).equal_share, min_share) << "LayerNorm dx";
    EXPECT_LE(max_diff(dw.data(), gref.dweight), tol<float>(max_abs(gref.dweight) + 4, double(rows)));
  }
}

TEST(Mixed, BFloat16RowNorms) { check_row_norms<Eigen::bfloat16>(0.999); }
TEST(Mixed, HalfRowNorms) { check_row_norms<Eigen::half>(0.995); }

TEST(Mixed, BatchNormBFloat16IsTheFloatPathRoundedOnce) {
  const Index N = 8, C = 5, S = 40;
  const auto xs = to16<Eigen::bfloat16>(randn<float>(static_cast<std::size_t>(N * C * S), 6, 2.0, 3.0));
  const auto xw = to32(xs);
  Eigen::TensorMap<const Eigen::Tensor<Eigen::bfloat16, 3, Eigen::RowMajor>> x(xs.data(), N, C, S);
  Eigen::TensorMap<const Eigen::Tensor<float, 3, Eigen::RowMajor>> xf(xw.data(), N, C, S);
  normcore::BatchNorm<float> a{normcore::BatchNormOptions(C)}, b{normcore::BatchNormOptions(C)};
  Eigen::Tensor<Eigen::bfloat16, 3, Eigen::RowMajor> y = a(x);
  Eigen::Tensor<float, 3, Eigen::RowMajor> yf = b(xf);
  for (Index i = 0; i < y.size(); ++i)
    ASSERT_EQ(static_cast<float>(y.data()[i]), static_cast<float>(static_cast<Eigen::bfloat16>(yf.data()[i])));
  EXPECT_TRUE(bit_equal(a.running_var().data(), b.running_var().data(), static_cast<std::size_t>(C)));
}

TEST(Fused, AddLayerNormEqualsAddThenNorm) {
  const Index rows = 50, n = 96;
  const auto xv = randn<float>(static_cast<std::size_t>(rows * n), 7);
  auto rv = randn<float>(xv.size(), 8, 1.0, 2.0);
  Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>> x(xv.data(), rows, n);
  Eigen::TensorMap<Eigen::Tensor<float, 2, Eigen::RowMajor>> res(rv.data(), rows, n);
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({n}));
  ln.weight().setRandom();
  normcore::RMSNorm<float> rn(normcore::RMSNormOptions({n}));
  // Unfused.
  Eigen::Tensor<float, 2, Eigen::RowMajor> h0 = x + res;
  Eigen::Tensor<float, 2, Eigen::RowMajor> y0 = ln(h0), z0 = rn(h0);
  normcore::NormStats<float> s0;
  Eigen::Tensor<float, 2, Eigen::RowMajor> tmp(rows, n);
  ln.forward(h0, tmp, s0);
  // Fused, into a separate h, then in place over the residual.
  Eigen::Tensor<float, 2, Eigen::RowMajor> h(rows, n), y(rows, n), z(rows, n);
  normcore::NormStats<float> s;
  ln.forward_add(x, res, h, y, &s);
  rn.forward_add(x, res, h, z);
  const auto N = static_cast<std::size_t>(rows * n);
  EXPECT_TRUE(bit_equal(h.data(), h0.data(), N));
  EXPECT_TRUE(bit_equal(y.data(), y0.data(), N));
  EXPECT_TRUE(bit_equal(z.data(), z0.data(), N));
  EXPECT_TRUE(bit_equal(s.rstd.data(), s0.rstd.data(), static_cast<std::size_t>(rows)));
  ln.forward_add(x, res, res, y);  // in place: res becomes h
  EXPECT_TRUE(bit_equal(rv.data(), h0.data(), N));
  EXPECT_TRUE(bit_equal(y.data(), y0.data(), N));
  // Backward: dx = LayerNorm'(h) dy + dh_next.
  const auto dyv = randn<float>(N, 9), dhv = randn<float>(N, 10);
  Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>> dy(dyv.data(), rows, n), dh(dhv.data(), rows, n);
  Eigen::Tensor<float, 2, Eigen::RowMajor> dx(rows, n), dx0(rows, n);
  Eigen::Tensor<float, 1> dw, db, dw0, db0;
  ln.backward_add(h0, dy, &dh, &dx, &dw, &db, &s0);
  ln.backward(h0, dy, &dx0, &dw0, &db0, &s0);
  for (Index i = 0; i < dx.size(); ++i) ASSERT_EQ(dx.data()[i], dx0.data()[i] + dhv[static_cast<std::size_t>(i)]);
  EXPECT_TRUE(bit_equal(dw.data(), dw0.data(), static_cast<std::size_t>(n)));
}

TEST(Fused, BFloat16ResidualSumsInFloatAndRoundsOnce) {
  const Index rows = 9, n = 64;
  const auto xs = to16<Eigen::bfloat16>(randn<float>(static_cast<std::size_t>(rows * n), 11));
  const auto rs = to16<Eigen::bfloat16>(randn<float>(xs.size(), 12, 0.0, 4.0));
  Eigen::TensorMap<const Eigen::Tensor<Eigen::bfloat16, 2, Eigen::RowMajor>> x(xs.data(), rows, n), r(rs.data(), rows, n);
  normcore::RMSNorm<float> rn(normcore::RMSNormOptions({n}));
  Eigen::Tensor<Eigen::bfloat16, 2, Eigen::RowMajor> h(rows, n), y(rows, n);
  rn.forward_add(x, r, h, y);
  for (Index i = 0; i < h.size(); ++i) {
    const auto want = static_cast<Eigen::bfloat16>(static_cast<float>(xs[static_cast<std::size_t>(i)]) +
                                                   static_cast<float>(rs[static_cast<std::size_t>(i)]));
    ASSERT_EQ(static_cast<float>(h.data()[i]), static_cast<float>(want));
  }
  Eigen::Tensor<Eigen::bfloat16, 2, Eigen::RowMajor> y0 = rn(h);
  for (Index i = 0; i < y.size(); ++i) ASSERT_EQ(static_cast<float>(y.data()[i]), static_cast<float>(y0.data()[i]));
}

}  // namespace
