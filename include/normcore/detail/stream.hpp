// normcore::detail: non-temporal (streaming) stores of whole packets, for
// outputs that are written once and not read back soon: the line goes to
// memory without first being read into the cache (no read-for-ownership)
// and without evicting what the loop still reads. x86 only (SSE, AVX,
// AVX-512 packets); elsewhere kStreamStores is false and callers keep
// ordinary stores.
#pragma once

#include <cstdint>
#include <type_traits>

#include <Eigen/Core>

#include "normcore/detail/convert.hpp"
#include "normcore/statistics.hpp"

namespace normcore {
namespace detail {

/// Whether this build has streaming stores for simd<T>'s packets (every
/// x86 vector ISA Eigen uses), and stream_store(p, v) for each of them; p
/// must be aligned to the packet.
#ifdef EIGEN_VECTORIZE_SSE2
constexpr bool kStreamStores = true;
inline void stream_store(float* p, const Eigen::internal::Packet4f& v) { _mm_stream_ps(p, v); }
inline void stream_store(double* p, const Eigen::internal::Packet2d& v) { _mm_stream_pd(p, v); }
#ifdef EIGEN_VECTORIZE_AVX
inline void stream_store(float* p, const Eigen::internal::Packet8f& v) { _mm256_stream_ps(p, v); }
inline void stream_store(double* p, const Eigen::internal::Packet4d& v) { _mm256_stream_pd(p, v); }
#endif
#ifdef EIGEN_VECTORIZE_AVX512
inline void stream_store(float* p, const Eigen::internal::Packet16f& v) { _mm512_stream_ps(p, v); }
inline void stream_store(double* p, const Eigen::internal::Packet8d& v) { _mm512_stream_pd(p, v); }
#endif
#else
constexpr bool kStreamStores = false;
template <typename T, typename Packet>
void stream_store(T* p, const Packet& v) {
  Eigen::internal::pstoreu(p, v);
}
#endif

/// Whether the n values of A at a and the m values of B at b share no
/// byte (the types may differ).
template <typename A, typename B>
bool disjoint(const A* a, Index n, const B* b, Index m) {
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa + static_cast<std::uintptr_t>(n) * sizeof(A) <= pb ||
         pb + static_cast<std::uintptr_t>(m) * sizeof(B) <= pa;
}

/// Whether rows of n values of T starting at p can take streaming stores of
/// simd<T> packets: the ISA has them, p is aligned to a packet and every row
/// is whole packets (so every packet of every row is aligned too).
template <typename T>
bool can_stream_rows(const T* p, Index n) {
  using Packet = typename simd<T>::Packet;
  constexpr Index kBytes = static_cast<Index>(sizeof(Packet));
  return kStreamStores && reinterpret_cast<std::uintptr_t>(p) % kBytes == 0 &&
         (n * static_cast<Index>(sizeof(T))) % kBytes == 0;
}

/// Whether a loop that reads row r + 1 of `in` while it writes row r of
/// `out` (rows of n values, end to end, a 64-byte packet at a time) has
/// loads that wait on its stores: the CPU's store-to-load check compares
/// the low 12 address bits, so a load whose bytes overlap those of an
/// earlier store modulo 4 KB waits for it (4K aliasing). With d the
/// distance from in + n to out, the store to out[j] meets the load of
/// in[n + j] (issued in the same step) where |d| < 64 bytes modulo 4 KB,
/// and that of the next packet where 0 < d < 128. Measured on a Zen 4 guest
/// (LayerNorm's forward_long_rows on float rows the caches hold, against the
/// groups it replaces there, this check left out): d of 0 took 1.13-1.21x
/// the time at 256x1024, 512x768 and 100x1536, d of 64 bytes 0.98-1.08x, d
/// of -64 bytes 0.93-0.96x and d of 128 bytes 0.98x.
template <typename T>
bool next_row_loads_alias_stores(const T* in, const T* out, Index n) {
  const std::uintptr_t d = reinterpret_cast<std::uintptr_t>(out) - reinterpret_cast<std::uintptr_t>(in + n);
  return (d + 63u) % 4096u < 191u;  // d modulo 4 KB in (-64, 128)
}

/// can_stream_rows(out, n) for count rows written from `count` rows at in,
/// which they must not overlap: a streaming store evicts the line it
/// writes, so an output over its input would read that input back from
/// memory.
template <typename T>
bool can_stream_rows(const T* in, const T* out, Index n, Index count) {
  return can_stream_rows(out, n) && disjoint(in, n * count, out, n * count);
}

/// Whether a ColMajor forward (LayerNorm, RMSNorm) over `rows` x n values
/// of T at x writes y at out with streaming stores: packets of a whole
/// 64-byte line (AVX-512; where they were measured), the row-wise forwards'
/// gate (an input of at least kStreamingBytes and forward_stream_threshold()),
/// y aligned to a line, every feature's column of y whole lines, and y
/// apart from x. Every packet store then writes one whole line. On a Zen 5
/// guest (AVX-512, float, 1 thread, the same input every call) LayerNorm's
/// ColMajor forward took 0.80x the time at 4096x1024, 0.86x at 16384x4096
/// and 0.78x at 65536x64.
template <typename T>
bool can_stream_colmajor(const T* x, const T* out, Index rows, Index n) {
  constexpr Index kLine = 64;
  const Index bytes = rows * n * static_cast<Index>(sizeof(T));
  return sizeof(typename simd<T>::Packet) >= kLine && bytes >= kStreamingBytes && stream_forward_output(bytes) &&
         can_stream_rows(x, out, rows, n) && reinterpret_cast<std::uintptr_t>(out) % kLine == 0 &&
         (rows * static_cast<Index>(sizeof(T))) % kLine == 0;
}

/// Whether a row-wise backward over `rows` rows of n values stored as S,
/// run by `threads` threads, writes dx with streaming stores: a streaming
/// backward (streaming_backward: stored in the compute type T, x and dy
/// together at least kStreamingBytes), or on Intel CPUs one whose threads'
/// inputs overflow their L2 (l2_backward_streams); and dx can take them and
/// is apart from x, dy and dh (dh may be null).
template <typename S, typename T>
bool stream_gradient(const S* x, const S* dy, const S* dh, const S* dx, Index rows, Index n, Index threads) {
  if constexpr (std::is_same<S, T>::value) {
    const Index total = rows * n;
    return dx && (streaming_backward<S, T>(rows, n) || l2_backward_streams<S, T>(rows, n, threads)) &&
           can_stream_rows(x, dx, n, rows) &&
           disjoint(dy, total, dx, total) && (!dh || disjoint(dh, total, dx, total));
  } else {
    return false;
  }
}

/// Stores v at p: streaming when Stream (p aligned), else pstoreu. When p
/// holds a 16-bit type (the packet's values are floats), the packet is
/// rounded once as it is stored (store_narrowed), never streaming.
template <bool Stream, typename T, typename Packet>
EIGEN_ALWAYS_INLINE void store_packet(T* p, const Packet& v) {
  if constexpr (!std::is_same<T, typename Eigen::internal::unpacket_traits<Packet>::type>::value) {
    store_narrowed(p, v);
  } else if constexpr (Stream && kStreamStores) {
    stream_store(p, v);
  } else {
    Eigen::internal::pstoreu(p, v);
  }
}

/// Orders this thread's streaming stores before its later stores (and so
/// before it signals another thread that the output is ready).
inline void stream_fence() {
#ifdef EIGEN_VECTORIZE_SSE2
  _mm_sfence();
#endif
}

}  // namespace detail
}  // namespace normcore
