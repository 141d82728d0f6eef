// normcore: the scalar Welford state, public so that it can be used alone.
//
//   normcore::Welford<double> w;
//   for (double v : chunk1) w.update(v);
//   normcore::Welford<double> other = normcore::Welford<double>::of(chunk2.data(), chunk2.size());
//   w.merge(other);                 // Chan et al.: exact in exact arithmetic
//   w.mean(), w.variance(), w.sample_variance();
//
// Merging is associative and commutative in exact arithmetic; in floating
// point, a different grouping changes the last bits (about one rounding per
// merge, relative to M2). normcore's kernels always merge in a fixed order so
// that results do not depend on threads or addresses.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

namespace normcore {

/// Running count, mean and sum of squared deviations (M2) of a stream.
template <typename Acc>
class Welford {
  static_assert(std::is_floating_point<Acc>::value,
                "normcore::Welford<Acc>: Acc must be a floating-point type");

 public:
  Welford() = default;
  Welford(Acc count, Acc mean, Acc m2) : count_(count), mean_(mean), m2_(m2) {}

  /// State of n values (two passes: exact mean first, then deviations).
  static Welford of(const Acc* data, std::size_t n) {
    if (n == 0) return Welford();
    Acc sum = 0;
    for (std::size_t i = 0; i < n; ++i) sum += data[i];
    const Acc mean = sum / static_cast<Acc>(n);
    Acc m2 = 0;
    for (std::size_t i = 0; i < n; ++i) m2 += (data[i] - mean) * (data[i] - mean);
    return Welford(static_cast<Acc>(n), mean, m2);
  }

  /// Adds one value (Welford 1962).
  void update(Acc x) {
    count_ += 1;
    const Acc delta = x - mean_;
    mean_ += delta / count_;
    m2_ += delta * (x - mean_);
  }

  /// Adds the values of another state (Chan, Golub, LeVeque 1979). Either
  /// side may be empty.
  void merge(const Welford& b) {
    if (b.count_ == 0) return;
    if (count_ == 0) {
      *this = b;
      return;
    }
    const Acc n = count_ + b.count_;
    const Acc delta = b.mean_ - mean_;
    const Acc fb = b.count_ / n;
    mean_ += delta * fb;
    m2_ += b.m2_ + delta * delta * count_ * fb;
    count_ = n;
  }

  Acc count() const { return count_; }
  Acc mean() const { return mean_; }
  Acc m2() const { return m2_; }
  /// Biased (population) variance M2 / n; NaN for an empty state.
  Acc variance() const {
    return count_ > 0 ? m2_ / count_ : std::numeric_limits<Acc>::quiet_NaN();
  }
  /// Unbiased (sample) variance M2 / (n - 1); NaN for fewer than two values.
  Acc sample_variance() const {
    return count_ > 1 ? m2_ / (count_ - 1) : std::numeric_limits<Acc>::quiet_NaN();
  }

 private:
  Acc count_ = 0;
  Acc mean_ = 0;
  Acc m2_ = 0;
};

}  // namespace normcore
