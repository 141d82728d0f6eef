// Lesson 3: padded sequences.
//
// Sequences of different lengths are batched by padding them with zeros to
// one length T, giving a tensor [batch, T, features]. A normalization layer
// sees the padding as data unless told otherwise.
//
// BatchNorm averages each feature over every position of the batch, the
// padded ones included: its mean is pulled toward 0 and its variance grows,
// by an amount that depends on how much padding the batch happens to hold.
// The same sentence is then normalized differently depending on the length
// of the longest sentence it is batched with.
//
// LayerNorm's statistics are per token: a real token's row never contains
// padding, so its output does not change whatever the padding. (A padded row
// is constant, and LayerNorm maps a constant row to exactly its bias, 0.)
//
// Below: three sequences of lengths 5, 3 and 2 with 4 features whose values
// are around 5, padded to T = 5 and to T = 10.
#include <cmath>
#include <cstdio>

#include <normcore/batch_norm.hpp>
#include <normcore/layer_norm.hpp>

#include "lesson.hpp"

using lesson::claim;
using lesson::list;
using lesson::num;
using Seq = Eigen::Tensor<float, 3, Eigen::RowMajor>;  // [batch, T, features]

constexpr long kBatch = 3, kFeatures = 4;
const long kLengths[kBatch] = {5, 3, 2};

// The batch padded with zeros to length T. Token t of sequence b, feature f:
// a fixed pattern around 5.
Seq padded(long T) {
  Seq x(kBatch, T, kFeatures);
  x.setZero();
  for (long b = 0; b < kBatch; ++b) {
    for (long t = 0; t < kLengths[b]; ++t) {
      for (long f = 0; f < kFeatures; ++f) {
        x(b, t, f) = 5.0f + static_cast<float>((3 * b + 5 * t + 7 * f) % 9) * 0.5f - 2.0f;
      }
    }
  }
  return x;
}

int main() {
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({kFeatures}));
  Seq x5 = padded(5), x10 = padded(10);

  // BatchNorm with the features as channels: channel_axis(-1), the last dim
  // of [batch, T, features]. Its statistics for each feature run over all
  // batch * T positions. forward(x, y, stats) also returns the per-channel
  // mean it normalized with.
  auto batch_norm = [](const Seq& x, float* channel_mean0) {
    normcore::BatchNorm<float> bn(normcore::BatchNormOptions(kFeatures).channel_axis(-1));
    Seq y(x.dimension(0), x.dimension(1), kFeatures);
    normcore::NormStats<float> stats;
    bn.forward(x, y, stats);
    *channel_mean0 = stats.mean(0);
    return y;
  };
  float m5 = 0, m10 = 0;
  const Seq bn5 = batch_norm(x5, &m5), bn10 = batch_norm(x10, &m10);
  const Seq ln5 = ln(x5), ln10 = ln(x10);

  // Feature 0's mean over real tokens only, for comparison.
  double real = 0;
  long n_real = 0;
  for (long b = 0; b < kBatch; ++b) {
    for (long t = 0; t < kLengths[b]; ++t, ++n_real) real += x5(b, t, 0);
  }
  real /= static_cast<double>(n_real);
  std::printf("1. feature 0 over the %ld real tokens has mean %s\n", n_real, num(real, 3).c_str());
  std::printf("   BatchNorm's mean of feature 0, padded to T = 5:  %s (%ld of 15 positions real)\n",
              num(m5, 3).c_str(), n_real);
  std::printf("   BatchNorm's mean of feature 0, padded to T = 10: %s (%ld of 30 positions real)\n",
              num(m10, 3).c_str(), n_real);
  claim(std::fabs(m5 - real * n_real / 15.0) < 1e-3, "padded to 5, the mean shrinks by 10/15");
  claim(std::fabs(m10 - real * n_real / 30.0) < 1e-3, "padded to 10, the mean shrinks by 10/30");

  // The last token of the shortest sequence (b = 2, t = 1).
  auto token = [](const Seq& s) { return list(kFeatures, [&](long f) { return s(2, 1, f); }); };
  std::printf("2. sequence 2, token 1 = %s\n", token(x5).c_str());
  std::printf("   BatchNorm, padded to 5:   %s\n", token(bn5).c_str());
  std::printf("   BatchNorm, padded to 10:  %s\n", token(bn10).c_str());
  std::printf("   LayerNorm, padded to 5:   %s\n", token(ln5).c_str());
  std::printf("   LayerNorm, padded to 10:  %s\n", token(ln10).c_str());
  std::printf("   LayerNorm of a padded position: %s\n",
              list(kFeatures, [&](long f) { return ln10(2, 7, f); }).c_str());

  bool ln_same = true, bn_same = true, pad_zero = true;
  for (long b = 0; b < kBatch; ++b) {
    for (long t = 0; t < 5; ++t) {
      for (long f = 0; f < kFeatures; ++f) {
        if (t < kLengths[b]) {
          ln_same = ln_same && ln5(b, t, f) == ln10(b, t, f);
          bn_same = bn_same && std::fabs(bn5(b, t, f) - bn10(b, t, f)) < 1e-3f;
        }
      }
    }
    for (long t = kLengths[b]; t < 10; ++t) {
      for (long f = 0; f < kFeatures; ++f) pad_zero = pad_zero && ln10(b, t, f) == 0.0f;
    }
  }
  claim(ln_same, "LayerNorm's real tokens are identical whatever the padding");
  claim(!bn_same, "BatchNorm's real tokens change with the padding");
  claim(pad_zero, "LayerNorm maps padded positions to 0");

  return lesson::finish("03_padding");
}
