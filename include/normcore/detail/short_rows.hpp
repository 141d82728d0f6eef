// normcore::detail: the packets of a short row in the LayerNorm and RMSNorm
// backwards' short-row kernels (backward_rows_short<K>): a row of n values
// with (K - 1) L < n <= K L is K packets, the last one over the row's last L
// values, of which lanes L - fresh .. L - 1 are new (those before belong to
// packet K - 2 too).
#pragma once

#include <vector>

#include <Eigen/Core>

#include "normcore/detail/stream.hpp"
#include "normcore/statistics.hpp"

namespace normcore {
namespace detail {

/// The most packets a row of the short-row backward kernels has: their state
/// (gamma, the block's parameter sums, the row's x and dy) stays in
/// registers, which four packets fit where the ISA has 32 vector registers
/// and would spill with 16.
constexpr int kShortBackwardPackets = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 ? 4 : 2;

/// The packets (simd<T>) of a row of K of them.
template <typename T, int K>
struct ShortRow {
  using Packet = typename simd<T>::Packet;
  static constexpr int L = simd<T>::L;
  Index last;   // the last packet's offset, n - L
  Index fresh;  // its new lanes: L - fresh .. L - 1
  Packet mask;  // those lanes set

  explicit ShortRow(Index n)
      : last(n - L),
        fresh(n - (K - 1) * L),
        mask(Eigen::internal::pcmp_le(Eigen::internal::pset1<Packet>(static_cast<T>(L - fresh)),
                                      Eigen::internal::plset<Packet>(T(0)))) {}

  /// The offset of packet k.
  Index at(int k) const { return k == K - 1 ? last : static_cast<Index>(k) * L; }

  /// Whether each row's last packet of dx may be stored whole (its lanes
  /// before the tail recomputed, the same bits): it has no such lanes, or
  /// dx is apart from x, dy and dh (dh may be null). Otherwise the tail's
  /// dx goes value by value, after the inputs it overlaps were read.
  template <typename S>
  bool whole_dx(const S* x, const S* dy, const S* dx, const S* dh, Index rows, Index n) const {
    const Index total = rows * n;
    return fresh == L || (dx && disjoint(dx, total, x, total) && disjoint(dx, total, dy, total) &&
                          (!dh || disjoint(dx, total, dh, total)));
  }
};

/// The residual gradient of a ColMajor backward_add (rows r0 .. r1 of an
/// n-feature block with leading dim ld), added to dx in a pass after the
/// kernel has written dx. Constructed before the kernel runs: where dx lies
/// over dh, dh's rows are copied then, since the kernel overwrites them.
template <typename T>
class ColMajorResidual {
 public:
  ColMajorResidual(const T* dx, const T* dh, Index ld, Index n, Index r0, Index r1)
      : dh_(dx ? dh : nullptr), ld_(ld), n_(n), r0_(r0), r1_(r1) {
    if (dh_ && !disjoint(dx, ld * n, dh, ld * n)) {
      const Index m = r1 - r0;
      copy_.resize(static_cast<std::size_t>(m * n));
      for (Index j = 0; j < n; ++j)
        for (Index r = r0; r < r1; ++r) copy_[static_cast<std::size_t>(j * m + r - r0)] = dh[j * ld + r];
    }
  }

  /// dx += dh over the rows.
  void add_to(T* dx) const {
    if (!dh_) return;
    const Index m = r1_ - r0_;
    for (Index j = 0; j < n_; ++j)
      for (Index r = r0_; r < r1_; ++r)
        dx[j * ld_ + r] += copy_.empty() ? dh_[j * ld_ + r] : copy_[static_cast<std::size_t>(j * m + r - r0_)];
  }

 private:
  const T* dh_;
  Index ld_, n_, r0_, r1_;
  std::vector<T> copy_;
};

}  // namespace detail
}  // namespace normcore
