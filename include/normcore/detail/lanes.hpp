// normcore::detail: the leftover rows of a ColMajor (lane-parallel) kernel.
// A ColMajor block stores row r of feature j at [j * ld + r]; kernels take a
// packet of L rows at a time. The last rows (fewer than L) are copied into a
// padded L-wide block, run through the same packet code and copied back, so a
// row's result never depends on its position in the batch.
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include "normcore/statistics.hpp"

namespace normcore {
namespace detail {

/// Packets of rows a ColMajor kernel takes side by side where it can: each
/// feature's values of those rows are then one contiguous run instead of one
/// line per stride of the leading dimension.
constexpr int kLanePackets = 4;

/// Walks rows [i0, i1) in blocks of K packets of L rows: as many blocks of
/// KMax packets as fit, then one of 2 (when KMax > 2), then single packets,
/// calling f(std::integral_constant<int, K>(), i) for the block at row i.
/// Returns the first row left over (fewer than L, for the padded copy). A
/// kernel whose lanes compute alike whatever K gives the same bits for any
/// row count.
template <int KMax, typename F>
Index for_lane_blocks(Index i0, Index i1, Index L, F&& f) {
  for (; i0 + KMax * L <= i1; i0 += KMax * L) f(std::integral_constant<int, KMax>(), i0);
  if constexpr (KMax > 2) {
    if (i0 + 2 * L <= i1) {
      f(std::integral_constant<int, 2>(), i0);
      i0 += 2 * L;
    }
  }
  for (; i0 + L <= i1; i0 += L) f(std::integral_constant<int, 1>(), i0);
  return i0;
}

/// Copies rows r0..r0+m of an n-feature ColMajor block (leading dim ld) into
/// dst (leading dim L), repeating the last real row into the padding lanes.
template <typename T>
void gather_lanes(const T* src, Index ld, Index r0, Index m, Index n, Index L, T* dst) {
  for (Index j = 0; j < n; ++j)
    for (Index l = 0; l < L; ++l) dst[j * L + l] = src[j * ld + r0 + std::min(l, m - 1)];
}

/// Copies the first m lanes of a padded block back.
template <typename T>
void scatter_lanes(const T* src, Index ld, Index r0, Index m, Index n, Index L, T* dst) {
  for (Index j = 0; j < n; ++j)
    for (Index l = 0; l < m; ++l) dst[j * ld + r0 + l] = src[j * L + l];
}

/// Per-row values (coefficients) for lanes r0..r0+m, padded to L.
template <typename T>
void gather_values(const T* src, Index r0, Index m, Index L, T* dst) {
  for (Index l = 0; l < L; ++l) dst[l] = src[r0 + std::min(l, m - 1)];
}

}  // namespace detail
}  // namespace normcore
