// normcore::detail: packets of float read from, and written to, values
// stored as a 16-bit type (Eigen::bfloat16, Eigen::half): each packet is
// widened exactly as it is loaded and rounded once (to nearest even) as it
// is stored, so that kernels can take 16-bit rows without staging them in
// float buffers. F16C for half (Eigen 3.4 enables its own F16C conversions
// only for clang), Eigen's packet casts for bfloat16 (AVX512-BF16, AVX2,
// NEON).
#pragma once

#include <type_traits>

#include <Eigen/Core>
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define NORMCORE_F16C 1
#endif

#include "normcore/common.hpp"

namespace normcore {
namespace detail {

template <typename S>
struct is_storage16
    : std::integral_constant<bool, std::is_same<S, Eigen::bfloat16>::value ||
                                       std::is_same<S, Eigen::half>::value> {};

/// Whether this build converts whole packets of L floats to and from a
/// 16-bit S one packet at a time (the conversions of mixed.hpp's convert_n);
/// always true for float and double, which are their own compute type.
/// Kernels that take 16-bit rows directly need it; without it, they stage
/// rows in float buffers through convert_n.
template <typename S, int L>
constexpr bool packet_io() {
  using namespace Eigen::internal;
  if constexpr (std::is_same<S, float>::value || std::is_same<S, double>::value) {
    return true;
  } else if constexpr (!is_storage16<S>::value || L <= 1) {
    return false;
  } else {
#ifdef NORMCORE_F16C
    if constexpr (std::is_same<S, Eigen::half>::value) {
#ifdef EIGEN_VECTORIZE_AVX512
      return L == 8 || L == 16;
#else
      return L == 8;
#endif
    }
#endif
    // Otherwise Eigen's own conversions, wherever its packet of S is as wide
    // (half only where F16C is not, as in convert_n).
    return unpacket_traits<typename packet_traits<S>::type>::size == L;
  }
}

/// L values stored as S at p, widened to a packet of floats (exact); a
/// plain load when S is the packet's own type.
template <typename Packet, typename S>
EIGEN_ALWAYS_INLINE Packet load_widened(const S* p) {
  using namespace Eigen::internal;
  constexpr int L = unpacket_traits<Packet>::size;
  if constexpr (std::is_same<S, typename unpacket_traits<Packet>::type>::value) {
    return ploadu<Packet>(p);
  } else {
    static_assert(packet_io<S, L>(), "load_widened: no packet conversion from S in this build");
#ifdef NORMCORE_F16C
    if constexpr (std::is_same<S, Eigen::half>::value && L == 8) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
#ifdef EIGEN_VECTORIZE_AVX512
    if constexpr (std::is_same<S, Eigen::half>::value && L == 16) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
#endif
#endif
    using PS = typename packet_traits<S>::type;
    return pcast<PS, Packet>(ploadu<PS>(p));
  }
}

/// Rounds a packet of floats once (to nearest even) into L values of S at p;
/// a plain store when S is the packet's own type.
template <typename S, typename Packet>
EIGEN_ALWAYS_INLINE void store_narrowed(S* p, const Packet& v) {
  using namespace Eigen::internal;
  constexpr int L = unpacket_traits<Packet>::size;
  if constexpr (std::is_same<S, typename unpacket_traits<Packet>::type>::value) {
    pstoreu(p, v);
  } else {
    static_assert(packet_io<S, L>(), "store_narrowed: no packet conversion to S in this build");
#ifdef NORMCORE_F16C
    if constexpr (std::is_same<S, Eigen::half>::value && L == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      return;
    }
#ifdef EIGEN_VECTORIZE_AVX512
    if constexpr (std::is_same<S, Eigen::half>::value && L == 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                          _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      return;
    }
#endif
#endif
    using PS = typename packet_traits<S>::type;
    pstoreu(p, pcast<Packet, PS>(v));
  }
}

/// The values of a row stored as S, read as T (float): a source for the
/// row kernels (statistics.hpp's RowValues reads a row stored as T).
template <typename S, typename T>
struct WidenValues {
  const S* x;
  template <typename Packet>
  EIGEN_ALWAYS_INLINE Packet packet(Index i) const {
    return load_widened<Packet>(x + i);
  }
  EIGEN_ALWAYS_INLINE T value(Index j) const { return static_cast<T>(x[j]); }
};

}  // namespace detail
}  // namespace normcore
