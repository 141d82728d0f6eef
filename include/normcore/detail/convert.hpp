// normcore::detail: packets of float read from, and written to, values
// stored as a 16-bit type (Eigen::bfloat16, Eigen::half): each packet is
// widened exactly as it is loaded and rounded once (to nearest even) as it
// is stored, so that kernels can take 16-bit rows without staging them in
// float buffers. F16C for half (Eigen 3.4 enables its own F16C conversions
// only for clang), Eigen's packet casts for bfloat16 where Eigen 3.4 has
// them (its x86 AVX and AVX-512 backends; AVX512-BF16 instructions where
// the build has them). Elsewhere (SSE-only x86, NEON, whose backend has no
// casts for its 16-bit packets) packet_io is false and the layers widen
// rows a block at a time through convert_n's scalar conversions.
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

/// The arithmetic type of values (or of a layer whose parameters are)
/// stored as P: float for the 16-bit types, P itself otherwise.
template <typename P>
using compute_t = std::conditional_t<is_storage16<P>::value, float, P>;

/// Whether this build has Eigen's packet casts between float's packets and
/// the 16-bit ones of the same width (pcast): Eigen 3.4 defines them in its
/// x86 AVX and AVX-512 backends only.
#if defined(EIGEN_VECTORIZE_AVX)
constexpr bool kEigenPacketCasts = true;
#else
constexpr bool kEigenPacketCasts = false;
#endif

/// Eigen's packet of S that holds L values, where it has one: its full
/// packet, or its half (with AVX-512, Packet8bf for the 256-bit float
/// packets of the short-row kernels).
template <typename S, int L,
          bool Full = Eigen::internal::unpacket_traits<typename Eigen::internal::packet_traits<S>::type>::size == L>
struct storage_packet {
  using type = typename Eigen::internal::packet_traits<S>::type;
};
template <typename S, int L>
struct storage_packet<S, L, false> {
  using type = typename Eigen::internal::packet_traits<S>::half;
};

/// Whether packets of L floats convert to and from half through F16C here
/// (Eigen 3.4 enables its own F16C conversions only for clang).
template <typename S, int L>
constexpr bool f16c_io() {
#ifdef NORMCORE_F16C
#ifdef EIGEN_VECTORIZE_AVX512
  return std::is_same<S, Eigen::half>::value && (L == 8 || L == 16);
#else
  return std::is_same<S, Eigen::half>::value && L == 8;
#endif
#else
  return false;
#endif
}

/// The width of Eigen's packet of S that its casts take for packets of L
/// floats: for bfloat16 its full packet or the half of it
/// (storage_packet); for half (where F16C is not) its full packet only,
/// as in convert_n (with AVX-512 Eigen has no casts for the half of it).
template <typename S, int L>
constexpr int eigen_cast_width() {
  using namespace Eigen::internal;
  if constexpr (std::is_same<S, Eigen::bfloat16>::value) {
    return unpacket_traits<typename storage_packet<S, L>::type>::size;
  } else {
    return unpacket_traits<typename packet_traits<S>::type>::size;
  }
}

/// Whether this build converts whole packets of L floats to and from a
/// 16-bit S one packet at a time (F16C for half, else Eigen's packet casts);
/// always true for float and double, which are their own compute type.
/// Kernels that take 16-bit rows directly need it; without it, they stage
/// rows in float buffers through convert_n.
template <typename S, int L>
constexpr bool packet_io() {
  if constexpr (std::is_same<S, float>::value || std::is_same<S, double>::value) {
    return true;
  } else if constexpr (!is_storage16<S>::value || L <= 1) {
    return false;
  } else {
    return f16c_io<S, L>() || (kEigenPacketCasts && eigen_cast_width<S, L>() == L);
  }
}

#ifdef NORMCORE_F16C
/// F16C's conversions of 8 or 16 halves (f16c_io).
template <typename Packet>
EIGEN_ALWAYS_INLINE Packet f16c_load(const Eigen::half* p) {
  if constexpr (Eigen::internal::unpacket_traits<Packet>::size == 8) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#ifdef EIGEN_VECTORIZE_AVX512
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
  }
}
template <typename Packet>
EIGEN_ALWAYS_INLINE void f16c_store(Eigen::half* p, const Packet& v) {
  if constexpr (Eigen::internal::unpacket_traits<Packet>::size == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#ifdef EIGEN_VECTORIZE_AVX512
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  }
}
#endif

/// L values stored as S at p, widened to a packet of floats (exact); a
/// plain load when S is the packet's own type.
template <typename Packet, typename S>
EIGEN_ALWAYS_INLINE Packet load_widened(const S* p) {
  using namespace Eigen::internal;
  constexpr int L = unpacket_traits<Packet>::size;
  if constexpr (std::is_same<S, typename unpacket_traits<Packet>::type>::value) {
    return ploadu<Packet>(p);
#ifdef NORMCORE_F16C
  } else if constexpr (f16c_io<S, L>()) {
    return f16c_load<Packet>(p);
#endif
  } else {
    static_assert(packet_io<S, L>(), "load_widened: no packet conversion from S in this build");
    using PS = typename storage_packet<S, L>::type;
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
#ifdef NORMCORE_F16C
  } else if constexpr (f16c_io<S, L>()) {
    f16c_store(p, v);
#endif
  } else {
    static_assert(packet_io<S, L>(), "store_narrowed: no packet conversion to S in this build");
    using PS = typename storage_packet<S, L>::type;
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
