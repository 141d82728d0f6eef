// normcore::detail: the leftover rows of a ColMajor (lane-parallel) kernel.
// A ColMajor block stores row r of feature j at [j * ld + r]; kernels take a
// packet of L rows at a time. The last rows (fewer than L) are copied into a
// padded L-wide block, run through the same packet code and copied back, so a
// row's result never depends on its position in the batch.
#pragma once

#include <algorithm>
#include <vector>

#include "normcore/statistics.hpp"

namespace normcore {
namespace detail {

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
