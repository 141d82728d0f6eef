// Lesson 4: RMSNorm, LayerNorm without the mean.
//
// RMSNorm (Zhang and Sennrich, 2019) divides each row by its root mean
// square and skips the centring:
//
//     y = x / sqrt(mean(x^2) + eps) * gamma            (a weight, no bias)
//
// For a row whose mean is 0, mean(x^2) is exactly the variance, so RMSNorm
// and LayerNorm agree (with the same eps). Otherwise they differ: RMSNorm
// does not move the row to mean 0; [2, 4, 4, 6] stays all positive.
// LayerNorm is RMSNorm applied to x - mean(x).
//
// What RMSNorm saves is the mean. Its one statistic, a sum of squares, costs
// a multiply-add per value. LayerNorm needs the mean before the variance: two
// passes over the row as the formula is written, or, as normcore does it,
// one Welford pass whose update costs several operations per value (and then
// both layers make one more pass to write the output). Part 3 times the two
// layers on the same data and prints the ratio; timings vary from machine to
// machine, so those numbers are an illustration, not a checked claim.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include <normcore/layer_norm.hpp>
#include <normcore/rms_norm.hpp>

#include "lesson.hpp"

using lesson::claim;
using lesson::list;
using lesson::num;
using Rows = Eigen::Tensor<float, 2, Eigen::RowMajor>;

int main() {
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({4}).eps(1e-5));
  normcore::RMSNorm<float> rn(normcore::RMSNormOptions({4}).eps(1e-5));

  // --- 1. Same data, both layers. ---------------------------------------------
  Rows x(2, 4);
  x.setValues({{-3, -1, 1, 3}, {2, 4, 4, 6}});
  Rows y_ln(2, 4), y_rn(2, 4);
  normcore::NormStats<float> s_ln, s_rn;
  ln.forward(x, y_ln, s_ln);
  rn.forward(x, y_rn, s_rn);
  auto row = [](const Rows& t, long r) { return list(4, [&](long j) { return t(r, j); }); };
  std::printf("1. x = [-3, -1, 1, 3] (mean 0)\n");
  std::printf("   LayerNorm: %s\n   RMSNorm:   %s\n", row(y_ln, 0).c_str(), row(y_rn, 0).c_str());
  std::printf("   x = [2, 4, 4, 6] (mean 4, mean of squares 18)\n");
  std::printf("   LayerNorm: %s\n   RMSNorm:   %s\n", row(y_ln, 1).c_str(), row(y_rn, 1).c_str());
  std::printf("   RMSNorm's saved rstd: %s = 1/sqrt(5 + eps), 1/sqrt(18 + eps)\n",
              list(2, [&](long r) { return s_rn.rstd(r); }).c_str());
  bool equal0 = true, differ1 = false;
  for (long j = 0; j < 4; ++j) {
    equal0 = equal0 && std::fabs(y_ln(0, j) - y_rn(0, j)) < 1e-6f;
    differ1 = differ1 || std::fabs(y_ln(1, j) - y_rn(1, j)) > 0.1f;
  }
  claim(equal0, "zero-mean row: RMSNorm equals LayerNorm");
  claim(differ1, "row with mean 4: RMSNorm differs from LayerNorm");
  claim(std::fabs(y_rn(1, 0) - 2.0f / std::sqrt(18.0f)) < 1e-5f, "RMSNorm(2) = 2 / sqrt(18)");
  claim(std::fabs(s_rn.rstd(1) - 1.0f / std::sqrt(18.0f + 1e-5f)) < 1e-6f, "saved rstd = 1/rms");

  // --- 2. LayerNorm = RMSNorm after centring. ---------------------------------
  Rows centred(1, 4);
  centred.setValues({{-2, 0, 0, 2}});  // [2, 4, 4, 6] - 4
  const Rows y_c = rn(centred);
  std::printf("2. RMSNorm(x - mean(x)) = %s (LayerNorm(x) above)\n", row(y_c, 0).c_str());
  bool same = true;
  for (long j = 0; j < 4; ++j) same = same && std::fabs(y_c(0, j) - y_ln(1, j)) < 1e-6f;
  claim(same, "RMSNorm of the centred row equals LayerNorm of the row");

  // --- 3. The cost: one statistic against two. ----------------------------------
  // Rows of 1024 floats, each layer timed 20 times in turn; the fastest run
  // of each counts. 256 rows (1 MB) stay in cache: there the statistics pass
  // is most of the work and RMSNorm's cheaper one shows. 4096 rows (16 MB)
  // come from memory: both layers then wait mostly on memory and the gap
  // typically narrows.
  auto time_both = [](long rows) {
    const long n = 1024;
    Rows big(rows, n), out(rows, n);
    for (long i = 0; i < big.size(); ++i) big.data()[i] = static_cast<float>((i * 7919) % 1000) * 1e-3f + 0.5f;
    normcore::LayerNorm<float> ln_big(normcore::LayerNormOptions({n}));
    normcore::RMSNorm<float> rn_big(normcore::RMSNormOptions({n}));
    auto time_once = [&](const auto& layer) {
      const auto t0 = std::chrono::steady_clock::now();
      layer.forward(big, out);
      const auto t1 = std::chrono::steady_clock::now();
      return std::chrono::duration<double, std::micro>(t1 - t0).count();
    };
    double t_ln = 1e30, t_rn = 1e30;
    for (int rep = 0; rep < 20; ++rep) {  // alternate, so that load on the machine hits both
      t_ln = std::min(t_ln, time_once(ln_big));
      t_rn = std::min(t_rn, time_once(rn_big));
    }
    std::printf("   %4ld x %ld floats: LayerNorm %6.0f us, RMSNorm %6.0f us, LayerNorm / RMSNorm = %.2f\n",
                rows, n, t_ln, t_rn, t_ln / t_rn);
  };
  std::printf("3. forward time (depends on the machine and the build; not checked)\n");
  time_both(256);
  time_both(4096);

  return lesson::finish("04_rms_norm");
}
