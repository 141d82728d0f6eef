// normcore: the statistics core. Single-pass SIMD Welford moments of a
// contiguous row (row_moments) and of many strided columns side by side, one
// per SIMD lane (lane_moments), written on Eigen's packet layer so the same
// code serves SSE, AVX2, AVX-512 and NEON.
//
// Numerical design (see README, "Numerical choices"):
// * Values are shifted by a pivot taken from the data (the first element)
//   before accumulating. For data with a large mean the shifted values are
//   exact (Sterbenz) and small, so the running means stay small and their
//   rounding error scales with the spread, not with the offset.
// * Each lane of each accumulator runs its own Welford recurrence in T. All
//   lanes advance together, so their counts are equal and 1/k comes from a
//   table: no division in the inner loop.
// * At most kChunk updates run per lane in T; then the lane states are
//   widened to double and merged with Chan's formula in a fixed tree order.
//   Merging in T would cost about 4x the error (measured: 5e-8 vs 1.5e-8 rms
//   relative variance error for 768 float values); merging in double makes
//   the variance good to about one float ulp.
// * Results are Welford<double> states in pivot-shifted coordinates; the
//   order of every operation depends only on the row length, never on the
//   address or on other rows, so results are bit-reproducible.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(_MSC_VER)
#include <cpuid.h>
#endif
#include <utility>
#include <vector>

#include <Eigen/Core>

#if defined(__has_include)
#if __has_include(<unistd.h>)
#include <unistd.h>
#endif
#endif

#include "normcore/detail/convert.hpp"
#include "normcore/detail/scratch.hpp"
#include "normcore/welford.hpp"

namespace normcore {

using Index = Eigen::Index;

namespace detail {

template <typename T>
struct simd {
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                "normcore supports float and double");
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  static constexpr int L = Eigen::internal::unpacket_traits<Packet>::size;
  /// Independent accumulators in the moments loop. Welford's loop-carried
  /// chain is sub + fma (about 7 cycles); with 2 FMA pipes, four 512-bit
  /// (or eight 256-bit) accumulators keep the pipes busy. Eight 256-bit
  /// states spill on AVX2 (16 registers); four would not, and measured
  /// 5-15% faster on 768-float rows, but each lane then sees twice the
  /// updates and the forward error at offset 0 rose from 2.8e-7 to 3.7e-7
  /// (768) and 3.7e-7 to 4.9e-7 (4096), past the accuracy tests' 4e-7:
  /// accuracy is not traded, so eight it is.
  static constexpr int A = L >= 16 ? 4 : 8;
};

/// The packet of at most 256 bits: simd<T>'s packet, or its half with
/// AVX-512. Two uses:
/// * The short-row paths (short_rows_moments, short_rows_sum_squares): their
///   cost per row is mostly the lane merge, which grows with the lane count.
///   With AVX-512, 256-bit packets took 0.35-0.7x the time of 512-bit ones
///   for rows of 20 to 255 floats (and of 20 to 100 doubles), and give the
///   same bits as an AVX2 build (for rows of at least one packet: shorter
///   ones are a scalar two-pass, which compilers may contract differently).
/// * detail::inv_sqrt_eps: Eigen 3.4's AVX-512 psqrt for doubles is, by
///   default (EIGEN_FAST_MATH), rsqrt14 and two Newton steps: not correctly
///   rounded, NaN for +inf and infinite for subnormals. Its 256-bit psqrt is
///   the sqrt instruction.
/// (Only where Eigen's half packet is really narrower: its SVE backend
/// declares the full packet as its own half.)
template <typename T, bool Half = (sizeof(typename simd<T>::Packet) > 32 &&
                                   sizeof(typename Eigen::internal::packet_traits<T>::half) <
                                       sizeof(typename simd<T>::Packet))>
struct narrow_simd {
  using Packet = typename simd<T>::Packet;
  static constexpr int L = simd<T>::L;
};
template <typename T>
struct narrow_simd<T, true> {
  using Packet = typename Eigen::internal::packet_traits<T>::half;
  static constexpr int L = static_cast<int>(sizeof(Packet) / sizeof(T));
};

/// a * b + c rounded exactly as Eigen's pmadd rounds it in this build (fused
/// when the packets use FMA: x86 with FMA, and NEON wherever the target has
/// it, as every 64-bit Arm does), so scalar tails match the vector body bit
/// for bit.
template <typename T>
inline T madd(T a, T b, T c) {
#if defined(EIGEN_VECTORIZE_FMA) || (defined(EIGEN_VECTORIZE_NEON) && defined(__ARM_FEATURE_FMA))
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

/// Updates per lane before the T states are flushed into double.
constexpr int kChunk = 256;

/// 1/k for k = 0..kChunk, correctly rounded (division at compile time).
template <typename T>
struct reciprocals {
  static constexpr std::array<T, kChunk + 1> make() {
    std::array<T, kChunk + 1> r{};
    r[0] = T(0);
    for (int k = 1; k <= kChunk; ++k) r[static_cast<std::size_t>(k)] = T(1) / T(k);
    return r;
  }
  static constexpr std::array<T, kChunk + 1> table = make();
};

/// The simd<double>::L values of T at p as a double packet (each widened
/// exactly), converted in registers: the lanes' states written to the
/// stack as doubles in halves and read back as whole packets (as GCC
/// compiled the element-wise conversion) cannot be forwarded from the
/// stores, and merge_equal waited for them.
template <typename T>
EIGEN_ALWAYS_INLINE typename simd<double>::Packet load_as_double(const T* p) {
  using PD = typename simd<double>::Packet;
  if constexpr (std::is_same<T, double>::value) {
    return Eigen::internal::ploadu<PD>(p);
  } else {
#if defined(EIGEN_VECTORIZE_AVX512)
    return _mm512_cvtps_pd(_mm256_loadu_ps(p));
#elif defined(EIGEN_VECTORIZE_AVX)
    return _mm256_cvtps_pd(_mm_loadu_ps(p));
#elif defined(EIGEN_VECTORIZE_SSE2)
    return _mm_cvtps_pd(_mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#elif defined(EIGEN_VECTORIZE_NEON) && defined(__aarch64__)
    return vcvt_f64_f32(vld1_f32(p));
#else
    alignas(64) double t[simd<double>::L];
    for (int i = 0; i < simd<double>::L; ++i) t[i] = static_cast<double>(p[i]);
    return Eigen::internal::pload<PD>(t);
#endif
  }
}

/// Lanes [H * LD, (H + 1) * LD) of a packet of simd<T> as a double packet
/// (LD: simd<double>::L; each value widened exactly), converted in
/// registers; for T double, the packet itself (H = 0). Defined where
/// kRegisterMerge says.
template <int H, typename T>
EIGEN_ALWAYS_INLINE typename simd<double>::Packet half_as_double(const typename simd<T>::Packet& p) {
  static_assert(H == 0 || (H == 1 && !std::is_same<T, double>::value), "two halves of float, one of double");
  if constexpr (std::is_same<T, double>::value) {
    return p;
  } else {
#if defined(EIGEN_VECTORIZE_AVX512)
    return _mm512_cvtps_pd(H == 0 ? _mm512_castps512_ps256(p)
                                  : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
#elif defined(EIGEN_VECTORIZE_AVX)
    return _mm256_cvtps_pd(H == 0 ? _mm256_castps256_ps128(p) : _mm256_extractf128_ps(p, 1));
#elif defined(EIGEN_VECTORIZE_SSE2)
    return _mm_cvtps_pd(H == 0 ? p : _mm_movehl_ps(p, p));
#elif defined(EIGEN_VECTORIZE_NEON) && defined(__aarch64__)
    return H == 0 ? vcvt_f64_f32(vget_low_f32(p)) : vcvt_high_f64_f32(p);
#else
    // Builds where kRegisterMerge is false for floats do not call this;
    // through memory, for completeness.
    alignas(64) T v[simd<T>::L];
    Eigen::internal::pstoreu(v, p);
    return load_as_double(v + H * simd<double>::L);
#endif
  }
}

/// Whether half_as_double is defined for T: doubles, and floats where the
/// build's float packets hold two double packets' worth (x86 from SSE2 up,
/// 64-bit Arm).
template <typename T>
constexpr bool kRegisterMerge =
    std::is_same<T, double>::value ||
#if defined(EIGEN_VECTORIZE_AVX512) || defined(EIGEN_VECTORIZE_AVX) || defined(EIGEN_VECTORIZE_SSE2) || \
    (defined(EIGEN_VECTORIZE_NEON) && defined(__aarch64__))
    (std::is_same<T, float>::value && simd<T>::L == 2 * simd<double>::L);
#else
    false;
#endif

/// The sum of a double packet's lanes, in the order of Eigen's predux, and
/// so the same bits: with AVX-512, (s0 + s1) + (s2 + s3) where s is the sum
/// of the packet's two 256-bit halves; here through a lane swap instead of
/// Eigen's two horizontal adds (on a Zen 5 guest: 0.91-0.97x the time of
/// the moments of rows of 768 and 1000, three sums a row).
EIGEN_ALWAYS_INLINE double sum_lanes(const typename simd<double>::Packet& a) {
#if defined(EIGEN_VECTORIZE_AVX512)
  const __m256d s = _mm256_add_pd(_mm512_castpd512_pd256(a), _mm512_extractf64x4_pd(a, 1));
  const __m256d t = _mm256_add_pd(s, _mm256_permute_pd(s, 0x5));  // s0 + s1, s1 + s0, s2 + s3, s3 + s2
  return _mm_cvtsd_f64(_mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1)));
#else
  return Eigen::internal::predux(a);
#endif
}

/// One double Welford state from the means m and M2s q of S states of equal
/// count k, widened to double (S / simd<double>::L packets each, state i in
/// lane i). For equal counts Chan's pairwise tree collapses to a closed
/// form: mean = average of the means, M2 = sum of M2 + k * sum (mean_i -
/// mean)^2, a two-pass over the S means in double (exact up to double
/// rounding).
template <int S>
EIGEN_ALWAYS_INLINE Welford<double> merge_equal_doubles(const typename simd<double>::Packet* m,
                                                        const typename simd<double>::Packet* q, double k) {
  using namespace Eigen::internal;
  using PD = typename simd<double>::Packet;
  constexpr int LD = simd<double>::L;
  static_assert(S % (2 * LD) == 0, "an even number of double packets");
  PD s0 = pset1<PD>(0.0), s1 = s0;
  NORMCORE_UNROLL
  for (int i = 0; i < S / LD; i += 2) {
    s0 = padd(s0, m[i]);
    s1 = padd(s1, m[i + 1]);
  }
  const double sum = sum_lanes(padd(s0, s1));
  const PD mu = pset1<PD>(sum / S);
  PD q0 = pset1<PD>(0.0), q1 = q0, d0 = q0, d1 = q0;
  NORMCORE_UNROLL
  for (int i = 0; i < S / LD; i += 2) {
    q0 = padd(q0, q[i]);
    q1 = padd(q1, q[i + 1]);
    const PD e0 = psub(m[i], mu), e1 = psub(m[i + 1], mu);
    d0 = pmadd(e0, e0, d0);
    d1 = pmadd(e1, e1, d1);
  }
  const double sq = sum_lanes(padd(q0, q1));
  const double dev = sum_lanes(padd(d0, d1));
  return Welford<double>(k * S, sum / S, sq + k * dev);
}

/// Merges S states of equal count k (T arrays) into one double Welford
/// state (merge_equal_doubles).
template <typename T, int S>
Welford<double> merge_equal(const T* mean, const T* m2, double k) {
  using PD = typename simd<double>::Packet;
  constexpr int LD = simd<double>::L;
  if constexpr (S % (2 * LD) == 0) {
    PD m[S / LD];
    PD q[S / LD];
    NORMCORE_UNROLL
    for (int i = 0; i < S / LD; ++i) {
      m[i] = load_as_double(mean + i * LD);
      q[i] = load_as_double(m2 + i * LD);
    }
    return merge_equal_doubles<S>(m, q, k);
  } else {
    double sum = 0, sq = 0, dev = 0;
    double m[S];
    double q[S];
    NORMCORE_UNROLL
    for (int i = 0; i < S; ++i) {
      m[i] = static_cast<double>(mean[i]);
      q[i] = static_cast<double>(m2[i]);
    }
    NORMCORE_UNROLL
    for (int i = 0; i < S; ++i) sum += m[i];
    NORMCORE_UNROLL
    for (int i = 0; i < S; ++i) {
      sq += q[i];
      dev += (m[i] - sum / S) * (m[i] - sum / S);
    }
    return Welford<double>(k * S, sum / S, sq + k * dev);
  }
}

/// merge_equal<T, A * L> of the A packets of states `mean` and `m2`
/// (packet a: states a * L .. a * L + L - 1). Where kRegisterMerge allows
/// and the states fill whole pairs of double packets, they are widened in
/// registers: the same values in the same order, so the same bits, without
/// the stores and reloads, which the conversions waited for (on a Zen 5
/// guest, AVX-512 float: 0.90x the time of the moments of rows of 768).
template <typename T, int A>
EIGEN_ALWAYS_INLINE Welford<double> merge_equal_packets(const typename simd<T>::Packet* mean,
                                                        const typename simd<T>::Packet* m2, double k) {
  using PD = typename simd<double>::Packet;
  constexpr int L = simd<T>::L;
  if constexpr (kRegisterMerge<T> && (A * L) % (2 * simd<double>::L) == 0) {
    constexpr int H = L / simd<double>::L;  // double packets per packet
    static_assert(H == 1 || H == 2, "packets of float or double");
    PD m[A * H];
    PD q[A * H];
    NORMCORE_UNROLL
    for (int a = 0; a < A; ++a) {
      m[a * H] = half_as_double<0, T>(mean[a]);
      q[a * H] = half_as_double<0, T>(m2[a]);
      if constexpr (H == 2) {
        m[a * H + 1] = half_as_double<1, T>(mean[a]);
        q[a * H + 1] = half_as_double<1, T>(m2[a]);
      }
    }
    return merge_equal_doubles<A * L>(m, q, k);
  } else {
    alignas(64) T ms[A * L];
    alignas(64) T qs[A * L];
    NORMCORE_UNROLL
    for (int a = 0; a < A; ++a) {
      Eigen::internal::pstoreu(ms + a * L, mean[a]);
      Eigen::internal::pstoreu(qs + a * L, m2[a]);
    }
    return merge_equal<T, A * L>(ms, qs, k);
  }
}

}  // namespace detail


namespace detail {

/// Where the long-row kernels (row_moments_acc, sum_squares_of, the
/// normalize loops) read a row's values: a row in memory (RowValues), or
/// values made as they are read (mixed.hpp: x + residual for the fused
/// residual norms). packet(i) gives the L values from i (packet(i, mask):
/// the masked-in lanes); value(j) one value (tails and scalar paths). A
/// source returns the same bits for a value whether it is read in a packet
/// or alone. Kernels take sources by value: a copy on the stack cannot be
/// aliased by the stores a source makes, so its pointers stay in registers
/// (by reference, GCC reloaded them after every streaming store).
template <typename T>
struct RowValues {
  const T* x;
  template <typename Packet>
  EIGEN_ALWAYS_INLINE Packet packet(Index i) const {
    return Eigen::internal::ploadu<Packet>(x + i);
  }
  template <typename Packet, typename Mask>
  EIGEN_ALWAYS_INLINE Packet packet(Index i, Mask m) const {
    return Eigen::internal::ploadu<Packet>(x + i, m);
  }
  EIGEN_ALWAYS_INLINE T value(Index j) const { return x[j]; }
};

/// One Welford update of a packet of lane states (mean, m2) with the values
/// d (shifted by the pivot); inv is 1 / (the lanes' count after it).
template <typename Packet>
EIGEN_ALWAYS_INLINE void welford_step(const Packet& d, const Packet& inv, Packet& mean, Packet& m2) {
  using namespace Eigen::internal;
  const Packet delta = psub(d, mean);
  mean = pmadd(delta, inv, mean);
  m2 = pmadd(delta, psub(d, mean), m2);
}

/// welford_step for the lanes in `mask` only: the others' delta is 0, so
/// their states are unchanged (a row's tail, short_rows_moments).
template <typename Packet>
EIGEN_ALWAYS_INLINE void welford_step(const Packet& d, const Packet& inv, Packet& mean, Packet& m2,
                                      const Packet& mask) {
  using namespace Eigen::internal;
  const Packet delta = pand(psub(d, mean), mask);
  mean = pmadd(delta, inv, mean);
  m2 = pmadd(delta, psub(d, mean), m2);
}

/// The moments of R rows (sources[0..R), pivots[0..R)) side by side, into
/// total[0..R): each row's operations, and so its bits, are those of the
/// row alone (R = 1); only their order in the program differs. Two rows in
/// one loop (rows_moments' pairs, kPairRows) give the core two rows' chains
/// and lane merges to overlap, where a row alone leaves it waiting on them:
/// on a Zen 5 guest (AVX-512 float, in one process) rows_moments took
/// 0.89-0.95x the time at 8x768 to 64x1024 before merge_equal_packets and
/// 0.81-0.83x after it.
template <typename T, int A, int R, typename Src>
void rows_moments_acc(const Src* sources, Index n, const T* pivots, Welford<double>* total) {
  using namespace Eigen::internal;
  using S = detail::simd<T>;
  using Packet = typename S::Packet;
  constexpr int L = S::L;
  const auto& recip = detail::reciprocals<T>::table;

  // Copies on the stack: see RowValues.
  Src src[R];
  Packet pv[R];
  NORMCORE_UNROLL
  for (int r = 0; r < R; ++r) {
    src[r] = sources[r];
    pv[r] = pset1<Packet>(pivots[r]);
    total[r] = Welford<double>();
  }
  const Index packets = n / L;  // full packets in the row
  Index p = 0;                  // packets consumed
  // Chunks of at most kChunk updates per lane; the leftover packets (fewer
  // than A) take one more update, one per accumulator (see `last` below).
  do {
    const Index iters = std::min<Index>((packets - p) / A, detail::kChunk);
    // The states are indexed only by the unrolled `a` and `r` (the leftover
    // loop below too), so they stay in registers from the loop to the merge,
    // even when the source stores (the fused residual add).
    Packet mean[R][A];
    Packet m2[R][A];
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) {
      NORMCORE_UNROLL
      for (int a = 0; a < A; ++a) mean[r][a] = m2[r][a] = pset1<Packet>(T(0));
    }
    for (Index it = 1; it <= iters; ++it, p += A) {
      const Packet inv = pset1<Packet>(recip[static_cast<std::size_t>(it)]);
      NORMCORE_UNROLL
      for (int a = 0; a < A; ++a) {
        NORMCORE_UNROLL
        for (int r = 0; r < R; ++r)
          welford_step(psub(src[r].template packet<Packet>((p + a) * L), pv[r]), inv, mean[r][a], m2[r][a]);
      }
    }
    T count[A];
    NORMCORE_UNROLL
    for (int a = 0; a < A; ++a) count[a] = static_cast<T>(iters);
    // Leftover packets join this chunk only if it has room for one more
    // update per lane (1/k comes from a table of kChunk + 1 entries); after
    // a full chunk they start a chunk of their own.
    const bool last = p == packets || (packets - p < A && iters < detail::kChunk);
    if (last && p < packets) {
      const Packet inv = pset1<Packet>(recip[static_cast<std::size_t>(iters + 1)]);
      const Index left = packets - p;  // fewer than A
      NORMCORE_UNROLL
      for (int a = 0; a < A; ++a) {
        if (a >= left) break;
        NORMCORE_UNROLL
        for (int r = 0; r < R; ++r)
          welford_step(psub(src[r].template packet<Packet>((p + a) * L), pv[r]), inv, mean[r][a], m2[r][a]);
        count[a] += T(1);
      }
      p = packets;
    }
    // Merge every lane of every accumulator in double, in a fixed tree order.
    // When the leftover packets made the counts unequal, each accumulator's
    // lanes are merged on their own and the accumulators then in order.
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) {
      if (count[0] == count[A - 1]) {
        if (count[0] > T(0)) total[r].merge(detail::merge_equal_packets<T, A>(mean[r], m2[r], static_cast<double>(count[0])));
      } else {
        NORMCORE_UNROLL
        for (int a = 0; a < A; ++a)
          if (count[a] > T(0))
            total[r].merge(detail::merge_equal_packets<T, 1>(&mean[r][a], &m2[r][a], static_cast<double>(count[a])));
      }
    }
    if (last) break;
  } while (true);
  // Tail (< L values): exact two-pass in double, then one merge.
  const Index full = packets * L;
  const Index rest = n - full;
  if (rest > 0) {
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) {
      double sum = 0;
      for (Index j = full; j < n; ++j) sum += static_cast<double>(src[r].value(j)) - static_cast<double>(pivots[r]);
      const double m = sum / static_cast<double>(rest);
      double q = 0;
      for (Index j = full; j < n; ++j) {
        const double d = static_cast<double>(src[r].value(j)) - static_cast<double>(pivots[r]) - m;
        q += d * d;
      }
      total[r].merge(Welford<double>(static_cast<double>(rest), m, q));
    }
  }
}

template <typename T, int A, typename Src>
EIGEN_ALWAYS_INLINE Welford<double> row_moments_acc(const Src src, Index n, T pivot) {
  Welford<double> total;
  rows_moments_acc<T, A, 1>(&src, n, &pivot, &total);
  return total;
}

/// The accumulators moments_of takes for rows of n values.
template <typename T>
constexpr int moments_accumulators(Index n) {
  constexpr int L = detail::simd<T>::L;
  constexpr int A = detail::simd<T>::A;
  if (A >= 8 && n >= 8 * 4 * L) return 8;
  if (A >= 4 && n >= 4 * 4 * L) return 4;
  if (A >= 2 && n >= 2 * 4 * L) return 2;
  return 1;
}

/// row_moments of the values a source gives (RowValues: a row in memory).
template <typename T, typename Src>
Welford<double> moments_of(const Src src, Index n, T pivot) {
  switch (moments_accumulators<T>(n)) {
    case 8: return detail::row_moments_acc<T, (detail::simd<T>::A >= 8 ? 8 : 1)>(src, n, pivot);
    case 4: return detail::row_moments_acc<T, (detail::simd<T>::A >= 4 ? 4 : 1)>(src, n, pivot);
    case 2: return detail::row_moments_acc<T, 2>(src, n, pivot);
    default: return detail::row_moments_acc<T, 1>(src, n, pivot);
  }
}

}  // namespace detail

/// Moments of the n values x[0..n), shifted by `pivot`: the returned state's
/// mean is mean(x) - pivot; its M2 and count are those of x. Any length,
/// any alignment. Single pass. The number of independent accumulators
/// follows the row length (at least four updates per accumulator), so short
/// rows do not pay for merging lanes that saw one value each.
template <typename T>
Welford<double> row_moments(const T* x, Index n, T pivot) {
  return detail::moments_of(detail::RowValues<T>{x}, n, pivot);
}

namespace detail {

/// Rows shorter than this many packets are taken a group at a time by
/// rows_moments: their own Welford chains are too short to fill the
/// pipelines, and merging their lanes one row at a time is mostly latency.
constexpr Index kShortRowPackets = 16;

/// Rows shorter than this go through short_rows_moments in rows_moments:
/// 64 packets of narrow_simd (512 floats or 256 doubles with AVX2 or AVX-512).
template <typename T>
constexpr Index kShortMomentsValues = 64 * narrow_simd<T>::L;

/// Bytes of rows whose statistics are taken before any of them is
/// normalized. Long rows are grouped too: the per-row tail (lane merge,
/// sqrt, division) of one row then overlaps the next row's loop instead of
/// stalling the normalize loop that waits for it, and the group is still in
/// L1 when it is read the second time.
constexpr Index kGroupBytes = 16 * 1024;

/// Inputs at least this large are mostly read from memory, not from a
/// cache (streaming inputs). The row-wise forwards (LayerNorm, RMSNorm)
/// then change how they group rows (forward_group): long rows go one at a
/// time, short rows keep their groups and request each row of the next
/// group while a row of this one is normalized (software prefetch), so that
/// the next group's statistics pass does not start on misses. Below the
/// gate the caches hold the input between calls, and the groups (and no
/// prefetch) are faster: see forward_group (except LayerNorm's long float
/// rows from half the gate under the other CPUs' path choices, and on
/// Intel CPUs: LayerNorm::mid_streaming, LayerNorm::intel_streaming).
constexpr Index kStreamingBytes = Index(12) << 20;

/// The caches the OS reports, in bytes, each read once: the last-level
/// (L3) cache and a core's L2 (sysconf(_SC_LEVEL3_CACHE_SIZE) and
/// _SC_LEVEL2_CACHE_SIZE where the C library has them); 0 where it reports
/// none.
#if defined(_SC_LEVEL3_CACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
inline Index reported_cache_bytes(int name) {
  const long v = sysconf(name);
  return v > 0 ? static_cast<Index>(v) : Index(0);
}
inline Index l3_cache_bytes() {
  static const Index bytes = reported_cache_bytes(_SC_LEVEL3_CACHE_SIZE);
  return bytes;
}
inline Index l2_cache_bytes() {
  static const Index bytes = reported_cache_bytes(_SC_LEVEL2_CACHE_SIZE);
  return bytes;
}
#else
inline Index l3_cache_bytes() { return 0; }
inline Index l2_cache_bytes() { return 0; }
#endif

inline bool intel_tuned();  // (below, with the other path choices)

/// forward_stream_threshold()'s default: kStreamingBytes, or, with the
/// Intel path choices (intel_tuned), a sixteenth of the L3 the OS reports
/// when that is more. A streaming store sends y to memory; an ordinary one
/// leaves it in the cache, where the next layer reads it and where, in a
/// loop over one input, the next call finds x. Which is faster depends on
/// how much of the L3 the call gets. Measured on an Intel Xeon guest that
/// reports 480 MB of L3 (AVX-512, float, the same input every call),
/// LayerNorm forward with ordinary stores took 0.88x the time at 4096x1024
/// and 6144x1024, 0.99x at 8192x1024, but 1.47x at 12288x1024 and 1.96x at
/// 4096x4096; RMSNorm 0.78x at 4096x1024. On Zen 4 (32 MB of L3)
/// streaming stores took 0.77-0.82x the time at 4096x1024 (see
/// bench/HISTORY.md, the sixth round). Other CPUs, AMD's among them, keep
/// kStreamingBytes whatever L3 the OS reports: a Zen 5 guest that reported
/// 508 MB of L3 on one boot (32 MB on others; a core there reaches its own
/// CCX's L3) took, with streaming stores from 12 MiB against from 31 MiB,
/// 0.63x the time for LayerNorm forward at 65536x64, 0.62x at 32768x128,
/// 0.70x at 2048x2048, 0.87x at 4096x1024 and 6144x1024; RMSNorm 0.85x at
/// 65536x64, 0.84x at 4096x1024, 0.78x at 6144x1024 (float, both in one
/// process).
inline Index default_forward_stream_bytes() {
  return intel_tuned() ? std::max<Index>(kStreamingBytes, l3_cache_bytes() / 16) : kStreamingBytes;
}

/// The setting behind forward_stream_threshold(); negative: the default.
inline std::atomic<Index>& forward_stream_setting() {
  static std::atomic<Index> bytes{-1};
  return bytes;
}

}  // namespace detail

/// The size of input (bytes) from which the LayerNorm and RMSNorm forwards
/// write y with streaming (non-temporal) stores, on x86: inputs stored as
/// float or double, when y does not overlap x and, RowMajor, y is aligned
/// to a packet and every row is whole packets; ColMajor (AVX-512 builds
/// only), y is aligned to 64 bytes and every feature's column is whole
/// 64-byte lines (detail::can_stream_colmajor). Inputs under
/// detail::kStreamingBytes (12 MiB) never stream, whatever the threshold
/// (the forwards take them to be cached). Default: 12 MiB; with the Intel
/// path choices, a sixteenth of the L3 cache the OS reports when that is
/// more (detail::default_forward_stream_bytes). Only where the bits are
/// written from changes, never the bits.
inline Index forward_stream_threshold() {
  const Index v = detail::forward_stream_setting().load(std::memory_order_relaxed);
  return v >= 0 ? v : detail::default_forward_stream_bytes();
}

/// Sets forward_stream_threshold() for every later call, on every thread (a
/// negative value restores the default). Set it before the calls it is
/// meant for: a call running meanwhile sees the old value or the new one.
inline void set_forward_stream_threshold(Index bytes) {
  detail::forward_stream_setting().store(bytes, std::memory_order_relaxed);
}

namespace detail {

/// Whether a forward over an input of `bytes` writes y with streaming
/// stores where it can: at least forward_stream_threshold() (the callers
/// also require at least kStreamingBytes: streaming_input, or
/// can_stream_colmajor).
inline bool stream_forward_output(Index bytes) { return bytes >= forward_stream_threshold(); }

/// Whether a forward over `rows` rows of n values stored as S (computed in
/// T) streams: inputs of kStreamingBytes or more, stored in the compute
/// type (16-bit rows have their own gate: see forward_rows_widened).
template <typename S, typename T>
bool streaming_input(Index rows, Index n) {
  return std::is_same<S, T>::value && rows * n * static_cast<Index>(sizeof(S)) >= kStreamingBytes;
}

/// Rows of n values of `bytes` each taken per group, 1..max_group (rows of
/// up to 2 KB get max_group).
inline Index rows_per_group(Index n, Index bytes, Index max_group) {
  const Index fit = kGroupBytes / std::max<Index>(1, n * bytes);
  return std::max<Index>(1, std::min<Index>(max_group, fit));
}

/// Rows per group of the row-wise forwards, whose statistics are taken
/// before any of the group is normalized: rows_per_group(n, bytes,
/// max_group), except on streaming inputs for rows of at least `long_row`
/// values (the long-row kernels'), which go one at a time: each row is then
/// normalized straight after its statistics, while it is in L1, and the
/// hardware prefetchers see one forward stream. Measured on Zen 4 (32 MB L3,
/// 32 KB L1), LayerNorm forward, one row at a time against groups of up to
/// 16 KB that prefetched the next group: 0.52-0.64x the time on inputs of
/// 12-64 MB in rows of 512-1024 floats, 0.88x in rows of 2048; groups of
/// two rows without the prefetch 0.79x, groups of four without it 0.87x.
/// RMSNorm forward 0.85-1.06x. On inputs the caches hold (4-6 MB) one row
/// at a time took 1.03-1.17x the time, hence the gate (LayerNorm lowers it
/// to 6 MB under the other CPUs' path choices: LayerNorm::mid_streaming).
inline Index forward_group(bool streaming, Index n, Index bytes, Index max_group, Index long_row) {
  return streaming && n >= long_row ? 1 : rows_per_group(n, bytes, max_group);
}

/// Rows of the next group to prefetch while a group of `group` rows is
/// normalized (`left`: rows after this group), on streaming inputs. None for
/// one-row groups: rows that long are runs the hardware prefetchers follow
/// (4096 floats took 1.12x the time with the prefetches).
inline Index rows_ahead(bool streaming, Index group, Index left) {
  return streaming && group > 1 ? std::min(group, left) : 0;
}

/// Whether a row-wise backward over `rows` rows of n values stored as S
/// (computed in T) streams: the gate of streaming_input on what it reads,
/// x and dy together (so x alone of at least kStreamingBytes / 2). Its dx
/// then takes streaming stores where it can (stream_gradient) and its long
/// rows request the next row (prefetch_next_row): RMSNorm's one row at a
/// time, LayerNorm's in pairs where its dx streams and its rows are long
/// enough (LayerNorm::pair_streaming_rows), one at a time otherwise.
/// The call touches x, dy and dx, 1.5x what a forward of the same input
/// touches; with x at 6-12 MB (18-36 MB in all, against a 32 MB L3) dx
/// written through the cache evicted the x and dy lines that the next call,
/// or the next row, reads.
/// Measured on Zen 4 against the gate on x alone (float, -O3, the same
/// input every call, two sittings): LayerNorm backward 0.48-0.61x the time
/// at 2048x1024, 0.63-0.67x at 1536x1024, 0.73x at 768x2048; RMSNorm
/// 0.65-0.73x and 0.75-0.77x; rows of 64 at 6 MB 0.89-1.02x; -O2 alike.
/// On 2 threads, whose two L2s hold more of the call: 0.94x (LayerNorm) and
/// 1.07x (RMSNorm) at 2048x1024.
/// With x at 4 MB, long rows still gained (0.84-0.96x) but RMSNorm's rows
/// of 64 lost (1.08x at 16384x64), hence this gate. The forwards, which
/// touch only x and y, keep streaming_input: with the same lower gate they
/// took 1.03-1.15x the time at 1536x1024, 768x2048 and on rows of 50 and 64
/// (RMSNorm 1.05x at 2048x1024, LayerNorm 0.82x) in an earlier round on
/// Zen 4. In session 53, on a Zen 4 guest whose caches held less,
/// LayerNorm's long rows gained from 6 MB (0.67-0.94x), and take the lower
/// gate under the other CPUs' path choices (LayerNorm::mid_streaming).
template <typename S, typename T>
bool streaming_backward(Index rows, Index n) {
  return streaming_input<S, T>(2 * rows, n);
}

/// Whether the row-wise backwards request the next row as they go
/// (prefetch_l2 of its x and dy, a line for each line of the second pass):
/// rows of at least kShortMomentsValues values of a streaming backward
/// (streaming_backward). Each row's first pass reads it from memory and its
/// second pass from L1, so without the requests no memory read is in flight
/// during the second pass. Measured on Zen 4 on 4096x4096, 8192x2048 and
/// 16384x4096: LayerNorm backward 0.69-0.84x the time, RMSNorm 0.70-0.79x
/// (requests into the L1: 0.82-0.94x).
template <typename S, typename T>
bool prefetch_next_row(Index rows, Index n) {
  return streaming_backward<S, T>(rows, n) && n >= kShortMomentsValues<T>;
}

/// Whether a row-wise forward's normalize pass requests the next row as it
/// goes (RequestNext): rows of more than kRequestRowBytes, up to
/// max_row_bytes, of a streaming input (rows that long go one at a time,
/// forward_group). Measured on Zen 4, RMSNorm forward: 0.80-0.85x the time
/// at 4096x4096, 16384x4096 and 16384x2048, 0.76-0.91x at 24576x1536 and
/// 2048x8192; rows of 1024 floats 1.12-1.36x at 4096x1024 and 8192x1024,
/// 0.99x at 65536x1024. LayerNorm forward, whose normalize pass also reads
/// gamma and beta: 0.79-0.85x with rows of 1536 and 2048 floats, 0.96-0.97x
/// at 2560 and 3072, 1.12-1.21x at 4096 and 8192; so its limit is 8 KB.
constexpr Index kRequestRowBytes = 4096;

/// Whether the CPU is Intel's (x86 builds by GCC or Clang; read once).
/// Path choices tuned on an Intel Xeon follow it through intel_tuned:
/// LayerNorm's longest requested rows (request_max_row_bytes: the same loop
/// measured 1.12-1.21x the time on Zen 4 and 0.73-0.77x on an Intel Xeon),
/// LayerNorm's streaming path on smaller inputs (intel_streaming),
/// BatchNorm's fused channels-first groups (fused_channel_group), and,
/// through dx_streams_tuned (which AMD Zen 5 takes too), the row-wise
/// backwards' streaming dx on inputs that overflow the L2
/// (l2_backward_streams).
inline bool intel_cpu() {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(_MSC_VER)
  // (Not clang-cl: its __builtin_cpu_is needs compiler-rt's __cpu_model.)
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
#else
  return false;
#endif
}

/// An AMD CPU's family and model (CPUID leaf 1, with the extended fields
/// where the base family is 0xF); both 0 for any other CPU or build (x86
/// builds by GCC or Clang; read once).
struct AmdCpu {
  unsigned family = 0;
  unsigned model = 0;
};
inline AmdCpu amd_cpu() {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(_MSC_VER)
  static const AmdCpu cpu = [] {
    AmdCpu id;
    __builtin_cpu_init();
    if (__builtin_cpu_is("amd") == 0) return id;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return id;
    const unsigned base = (a >> 8) & 0xFu;
    id.family = base == 0xFu ? base + ((a >> 20) & 0xFFu) : base;
    id.model = ((a >> 4) & 0xFu) | (base == 0xFu ? ((a >> 16) & 0xFu) << 4 : 0u);
    return id;
  }();
  return cpu;
#else
  return AmdCpu();
#endif
}

/// Whether the CPU is AMD's of family 0x1A or later (Zen 5 on; amd_cpu).
/// Its path choices (zen5_tuned): Zen 4's, with one of the Intel CPUs'
/// (dx_streams_tuned), LayerNorm forward's requests into the L1
/// (LayerNorm::request_max_row_bytes), and without LayerNorm's streaming
/// kernels on inputs of 6-12 MB (LayerNorm::mid_streaming).
inline bool amd_zen5_cpu() { return amd_cpu().family >= 0x1Au; }

/// Whether the CPU is AMD's Zen 3 (family 0x19, models 0x00-0x0F and
/// 0x20-0x5F; Zen 4 is family 0x19 too, models 0x10-0x1F, 0x60-0x7F and
/// 0xA0-0xAF; amd_cpu). Its path choices (zen3_tuned): Zen 4's, with
/// LayerNorm forward's long rows requested as on Intel CPUs
/// (LayerNorm::request_max_row_bytes).
inline bool amd_zen3_cpu() {
  const AmdCpu cpu = amd_cpu();
  return cpu.family == 0x19u && (cpu.model <= 0x0Fu || (cpu.model >= 0x20u && cpu.model <= 0x5Fu));
}

/// The setting behind path_choices: -1 (the default) follows the CPU
/// (intel_cpu, amd_zen5_cpu, amd_zen3_cpu), 0 takes the other CPUs' path
/// choices (measured on Zen 4), 1 the Intel ones, 2 the AMD Zen 5 ones, 3
/// the AMD Zen 3 ones. For the tests, which check every set of paths on any
/// machine: a choice of paths, never of output bits.
inline std::atomic<int>& intel_tuning_setting() {
  static std::atomic<int> v{-1};
  return v;
}

/// The set of path choices that applies: 0 (other CPUs), 1 (Intel), 2
/// (AMD Zen 5) or 3 (AMD Zen 3), by intel_tuning_setting.
inline int path_choices() {
  const int v = intel_tuning_setting().load(std::memory_order_relaxed);
  return v >= 0 ? v : intel_cpu() ? 1 : amd_zen5_cpu() ? 2 : amd_zen3_cpu() ? 3 : 0;
}

/// Whether the path choices tuned on Intel CPUs apply (path_choices).
inline bool intel_tuned() { return path_choices() == 1; }

/// Whether the path choices tuned on AMD Zen 5 apply (path_choices).
inline bool zen5_tuned() { return path_choices() == 2; }

/// Whether the path choices tuned on AMD Zen 3 apply (path_choices).
inline bool zen3_tuned() { return path_choices() == 3; }

/// Whether the row-wise backwards' streaming dx on inputs that overflow the
/// L2 (l2_backward_streams) applies: with the Intel and the Zen 5 path
/// choices (path_choices). Measured on an AMD Zen 5 guest (1 MB of L2,
/// AVX-512, float, both settings alternating in one process, the same
/// bits), against ordinary stores: LayerNorm backward 0.88-0.95x the time
/// with x at 0.5-4 MB (170x768 to 1024x1024, 1024x256), RMSNorm 0.88-0.98x,
/// 2048x768 (x of 6 MiB, which streams anyway: streaming_backward) 1.00x;
/// on 2 threads 0.84-0.94x and 0.76-0.93x. (The Intel set's other choices
/// lost there: LayerNorm forward 1.01-1.14x the time on rows of 2048-8192
/// floats, BatchNorm's fused training forward 1.10-1.16x at 32x64x56x56.)
/// On Zen 4 (session 53, each set against the other CPUs', 9 shuffled
/// rounds in one process) RMSNorm's backward at 512x768 took 1.24x the time
/// under the Intel set and under the Zen 5 set. BatchNorm's channels-last dx streams on every CPU
/// (BatchNorm::dx_streams_channels_last), which until session 53 took this
/// setting too.
inline bool dx_streams_tuned() { return intel_tuned() || zen5_tuned(); }

/// Rows shorter than this many bytes keep ordinary dx stores under the
/// streaming_backward gate (l2_backward_streams).
constexpr Index kL2StreamRowBytes = 1024;

/// The L2 that l2_backward_streams weighs a thread's share against: the one
/// the OS reports, or 2 MiB where it reports none.
inline Index backward_l2_bytes() { return l2_cache_bytes() > 0 ? l2_cache_bytes() : (Index(2) << 20); }

/// Whether a row-wise backward under the streaming_backward gate still
/// writes dx with streaming stores (where dx can take them): on Intel CPUs
/// and AMD Zen 5 (dx_streams_tuned), rows of at least kL2StreamRowBytes,
/// when what each of the `threads` threads touches, x, dy and dx
/// (3 * x / threads), is more than the L2 (backward_l2_bytes: the OS's, or
/// 2 MiB). A dx written through the cache then evicts the x and dy lines
/// that the row's second pass, or the next call over the same input, reads;
/// streamed, x and dy stay in the L2. Measured on an Intel Xeon guest (2 MB
/// of L2, AVX-512, float, the same input every call, two builds
/// alternating), against ordinary stores: 1 thread, LayerNorm backward
/// 0.77-0.82x the time with x at 0.75-1 MB (256x768, 192x1024, 256x1024,
/// 341x768), 0.79-0.99x at 1-4 MB with rows of 512-2048 floats, 0.89-0.98x
/// with rows of 256; RMSNorm 0.58-0.93x. But x at 0.5 MB (which the L2
/// holds with dx): 1.13x and 1.35x for RMSNorm at 170x768 and 512x256; rows
/// of 64 and 128 at 2-4 MB: 1.02-1.12x. On 2 threads: 0.67-0.75x at 512x768
/// and 768x768, 0.75-0.88x at 1.5 MB (384x1024, 1536x256), but 1.04-1.37x
/// at 1 MB (256x1024, 1024x256: 0.5 MB a thread).
template <typename S, typename T>
bool l2_backward_streams(Index rows, Index n, Index threads) {
  if (!std::is_same<S, T>::value || !dx_streams_tuned()) return false;
  const Index row = n * static_cast<Index>(sizeof(S));
  return row >= kL2StreamRowBytes &&
         rows * row > std::max<Index>(1, threads) * (backward_l2_bytes() / 3);  // 3x > L2 a thread
}

inline bool forward_requests(bool streaming, Index n, Index bytes, Index max_row_bytes) {
  const Index row = n * bytes;
  return streaming && row > kRequestRowBytes && row <= max_row_bytes;
}

/// Requests the cache line at p for reading, with the builtin's temporal
/// locality (2: into the L2, 3: into the L1 as well), where the compiler
/// has the builtin.
template <int Locality>
EIGEN_ALWAYS_INLINE void prefetch_line(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, Locality);
#else
  Eigen::internal::prefetch(static_cast<const char*>(p));
#endif
}

/// Requests the cache line at p into the L2, not the L1 (which holds the
/// row being worked on).
EIGEN_ALWAYS_INLINE void prefetch_l2(const void* p) { prefetch_line<2>(p); }

/// Requests the `bytes` bytes at p into the cache (one prefetch per line,
/// into the L1 as well). Always inlined, as every function here whose only
/// effect is a request: GCC 12 takes a function that only requests (the
/// builtin touches no memory it tracks) for one without side effects, and
/// where it does not inline it, it removes the calls, requests and all
/// (seen with -fno-inline, and with a functor's call in a loop).
EIGEN_ALWAYS_INLINE void prefetch_span(const void* p, Index bytes) {
  const char* c = static_cast<const char*>(p);
  for (Index off = 0; off < bytes; off += 64) prefetch_line<3>(c + off);
}

/// Values of T in a 64-byte cache line.
template <typename T>
constexpr Index kLineValues = Index(64 / sizeof(T));

/// prefetch_l2 (IntoL1: into the L1 as well) of the lines holding values
/// j .. j + L - 1 of the row at `next`, for a pass that reads packets of L
/// values at j: once per line (at the packet that starts a line when a line
/// holds several packets).
template <int L, bool IntoL1 = false, typename T>
EIGEN_ALWAYS_INLINE void request_lines(const T* next, Index j) {
  constexpr Index kLine = kLineValues<T>;
  if (L >= kLine || j % kLine == 0) {
    for (Index l = 0; l < L; l += kLine) prefetch_line<IntoL1 ? 3 : 2>(next + j + l);
  }
}

/// Whether the row-wise backwards' requests of the next row
/// (prefetch_next_row) go into the L1 as well as the L2: on AMD Zen 5
/// (zen5_tuned). Measured on a Zen 5 guest (48 KB of L1d, 1 MB of L2;
/// AVX-512, float, both kinds in one process, the median of 15 paired
/// ratios in each of one to three processes) against requests into the L2:
/// LayerNorm backward 0.86-0.98x the time at 8192x1024, 4096x2048 and
/// 16384x512, 0.94-0.98x at 4096x4096 and 16384x4096; RMSNorm 0.93-0.98x
/// at 4096x2560, 8192x1024 and 16384x512, 0.97-1.00x at 4096x2048,
/// 4096x4096 and 16384x4096. On 2 threads LayerNorm 0.88-0.98x, RMSNorm
/// 0.94-1.01x. On Zen 4 the L2 won (prefetch_next_row).
inline bool backward_requests_into_l1() { return zen5_tuned(); }

/// The second pass's request at value j of a row (packets of L values):
/// the lines holding value j of the next row's x and dy (x_next, dy_next),
/// into the L2, or with into_l1 the L1 (backward_requests_into_l1).
template <int L, typename T>
EIGEN_ALWAYS_INLINE void request_next_row(const T* x_next, const T* dy_next, Index j, bool into_l1) {
  if (into_l1) {
    request_lines<L, true>(x_next, j);
    request_lines<L, true>(dy_next, j);
  } else {
    request_lines<L>(x_next, j);
    request_lines<L>(dy_next, j);
  }
}

/// A source (RowValues and kin) that requests the next row as it is read:
/// as packet i is read, the line holding value i of the row at `next` goes
/// to the L2 (IntoL1: the L1; request_lines). For the second pass of a long
/// row of a streaming input, which reads the row from L1, so that memory
/// reads stay in flight while it runs. Masked packets and single values (a
/// row's tail) request nothing.
template <typename Src, typename N, bool IntoL1 = false>
struct RequestNext {
  Src src;
  const N* next;
  template <typename Packet>
  EIGEN_ALWAYS_INLINE Packet packet(Index i) const {
    request_lines<Eigen::internal::unpacket_traits<Packet>::size, IntoL1>(next, i);
    return src.template packet<Packet>(i);
  }
  template <typename Packet, typename Mask>
  EIGEN_ALWAYS_INLINE Packet packet(Index i, Mask m) const {
    return src.template packet<Packet>(i, m);
  }
  EIGEN_ALWAYS_INLINE auto value(Index j) const { return src.value(j); }
};

template <bool IntoL1 = false, typename N, typename Src>
RequestNext<Src, N, IntoL1> request_next(const Src src, const N* next) {
  return RequestNext<Src, N, IntoL1>{src, next};
}

/// widen_lanes(a, out): the lanes of a as doubles, out[i] holding lanes
/// i * R .. i * R + R - 1 (R = simd<double>::L), in registers. x86 builds
/// have it for narrow_simd<float>'s packet and for simd<double>'s (as is);
/// kWidenInRegisters says whether the build has any (widen_transposed also
/// checks that the packet at hand has one).
#if defined(EIGEN_VECTORIZE_SSE2)
constexpr bool kWidenInRegisters = true;
template <typename PD>
inline void widen_lanes(const PD& a, PD* out) {  // already double
  out[0] = a;
}
#if defined(EIGEN_VECTORIZE_AVX512)
inline void widen_lanes(const Eigen::internal::Packet8f& a, Eigen::internal::Packet8d* out) {
  out[0] = _mm512_cvtps_pd(a);
}
#elif defined(EIGEN_VECTORIZE_AVX)
inline void widen_lanes(const Eigen::internal::Packet8f& a, Eigen::internal::Packet4d* out) {
  out[0] = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
  out[1] = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
}
#else
inline void widen_lanes(const Eigen::internal::Packet4f& a, Eigen::internal::Packet2d* out) {
  out[0] = _mm_cvtps_pd(a);
  out[1] = _mm_cvtps_pd(_mm_movehl_ps(a, a));
}
#endif
#else
constexpr bool kWidenInRegisters = false;
#endif

// PacketBlock over Eigen's packet types: GCC warns that the vector types'
// attributes are ignored as template arguments, which is harmless here
// (the block only holds them).
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
/// Whether widen_lanes takes a Packet (into simd<double> packets).
template <typename Packet>
constexpr auto has_widen_lanes(int)
    -> decltype(widen_lanes(std::declval<const Packet&>(), static_cast<typename simd<double>::Packet*>(nullptr)),
                bool()) {
  return true;
}
template <typename Packet>
constexpr bool has_widen_lanes(...) {
  return false;
}

/// out[l] = lane l of in[0..R), widened to double (R = simd<double>::L
/// rows of L lanes, transposed to lane-major). Exact: widening and moving
/// values round nothing, so either route gives the same bits. In registers
/// (widen_lanes, then transposes of R x R blocks) where the build has them,
/// else through memory lane by lane.
template <int R, typename Packet, typename PD>
EIGEN_ALWAYS_INLINE void widen_transposed(const Packet* in, PD* out) {
  using namespace Eigen::internal;
  using T = typename unpacket_traits<Packet>::type;
  constexpr int L = unpacket_traits<Packet>::size;
  if constexpr (kWidenInRegisters && R > 1 && L == R && std::is_same<T, float>::value &&
                has_widen_lanes<Packet>(0)) {
    // Square (AVX-512: 8 rows of 8 floats): transposed as floats, then each
    // lane widened; half the shuffles of transposing the widened doubles.
    // On an Intel Xeon, whose shuffles all take one port, LayerNorm's
    // forward at 2048x50 took 0.92x the time (65536x64: 0.91x).
    PacketBlock<Packet, R> blk;
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) blk.packet[r] = in[r];
    ptranspose(blk);
    NORMCORE_UNROLL
    for (int l = 0; l < L; ++l) widen_lanes(blk.packet[l], out + l);
  } else if constexpr (kWidenInRegisters && R > 1 && L % R == 0 && has_widen_lanes<Packet>(0)) {
    PD w[R][L / R];
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) widen_lanes(in[r], w[r]);
    NORMCORE_UNROLL
    for (int b = 0; b < L / R; ++b) {
      PacketBlock<PD, R> blk;
      NORMCORE_UNROLL
      for (int r = 0; r < R; ++r) blk.packet[r] = w[r][b];
      ptranspose(blk);
      NORMCORE_UNROLL
      for (int i = 0; i < R; ++i) out[b * R + i] = blk.packet[i];
    }
  } else {
    alignas(64) double t[L * R];
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) {
      alignas(64) T a[L];
      pstore(a, in[r]);
      NORMCORE_UNROLL
      for (int l = 0; l < L; ++l) t[l * R + r] = static_cast<double>(a[l]);
    }
    NORMCORE_UNROLL
    for (int l = 0; l < L; ++l) out[l] = pload<PD>(t + l * R);
  }
}
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

/// a[l] += a[l + h] for h = L/2, ..., 1: a[0] ends with the sum of the L
/// lane packets, in the same tree on every ISA.
template <int L, typename PD>
EIGEN_ALWAYS_INLINE void sum_lanes_by_halving(PD* a) {
  NORMCORE_UNROLL
  for (int h = L / 2; h >= 1; h /= 2)
    NORMCORE_UNROLL
    for (int l = 0; l < h; ++l) a[l] = Eigen::internal::padd(a[l], a[l + h]);
}

/// Two of narrow_simd<T>'s packets side by side in one of simd<T>'s, where
/// that is twice as wide (AVX-512): join_halves(lo, hi) and its inverse,
/// split_halves. Moving lanes rounds nothing.
#if defined(EIGEN_VECTORIZE_AVX512)
constexpr bool kJoinHalves = true;
EIGEN_ALWAYS_INLINE Eigen::internal::Packet16f join_halves(const Eigen::internal::Packet8f& lo,
                                                           const Eigen::internal::Packet8f& hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
EIGEN_ALWAYS_INLINE Eigen::internal::Packet8d join_halves(const Eigen::internal::Packet4d& lo,
                                                          const Eigen::internal::Packet4d& hi) {
  return _mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1);
}
EIGEN_ALWAYS_INLINE void split_halves(const Eigen::internal::Packet16f& a, Eigen::internal::Packet8f* lo,
                                      Eigen::internal::Packet8f* hi) {
  *lo = _mm512_castps512_ps256(a);
  *hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}
EIGEN_ALWAYS_INLINE void split_halves(const Eigen::internal::Packet8d& a, Eigen::internal::Packet4d* lo,
                                      Eigen::internal::Packet4d* hi) {
  *lo = _mm512_castpd512_pd256(a);
  *hi = _mm512_extractf64x4_pd(a, 1);
}
#else
constexpr bool kJoinHalves = false;
#endif

/// Whether short_rows_moments runs its rows two to a packet
/// (short_rows_welford_paired): with AVX-512, in full groups (A = R).
template <typename T, typename Packet, int A>
constexpr bool kPairShortRows = kJoinHalves && A == simd<double>::L &&
                                sizeof(typename simd<T>::Packet) == 2 * sizeof(Packet);

/// Steps 1 and 1b of short_rows_moments (below) for all R of its rows, two
/// rows to one of simd<T>'s packets where that is twice narrow_simd<T>'s
/// (AVX-512: row 2i in the low half, row 2i + 1 in the high). Every lane
/// runs the same operations on the same values as with a row to a narrow
/// packet, so the same bits, in half the arithmetic instructions; out in
/// narrow packets, one per row.
template <int R, typename S, typename T, typename Packet>
EIGEN_ALWAYS_INLINE void short_rows_welford_paired(const S* const* rows, Index n, Packet* mean, Packet* m2) {
  using namespace Eigen::internal;
  using Wide = typename simd<T>::Packet;
  constexpr int L = unpacket_traits<Packet>::size;
  constexpr int P = R / 2;
  static_assert(R % 2 == 0 && simd<T>::L == 2 * L, "two narrow packets to a wide one");
  const auto& recip = reciprocals<T>::table;
  const Index packets = n / L;
  const Index rest = n - packets * L;
  Wide pivot[P];
  Wide wmean[P];
  Wide wm2[P];
  NORMCORE_UNROLL
  for (int i = 0; i < P; ++i) {
    pivot[i] = join_halves(pset1<Packet>(static_cast<T>(rows[2 * i][0])),
                           pset1<Packet>(static_cast<T>(rows[2 * i + 1][0])));
    wmean[i] = wm2[i] = pset1<Wide>(T(0));
  }
  for (Index p = 0; p < packets; ++p) {
    const Wide inv = pset1<Wide>(recip[static_cast<std::size_t>(p + 1)]);
    NORMCORE_UNROLL
    for (int i = 0; i < P; ++i) {
      const Wide x =
          join_halves(load_widened<Packet>(rows[2 * i] + p * L), load_widened<Packet>(rows[2 * i + 1] + p * L));
      welford_step(psub(x, pivot[i]), inv, wmean[i], wm2[i]);
    }
  }
  if (packets > 0 && rest > 0) {
    const Wide inv = pset1<Wide>(recip[static_cast<std::size_t>(packets + 1)]);
    const Packet half_mask = pcmp_le(pset1<Packet>(static_cast<T>(L - rest)), plset<Packet>(T(0)));
    const Wide mask = join_halves(half_mask, half_mask);
    NORMCORE_UNROLL
    for (int i = 0; i < P; ++i) {
      const Wide x =
          join_halves(load_widened<Packet>(rows[2 * i] + n - L), load_widened<Packet>(rows[2 * i + 1] + n - L));
      welford_step(psub(x, pivot[i]), inv, wmean[i], wm2[i], mask);
    }
  }
  NORMCORE_UNROLL
  for (int i = 0; i < P; ++i) {
    split_halves(wmean[i], mean + 2 * i, mean + 2 * i + 1);
    split_halves(wm2[i], m2 + 2 * i, m2 + 2 * i + 1);
  }
}

/// Moments of simd<double>::L short rows (rows_moments' kShortMomentsValues) side
/// by side, each shifted by its first value; out[r] in shifted coordinates.
/// Every operation is vertical across the rows, so a row's result depends
/// only on its own values and on n, never on the rows it is grouped with.
///   1. One Welford accumulator per row, the rows interleaved: the group's
///      chains are independent, so the loop runs at throughput, not latency.
///      The tail (n mod L values) is one more update of the row's last L
///      values with the lanes that already counted theirs masked out.
///      With AVX-512, a full group runs two rows to a 512-bit packet
///      (short_rows_welford_paired): the same bits in half the arithmetic
///      instructions. On an AMD Zen 5 guest (float, both in one process):
///      0.77x the time of the moments of 256 rows of 384 and 0.95x at 2048
///      rows of 50; LayerNorm's forward 0.86x at 512x256, 0.93x at 256x384,
///      0.95-0.97x at 2048x50 and 2048x64.
///   2. The lane states are widened to double and transposed (lane-major,
///      one double packet per lane holds that lane of every row).
///   3. merge_equal's closed form, in double (each lane weighted by its own
///      count when a tail made them unequal), summing the lanes by halving
///      (lane l += lane l + h for h = L/2, ..., 1): the same tree on every
///      ISA.
///   4. Rows shorter than one packet: two-pass in double.
/// Rows stored as a 16-bit S are widened to T (float) packet by packet as
/// they are read (load_widened): the same values, so the same bits, as rows
/// widened beforehand. A < R: rows A .. R - 1 repeat row A - 1, whose chain
/// they copy instead of running their own (a partial group, below).
template <typename S, typename T = compute_t<S>, typename Packet = typename narrow_simd<T>::Packet,
          int A = simd<double>::L>
NORMCORE_FLATTEN void short_rows_moments(const S* const* rows, Index n, double* mu, double* q) {
  using namespace Eigen::internal;
  using PD = typename simd<double>::Packet;
  constexpr int L = unpacket_traits<Packet>::size;
  constexpr int R = simd<double>::L;  // rows per group
  static_assert((L & (L - 1)) == 0, "packet sizes are powers of two");
  static_assert(A >= 1 && A <= R, "computed rows: 1 to R");
  const auto& recip = reciprocals<T>::table;
  const Index packets = n / L;
  // 1. Lane-wise Welford, R independent chains.
  Packet mean[R];
  Packet m2[R];
  NORMCORE_UNROLL
  for (int r = 0; r < R; ++r) mean[r] = m2[r] = pset1<Packet>(T(0));
  const Index full = packets * L;
  const Index rest = n - full;
  const bool lane_tail = packets > 0 && rest > 0;
  if constexpr (kPairShortRows<T, Packet, A>) {
    short_rows_welford_paired<R, S, T>(rows, n, mean, m2);
  } else {
    for (Index p = 0; p < packets; ++p) {
      const Packet inv = pset1<Packet>(recip[static_cast<std::size_t>(p + 1)]);
      NORMCORE_UNROLL
      for (int r = 0; r < A; ++r) {
        const Packet d = psub(load_widened<Packet>(rows[r] + p * L), pset1<Packet>(static_cast<T>(rows[r][0])));
        welford_step(d, inv, mean[r], m2[r]);
      }
    }
    // 1b. The tail (0 < rest < L values), when the row has a full packet: the
    //     row's last L values, of which lanes L - rest .. L - 1 are the tail;
    //     the other lanes' delta is masked to 0, so their state is unchanged.
    //     Lane l then holds c_l = packets + (l >= L - rest) values.
    if (lane_tail) {
      const Packet inv = pset1<Packet>(recip[static_cast<std::size_t>(packets + 1)]);
      const Packet mask = pcmp_le(pset1<Packet>(static_cast<T>(L - rest)), plset<Packet>(T(0)));
      NORMCORE_UNROLL
      for (int r = 0; r < A; ++r) {
        const Packet d = psub(load_widened<Packet>(rows[r] + n - L), pset1<Packet>(static_cast<T>(rows[r][0])));
        welford_step(d, inv, mean[r], m2[r], mask);
      }
    }
  }
  // Rows A .. R - 1 repeat row A - 1 (a partial group): its chains' values.
  NORMCORE_UNROLL
  for (int r = A; r < R; ++r) {
    mean[r] = mean[A - 1];
    m2[r] = m2[A - 1];
  }
  if (lane_tail) {
    // 2'. As 2 and 3 below with unequal lane counts: mean = sum c_l mean_l / n,
    //     M2 = sum M2_l + sum c_l (mean_l - mean)^2, the lanes summed by
    //     halving in the same tree. (A separate branch: folded into 2 and 3,
    //     GCC contracted their multiply-adds differently, changing the bits
    //     of rows without a tail.)
    PD mt[L];
    PD qt[L];
    PD st[L];
    widen_transposed<R>(mean, mt);
    widen_transposed<R>(m2, qt);
    NORMCORE_UNROLL
    for (int l = 0; l < L; ++l) st[l] = pmul(pset1<PD>(static_cast<double>(packets + (l >= L - rest ? 1 : 0))), mt[l]);
    sum_lanes_by_halving<L>(st);
    sum_lanes_by_halving<L>(qt);
    const PD avg = pdiv(st[0], pset1<PD>(static_cast<double>(n)));
    NORMCORE_UNROLL
    for (int l = 0; l < L; ++l) {
      const PD c = pset1<PD>(static_cast<double>(packets + (l >= L - rest ? 1 : 0)));
      const PD e = psub(mt[l], avg);
      mt[l] = pmul(c, pmul(e, e));
    }
    sum_lanes_by_halving<L>(mt);
    pstoreu(mu, avg);
    pstoreu(q, padd(qt[0], mt[0]));
  } else if (packets > 0) {
    // 2. Widen and transpose: mt[l] holds lane l of every row.
    PD mt[L];
    PD qt[L];
    widen_transposed<R>(mean, mt);
    widen_transposed<R>(m2, qt);
    // 3. Sum of the lane means and of the lane M2s by halving; then the
    //    spread of the lane means about their mean.
    PD st[L];
    NORMCORE_UNROLL
    for (int l = 0; l < L; ++l) st[l] = mt[l];
    sum_lanes_by_halving<L>(st);
    sum_lanes_by_halving<L>(qt);
    const PD avg = pdiv(st[0], pset1<PD>(static_cast<double>(L)));
    NORMCORE_UNROLL
    for (int l = 0; l < L; ++l) {
      const PD e = psub(mt[l], avg);
      mt[l] = pmul(e, e);
    }
    sum_lanes_by_halving<L>(mt);
    const PD k = pset1<PD>(static_cast<double>(packets));
    pstoreu(mu, avg);
    pstoreu(q, padd(qt[0], pmul(k, mt[0])));
  }
  // 4. Rows without a full packet (n < L): two-pass in double per row.
  if (packets == 0) {
    alignas(64) double tm[R];
    alignas(64) double tq[R];
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) {
      const double pivot = static_cast<double>(static_cast<T>(rows[r][0]));
      double sum = 0;
      for (Index j = full; j < n; ++j) sum += static_cast<double>(static_cast<T>(rows[r][j])) - pivot;
      tm[r] = sum;
    }
    pstore(tm, pdiv(pload<PD>(tm), pset1<PD>(static_cast<double>(rest))));
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) {
      const double pivot = static_cast<double>(static_cast<T>(rows[r][0]));
      double qq = 0;
      for (Index j = full; j < n; ++j) {
        const double d = static_cast<double>(static_cast<T>(rows[r][j])) - pivot - tm[r];
        qq += d * d;
      }
      tq[r] = qq;
    }
    pstoreu(mu, pload<PD>(tm));
    pstoreu(q, pload<PD>(tq));
  }
}

/// short_rows_moments of a group whose rows from `active` on repeat row
/// active - 1 (a partial group: a batch of fewer rows than R, or its last
/// rows): only the chains of the first 1, 2, 4 or R rows run, the fewest
/// that hold the active ones, and the repeats take the last chain's state.
/// The same bits, since each row's chain is its own. Measured on an AMD Zen 5
/// guest (AVX-512, R = 8, float, LayerNorm forward, both in one process)
/// against all R chains: 0.69-0.78x the time at 1x256 to 1x511 and 2x384,
/// 0.80-0.83x at 3x384 and 4x256, 0.87-0.89x at 1x50 and 1x64; the
/// backward without saved statistics 0.88-0.91x at 1x384 and 3x256. Full
/// groups are unchanged (1.00x at 2048x50 and 512x256).
template <typename S>
void short_rows_moments(const S* const* rows, Index n, Index active, double* mu, double* q) {
  constexpr int R = simd<double>::L;
  using T = compute_t<S>;
  using Packet = typename narrow_simd<T>::Packet;
  if (active <= 1) {
    short_rows_moments<S, T, Packet, 1>(rows, n, mu, q);
    return;
  }
  if constexpr (R > 2) {
    if (active <= 2) {
      short_rows_moments<S, T, Packet, 2>(rows, n, mu, q);
      return;
    }
  }
  if constexpr (R > 4) {
    if (active <= 4) {
      short_rows_moments<S, T, Packet, 4>(rows, n, mu, q);
      return;
    }
  }
  short_rows_moments(rows, n, mu, q);
}

/// short_rows_moments as Welford states (rows from `active` on: see above).
template <typename T>
void short_rows_moments(const T* const* rows, Index n, Welford<double>* out,
                        Index active = simd<double>::L) {
  constexpr int R = simd<double>::L;
  alignas(64) double mu[R];
  alignas(64) double q[R];
  short_rows_moments(rows, n, active, mu, q);
  NORMCORE_UNROLL
  for (int r = 0; r < R; ++r) out[r] = Welford<double>(static_cast<double>(n), mu[r], q[r]);
}

/// Whether rows_moments takes long rows two at a time (rows_moments_acc
/// with R = 2): where two rows' Welford states (2 x A packets each) fit in
/// the registers beside the loop's temporaries, that is with 32 vector
/// registers and at most four accumulators (AVX-512 float). The same bits
/// as a row at a time.
template <typename T>
constexpr bool kPairRows = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 && simd<T>::A <= 4;

/// row_moments of rows x and x + ld (n values each, pivots their first
/// values) in one loop, into out[0] and out[1].
template <typename T>
void row_pair_moments(const T* x, Index ld, Index n, Welford<double>* out) {
  const RowValues<T> src[2] = {{x}, {x + ld}};
  const T pivot[2] = {x[0], x[ld]};
  switch (moments_accumulators<T>(n)) {
    case 8: rows_moments_acc<T, (simd<T>::A >= 8 ? 8 : 1), 2>(src, n, pivot, out); return;
    case 4: rows_moments_acc<T, (simd<T>::A >= 4 ? 4 : 1), 2>(src, n, pivot, out); return;
    case 2: rows_moments_acc<T, 2, 2>(src, n, pivot, out); return;
    default: rows_moments_acc<T, 1, 2>(src, n, pivot, out); return;
  }
}

/// Moments of `count` <= G short rows (0 < n < kShortMomentsValues), row r
/// at x + r * ld, as rows_moments computes them but split into their means
/// (shifted by the row's first value) and M2s: mu[r], q[r] for r < G, the
/// rows past `count` repeating the last one. G: a multiple of
/// simd<double>::L. T: the rows' storage type (16-bit rows are widened as
/// they are read).
template <int G, typename T>
void short_rows_moments_split(const T* x, Index n, Index ld, Index count, double* mu, double* q) {
  constexpr int R = simd<double>::L;
  static_assert(G % R == 0, "whole groups");
  for (int r0 = 0; r0 < G; r0 += R) {
    if (r0 >= count) {  // a whole group of padding: the last row's results, as computed
      for (int r = r0; r < r0 + R; ++r) {
        mu[r] = mu[count - 1];
        q[r] = q[count - 1];
      }
      continue;
    }
    const T* rows[R];
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) rows[r] = x + std::min<Index>(r0 + r, count - 1) * ld;
    short_rows_moments(rows, n, count - r0, mu + r0, q + r0);
  }
}

}  // namespace detail

/// Moments of `count` rows of n contiguous values, row r at x + r * ld, each
/// shifted by its first value (out[r] is in shifted coordinates, as
/// row_moments(row, n, row[0]) returns). Short rows are taken in groups
/// (detail::short_rows_moments; a partial group repeats its last row), long
/// rows one at a time by row_moments. Either way a row's result depends only
/// on its values and n: not on count, on its neighbours or on threads.
template <typename T>
void rows_moments(const T* x, Index n, Index ld, Index count, Welford<double>* out) {
  if (n <= 0) {
    for (Index r = 0; r < count; ++r) out[r] = Welford<double>();
    return;
  }
  if (n >= detail::kShortMomentsValues<T>) {
    Index r = 0;
    if constexpr (detail::kPairRows<T>) {
      for (; r + 1 < count; r += 2) detail::row_pair_moments(x + r * ld, ld, n, out + r);
    }
    for (; r < count; ++r) out[r] = row_moments(x + r * ld, n, x[r * ld]);
    return;
  }
  constexpr int R = detail::simd<double>::L;
  for (Index r0 = 0; r0 < count; r0 += R) {
    const T* rows[R];
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) rows[r] = x + std::min<Index>(r0 + r, count - 1) * ld;
    if (r0 + R <= count) {
      detail::short_rows_moments(rows, n, out + r0);
      continue;
    }
    // The last, partial group repeats its last row to fill the packet.
    Welford<double> w[R];
    detail::short_rows_moments(rows, n, w, count - r0);
    for (Index r = 0; r0 + r < count; ++r) out[r0 + r] = w[r];
  }
}

/// Moments of one contiguous row (pivot: its first element); the returned
/// state is in absolute coordinates (mean = mean(x)).
template <typename T>
Welford<double> row_moments(const T* x, Index n) {
  if (n <= 0) return Welford<double>();
  const Welford<double> w = row_moments(x, n, x[0]);
  return Welford<double>(w.count(), static_cast<double>(x[0]) + w.mean(), w.m2());
}

namespace detail {

/// Most packets of lanes whose Welford states lane_chunks keeps in registers
/// for a whole chunk: 8 with 32 vector registers (AVX-512: 128 floats), 4
/// with 16 (AVX2: 32 floats). BatchNorm's channels-last normalize keeps as
/// many packets of channel constants (three per packet) in registers.
constexpr int kRegisterLanePackets = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 ? 8 : 4;

/// Bytes of rows that lane_chunks steps through block after block when the
/// lanes fill more than one block (see lane_chunks): half of a 32 KB L1.
constexpr Index kLaneTileBytes = 16 * 1024;

/// Rows of a chunk of lane_chunks with the states of NP packets of lanes
/// (every lane; no leftover lanes) in registers: the states are loaded from
/// mean and m2, stepped through the chunk's rows first .. first + iters - 1
/// (counted from 1; row k of the chunk is x + (i0 + k - 1) * stride) and
/// stored back. Each lane runs the same recurrence as in memory, so the
/// same bits. Ahead (lane_chunks' requests of the next tile): step k also
/// calls ask.request(line) for the 64-byte lines that start in bytes
/// [k * ask.step, (k + 1) * ask.step) of the ask.bytes bytes at ask.from.
template <int NP, bool Ahead = false, typename T, typename Ask = int>
void lane_chunk_in_registers(const T* x, Index stride, Index i0, Index first, Index iters, const T* pivot,
                             T* mean, T* m2, const Ask& ask = {}) {
  using namespace Eigen::internal;
  using Packet = typename simd<T>::Packet;
  constexpr int L = simd<T>::L;
  const auto& recip = detail::reciprocals<T>::table;
  Packet mu[NP];
  Packet q[NP];
  NORMCORE_UNROLL
  for (int k = 0; k < NP; ++k) {
    mu[k] = ploadu<Packet>(mean + k * L);
    q[k] = ploadu<Packet>(m2 + k * L);
  }
  for (Index it = first; it < first + iters; ++it) {
    const T* row = x + (i0 + it - 1) * stride;
    const Packet pinv = pset1<Packet>(recip[static_cast<std::size_t>(it)]);
    NORMCORE_UNROLL
    for (int k = 0; k < NP; ++k) {
      welford_step(psub(ploadu<Packet>(row + k * L), ploadu<Packet>(pivot + k * L)), pinv, mu[k], q[k]);
    }
    if constexpr (Ahead) ask.lines_of_step(it - first);
  }
  NORMCORE_UNROLL
  for (int k = 0; k < NP; ++k) {
    pstoreu(mean + k * L, mu[k]);
    pstoreu(m2 + k * L, q[k]);
  }
}

/// Calls f(std::integral_constant<int, np>()) for a run-time packet count
/// 1 <= np <= kRegisterLanePackets: the register-resident loops are
/// templates on their packet count.
template <typename F>
void with_register_packets(int np, F&& f) {
  static_assert(kRegisterLanePackets == 4 || kRegisterLanePackets == 8, "the cases cover 4 or 8 packets");
  // Counts past 4 only where there are registers for them; with 16, one
  // switch holding them would have identical cases (bugprone-branch-clone).
  if constexpr (kRegisterLanePackets >= 8) {
    switch (np) {
      case 5: return f(std::integral_constant<int, 5>());
      case 6: return f(std::integral_constant<int, 6>());
      case 7: return f(std::integral_constant<int, 7>());
      case 8: return f(std::integral_constant<int, 8>());
      default: break;
    }
  }
  switch (np) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    default: return f(std::integral_constant<int, 4>());
  }
}

/// lane_chunk_in_registers for np packets, 1 <= np <= kRegisterLanePackets
/// (Ahead: with requests, ask a TileAsk). Two sets of loops, so that the
/// loop without requests (and its caller's code) stays as it was: with the
/// requests' test in the one loop, lane_moments took about 1.05x the time
/// at 4096x512 on a Zen 4 guest.
template <bool Ahead = false, typename T, typename Ask = int>
void lane_chunk_of(int np, const T* x, Index stride, Index i0, Index first, Index iters, const T* pivot, T* mean,
                   T* m2, const Ask& ask = {}) {
  with_register_packets(np, [&](auto k) {
    lane_chunk_in_registers<decltype(k)::value, Ahead>(x, stride, i0, first, iters, pivot, mean, m2, ask);
  });
}

/// Requests the cache line at p into the L2 (prefetch_l2): lane_chunks'
/// requests of the next tile, unless the caller passes its own (the tests
/// record them).
struct RequestL2 {
  // Always inlined (see prefetch_span): called through TileAsk it was not,
  // and GCC 12 removed every request.
  EIGEN_ALWAYS_INLINE void operator()(const char* p) const { prefetch_l2(p); }
};

/// A share of lane_chunks' next tile, `bytes` bytes from `from`, that a
/// block requests `step` bytes a step: step k requests the lines that start
/// in bytes [k * step, min((k + 1) * step, bytes)).
template <typename Request>
struct TileAsk {
  const char* from;
  Index bytes;
  Index step;
  Request request;
  EIGEN_ALWAYS_INLINE void lines_of_step(Index k) const {
    const Index b0 = k * step;
    if (b0 >= bytes) return;
    const Index b1 = std::min(b0 + step, bytes);
    const auto at = reinterpret_cast<std::uintptr_t>(from) + static_cast<std::uintptr_t>(b0);
    for (Index b = b0 + static_cast<Index>((64 - at % 64) % 64); b < b1; b += 64) request(from + b);
  }
};

/// One Welford step of lanes [c0, c1) of a row, in scalars (inv = 1 / the
/// step's count): the recurrence the packet paths run per lane.
template <typename T>
inline void lanes_step_scalar(const T* row, const T* pivot, T inv, Index c0, Index c1, T* mean, T* m2) {
  for (Index c = c0; c < c1; ++c) {
    const T d = row[c] - pivot[c];
    const T delta = d - mean[c];
    mean[c] = detail::madd(delta, inv, mean[c]);
    m2[c] = detail::madd(delta, d - mean[c], m2[c]);
  }
}

/// The chunks of kChunk rows of [0, count): step(i, iters, mean, m2) with
/// the states of `lanes` lanes zeroed (i: the chunk's first row), then
/// flush(k, iters, mean, m2) for chunk k. The states are the calling
/// thread's scratch (detail::Scratch), kept from one call to the next.
template <typename T, typename Step, typename Flush>
void chunked_lane_states(Index count, Index lanes, Step&& step, Flush&& flush) {
  detail::Scratch<T> state(static_cast<std::size_t>(2 * lanes), false);
  T* mean = state.data();
  T* m2 = mean + lanes;
  Index i = 0;
  for (Index k = 0; i < count; ++k) {
    const Index iters = std::min<Index>(count - i, detail::kChunk);
    std::fill(mean, mean + 2 * lanes, T(0));
    step(i, iters, mean, m2);
    i += iters;
    flush(k, iters, static_cast<const T*>(mean), static_cast<const T*>(m2));
  }
}

/// lane_chunks with every lane's state in memory, updated row after row, in
/// packets of at most 256 bits (with AVX-512, the 512-bit store-to-load
/// chains took about twice as long): lane_chunks' path for fewer lanes than
/// one packet, and the tests' witness that its register path keeps the bits.
template <typename T, typename Flush>
void lane_chunks_in_memory(const T* x, Index stride, Index count, Index lanes, const T* pivot, Flush&& flush) {
  using namespace Eigen::internal;
  using Packet = typename narrow_simd<T>::Packet;
  constexpr int L = narrow_simd<T>::L;
  const auto& recip = detail::reciprocals<T>::table;
  if (lanes <= 0 || count <= 0) return;
  const Index vec = lanes / L * L;
  chunked_lane_states<T>(count, lanes, [&x, &stride, &vec, &pivot, &lanes](Index i, Index iters, T* mean, T* m2) {
    for (Index it = 1; it <= iters; ++it) {
      const T* row = x + (i + it - 1) * stride;
      const T inv = recip[static_cast<std::size_t>(it)];
      const Packet pinv = pset1<Packet>(inv);
      for (Index c = 0; c < vec; c += L) {
        Packet mu = ploadu<Packet>(mean + c), q = ploadu<Packet>(m2 + c);
        welford_step(psub(ploadu<Packet>(row + c), ploadu<Packet>(pivot + c)), pinv, mu, q);
        pstoreu(mean + c, mu);
        pstoreu(m2 + c, q);
      }
      lanes_step_scalar(row, pivot, inv, vec, lanes, mean, m2);
    }
  }, flush);
}

/// The chunks of lane_moments: rows [0, count) in chunks of kChunk rows (the
/// last may be shorter); after chunk k, flush(k, rows, mean, m2) receives
/// each lane's state in T (mean and M2 of the chunk's rows, shifted).
/// Lanes in whole packets keep their states in registers, kRegisterLanePackets
/// packets (a block) at a time (the same recurrence per lane as
/// lane_chunks_in_memory, so the same bits); fewer lanes than one packet go
/// through lane_chunks_in_memory. Rows of one block go down the whole chunk
/// with their states in registers. Wider rows go a tile of rows at a time
/// (kLaneTileBytes, at least 4 rows): every block steps through the tile's
/// rows, then the next tile. Each row is then read front to back within a
/// few pages, and each line once (the tile stays in L1).
///
/// Wider rows used to go down the whole chunk one block at a time: each
/// block read a few lines of each of 256 rows, a walk the prefetchers and
/// the TLB follow poorly, and on inputs read from memory every block waited
/// on it. Measured on Zen 3 (AVX2, float, 1 thread, 7 alternating rounds),
/// lane_moments alone took 0.55x the time at 32768x512 (64 MB), 0.83x at
/// 4096x512, 0.82-0.85x at 100352x64, 1024x512 and 512x2048, 0.91-0.96x at
/// 3136x512, 50176x256 and 20000x48; the channels-last training forward at
/// (N,C) 4096x512 0.64-0.67x in the bench. Four rows per load and store of
/// states kept in memory (no registers across rows) measured 0.63x, 0.87x,
/// 0.74-0.91x and 0.76-1.05x on the same shapes: slower than the tiles
/// except on the narrowest rows, and slower than before at 50176x256.
/// (The tiles were not measured against the walk before them with AVX-512,
/// where rows of more than 128 floats take them.)
///
/// Requests ahead (ahead_rows >= 0; AVX-512 measurements): where the rows
/// lie end to end (stride == lanes) and take tiles, each tile requests the
/// next one into the L2 while it is worked on, front to back: every step of
/// every block requests the next slice of the next tile's lines (request:
/// prefetch_l2 unless the caller passes its own). Requests reach as far as
/// row count + ahead_rows (rows past this call's that the caller says
/// exist). Requests only: the same operations, so the same bits. From
/// memory, the tiles' walk (each block reads a few lines of each row of
/// the tile, then the next block the next few) ran at about half the speed
/// of a plain read; front-to-back requests of the next tile bring it to
/// that speed. Measured on a Zen 4 guest (AVX-512, float, 1 thread, two
/// builds alternating, 5-7 rounds, medians): lane_moments 0.47-0.51x the
/// time at 50176x256 (49 MB), 16384x300 and 16384x512 (19-32 MB). On inputs the L3
/// holds they cost time (a plain tiled read 1.07x at 4096x512), hence the
/// callers' gate (lane_moments, BatchNorm's channel statistics: inputs of
/// at least kStreamingBytes).
template <typename T, typename Flush, typename Request = RequestL2>
void lane_chunks(const T* x, Index stride, Index count, Index lanes, const T* pivot, Flush&& flush,
                 Index ahead_rows = -1, Request request = {}) {
  const auto& recip = detail::reciprocals<T>::table;
  if (lanes <= 0 || count <= 0) return;
  constexpr int LF = simd<T>::L;
  constexpr Index kBlock = Index(kRegisterLanePackets) * LF;
  if (lanes >= LF) {
    // The whole packets of lanes in blocks of up to kRegisterLanePackets,
    // with their states in registers, a tile of rows at a time when there
    // are several blocks. Leftover lanes (lanes mod LF) run the same
    // recurrence in scalars, in memory.
    const Index full = lanes / LF * LF;
    const Index tile = full > kBlock ? std::max<Index>(4, kLaneTileBytes / (lanes * Index(sizeof(T)))) : kChunk;
    // Requests ahead (see above): rows [0, last_row) may be requested.
    const Index last_row = stride == lanes && ahead_rows >= 0 && full > kBlock ? count + ahead_rows : 0;
    chunked_lane_states<T>(count, lanes, [&tile, &full, &kBlock, &x, &stride, &pivot, &lanes, &last_row,
                                          &request](Index i, Index iters, T* mean, T* m2) {
      for (Index t = 1; t <= iters; t += tile) {
        const Index rows = std::min<Index>(tile, iters - t + 1);
        // The next tile (the next chunk's first, after a chunk's last): its
        // bytes up to last_row, shared among the blocks by their lanes.
        const Index next = i + t - 1 + rows;
        const Index next_bytes = last_row > next ? std::min(tile, last_row - next) * lanes * Index(sizeof(T)) : 0;
        for (Index c0 = 0; c0 < full; c0 += kBlock) {
          const Index width = std::min<Index>(kBlock, full - c0);
          const int np = static_cast<int>(width / LF);
          const Index lo = next_bytes * c0 / full;
          const Index hi = next_bytes * (c0 + width) / full;
          if (hi > lo) {
            const TileAsk<Request> ask{reinterpret_cast<const char*>(x + next * stride) + lo, hi - lo,
                                       (hi - lo + rows - 1) / rows, request};
            lane_chunk_of<true>(np, x + c0, stride, i, t, rows, pivot + c0, mean + c0, m2 + c0, ask);
          } else {
            lane_chunk_of(np, x + c0, stride, i, t, rows, pivot + c0, mean + c0, m2 + c0);
          }
        }
      }
      if (full == lanes) return;
      for (Index it = 1; it <= iters; ++it)
        lanes_step_scalar(x + (i + it - 1) * stride, pivot, recip[static_cast<std::size_t>(it)], full, lanes,
                          mean, m2);
    }, flush);
    return;
  }
  lane_chunks_in_memory(x, stride, count, lanes, pivot, flush);
}

}  // namespace detail

/// Lane-parallel column moments: for each of the `lanes` columns c,
/// statistics of x[c + i*stride], i = 0..count. Column c is shifted by
/// pivot[c]; out[c] receives its state in shifted coordinates. One pass over
/// memory, row by row: each packet of columns keeps its Welford state in T
/// (kChunk rows at most, then flushed into double and merged, chunk after
/// chunk); leftover columns run the same recurrence one lane at a time, so a
/// column's result does not depend on its position.
template <typename T>
void lane_moments(const T* x, Index stride, Index count, Index lanes, const T* pivot,
                  Welford<double>* out) {
  for (Index c = 0; c < lanes; ++c) out[c] = Welford<double>();
  // Inputs of kStreamingBytes or more: the tiles request the next one ahead
  // (lane_chunks' ahead_rows). LayerNorm's ColMajor forward, which takes
  // its statistics here, measured 1.00-1.02x the time with them at
  // 4096x1024, 16384x1024 and 4096x4096 (Zen 4, float, 1 thread).
  const bool large = detail::streaming_input<T, T>(count, lanes);
  detail::lane_chunks(x, stride, count, lanes, pivot, [&](Index, Index rows, const T* mean, const T* m2) {
    for (Index c = 0; c < lanes; ++c)
      out[c].merge(Welford<double>(static_cast<double>(rows), static_cast<double>(mean[c]),
                                   static_cast<double>(m2[c])));
  }, large ? 0 : -1);
}

namespace detail {

/// row_sum_squares of the values a source gives (see row_sum_squares).
template <typename T, typename Src>
double sum_squares_of(const Src src, Index n) {
  using namespace Eigen::internal;
  using S = detail::simd<T>;
  using Packet = typename S::Packet;
  constexpr int L = S::L;
  constexpr int A = 8;  // the chain is one FMA (4 cycles); two FMA pipes
  constexpr Index kBlock = Index(A) * L;
  double total = 0;
  Index i = 0;
  const Index full = n / kBlock * kBlock;
  while (i < full) {
    const Index iters = std::min<Index>((full - i) / kBlock, detail::kChunk);
    Packet acc[A];
    NORMCORE_UNROLL
    for (int a = 0; a < A; ++a) acc[a] = pset1<Packet>(T(0));
    for (Index it = 0; it < iters; ++it, i += kBlock) {
      NORMCORE_UNROLL
      for (int a = 0; a < A; ++a) {
        const Packet v = src.template packet<Packet>(i + a * L);
        acc[a] = pmadd(v, v, acc[a]);
      }
    }
    NORMCORE_UNROLL
    for (int a = 1; a < A; ++a) acc[0] = padd(acc[0], acc[a]);
    alignas(64) T lanes[L];
    pstoreu(lanes, acc[0]);
    double part[4] = {0, 0, 0, 0};  // four chains: the adds do not wait on each other
    NORMCORE_UNROLL
    for (int l = 0; l < L; ++l) part[l % 4] += static_cast<double>(lanes[l]);
    total += (part[0] + part[1]) + (part[2] + part[3]);
  }
  if (i + L <= n) {  // leftover full packets
    Packet acc = pset1<Packet>(T(0));
    for (; i + L <= n; i += L) {
      const Packet v = src.template packet<Packet>(i);
      acc = pmadd(v, v, acc);
    }
    alignas(64) T lanes[L];
    pstoreu(lanes, acc);
    double part[4] = {0, 0, 0, 0};
    NORMCORE_UNROLL
    for (int l = 0; l < L; ++l) part[l % 4] += static_cast<double>(lanes[l]);
    total += (part[0] + part[1]) + (part[2] + part[3]);
  }
  for (; i < n; ++i) {
    const double v = static_cast<double>(src.value(i));
    total += v * v;
  }
  return total;
}

}  // namespace detail

/// Sum of squares of x[0..n) in one pass: A independent packet accumulators
/// in T, flushed into double every kChunk iterations and at the end, in a
/// fixed order. May overflow or underflow T for extreme magnitudes; RMSNorm
/// detects that and takes a scaled path.
template <typename T>
double row_sum_squares(const T* x, Index n) {
  return detail::sum_squares_of<T>(detail::RowValues<T>{x}, n);
}

namespace detail {

/// Sums of squares of simd<double>::L short rows (n < kShortRowPackets full
/// packets) side by side, as short_rows_moments: one accumulator per row,
/// the lanes widened, transposed and summed by halving in double, then the
/// tail in double. A row's result depends only on its values and n. Rows
/// stored as a 16-bit S are widened as they are read (as short_rows_moments).
template <typename S, typename T = compute_t<S>, typename Packet = typename narrow_simd<T>::Packet>
NORMCORE_FLATTEN void short_rows_sum_squares(const S* const* rows, Index n, double* out) {
  using namespace Eigen::internal;
  constexpr int L = unpacket_traits<Packet>::size;
  constexpr int R = simd<double>::L;
  const Index packets = n / L;
  Packet acc[R];
  NORMCORE_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = pset1<Packet>(T(0));
  for (Index p = 0; p < packets; ++p) {
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) {
      const Packet v = load_widened<Packet>(rows[r] + p * L);
      acc[r] = pmadd(v, v, acc[r]);
    }
  }
  using PD = typename simd<double>::Packet;
  PD st[L];
  widen_transposed<R>(acc, st);
  sum_lanes_by_halving<L>(st);
  alignas(64) double sum[R];
  pstore(sum, st[0]);
  NORMCORE_UNROLL
  for (int r = 0; r < R; ++r) {
    double total = sum[r];
    for (Index j = packets * L; j < n; ++j) {
      const double v = static_cast<double>(static_cast<T>(rows[r][j]));
      total += v * v;
    }
    out[r] = total;
  }
}

}  // namespace detail

/// row_sum_squares of `count` rows of n values, row r at x + r * ld. Short
/// rows go a group at a time (detail::short_rows_sum_squares; a partial
/// group repeats its last row); a row's result depends only on its values
/// and n, not on count, its neighbours or threads. Rows stored as a 16-bit S
/// are widened to float as they are read: the same sums as the widened rows.
template <typename S>
void rows_sum_squares(const S* x, Index n, Index ld, Index count, double* out) {
  using T = detail::compute_t<S>;
  constexpr int L = detail::simd<T>::L;
  if (n >= detail::kShortRowPackets * L || n <= 0) {
    for (Index r = 0; r < count; ++r) out[r] = detail::sum_squares_of<T>(detail::WidenValues<S, T>{x + r * ld}, n);
    return;
  }
  constexpr int R = detail::simd<double>::L;
  for (Index r0 = 0; r0 < count; r0 += R) {
    const S* rows[R];
    double ss[R];
    NORMCORE_UNROLL
    for (int r = 0; r < R; ++r) rows[r] = x + std::min<Index>(r0 + r, count - 1) * ld;
    detail::short_rows_sum_squares(rows, n, ss);
    for (Index r = 0; r < R && r0 + r < count; ++r) out[r0 + r] = ss[r];
  }
}

/// max |x[i]|, NaN if any x[i] is NaN.
template <typename T>
T max_abs(const T* x, Index n, Index stride = 1) {
  T m = 0;
  for (Index i = 0; i < n; ++i) {
    const T a = std::fabs(x[i * stride]);
    if (std::isnan(a)) return a;
    m = std::max(m, a);
  }
  return m;
}

/// Moments of x[i * stride], i = 0..n, shifted by `pivot`, two-pass in long
/// double: the slow, exact path for rows whose squares overflow or underflow
/// T in the SIMD recurrence (float values beyond ~1e19 or a spread below
/// ~1e-19). M2 is returned in double: exact for any float input; for double
/// inputs beyond ~1e150 it overflows (documented limit).
template <typename T>
Welford<double> exact_moments(const T* x, Index n, Index stride, T pivot) {
  if (n <= 0) return Welford<double>();
  long double sum = 0;
  for (Index i = 0; i < n; ++i) sum += static_cast<long double>(x[i * stride]) - pivot;
  const long double mean = sum / static_cast<long double>(n);
  long double m2 = 0;
  for (Index i = 0; i < n; ++i) {
    const long double d = static_cast<long double>(x[i * stride]) - pivot - mean;
    m2 += d * d;
  }
  return Welford<double>(static_cast<double>(n), static_cast<double>(mean), static_cast<double>(m2));
}

namespace detail {

/// The smallest value whose terms of T kept every bit: T's smallest
/// normal times 2^digits. A sum of squares under it lost bits to underflow.
template <typename T>
inline constexpr double kSafeLow = static_cast<double>(std::numeric_limits<T>::min()) *
                                   static_cast<double>(1ULL << std::numeric_limits<T>::digits);

/// Whether a finite M2 of `count` values accumulated in T is so small that
/// its terms lost bits to underflow and eps is too small to hide that (the
/// exact path then takes the values again).
template <typename T>
bool m2_underflowed(double m2, double count, double eps) {
  return m2 < kSafeLow<T> * count && eps < kSafeLow<T> * 1e7;
}

/// Whether a row's SIMD moments (M2 accumulated in T) of n values can be
/// trusted without looking at the values again: finite, and not
/// m2_underflowed. needs_exact_moments' first test.
template <typename T>
bool moments_in_range(const Welford<double>& w, Index n, double eps) {
  return std::isfinite(w.m2()) && std::isfinite(w.mean()) &&
         !m2_underflowed<T>(w.m2(), static_cast<double>(n), eps);
}

/// True when a row's SIMD moments (M2 accumulated in T) cannot be trusted:
/// M2 overflowed while the values are finite, or m2_underflowed.
template <typename T>
bool needs_exact_moments(const Welford<double>& w, const T* x, Index n, Index stride, double eps) {
  if (moments_in_range<T>(w, n, eps)) return false;
  if (std::isfinite(w.m2()) && std::isfinite(w.mean())) return true;  // M2 underflowed
  return std::isfinite(max_abs(x, n, stride));  // non-finite input: NaN is the answer
}

}  // namespace detail

/// row_moments, with the exact path for rows whose squares leave T's range.
template <typename T>
Welford<double> checked_row_moments(const T* x, Index n, T pivot, double eps) {
  const Welford<double> w = row_moments(x, n, pivot);
  return detail::needs_exact_moments(w, x, n, 1, eps) ? exact_moments(x, n, 1, pivot) : w;
}

}  // namespace normcore
