// The accuracy experiment of the README's error table, shared by the test
// that enforces the targets and the tool that prints the table.
// fp32, data = offset + N(0, 1), gamma = 1, beta = 0; errors are max |y - ref|
// against the double two-pass reference.
#pragma once

#include <cmath>
#include <random>
#include <vector>

#include <normcore/normcore.hpp>
#include <normcore/reference/reference.hpp>

namespace nctest {

struct AccuracyRow {
  long H;
  double offset;
  double floor;        // ulp(mean)/2 / std: the input's own quantization
  double fwd;          // normcore LayerNorm forward, max abs error
  double naive;        // one-pass E[x^2] - E[x]^2 in float (NaN rows count as inf)
  double naive_nan_rows;  // fraction of rows the naive formula turns into NaN
  double bwd_dx;       // normcore LayerNorm backward dx (dy = N(0,1)), max abs error
};

inline AccuracyRow layer_norm_accuracy(long H, double offset, long rows = 64, unsigned seed = 2026) {
  std::mt19937_64 g(seed + static_cast<unsigned>(H));
  std::normal_distribution<double> nd;
  const std::size_t N = static_cast<std::size_t>(rows * H);
  std::vector<float> x(N), dy(N);
  double sum = 0, sq = 0;
  for (auto& v : x) {
    v = static_cast<float>(offset + nd(g));
    sum += v;
  }
  for (auto& v : dy) v = static_cast<float>(nd(g));
  const double mean = sum / static_cast<double>(N);
  for (float v : x) sq += (v - mean) * (v - mean);
  const double sd = std::sqrt(sq / static_cast<double>(N));
  const float mf = static_cast<float>(std::fabs(mean) > 0 ? std::fabs(mean) : 1.0);
  const double ulp = offset == 0.0 ? 0.0 : static_cast<double>(std::nextafter(mf, 2 * mf) - mf);

  AccuracyRow r{H, offset, ulp / 2 / sd, 0, 0, 0, 0};
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({H}));
  Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>> xm(x.data(), rows, H);
  Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>> dym(dy.data(), rows, H);
  Eigen::Tensor<float, 2, Eigen::RowMajor> y(rows, H), dx(rows, H);
  normcore::NormStats<float> stats;
  ln.forward(xm, y, stats);
  ln.backward(xm, dym, &dx, nullptr, nullptr, &stats);
  const auto ref = normcore::reference::layer_norm_forward(x.data(), rows, H, (const float*)nullptr,
                                                           (const float*)nullptr, 1e-5);
  const auto gref = normcore::reference::layer_norm_backward(x.data(), dy.data(), rows, H,
                                                             (const float*)nullptr, 1e-5);
  long nan_rows = 0;
  for (long i = 0; i < rows; ++i) {
    float s = 0, s2 = 0;
    for (long j = 0; j < H; ++j) {
      const float v = x[static_cast<std::size_t>(i * H + j)];
      s += v;
      s2 += v * v;
    }
    const float m = s / static_cast<float>(H);
    const float rs = 1.0f / std::sqrt(s2 / static_cast<float>(H) - m * m + 1e-5f);
    bool row_nan = false;
    for (long j = 0; j < H; ++j) {
      const std::size_t k = static_cast<std::size_t>(i * H + j);
      const float yn = (x[k] - m) * rs;
      if (std::isnan(yn)) row_nan = true;
      else r.naive = std::max(r.naive, std::fabs(static_cast<double>(yn) - ref[k]));
      r.fwd = std::max(r.fwd, std::fabs(static_cast<double>(y.data()[k]) - ref[k]));
      r.bwd_dx = std::max(r.bwd_dx, std::fabs(static_cast<double>(dx.data()[k]) - gref.dx[k]));
    }
    nan_rows += row_nan;
  }
  r.naive_nan_rows = static_cast<double>(nan_rows) / static_cast<double>(rows);
  return r;
}

}  // namespace nctest
