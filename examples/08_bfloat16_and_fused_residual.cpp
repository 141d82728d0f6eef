// Lesson 8: bfloat16 activations and the fused residual norm.
//
// A transformer block in inference keeps two streams in 16 bits: the
// residual stream h and the normalized input of the next sub-layer,
//
//     h = h + x              (x: what the previous sub-layer produced)
//     y = norm(h)            (LayerNorm or RMSNorm)
//
// bfloat16 has 8 significant bits: one part in 256. Storing a value in it is
// fine; *accumulating* in it is not. Once a running sum reaches a few
// hundred, adding a value near 1 moves it by less than half an ulp, so the
// sum stalls. Part 1 shows it on the mean of one row. normcore widens the
// values to float, shifts them by a pivot (the row's first value), runs
// Welford's update in float, merges in double, and rounds only the outputs
// (part 2).
//
// The add and the norm read and write the same rows. Done as two calls, the
// rows travel through memory twice. forward_add does both in one pass: each
// block of rows is added, then normalized while it is still in cache (part
// 3). Its backward, backward_add, returns the gradient of both x and h: the
// norm's backward plus the gradient that reaches h from the rest of the
// stream. Part 4 checks it with finite differences.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <normcore/normcore.hpp>
#include <normcore/reference/layer_norm.hpp>

#include "lesson.hpp"

using lesson::claim;
using lesson::num;
using BF = Eigen::bfloat16;

int main() {
  const long n = 4096;
  std::mt19937 gen(8);
  std::normal_distribution<float> around30(30.0f, 1.0f), standard(0.0f, 1.0f);
  Eigen::Tensor<BF, 2, Eigen::RowMajor> x(1, n);
  for (long j = 0; j < n; ++j) x(0, j) = BF(around30(gen));

  // --- 1. The mean of a row with mean 30, summed in bfloat16. -------------------
  double exact = 0;
  BF sum16(0.0f);
  for (long j = 0; j < n; ++j) {
    exact += static_cast<double>(static_cast<float>(x(0, j)));
    sum16 = BF(static_cast<float>(sum16) + static_cast<float>(x(0, j)));  // rounded each step
  }
  exact /= static_cast<double>(n);
  const double mean16 = static_cast<double>(static_cast<float>(sum16)) / static_cast<double>(n);
  std::printf("1. mean of %ld bfloat16 values around 30\n", n);
  std::printf("   exact: %s   summed in bfloat16: %s\n", num(exact, 6).c_str(), num(mean16, 6).c_str());
  claim(std::fabs(mean16 - exact) > 10.0, "a bfloat16 running sum stalls far from the mean");

  // --- 2. normcore: statistics in float, outputs rounded once. -----------------
  normcore::LayerNorm<BF> ln(normcore::LayerNormOptions({n}));  // weight and bias in bfloat16
  Eigen::Tensor<BF, 2, Eigen::RowMajor> y(1, n);
  normcore::NormStats<float> stats;  // saved statistics stay in float
  ln.forward(x, y, stats);
  std::vector<float> xw(static_cast<std::size_t>(n));
  for (long j = 0; j < n; ++j) xw[static_cast<std::size_t>(j)] = static_cast<float>(x(0, j));
  const auto ref = normcore::reference::layer_norm_forward(xw.data(), 1, n, (const float*)nullptr,
                                                           (const float*)nullptr, 1e-5);
  long equal = 0;
  for (long j = 0; j < n; ++j)
    equal += static_cast<float>(y(0, j)) == static_cast<float>(BF(static_cast<float>(ref[static_cast<std::size_t>(j)])));
  std::printf("2. normcore's mean: %s (error %.1e)\n", num(stats.mean(0), 6).c_str(),
              std::fabs(static_cast<double>(stats.mean(0)) - exact));
  std::printf("   outputs equal to the exact result rounded to bfloat16: %ld of %ld\n", equal, n);
  claim(std::fabs(static_cast<double>(stats.mean(0)) - exact) < 1e-5, "the float mean is exact to float's precision");
  claim(equal >= n - n / 1000, "at least 99.9% of the outputs are the correctly rounded ones");

  // --- 3. The fused residual norm. ----------------------------------------------
  const long rows = 64;
  Eigen::Tensor<BF, 2, Eigen::RowMajor> h(rows, n), h2(rows, n), sub(rows, n), y1(rows, n), y2(rows, n);
  for (long i = 0; i < h.size(); ++i) {
    h.data()[i] = BF(3.0f * standard(gen));
    sub.data()[i] = BF(standard(gen));
  }
  h2 = h;
  ln.forward_add(sub, h, h, y1);  // h += sub in place, y1 = LayerNorm(h): one pass
  for (long i = 0; i < h2.size(); ++i)  // the same in two passes: add (float sum, one rounding), then norm
    h2.data()[i] = BF(static_cast<float>(h2.data()[i]) + static_cast<float>(sub.data()[i]));
  ln.forward(h2, y2);
  bool same = true;
  for (long i = 0; i < h.size(); ++i)
    same = same && static_cast<float>(h.data()[i]) == static_cast<float>(h2.data()[i]) &&
           static_cast<float>(y1.data()[i]) == static_cast<float>(y2.data()[i]);
  std::printf("3. fused: h and y bit-identical to add then norm: %s\n", same ? "yes" : "no");
  claim(same, "forward_add equals the add followed by the norm, bit for bit");

  // --- 4. backward_add against finite differences (in double). -----------------
  // Loss L = sum(c * y) + sum(e * h) with h = x + r, y = LayerNorm(h):
  // dL/dx = dL/dr = LayerNorm'(h)^T c + e, i.e. backward_add with dy = c, dh_next = e.
  const long m = 3, k = 16;
  normcore::LayerNorm<double> lnd(normcore::LayerNormOptions({k}));
  using D2 = Eigen::Tensor<double, 2, Eigen::RowMajor>;
  D2 xd(m, k), rd(m, k), c(m, k), e(m, k), hd(m, k), yd(m, k), dx(m, k);
  for (D2* t : {&xd, &rd, &c, &e})
    for (long i = 0; i < t->size(); ++i) t->data()[i] = standard(gen);
  for (long j = 0; j < k; ++j) lnd.weight()(j) = 1.0 + 0.1 * j;
  auto loss = [&](const D2& xv) {
    D2 hh(m, k), yy(m, k);
    lnd.forward_add(xv, rd, hh, yy);
    double l = 0;
    for (long i = 0; i < hh.size(); ++i) l += c.data()[i] * yy.data()[i] + e.data()[i] * hh.data()[i];
    return l;
  };
  lnd.forward_add(xd, rd, hd, yd);
  lnd.backward_add(hd, c, &e, &dx, nullptr, nullptr);
  double worst = 0, scale = 0;
  for (long i = 0; i < xd.size(); ++i) {
    D2 plus = xd, minus = xd;
    plus.data()[i] += 1e-6;
    minus.data()[i] -= 1e-6;
    const double fd = (loss(plus) - loss(minus)) / 2e-6;
    worst = std::max(worst, std::fabs(fd - dx.data()[i]));
    scale = std::max(scale, std::fabs(fd));
  }
  std::printf("4. backward_add vs finite differences: relative error %.1e\n", worst / scale);
  claim(worst / scale < 1e-6, "backward_add is the gradient of the fused op");

  return lesson::finish("08_bfloat16_and_fused_residual");
}
