// Lesson 6: the statistics core on its own, normcore::Welford.
//
// Every normalization layer needs a mean and a variance. normcore computes
// them with Welford's recurrence: a state of three numbers (count, mean, M2 =
// sum of squared deviations from the mean) that takes one value at a time,
// update(x), and never keeps the values. Two states of two disjoint parts of
// the data combine into the state of their union, merge(other), with Chan,
// Golub and LeVeque's formula. So:
//
//   * a stream too large to hold can be read in chunks, in one pass;
//   * parts can be reduced by separate threads (or machines) and merged;
//   * and, unlike the textbook one-pass formula E[x^2] - E[x]^2, nothing
//     subtracts two huge, nearly equal numbers: data with a large mean keep
//     their variance.
//
// The data: one million values 1e9 + noise of variance 1.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include <normcore/normcore.hpp>

#include "lesson.hpp"

using lesson::claim;
using lesson::num;
using W = normcore::Welford<double>;

// The "source" of the stream: chunk k of the data, made on demand.
// Uniform noise on [-sqrt(3), sqrt(3)) has variance 1. mt19937_64 and this
// conversion are fully specified, so every platform sees the same numbers.
std::vector<double> read_chunk(std::mt19937_64& gen, std::size_t n) {
  std::vector<double> chunk(n);
  for (double& v : chunk) {
    const double u = static_cast<double>(gen() >> 11) * 0x1.0p-53;  // [0, 1)
    v = 1e9 + std::sqrt(3.0) * (2.0 * u - 1.0);
  }
  return chunk;
}

int main() {
  constexpr std::size_t kTotal = 1000000, kChunk = 4096;

  // --- 1. One pass over a stream read in chunks. -----------------------------
  // The state is all we keep; we also store the data here only to compare
  // with the two-pass answer (Welford::of: exact mean first, then deviations).
  std::mt19937_64 gen(2024);
  W stream;
  std::vector<double> all;
  for (std::size_t done = 0; done < kTotal; done += kChunk) {
    const std::vector<double> chunk = read_chunk(gen, std::min(kChunk, kTotal - done));
    for (double v : chunk) stream.update(v);
    all.insert(all.end(), chunk.begin(), chunk.end());
  }
  const W exact = W::of(all.data(), all.size());
  std::printf("1. %zu values in chunks of %zu\n", all.size(), kChunk);
  std::printf("   streaming Welford:    mean = %s, variance = %s\n",
              num(stream.mean()).c_str(), num(stream.variance(), 6).c_str());
  std::printf("   two-pass (Welford::of): mean = %s, variance = %s\n",
              num(exact.mean()).c_str(), num(exact.variance(), 6).c_str());
  claim(std::fabs(stream.variance() / exact.variance() - 1) < 1e-6,
        "streaming variance agrees with two-pass to 1e-6");

  // --- 2. Partial states, merged. --------------------------------------------
  // Four threads reduce four parts of different sizes; merging their states
  // gives the state of all the data. In exact arithmetic the order of the
  // merges does not matter; in floating point another order changes the
  // last digits (the relative difference is printed).
  const std::size_t bounds[5] = {0, 100000, 300000, 600000, kTotal};
  W part[4];
  std::vector<std::thread> workers;
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&, t] {
      for (std::size_t i = bounds[t]; i < bounds[t + 1]; ++i) part[t].update(all[i]);
    });
  }
  for (std::thread& w : workers) w.join();
  W forward, backward;
  for (int t = 0; t < 4; ++t) forward.merge(part[t]);
  for (int t = 3; t >= 0; --t) backward.merge(part[t]);
  std::printf("2. parts of 100000, 200000, 300000 and 400000 values, one thread each\n");
  for (int t = 0; t < 4; ++t) {
    std::printf("   thread %d: count = %7.0f, variance = %s\n", t, part[t].count(),
                num(part[t].variance(), 6).c_str());
  }
  std::printf("   merged from 4 threads: mean = %s, variance = %s\n",
              num(forward.mean()).c_str(), num(forward.variance(), 6).c_str());
  std::printf("   merged in reverse order:        variance = %s (relative difference %.1e)\n",
              num(backward.variance(), 6).c_str(),
              std::fabs(backward.variance() / forward.variance() - 1));
  claim(forward.count() == static_cast<double>(kTotal), "merged count is the total");
  claim(std::fabs(forward.variance() / exact.variance() - 1) < 1e-6,
        "merged variance agrees with two-pass to 1e-6");
  claim(std::fabs(backward.variance() / forward.variance() - 1) < 1e-9,
        "merge order changes the variance by less than 1e-9 relative");

  // --- 3. The naive formula collapses. ---------------------------------------
  // var = sum(x^2)/n - (sum(x)/n)^2 subtracts two numbers near 1e18, whose
  // spacing in double is 128: the answer, which should be about 1, is noise.
  // Shifting the data by any one of its values first (here the first) repairs
  // it; normcore's kernels shift by a value of the row for the same reason.
  double s = 0, s2 = 0, t = 0, t2 = 0;
  for (double v : all) {
    s += v;
    s2 += v * v;
    t += v - all[0];
    t2 += (v - all[0]) * (v - all[0]);
  }
  const double n = static_cast<double>(all.size());
  const double naive = s2 / n - (s / n) * (s / n);
  const double shifted = t2 / n - (t / n) * (t / n);
  std::printf("3. the same data through E[x^2] - E[x]^2\n");
  std::printf("   naive:                 variance = %s\n", num(naive, 1).c_str());
  std::printf("   shifted by x[0]:       variance = %s\n", num(shifted, 6).c_str());
  std::printf("   Welford:               variance = %s\n", num(stream.variance(), 6).c_str());
  claim(std::fabs(naive - exact.variance()) > 10.0, "the naive variance is off by more than 10");
  claim(std::fabs(shifted / exact.variance() - 1) < 1e-6, "the shifted formula is fine");

  // --- 4. The kernel inside the layers: row_moments. -------------------------
  // LayerNorm gets each row's moments from normcore::row_moments, a SIMD
  // Welford that returns a Welford<double> state. A float row of 768 values
  // around 1e4: the naive formula in float has nothing left, row_moments
  // matches the two-pass variance in double.
  std::vector<float> row(768);
  std::vector<double> row_d(row.size());
  for (std::size_t i = 0; i < row.size(); ++i) {
    row[i] = static_cast<float>(all[i] - 1e9 + 1e4);
    row_d[i] = row[i];
  }
  float fs = 0, fs2 = 0;
  for (float v : row) {
    fs += v;
    fs2 += v * v;
  }
  const float fn = static_cast<float>(row.size());
  const float naive_f = fs2 / fn - (fs / fn) * (fs / fn);
  const W rm = normcore::row_moments(row.data(), static_cast<normcore::Index>(row.size()));
  const W ref = W::of(row_d.data(), row_d.size());
  std::printf("4. 768 floats around 1e4\n");
  std::printf("   naive in float:        variance = %s\n", num(naive_f, 1).c_str());
  std::printf("   row_moments:           variance = %s\n", num(rm.variance(), 6).c_str());
  std::printf("   two-pass in double:    variance = %s\n", num(ref.variance(), 6).c_str());
  claim(std::fabs(naive_f - ref.variance()) > 1.0, "the naive float variance is off by more than 1");
  claim(std::fabs(rm.variance() / ref.variance() - 1) < 1e-6,
        "row_moments agrees with two-pass in double to 1e-6");

  return lesson::finish("06_streaming_statistics");
}
