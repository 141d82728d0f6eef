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

/// Features per tile of a ColMajor lane kernel's walk over m rows (whole
/// packets) in blocks of `block` rows: with more than one block, a tile of
/// kLaneTileBytes of the rows' values (at least 4 features), which every
/// block steps through before the next tile; else `all`.
template <typename T>
Index lane_tile(Index m, Index block, Index all) {
  return m > block ? std::max<Index>(4, kLaneTileBytes / (m * Index(sizeof(T)))) : all;
}

/// How the ColMajor backwards take a part's rows: two passes (sums, then dx
/// and the parameter gradients' sums) over
/// * chunks of rows, each down all the features in the first pass and
///   again in the second, so that the second reads the chunk's x and dy
///   from the cache: chunks of kLanePackets packets;
/// * with `tiled` (RMSNorm, one sum a row in its first pass): rows of at
///   most kNarrowRowBytes in chunks of kNarrowRowBytes of each feature's
///   values (256 floats), or of kNarrowAliasingChunkBytes (1024 floats)
///   where the leading dimension is a multiple of kNarrowAliasingStrideBytes
///   and such a chunk of x takes at most kBlockCacheBytes, each pass a tile
///   of features at a time (lane_tile); and the whole part at once, both
///   passes a tile at a time through blocks of rows, so that both read x
///   and dy front to back, where a chunk would not stay in the cache: rows
///   longer than kNarrowRowBytes whose leading dimension (rows * sizeof(T))
///   is a multiple of kAliasingStrideBytes, which puts a chunk's lines of
///   all the features into a few cache sets, or whose chunk of x and dy
///   takes more than kBlockCacheBytes.
/// Returns the chunk's rows, or 0 for the whole part. Chunks go in segments
/// of up to kSegmentBytes of x (colmajor_segment_rows), each with its own
/// statistics and residual. Chunks cross row groups; blocks of kLanePackets
/// packets never do (the groups' boundaries are on them).
///
/// Each row group (of 16, boundaries on packets) used to take its own
/// passes in blocks of up to four packets of rows (at 512 rows a group was
/// 32 rows: two packets). Measured on the Zen 5 guest (float, 1 thread, 5
/// shuffled rounds, new / old time, with saved statistics; recomputed in
/// brackets), RMSNorm: 0.72x (0.69x) at 64x768, 0.52x (0.71x) at 512x768,
/// 0.65x (0.59x) at 1024x768, 0.77x (0.81x) at 4096x1024, 0.73x (0.77x) at
/// 16384x4096, 0.78x (0.88x) at 65536x64, 0.79x (0.80x) at 2048x50, 0.91x
/// (0.91x) at 100000x50, 0.85x (0.81x) at 16384x256, 0.76x (0.82x) at
/// 640x768, 0.95x (0.96x) at 2000x2000, 1.02x (0.94x) at 12345x512, 1.05x
/// (1.13x) at 1000x1000. LayerNorm: 0.78x (0.80x) at 64x768, 0.76x (0.80x)
/// at 512x768, 0.73x (0.78x) at 1024x768, 0.89x (1.05x) at 4096x1024,
/// 0.91x (0.92x) at 640x768, 0.94x (0.99x) at 16384x256, 0.98-1.09x on the
/// others. The whole part took LayerNorm 1.18-1.39x the time at 4096x1024
/// and 2000x2000 (its three sums a row stored and reloaded every few
/// features), and RMSNorm 1.28-2.3x where the chunks stay in the cache
/// (1000x1000, 10000x1000, 12345x512, 20000x300); RMSNorm's chunks of four
/// packets for the shortest rows 1.2x at 100000x50.
///
/// Narrow rows on a leading dimension that is a multiple of 4 KB (the L1's
/// way on x86) put every feature's piece of a chunk into the same cache
/// sets. There, chunks four times longer took RMSNorm's backward (Zen 5
/// guest, float, 1 thread, saved statistics, 5 shuffled rounds, new / old
/// time) 0.76x at 65536x64, 0.79x at 16384x128, 0.75x at 8192x100, 0.76x
/// at 4096x64, 0.76x at 32768x32, 0.80x at 2048x50, 0.79x at 49152x64,
/// 0.77x at 12288x128, 0.80x at 262144x16, 0.77x at 4096x50; recomputed
/// statistics 0.86x at 65536x64, 0.85x at 2048x50; double 0.78x at
/// 32768x64, 0.68x at 4096x50. Single runs of the longer chunk elsewhere:
/// 1.12x the time at 16384x200 and 1.10x at 16384x256 (a chunk of x over
/// kBlockCacheBytes), 1.36x at 65792x64 and 1.15x at 16640x64 (multiples
/// of 1 KB, not of 4 KB), 1.24x at 100000x50. Copying the chunk's x and dy
/// in the first pass instead, as LayerNorm's does, took 1.15-1.21x the time
/// at 65536x64 (RMSNorm's first pass has one multiply-add a packet to hide
/// the stores behind); LayerNorm's backward took 0.95-1.05x with chunks of
/// 256 or 1024 rows there, so it keeps its own. Wide rows keep the whole
/// part (chunks of 64 rows took 1.52x the time at 4096x1024, of 256 1.12x).
constexpr Index kNarrowRowBytes = 1024;
constexpr Index kNarrowAliasingStrideBytes = 4096;
constexpr Index kNarrowAliasingChunkBytes = 4096;
constexpr Index kAliasingStrideBytes = 1024;
constexpr Index kBlockCacheBytes = 512 * 1024;
constexpr Index kSegmentBytes = 256 * 1024;

template <typename T>
Index colmajor_backward_chunk(Index rows, Index n, bool tiled) {
  constexpr Index s = sizeof(T);
  const Index row_bytes = n * s;
  const Index chunk = Index(kLanePackets) * simd<T>::L;
  if (!tiled) return chunk;
  if (row_bytes <= kNarrowRowBytes) {
    constexpr Index aliased = kNarrowAliasingChunkBytes / s;
    if ((rows * s) % kNarrowAliasingStrideBytes == 0 && aliased * row_bytes <= kBlockCacheBytes) return aliased;
    return kNarrowRowBytes / s;
  }
  if ((rows * s) % kAliasingStrideBytes == 0 || 2 * chunk * row_bytes > kBlockCacheBytes) return 0;
  return chunk;
}

/// Whether a ColMajor block of `rows` rows (its leading dimension) puts the
/// lines of a chunk of rows of all the features into a few cache sets: a
/// multiple of kAliasingStrideBytes. Measured on the Zen 5 guest
/// (LayerNorm's backward, float, 1 thread, saved statistics, before its
/// copies): 13.0 ns a packet at 4096x1024 against 7.3 at 4112x1024, 11.2
/// at 65536x64 against 8.3 at 65552x64, 5.0 at 512x768 against 4.3 at
/// 528x768.
template <typename T>
bool colmajor_aliasing(Index rows) {
  return (rows * Index(sizeof(T))) % kAliasingStrideBytes == 0;
}

/// The ColMajor forwards' normalize takes blocks of detail::kLanePackets
/// packets of rows down all the features, the blocks' coefficients in
/// registers. Where the leading dimension is a multiple of
/// kColumnAliasingBytes, a block's lines of all the features fall into one
/// or two of the L1's 1 KB groups of sets (4 KB a way on x86); there, and
/// where the output takes no streaming stores, they go a feature at a time
/// through runs of kColumnRunBytes of rows instead, reading each run of x
/// front to back and the run's coefficients from the L1 with every packet.
/// Measured on the Zen 5 guest (LayerNorm's forward, float, 1 thread, 5
/// shuffled rounds, new / old time): 0.47x at 1024x256, 0.53x at 2048x200,
/// 0.55x at 8192x100, 0.59x at 2048x50, 0.79x at 4096x700, 0.81x at
/// 512x768, 0.83x at 512x1024, 0.86x at 2560x64, 0.88x at 1536x768. Taken
/// everywhere it lost elsewhere: 1.10x at 768x768 (a multiple of 1 KB, not
/// of 2 KB), 1.16x at 65536x64 (streaming stores), single runs 1.15-1.30x
/// at 65552x64, 100000x50, 16x768 and 64x768.
constexpr Index kColumnAliasingBytes = 2048;
constexpr Index kColumnRunBytes = 4096;

template <typename T>
bool colmajor_column_walk(Index rows, bool stream) {
  return !stream && (rows * Index(sizeof(T))) % kColumnAliasingBytes == 0;
}

/// Rows of a segment of chunks of `chunk` rows of n values: up to
/// kSegmentBytes, at least one chunk.
template <typename T>
Index colmajor_segment_rows(Index chunk, Index n) {
  return chunk * std::max<Index>(1, kSegmentBytes / (chunk * n * Index(sizeof(T))));
}

/// Rows of a segment of LayerNorm's ColMajor forward, which takes the
/// statistics of a segment and then normalizes it while its x is in the
/// cache (colmajor_segment_rows of blocks of kLanePackets packets: about
/// kSegmentBytes of x), or 0 for the whole part at once: rows whose block
/// of x takes more than kBlockCacheBytes, or rows longer than
/// kNarrowRowBytes on an aliasing leading dimension (colmajor_aliasing),
/// whose lines a segment's normalize finds evicted anyway (and whose
/// column walk, colmajor_column_walk, wants runs longer than a segment).
/// Measured on the Zen 5 guest (float, 1 thread, 3 shuffled rounds, new /
/// old time): 0.73x at 65552x64, 0.79x at 65536x64, 0.82x at 4112x1024,
/// 0.84x at 100000x50, 0.85x at 1000x1000, 0.88x at 8192x100, 0.90x at
/// 65536x128, 0.91x at 2000x2000, 0.96x at 2048x50. Segmenting the inputs
/// it leaves whole: 1.60x at 4096x700, 1.08x at 4096x1024, 1.09x at
/// 16384x4096, 1.04x at 16400x4096.
template <typename T>
Index colmajor_forward_segment(Index rows, Index n) {
  const Index row_bytes = n * Index(sizeof(T));
  const Index block = Index(kLanePackets) * simd<T>::L;
  if (block * row_bytes > kBlockCacheBytes || (row_bytes > kNarrowRowBytes && colmajor_aliasing<T>(rows))) return 0;
  return colmajor_segment_rows<T>(block, n);
}

/// Runs fn(s0, s1) over the segments of rows [r0, r1) of a ColMajor
/// forward of `rows` rows of n features (colmajor_forward_segment; one
/// segment, the whole range, when it gives 0).
template <typename T, typename Fn>
void for_colmajor_segments(Index rows, Index n, Index r0, Index r1, Fn&& fn) {
  const Index seg = colmajor_forward_segment<T>(rows, n);
  const Index step = seg ? seg : r1 - r0;
  for (Index s0 = r0; s0 < r1; s0 += step) fn(s0, std::min(r1, s0 + step));
}

/// Rows of a block of a 16-bit ColMajor forward, widened into float a
/// block at a time (colmajor_in_compute_type): whole blocks of kLanePackets
/// packets, about kSegmentBytes of float x (colmajor_segment_rows), so that
/// the block's x and y stay in the L2 while it is normalized and rounded
/// back. Measured on the Zen 5 guest (bfloat16 forwards at 1024x768, 1
/// thread, 3 shuffled rounds, against whole float copies): blocks of 16 rows
/// took 1.73-1.78x the time, of 32 rows 0.93-0.94x, of 128 rows 0.90-0.91x,
/// these (64 rows) 0.78-0.85x.
template <typename T>
Index colmajor_stage_rows(Index n) {
  return colmajor_segment_rows<T>(Index(kLanePackets) * simd<T>::L, n);
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
