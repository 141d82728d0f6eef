// Lesson 1: layer normalization, by hand and then with normcore.
//
// LayerNorm looks at one example (one row) at a time. For a row x of n values
// it takes the row's mean and biased variance,
//
//     mu = sum(x) / n,    sigma^2 = sum((x - mu)^2) / n,
//
// and returns x_hat = (x - mu) / sqrt(sigma^2 + eps): the row moved to mean 0
// and scaled to variance 1 (eps, 1e-5 by default, guards against division by
// zero). Then a learned per-feature scale gamma and shift beta give the layer
// its output y = gamma * x_hat + beta.
//
// For x = [2, 4, 4, 6]: mu = 16 / 4 = 4, sigma^2 = (4 + 0 + 0 + 4) / 4 = 2,
// and x_hat = [-2, 0, 0, 2] / sqrt(2) = [-1.41, 0, 0, 1.41].
#include <cmath>
#include <cstdio>

#include <normcore/normcore.hpp>

#include "lesson.hpp"

using lesson::claim;
using lesson::list;
using lesson::num;
using Row = Eigen::Tensor<float, 2, Eigen::RowMajor>;

int main() {
  // --- 1. The formula, one step at a time, in plain C++. -------------------
  const double x[4] = {2, 4, 4, 6};
  const double eps = 1e-5;
  double mu = 0;
  for (double v : x) mu += v / 4;
  double var = 0;
  for (double v : x) var += (v - mu) * (v - mu) / 4;
  double x_hat[4];
  for (int i = 0; i < 4; ++i) x_hat[i] = (x[i] - mu) / std::sqrt(var + eps);

  std::printf("1. by hand, x = [2, 4, 4, 6]\n");
  std::printf("   mu = %s, sigma^2 = %s\n", num(mu).c_str(), num(var).c_str());
  std::printf("   x_hat = %s\n", list(4, [&](long i) { return x_hat[i]; }).c_str());
  claim(mu == 4.0 && var == 2.0, "mu = 4 and sigma^2 = 2");
  claim(std::fabs(x_hat[3] - std::sqrt(2.0)) < 1e-5, "x_hat[3] = sqrt(2) up to eps");

  // --- 2. gamma and beta. ---------------------------------------------------
  // gamma = 2, beta = 1 stretches and shifts x_hat. And gamma = sqrt(sigma^2 +
  // eps), beta = mu gives back x itself: the layer can learn to undo its own
  // normalization wherever that helps the loss.
  double y[4], undo[4];
  for (int i = 0; i < 4; ++i) {
    y[i] = 2.0 * x_hat[i] + 1.0;
    undo[i] = std::sqrt(var + eps) * x_hat[i] + mu;
  }
  std::printf("2. gamma = 2, beta = 1:               y = %s\n",
              list(4, [&](long i) { return y[i]; }).c_str());
  std::printf("   gamma = sqrt(sigma^2+eps), beta = mu: y = %s\n",
              list(4, [&](long i) { return undo[i]; }).c_str());
  bool recovered = true;
  for (int i = 0; i < 4; ++i) recovered = recovered && std::fabs(undo[i] - x[i]) < 1e-12;
  claim(recovered, "gamma = sqrt(var + eps), beta = mu recovers x");

  // --- 3. The same through normcore::LayerNorm. -----------------------------
  // normalized_shape {4}: each row of 4 values is normalized on its own. A
  // new layer has weight (gamma) = 1 and bias (beta) = 0, so its output is
  // x_hat. forward(x, y, stats) also saves each row's mean and 1/sqrt(var +
  // eps) ("rstd") for the backward pass.
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({4}).eps(1e-5));
  Row batch(2, 4);
  batch.setValues({{2, 4, 4, 6}, {10, 20, 30, 40}});
  Row out(2, 4);
  normcore::NormStats<float> stats;
  ln.forward(batch, out, stats);
  std::printf("3. normcore::LayerNorm({4}) on two rows\n");
  for (int r = 0; r < 2; ++r) {
    std::printf("   row %d: mean %s, rstd %s, y = %s\n", r, num(stats.mean(r)).c_str(),
                num(stats.rstd(r)).c_str(), list(4, [&](long j) { return out(r, j); }).c_str());
  }
  bool same = true;
  for (int j = 0; j < 4; ++j) same = same && std::fabs(out(0, j) - x_hat[j]) < 1e-6;
  claim(same, "LayerNorm's first row equals x_hat by hand");
  claim(stats.mean(0) == 4.0f && stats.mean(1) == 25.0f, "saved means are 4 and 25");

  // Its parameters are plain tensors: set gamma = 2 and beta = 1 and the
  // layer reproduces the y of step 2.
  ln.weight().setConstant(2.0f);
  ln.bias().setConstant(1.0f);
  Row y_ln = ln(batch);
  std::printf("   weight = 2, bias = 1: row 0 y = %s\n",
              list(4, [&](long j) { return y_ln(0, j); }).c_str());
  same = true;
  for (int j = 0; j < 4; ++j) same = same && std::fabs(y_ln(0, j) - y[j]) < 1e-5;
  claim(same, "LayerNorm with weight 2, bias 1 equals y by hand");

  // elementwise_affine(false): no gamma, no beta, the output is always x_hat.
  normcore::LayerNorm<float> plain(normcore::LayerNormOptions({4}).elementwise_affine(false));
  Row y_plain = plain(batch);
  std::printf("   elementwise_affine(false): %ld parameters, row 0 y = %s\n",
              static_cast<long>(plain.weight().size() + plain.bias().size()),
              list(4, [&](long j) { return y_plain(0, j); }).c_str());
  claim(plain.weight().size() == 0 && plain.bias().size() == 0, "no parameters without affine");
  claim(std::fabs(y_plain(0, 0) - x_hat[0]) < 1e-6, "elementwise_affine(false) gives x_hat");

  // --- 4. Which dims are normalized: normalized_shape. ----------------------
  // Take images x[N, C, H, W] = [2, 2, 2, 3] holding 0, 1, ..., 23.
  // normalized_shape {W} = {3} normalizes each run of 3 values along W on its
  // own: 2 * 2 * 2 = 8 rows, each of them [k, k+1, k+2], so every output row is
  // [-1.22, 0, 1.22]. normalized_shape {C, H, W} = {2, 2, 3} normalizes over
  // the last three dims at once: one row of 12 values per image, whose output
  // spreads from -1.59 to 1.59 and has mean 0 and variance 1 only as a whole.
  // The weight has one entry per normalized element: 3, or 2 * 2 * 3 = 12.
  Eigen::Tensor<float, 4, Eigen::RowMajor> img(2, 2, 2, 3);
  for (Eigen::Index i = 0; i < img.size(); ++i) img.data()[i] = static_cast<float>(i);
  normcore::LayerNorm<float> ln_w(normcore::LayerNormOptions({3}));
  normcore::LayerNorm<float> ln_chw(normcore::LayerNormOptions({2, 2, 3}));
  normcore::NormStats<float> s_w, s_chw;
  Eigen::Tensor<float, 4, Eigen::RowMajor> y_w(2, 2, 2, 3), y_chw(2, 2, 2, 3);
  ln_w.forward(img, y_w, s_w);
  ln_chw.forward(img, y_chw, s_chw);
  auto first12 = [](const Eigen::Tensor<float, 4, Eigen::RowMajor>& t) {
    return list(12, [&](long i) { return t.data()[i]; }, 2);
  };
  std::printf("4. x of shape [N, C, H, W] = [2, 2, 2, 3]; image 0 after each LayerNorm:\n");
  std::printf("   {W}:       %ld rows, %ld weights, y = %s\n",
              static_cast<long>(s_w.mean.size()), static_cast<long>(ln_w.weight().size()),
              first12(y_w).c_str());
  std::printf("   {C, H, W}: %ld rows, %ld weights, y = %s\n",
              static_cast<long>(s_chw.mean.size()), static_cast<long>(ln_chw.weight().size()),
              first12(y_chw).c_str());
  claim(s_w.mean.size() == 8 && s_chw.mean.size() == 2, "8 rows for {W}, 2 for {C, H, W}");
  claim(ln_w.weight().size() == 3 && ln_chw.weight().size() == 12, "3 and 12 weights");
  bool rows_equal = true;
  for (Eigen::Index i = 0; i < y_w.size(); ++i) {
    const float want = (i % 3 == 0) ? -1.2247f : (i % 3 == 1 ? 0.0f : 1.2247f);
    rows_equal = rows_equal && std::fabs(y_w.data()[i] - want) < 1e-3f;
  }
  claim(rows_equal, "{W}: every row is [-1.22, 0, 1.22]");
  double m = 0, v = 0;
  for (int i = 0; i < 12; ++i) m += y_chw.data()[i] / 12.0;
  for (int i = 0; i < 12; ++i) v += (y_chw.data()[i] - m) * (y_chw.data()[i] - m) / 12.0;
  claim(std::fabs(m) < 1e-6 && std::fabs(v - 1.0) < 1e-4, "{C, H, W}: image 0 has mean 0, var 1");
  claim(std::fabs(y_chw(0, 0, 0, 0) + 1.5933f) < 1e-3f && std::fabs(y_chw(0, 1, 1, 2) - 1.5933f) < 1e-3f,
        "{C, H, W}: outputs spread from -1.59 to 1.59");

  return lesson::finish("01_layer_norm_by_hand");
}
