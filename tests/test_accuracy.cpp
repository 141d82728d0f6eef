// Accuracy targets (the README's error table): LayerNorm forward within 1.5x
// the floor set by the input's own quantization at large offsets, within
// 4e-7 at offset 0; backward dx within oneDNN's error at offset 1e4.
#include "accuracy.hpp"
#include "test_util.hpp"

namespace {

using nctest::layer_norm_accuracy;

// With FMA, y = fma(x - pivot, rstd, -shift) rounds once. A build without FMA
// (the baseline-ISA test binary) rounds the product and the sum separately,
// which costs up to one more half-ulp of |y| <= ~4.5 at offset 0.
#ifdef EIGEN_VECTORIZE_FMA
constexpr double kOffsetZeroForward = 4e-7;
constexpr double kOffsetZeroBackward = 5e-7;
#else
constexpr double kOffsetZeroForward = 4e-7 + 2.4e-7;
constexpr double kOffsetZeroBackward = 5e-7 + 2.4e-7;
#endif

TEST(Accuracy, LayerNormForwardAtTheFloor) {
  for (long H : {64L, 768L, 4096L}) {
    for (double offset : {1e2, 1e4, 1e6}) {
      const auto r = layer_norm_accuracy(H, offset);
      EXPECT_LE(r.fwd, 1.5 * r.floor) << "H=" << H << " offset=" << offset << " floor=" << r.floor;
      // The naive one-pass formula misses the same target: the test can fail.
      EXPECT_TRUE(r.naive > 1.5 * r.floor || r.naive_nan_rows > 0) << "H=" << H << " offset=" << offset;
    }
    const auto z = layer_norm_accuracy(H, 0.0);
    EXPECT_LE(z.fwd, kOffsetZeroForward) << "H=" << H;
  }
}

TEST(Accuracy, LayerNormBackwardDx) {
  const auto r = layer_norm_accuracy(768, 1e4);
  EXPECT_LE(r.bwd_dx, 1.4e-4);  // oneDNN 2.6: 1.4e-4, libtorch 1.13: 1.1e-3
  for (long H : {64L, 768L, 4096L}) {
    EXPECT_LE(layer_norm_accuracy(H, 0.0).bwd_dx, kOffsetZeroBackward) << "H=" << H;
  }
}

}  // namespace

namespace {

// BatchNorm training forward at the same offsets: (N=8, C=4, H) with every
// channel's statistics over 8 x H values.
TEST(Accuracy, BatchNormTrainingForwardAtTheFloor) {
  for (long H : {64L, 768L, 4096L}) {
    for (double offset : {0.0, 1e2, 1e4, 1e6}) {
      const long N = 8, C = 4;
      const auto v = nctest::randn<float>(static_cast<std::size_t>(N * C * H), unsigned(H), offset, 1.0);
      Eigen::TensorMap<const Eigen::Tensor<float, 3, Eigen::RowMajor>> x(v.data(), N, C, H);
      normcore::BatchNorm<float> bn{normcore::BatchNormOptions(C)};
      Eigen::Tensor<float, 3, Eigen::RowMajor> y = bn(x);
      const auto st = normcore::reference::channel_stats(v.data(), N, C, H);
      const auto ref = normcore::reference::batch_norm_forward(v.data(), N, C, H, st.mean, st.var,
                                                               (const float*)nullptr, (const float*)nullptr, 1e-5);
      const float m = static_cast<float>(offset);
      const double floor = offset == 0 ? 0 : (std::nextafter(m, 2 * m) - m) / 2.0;
      const double bound = offset == 0 ? kOffsetZeroForward : 1.5 * floor;
      EXPECT_LE(nctest::max_diff(y.data(), ref), bound) << "H=" << H << " offset=" << offset;
    }
  }
}

}  // namespace
