// Lesson 2: LayerNorm and BatchNorm normalize the same grid in two directions.
//
// Put a batch in a grid, one example per row and one feature per column.
// LayerNorm takes its mean and variance along each row: every example is
// normalized with its own statistics. BatchNorm takes them down each column:
// every feature is normalized with statistics of the whole batch.
//
// Consequences, each shown below:
//   * LayerNorm's output for an example does not depend on the rest of the
//     batch, nor on the batch size. BatchNorm's does, in training mode.
//   * BatchNorm in training mode cannot normalize a batch of one (one value
//     per feature has no variance): normcore throws std::invalid_argument.
//   * So BatchNorm keeps running averages of the batch statistics while it
//     trains, and in eval mode normalizes with them instead. LayerNorm has
//     nothing to average: it behaves the same in training and in inference.
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>

#include <normcore/batch_norm.hpp>
#include <normcore/layer_norm.hpp>

#include "lesson.hpp"

using lesson::claim;
using lesson::list;
using lesson::num;
using Grid = Eigen::Tensor<float, 2, Eigen::RowMajor>;

// Mean and (biased) variance of row r, or of column c, of a grid.
double row_mean(const Grid& g, long r) {
  double s = 0;
  for (long j = 0; j < g.dimension(1); ++j) s += g(r, j);
  return s / static_cast<double>(g.dimension(1));
}
double col_mean(const Grid& g, long c) {
  double s = 0;
  for (long i = 0; i < g.dimension(0); ++i) s += g(i, c);
  return s / static_cast<double>(g.dimension(0));
}
double col_var(const Grid& g, long c) {
  const double m = col_mean(g, c);
  double s = 0;
  for (long i = 0; i < g.dimension(0); ++i) s += (g(i, c) - m) * (g(i, c) - m);
  return s / static_cast<double>(g.dimension(0));
}

void print_grid(const char* title, const Grid& g) {
  std::printf("%s\n", title);
  for (long i = 0; i < g.dimension(0); ++i) {
    std::printf("   %s   row mean %s\n", list(g.dimension(1), [&](long j) { return g(i, j); }, 2).c_str(),
                num(row_mean(g, i), 2).c_str());
  }
  std::printf("   column means %s\n", list(g.dimension(1), [&](long j) { return col_mean(g, j); }, 2).c_str());
}

// A batch of n examples with 3 features whose means are 10, 0 and -5.
Grid sample(std::mt19937& gen, long n) {
  Grid g(n, 3);
  for (long i = 0; i < n; ++i) {
    for (long j = 0; j < 3; ++j) {
      const float u = static_cast<float>(gen() % 1000) / 1000.0f - 0.5f;  // [-0.5, 0.5)
      g(i, j) = (j == 0 ? 10.0f : (j == 1 ? 0.0f : -5.0f)) + 4.0f * u;
    }
  }
  return g;
}

int main() {
  // --- 1. One grid, two directions. ------------------------------------------
  Grid x(4, 3);
  x.setValues({{1, 2, 6}, {4, 4, 4}, {2, 8, 5}, {9, 2, 1}});
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({3}));
  normcore::BatchNorm<float> bn(normcore::BatchNormOptions(3).channel_axis(1));  // training mode
  const Grid y_ln = ln(x);
  const Grid y_bn = bn(x);
  print_grid("1. a batch of 4 examples (rows) with 3 features (columns)", x);
  print_grid("   after LayerNorm: every row has mean 0 (a constant row becomes 0)", y_ln);
  print_grid("   after BatchNorm: every column has mean 0 and variance 1", y_bn);
  bool rows_ok = true, cols_ok = true;
  for (long i = 0; i < 4; ++i) rows_ok = rows_ok && std::fabs(row_mean(y_ln, i)) < 1e-6;
  for (long j = 0; j < 3; ++j) {
    cols_ok = cols_ok && std::fabs(col_mean(y_bn, j)) < 1e-6 && std::fabs(col_var(y_bn, j) - 1) < 1e-3;
  }
  claim(rows_ok, "LayerNorm rows have mean 0");
  claim(cols_ok, "BatchNorm columns have mean 0 and variance 1");

  // --- 2. One example, alone and in company. ---------------------------------
  // e is the first row of two batches of 32 that share nothing else.
  std::mt19937 gen(5);
  Grid batch_a = sample(gen, 32), batch_b = sample(gen, 32);
  for (long j = 0; j < 3; ++j) batch_b(0, j) = batch_a(0, j);
  Grid e(1, 3);
  for (long j = 0; j < 3; ++j) e(0, j) = batch_a(0, j);
  const Grid ln_alone = ln(e), ln_a = ln(batch_a), ln_b = ln(batch_b);
  const Grid bn_a = bn(batch_a), bn_b = bn(batch_b);
  auto row0 = [](const Grid& g) { return list(3, [&](long j) { return g(0, j); }); };
  std::printf("2. e = %s\n", row0(e).c_str());
  std::printf("   LayerNorm(e) alone:       %s\n", row0(ln_alone).c_str());
  std::printf("   LayerNorm, in batch A:    %s\n", row0(ln_a).c_str());
  std::printf("   LayerNorm, in batch B:    %s\n", row0(ln_b).c_str());
  std::printf("   BatchNorm, in batch A:    %s\n", row0(bn_a).c_str());
  std::printf("   BatchNorm, in batch B:    %s\n", row0(bn_b).c_str());
  bool ln_same = true, bn_same = true;
  for (long j = 0; j < 3; ++j) {
    ln_same = ln_same && ln_alone(0, j) == ln_a(0, j) && ln_alone(0, j) == ln_b(0, j);
    bn_same = bn_same && std::fabs(bn_a(0, j) - bn_b(0, j)) < 1e-3f;
  }
  claim(ln_same, "LayerNorm gives e the same output alone and in both batches, bit for bit");
  claim(!bn_same, "BatchNorm gives e a different output in batch A and in batch B");

  // --- 3. Batch size 1 in training mode. --------------------------------------
  bool threw = false;
  try {
    bn(e);
  } catch (const std::invalid_argument& err) {
    threw = true;
    std::printf("3. BatchNorm(e) in training mode throws std::invalid_argument:\n   \"%s\"\n", err.what());
  }
  claim(threw, "BatchNorm training on a batch of one throws");

  // --- 4. Running averages and eval mode. --------------------------------------
  // Every training-mode call above also moved BatchNorm's running averages
  // (momentum 0.1: running = 0.9 * running + 0.1 * batch statistic). Train on
  // 200 more batches and they approach the features' means, 10, 0 and -5.
  // In eval mode BatchNorm normalizes with them: e gets one output, in any
  // batch and alone.
  for (int step = 0; step < 200; ++step) bn(sample(gen, 32));
  bn.eval();
  const Grid bn_alone = bn(e), bn_in_a = bn(batch_a);
  std::printf("4. after %ld training batches (the call that threw did not count):\n"
              "   running_mean = %s, running_var = %s\n",
              static_cast<long>(bn.num_batches_tracked()),
              list(3, [&](long j) { return bn.running_mean()(j); }, 2).c_str(),
              list(3, [&](long j) { return bn.running_var()(j); }, 2).c_str());
  std::printf("   eval mode, BatchNorm(e) alone:    %s\n", row0(bn_alone).c_str());
  std::printf("   eval mode, BatchNorm in batch A:  %s\n", row0(bn_in_a).c_str());
  claim(bn.num_batches_tracked() == 203, "203 batches tracked: 3 before the error, 200 after");
  claim(!bn.is_training(), "eval() leaves training mode");
  claim(std::fabs(bn.running_mean()(0) - 10) < 0.5 && std::fabs(bn.running_mean()(2) + 5) < 0.5,
        "running means approach 10 and -5");
  bool eval_same = true;
  for (long j = 0; j < 3; ++j) eval_same = eval_same && bn_alone(0, j) == bn_in_a(0, j);
  claim(eval_same, "in eval mode BatchNorm gives e the same output alone and in a batch");

  return lesson::finish("02_layer_vs_batch");
}
