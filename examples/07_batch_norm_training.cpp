// Lesson 7: BatchNorm in a training loop.
//
// In training mode BatchNorm normalizes each batch with that batch's own
// statistics and, on the side, updates running averages of them:
//
//     running = (1 - momentum) * running + momentum * batch statistic
//
// (momentum 0.1 by default; running_mean starts at 0, running_var at 1; as
// in PyTorch, the variance that goes into running_var is the unbiased one,
// sum((x - mean)^2) / (n - 1), while the batch itself is normalized with
// the biased one, divided by n). In
// eval mode it normalizes with the running averages instead, so a model can
// then predict one example at a time.
//
// Below: a linear model on top of BatchNorm learns a regression by SGD on
// batches of 16. The running statistics converge to the features' true mean
// (3, -1) and variance (4, 0.25). Each training batch is normalized with
// its own statistics, estimated from 16 examples, so the features the model
// sees in training are noisy. Switched to eval mode, the trained model
// predicts single held-out examples with the running statistics, and does
// better than it did on its training batches. Last, momentum against
// momentum(std::nullopt), the cumulative average, when the data drift.
#include <cmath>
#include <cstdio>
#include <optional>
#include <random>

#include <normcore/batch_norm.hpp>

#include "lesson.hpp"

using lesson::claim;
using lesson::list;
using lesson::num;
using Batch = Eigen::Tensor<float, 2, Eigen::RowMajor>;

// n examples of 2 features, feature 0 ~ mean0 + 2 u, feature 1 ~ -1 + 0.5 u,
// u of mean 0 and variance 1 (uniform), and the target y = 1.5 z0 - 2 z1 on
// the standardized features z.
struct Data {
  std::mt19937 gen{3};
  float u() { return (static_cast<float>(gen() % 100000) / 100000.0f - 0.5f) * std::sqrt(12.0f); }
  Batch x;
  Eigen::Tensor<float, 1> y;
  void sample(long n, float mean0 = 3.0f) {
    x.resize(n, 2);
    y.resize(n);
    for (long i = 0; i < n; ++i) {
      const float z0 = u(), z1 = u();
      x(i, 0) = mean0 + 2.0f * z0;
      x(i, 1) = -1.0f + 0.5f * z1;
      y(i) = 1.5f * z0 - 2.0f * z1;
    }
  }
};

int main() {
  // --- 1. Training: the running statistics converge. --------------------------
  normcore::BatchNorm<float> bn(normcore::BatchNormOptions(2).affine(false).channel_axis(1));
  float w[2] = {0, 0}, b = 0;
  const float lr = 0.1f;
  double late_loss = 0;  // mean batch loss over the last 100 steps
  Data data;
  std::printf("1. training, batches of 16 (true mean [3, -1], true variance [4, 0.25])\n");
  std::printf("   step   running_mean       running_var        batch loss\n");
  for (int step = 1; step <= 300; ++step) {
    data.sample(16);
    const Batch z = bn(data.x);  // training mode: batch statistics
    float loss = 0, gw0 = 0, gw1 = 0, gb = 0;
    for (long i = 0; i < 16; ++i) {
      const float err = w[0] * z(i, 0) + w[1] * z(i, 1) + b - data.y(i);
      loss += 0.5f * err * err / 16;
      gw0 += err * z(i, 0) / 16;
      gw1 += err * z(i, 1) / 16;
      gb += err / 16;
    }
    w[0] -= lr * gw0;
    w[1] -= lr * gw1;
    b -= lr * gb;
    if (step > 200) late_loss += loss / 100.0;
    if (step == 1) {  // running_var after one batch: 0.9 * 1 + 0.1 * unbiased variance
      double m = 0, q = 0;
      for (long i = 0; i < 16; ++i) m += data.x(i, 0) / 16.0;
      for (long i = 0; i < 16; ++i) q += (data.x(i, 0) - m) * (data.x(i, 0) - m);
      claim(std::fabs(bn.running_var()(0) - (0.9 + 0.1 * q / 15)) < 1e-5,
            "running_var takes the unbiased batch variance");
    }
    if (step == 1 || step == 10 || step == 30 || step == 100 || step == 300) {
      std::printf("   %4d   %s   %s   %s\n", step,
                  list(2, [&](long c) { return bn.running_mean()(c); }, 3).c_str(),
                  list(2, [&](long c) { return bn.running_var()(c); }, 3).c_str(), num(loss).c_str());
    }
  }
  std::printf("   mean batch loss over steps 201-300: %s\n", num(late_loss).c_str());
  claim(bn.num_batches_tracked() == 300, "300 batches tracked");
  claim(std::fabs(bn.running_mean()(0) - 3) < 0.3f && std::fabs(bn.running_mean()(1) + 1) < 0.1f,
        "running_mean converges to [3, -1]");
  claim(std::fabs(bn.running_var()(0) - 4) < 1.0f && std::fabs(bn.running_var()(1) - 0.25f) < 0.07f,
        "running_var converges to [4, 0.25]");

  // --- 2. Eval: one example at a time, with the running statistics. -----------
  bn.eval();
  double eval_loss = 0;
  bool by_hand = true;
  const long kHeldOut = 200;
  for (long i = 0; i < kHeldOut; ++i) {
    data.sample(1);
    const Batch z = bn(data.x);  // batch of one: fine in eval mode
    const float err = w[0] * z(0, 0) + w[1] * z(0, 1) + b - data.y(0);
    eval_loss += 0.5 * err * err / kHeldOut;
    for (long c = 0; c < 2; ++c) {
      const float want = (data.x(0, c) - bn.running_mean()(c)) / std::sqrt(bn.running_var()(c) + 1e-5f);
      by_hand = by_hand && std::fabs(z(0, c) - want) < 1e-4f;
    }
  }
  std::printf("2. eval mode, %ld held-out examples one at a time: mean loss %s, weights %s, bias %s\n",
              kHeldOut, num(eval_loss).c_str(), list(2, [&](long c) { return w[c]; }, 3).c_str(),
              num(b, 3).c_str());
  claim(!bn.is_training(), "eval() leaves training mode");
  claim(by_hand, "eval output = (x - running_mean) / sqrt(running_var + eps)");
  claim(eval_loss < 0.5 * late_loss, "eval loss is below half the late training loss");

  // --- 3. Momentum against the cumulative average, on drifting data. ----------
  // 200 batches; feature 0's mean moves from 3 to 5 after batch 100. With
  // momentum 0.1 the running mean forgets old batches (weight 0.9^k after k
  // more): it ends near 5. With momentum(std::nullopt) every batch counts
  // equally: it ends near the average of all batches, 4.
  normcore::BatchNorm<float> ema(normcore::BatchNormOptions(2).affine(false).channel_axis(1).momentum(0.1));
  normcore::BatchNorm<float> cma(
      normcore::BatchNormOptions(2).affine(false).channel_axis(1).momentum(std::nullopt));
  std::printf("3. feature 0 drifts from mean 3 to mean 5 after batch 100\n");
  std::printf("   batch   momentum 0.1   cumulative\n");
  for (int step = 1; step <= 200; ++step) {
    data.sample(16, step <= 100 ? 3.0f : 5.0f);
    ema(data.x);
    cma(data.x);
    if (step % 50 == 0) {
      std::printf("   %5d   %12s   %10s\n", step, num(ema.running_mean()(0), 3).c_str(),
                  num(cma.running_mean()(0), 3).c_str());
    }
  }
  claim(std::fabs(ema.running_mean()(0) - 5) < 0.3f, "momentum 0.1 ends near 5");
  claim(std::fabs(cma.running_mean()(0) - 4) < 0.3f, "the cumulative average ends near 4");

  return lesson::finish("07_batch_norm_training");
}
