// normcore::detail: from statistics to the per-row (or per-channel)
// normalization coefficients, and the vector loops that apply them.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "normcore/detail/convert.hpp"
#include "normcore/detail/stream.hpp"
#include "normcore/statistics.hpp"

namespace normcore {
namespace detail {

/// y = (x - pivot) * scale - shift, then optionally * gamma + beta.
///
/// pivot is mean rounded to T when |mean| exceeds one standard deviation
/// (then x - pivot is exact or nearly so, and shift = (mean - pivot) * rstd is
/// tiny), and 0 otherwise (then shift = mean * rstd is small and the fused
/// multiply-add rounds once). Either way the rounded mean never multiplies
/// rstd, which is what limits the usual (x - mean) * rstd at large offsets.
/// A constant row has pivot = its value exactly, so y = 0 and the affine
/// result is exactly beta.
template <typename T>
struct NormCoeffs {
  T mean;   // mean rounded to T (what is saved for the backward)
  T rstd;   // 1 / sqrt(var + eps) rounded to T
  T pivot;
  T shift;
};

/// Rows per group of the layers' coefficient passes (coeffs_group, and the
/// callers of inv_sqrt_eps, which itself takes any count, a packet at a time).
constexpr Index kInvSqrtGroup = 8;

/// r[i] = 1 / sqrt(v[i] / d + eps) (Div) or 1 / sqrt(v[i] + eps) for
/// i < count, in double packets: a group of rows pays for one vector
/// division, sqrt and division per packet instead of one scalar each. IEEE
/// division and sqrt are correctly rounded, so every r[i] has the same bits
/// as the scalar expression. The packets are at most 256 bits (narrow_simd):
/// Eigen's AVX-512 double psqrt is an approximation. Whole packets are read
/// from v and written to r directly; only a last partial packet goes through
/// a padded copy, whose padding is d (so d must be finite and nonzero, as the
/// callers' 1 and row lengths are). r may be v: each packet is read before
/// it is written. (Copying every group through one, its count known only at
/// run time, compiled to `rep movs`, whose start-up cost on Zen 3 made
/// RMSNorm's forward at 2048x50 take about 1.15x the time.)
template <bool Div>
inline void inv_sqrt_group(const double* v, double d, double eps, Index count, double* r) {
  using namespace Eigen::internal;
  if (count == 1) {  // one row: a scalar sqrt and division, the same bits sooner
    r[0] = 1.0 / std::sqrt((Div ? v[0] / d : v[0]) + eps);
    return;
  }
  using PD = typename narrow_simd<double>::Packet;
  constexpr int LD = narrow_simd<double>::L;
  const PD one = pset1<PD>(1.0), pe = pset1<PD>(eps), pd = pset1<PD>(d);
  const auto inv_sqrt = [&pd, &one, &pe](PD a) {
    if (Div) a = pdiv(a, pd);
    return pdiv(one, psqrt(padd(a, pe)));
  };
  Index i = 0;
  for (; i + LD <= count; i += LD) pstoreu(r + i, inv_sqrt(ploadu<PD>(v + i)));
  if (i == count) return;
  alignas(64) double a[LD];
  alignas(64) double out[LD];
  for (int j = 0; j < LD; ++j) a[j] = i + j < count ? v[i + j] : d;  // padding: d / d = 1
  pstore(out, inv_sqrt(pload<PD>(a)));
  for (int j = 0; i + j < count; ++j) r[i + j] = out[j];
}

/// r[i] = 1 / sqrt(v[i] + eps) for i < count (see inv_sqrt_group).
inline void inv_sqrt_eps(const double* v, double eps, Index count, double* r) {
  inv_sqrt_group<false>(v, 1.0, eps, count, r);
}

/// r[i] = 1 / sqrt(ss[i] / n + eps) for i < count: RMSNorm's rstd from the
/// rows' sums of squares, the division by n in the same packets (the same
/// bits as the scalar ss[i] / n).
inline void inv_sqrt_mean_eps(const double* ss, double n, double eps, Index count, double* r) {
  inv_sqrt_group<true>(ss, n, eps, count, r);
}

/// Coefficients from a Welford state in pivot-shifted coordinates: the mean
/// is pivot + mean_shift, kept as two parts so that it is not rounded before
/// it is used (for T = double there is no wider type to hold it). r is
/// 1 / sqrt(var + eps), computed by the caller (inv_sqrt_eps for a group).
template <typename T>
NormCoeffs<T> norm_coeffs_r(T pivot, double mean_shift, double var, double r) {
  NormCoeffs<T> c;
  const double mean = static_cast<double>(pivot) + mean_shift;
  c.mean = static_cast<T>(mean);
  c.rstd = static_cast<T>(r);
  const bool shifted = !(std::fabs(mean) * r <= 1.0) || var == 0.0;
  c.pivot = shifted ? c.mean : T(0);
  // pivot - c.pivot is exact (Sterbenz, or pivot itself when c.pivot = 0).
  const double rest = static_cast<double>(pivot - c.pivot) + mean_shift;
  c.shift = static_cast<T>(rest * static_cast<double>(c.rstd));
  return c;
}

/// The coefficients of a group of kInvSqrtGroup rows, one array each.
template <typename T>
struct CoeffGroup {
  alignas(64) T mean[kInvSqrtGroup];
  alignas(64) T rstd[kInvSqrtGroup];
  alignas(64) T pivot[kInvSqrtGroup];
  alignas(64) T shift[kInvSqrtGroup];
  NormCoeffs<T> operator[](Index i) const { return NormCoeffs<T>{mean[i], rstd[i], pivot[i], shift[i]}; }
};

/// Whether every row of a group can take coeffs_group: its moments (mean
/// mu[i] and M2 q[i] of n values) are finite and needs_exact_moments would
/// not send it to the exact path.
template <typename T>
bool moments_all_fine(const double* mu, const double* q, Index n, double eps) {
  constexpr double kMax = std::numeric_limits<double>::max();
  bool fine = true;
  for (int i = 0; i < kInvSqrtGroup; ++i)
    fine &= std::fabs(mu[i]) <= kMax && std::fabs(q[i]) <= kMax &&
            !m2_underflowed<T>(q[i], static_cast<double>(n), eps);
  return fine;
}

#if defined(EIGEN_VECTORIZE_AVX)
/// coeffs_group's conversions, four values of T (float or double) at a
/// time: widened exactly, rounded to T (to nearest, as static_cast), and
/// a - b computed in T, widened.
inline __m256d avx_load_as_double(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
inline __m256d avx_load_as_double(const double* p) { return _mm256_loadu_pd(p); }
template <typename T>
inline __m256d avx_round_to(__m256d a) {
  if constexpr (std::is_same<T, float>::value) return _mm256_cvtps_pd(_mm256_cvtpd_ps(a));
  else return a;
}
template <typename T>
inline __m256d avx_difference(__m256d a, __m256d b) {  // a, b: values of T
  if constexpr (std::is_same<T, float>::value) return _mm256_cvtps_pd(_mm_sub_ps(_mm256_cvtpd_ps(a), _mm256_cvtpd_ps(b)));
  else return _mm256_sub_pd(a, b);
}
template <typename T>
inline void avx_store_as(T* p, __m256d a) {
  if constexpr (std::is_same<T, float>::value) _mm_storeu_ps(p, _mm256_cvtpd_ps(a));
  else _mm256_storeu_pd(p, a);
}
#endif

/// norm_coeffs_r(pivot[i], mu[i], var, 1 / sqrt(var + eps)) with var =
/// q[i] / n (Welford<double>::variance), for the kInvSqrtGroup rows of a
/// group at once: the same operations lane by lane, in loops of fixed
/// length the compiler vectorizes, so the same bits as row by row (IEEE
/// division and square root are correctly rounded; nothing here can be
/// contracted into a multiply-add).
template <typename T>
void coeffs_group(const T* pivot, const double* mu, const double* q, Index n, double eps, CoeffGroup<T>& k) {
  using namespace Eigen::internal;
  using PD = typename narrow_simd<double>::Packet;  // a correctly rounded psqrt (inv_sqrt_eps)
  constexpr int LD = narrow_simd<double>::L;
  constexpr int G = kInvSqrtGroup;
  static_assert(G % LD == 0, "a group is whole double packets");
  alignas(64) double vars[G];
  alignas(64) double rs[G];
  const PD one = pset1<PD>(1.0), pe = pset1<PD>(eps), pn = pset1<PD>(static_cast<double>(n));
  NORMCORE_UNROLL
  for (int i = 0; i < G; i += LD) {
    const PD v = pdiv(ploadu<PD>(q + i), pn);
    pstore(vars + i, v);
    pstore(rs + i, pdiv(one, psqrt(padd(v, pe))));
  }
#if defined(EIGEN_VECTORIZE_AVX)
  // The loop below in 256-bit double packets, four rows at a time: GCC left
  // it scalar (about 20 cycles a row on an Intel Xeon at 2048x50, a quarter
  // of the forward's time). Lane by lane the same IEEE operations.
  if constexpr (std::is_same<T, float>::value || std::is_same<T, double>::value) {
    static_assert(G % 4 == 0, "four rows a packet");
    const __m256d sign = _mm256_set1_pd(-0.0), unit = _mm256_set1_pd(1.0), zero = _mm256_setzero_pd();
    NORMCORE_UNROLL
    for (int i = 0; i < G; i += 4) {
      const __m256d var = _mm256_load_pd(vars + i);
      const __m256d r = _mm256_load_pd(rs + i);
      const __m256d m = _mm256_loadu_pd(mu + i);
      const __m256d pv = avx_load_as_double(pivot + i);
      const __m256d mean = _mm256_add_pd(pv, m);
      const __m256d kmean = avx_round_to<T>(mean);  // k.mean, as a double
      const __m256d krstd = avx_round_to<T>(r);
      // shifted = !(|mean| * r <= 1) || var == 0; unshifted rows get pivot 0.
      const __m256d small = _mm256_cmp_pd(_mm256_mul_pd(_mm256_andnot_pd(sign, mean), r), unit, _CMP_LE_OQ);
      const __m256d unshifted = _mm256_andnot_pd(_mm256_cmp_pd(var, zero, _CMP_EQ_OQ), small);
      const __m256d kpivot = _mm256_andnot_pd(unshifted, kmean);
      const __m256d rest = _mm256_add_pd(avx_difference<T>(pv, kpivot), m);
      avx_store_as<T>(k.mean + i, kmean);
      avx_store_as<T>(k.rstd + i, krstd);
      avx_store_as<T>(k.pivot + i, kpivot);
      avx_store_as<T>(k.shift + i, _mm256_mul_pd(rest, krstd));
    }
    return;
  }
#endif
  NORMCORE_UNROLL
  for (int i = 0; i < G; ++i) {
    const double var = vars[i];
    const double r = rs[i];
    const double mean = static_cast<double>(pivot[i]) + mu[i];
    k.mean[i] = static_cast<T>(mean);
    k.rstd[i] = static_cast<T>(r);
    const bool shifted = !(std::fabs(mean) * r <= 1.0) || var == 0.0;
    k.pivot[i] = shifted ? k.mean[i] : T(0);
    const double rest = static_cast<double>(pivot[i] - k.pivot[i]) + mu[i];
    k.shift[i] = static_cast<T>(rest * static_cast<double>(k.rstd[i]));
  }
}

/// norm_coeffs_r with r computed here, for one row or channel.
template <typename T>
NormCoeffs<T> norm_coeffs(T pivot, double mean_shift, double var, double eps) {
  return norm_coeffs_r<T>(pivot, mean_shift, var, 1.0 / std::sqrt(var + eps));
}

/// Whether a row's last n mod L values of T go through one masked packet
/// instead of a scalar loop: floats with AVX-512, whose masked loads and
/// stores (k-masks) neither touch nor fault on the lanes masked out. (AVX's
/// vmaskmovps store is slow on AMD; Eigen has no masked double packets.)
template <typename T>
struct masked_tail : std::false_type {};
#ifdef EIGEN_VECTORIZE_AVX512
template <>
struct masked_tail<float> : std::true_type {
  /// The mask of the first `count` lanes (0 < count < 16) of a Packet16f.
  static std::uint16_t first(Index count) { return static_cast<std::uint16_t>((1u << count) - 1u); }
};
#endif

/// f(j) for the whole packets of L values from j while j + L <= n, four a
/// loop iteration, then one; returns the index past them. Each packet's
/// arithmetic and the order of the stores are as in a loop of one packet
/// per iteration, so the bits are the same. A loop of one packet per
/// iteration is a handful of instructions whose speed depends on where the
/// compiler happens to place it: crossing a 64-byte line of code, the
/// normalize of RMSNorm's one row of 768 floats took 1.23x the time on
/// Zen 3 (the same code compiled with -falign-loops=32: 1.00x).
template <int L, typename F>
EIGEN_ALWAYS_INLINE Index for_packets(Index j, Index n, F&& f) {
  for (; j + 4 * L <= n; j += 4 * L) {
    f(j);
    f(j + L);
    f(j + 2 * L);
    f(j + 3 * L);
  }
  for (; j + L <= n; j += L) f(j);
  return j;
}

/// Normalizes the n values of a source (statistics.hpp: RowValues, or the
/// fused residual add's sums) into y; gamma/beta per element (either may be
/// null). Stream: y takes streaming stores (detail::can_stream_rows: y
/// aligned, n whole packets). Always inlined: for short rows the call and
/// the setup cost as much as the loop (rows of 64 floats: 0.66x the time
/// inlined).
///
/// y may also be a 16-bit type Y when T is float (detail::WidenValues then
/// reads the row): each packet is rounded once as it is stored
/// (store_packet), the tail one value at a time; no streaming stores.
template <bool Stream = false, typename T, typename Src, typename Y>
EIGEN_ALWAYS_INLINE void normalize_values(const Src src, Y* y, Index n, const NormCoeffs<T>& k, const T* gamma,
                                          const T* beta) {
  using namespace Eigen::internal;
  using Packet = typename simd<T>::Packet;
  constexpr int L = simd<T>::L;
  const Packet pp = pset1<Packet>(k.pivot);
  const Packet pr = pset1<Packet>(k.rstd);
  const Packet pc = pset1<Packet>(-k.shift);
  Index j = 0;
  if (gamma && beta) {
    j = for_packets<L>(j, n, [&](Index i) NORMCORE_INLINE_LAMBDA {
      const Packet v = pmadd(psub(src.template packet<Packet>(i), pp), pr, pc);
      store_packet<Stream>(y + i, pmadd(v, ploadu<Packet>(gamma + i), ploadu<Packet>(beta + i)));
    });
  } else if (gamma) {
    j = for_packets<L>(j, n, [&](Index i) NORMCORE_INLINE_LAMBDA {
      const Packet v = pmadd(psub(src.template packet<Packet>(i), pp), pr, pc);
      store_packet<Stream>(y + i, pmul(v, ploadu<Packet>(gamma + i)));
    });
  } else {
    j = for_packets<L>(j, n, [&](Index i) NORMCORE_INLINE_LAMBDA {
      store_packet<Stream>(y + i, pmadd(psub(src.template packet<Packet>(i), pp), pr, pc));
    });
  }
  if constexpr (masked_tail<T>::value && std::is_same<Y, T>::value) {
    if (j < n) {
      const auto m = masked_tail<T>::first(n - j);
      Packet v = pmadd(psub(src.template packet<Packet>(j, m), pp), pr, pc);
      if (gamma) v = beta ? pmadd(v, ploadu<Packet>(gamma + j, m), ploadu<Packet>(beta + j, m))
                          : pmul(v, ploadu<Packet>(gamma + j, m));
      pstoreu(y + j, v, m);
    }
    return;
  }
  for (; j < n; ++j) {
    T v = madd(src.value(j) - k.pivot, k.rstd, -k.shift);
    if (gamma) v = beta ? madd(v, gamma[j], beta[j]) : v * gamma[j];
    y[j] = static_cast<Y>(v);
  }
}

/// A source (statistics.hpp) that reads the row at `next`, for its
/// moments, and as it hands out packet i normalizes packet i of another row
/// (x, coefficients pp/pr/pc as in normalize_values) into y: the moments of
/// row r + 1 and the normalize of row r in one loop, so that the loop keeps
/// reading from memory while it writes. Affine: 2 with gamma and beta, 1
/// with gamma, 0 with neither (normalize_values' three loops). It does only
/// the full packets the moments kernel reads; the caller normalizes the
/// last n mod L values. The same operations on every value as
/// normalize_values, so the same bits. In place (y == x) is safe because
/// the moments kernel asks for each packet once: packet i of row x is read,
/// then written, and never read again.
template <bool Stream, int Affine, typename T>
struct NormalizeAlong {
  using Packet = typename simd<T>::Packet;
  RowValues<T> next;
  const T* x;
  T* y;
  const T* gamma;
  const T* beta;
  Packet pp, pr, pc;
  template <typename P>
  EIGEN_ALWAYS_INLINE P packet(Index i) const {
    using namespace Eigen::internal;
    const P v = pmadd(psub(ploadu<P>(x + i), pp), pr, pc);  // P: simd<T>'s packet, as Packet
    if constexpr (Affine == 2) {
      store_packet<Stream>(y + i, pmadd(v, ploadu<P>(gamma + i), ploadu<P>(beta + i)));
    } else if constexpr (Affine == 1) {
      store_packet<Stream>(y + i, pmul(v, ploadu<P>(gamma + i)));
    } else {
      store_packet<Stream>(y + i, v);
    }
    return next.template packet<P>(i);
  }
  EIGEN_ALWAYS_INLINE T value(Index j) const { return next.value(j); }
};

/// The moments of the n values at `next` (pivot: its first value, as
/// row_moments), while the full packets of the row at x are normalized into
/// y with coefficients k (NormalizeAlong); then the rest of that row.
template <bool Stream, typename T>
Welford<double> moments_normalizing(const T* next, const T* x, T* y, Index n, const NormCoeffs<T>& k,
                                    const T* gamma, const T* beta) {
  using namespace Eigen::internal;
  using Packet = typename simd<T>::Packet;
  constexpr int L = simd<T>::L;
  eigen_assert(n > 0 && "moments_normalizing: a row has at least one value (its pivot)");
  const Packet pp = pset1<Packet>(k.pivot), pr = pset1<Packet>(k.rstd), pc = pset1<Packet>(-k.shift);
  const auto moments = [&](auto affine) {
    const NormalizeAlong<Stream, decltype(affine)::value, T> src{{next}, x, y, gamma, beta, pp, pr, pc};
    return moments_of<T>(src, n, next[0]);
  };
  const Welford<double> w = gamma ? (beta ? moments(std::integral_constant<int, 2>())
                                          : moments(std::integral_constant<int, 1>()))
                                  : moments(std::integral_constant<int, 0>());
  const Index full = n / L * L;
  if (full < n)
    normalize_values(RowValues<T>{x + full}, y + full, n - full, k, gamma ? gamma + full : nullptr,
                     beta ? beta + full : nullptr);
  return w;
}

/// Whether the build has 32 vector registers (AVX-512, AArch64 NEON):
/// normalize_group keeps 24 broadcast coefficients and gamma and beta in
/// registers, which 16 (SSE, AVX2) would spill.
#if defined(EIGEN_VECTORIZE_AVX512) || defined(__aarch64__)
constexpr bool kWideRegisterFile = true;
#else
constexpr bool kWideRegisterFile = false;
#endif

/// The longest rows normalize_group takes: four packets, where the build
/// has the registers for it (none elsewhere). Measured on Zen 4 (AVX-512),
/// LayerNorm forward against a row at a time: 0.92x the time at 2048x50,
/// 0.95x at 4096x16, 0.98-0.99x at 4096x32 and 2048x64, but 1.03x at
/// 1024x128, where the group's 24 broadcast coefficients and the unrolled
/// rows cost more than the loads of gamma and beta they save.
template <typename T>
constexpr Index kGroupNormalizeValues = kWideRegisterFile ? 4 * simd<T>::L : 0;

/// normalize_values for G contiguous rows of n values each (row i at
/// x + i * n, coefficients k[i]), with both gamma and beta, a packet
/// column at a time: each packet of gamma and beta is loaded once for the
/// G rows instead of once per row, and a short row's masked tail is set up
/// once. The same operations on every value, so the same bits.
template <int G, typename T>
EIGEN_ALWAYS_INLINE void normalize_group(const T* x, T* y, Index n, const CoeffGroup<T>& k, const T* gamma,
                                         const T* beta) {
  using namespace Eigen::internal;
  using Packet = typename simd<T>::Packet;
  constexpr int L = simd<T>::L;
  Packet pp[G], pr[G], pc[G];
  NORMCORE_UNROLL
  for (int i = 0; i < G; ++i) {
    pp[i] = pset1<Packet>(k.pivot[i]);
    pr[i] = pset1<Packet>(k.rstd[i]);
    pc[i] = pset1<Packet>(-k.shift[i]);
  }
  Index j = 0;
  for (; j + L <= n; j += L) {
    const Packet g = ploadu<Packet>(gamma + j), b = ploadu<Packet>(beta + j);
    NORMCORE_UNROLL
    for (int i = 0; i < G; ++i) {
      const Packet v = pmadd(psub(ploadu<Packet>(x + i * n + j), pp[i]), pr[i], pc[i]);
      pstoreu(y + i * n + j, pmadd(v, g, b));
    }
  }
  if (j == n) return;
  if constexpr (masked_tail<T>::value) {
    const auto m = masked_tail<T>::first(n - j);
    const Packet g = ploadu<Packet>(gamma + j, m), b = ploadu<Packet>(beta + j, m);
    NORMCORE_UNROLL
    for (int i = 0; i < G; ++i) {
      const Packet v = pmadd(psub(ploadu<Packet>(x + i * n + j, m), pp[i]), pr[i], pc[i]);
      pstoreu(y + i * n + j, pmadd(v, g, b), m);
    }
  } else {
    NORMCORE_UNROLL
    for (int i = 0; i < G; ++i)
      for (Index t = j; t < n; ++t)
        y[i * n + t] = madd(madd(x[i * n + t] - k.pivot[i], k.rstd[i], -k.shift[i]), gamma[t], beta[t]);
  }
}

/// Normalizes n contiguous values with scalar gamma and beta (BatchNorm NCHW).
template <typename T>
void normalize_span_scalar_affine(const T* x, T* y, Index n, const NormCoeffs<T>& k, T gamma,
                                  T beta) {
  using namespace Eigen::internal;
  using Packet = typename simd<T>::Packet;
  constexpr int L = simd<T>::L;
  const Packet pp = pset1<Packet>(k.pivot);
  const Packet pr = pset1<Packet>(k.rstd);
  const Packet pc = pset1<Packet>(-k.shift);
  const Packet pg = pset1<Packet>(gamma);
  const Packet pb = pset1<Packet>(beta);
  Index j = 0;
  for (; j + L <= n; j += L) {
    const Packet v = pmadd(psub(ploadu<Packet>(x + j), pp), pr, pc);
    pstoreu(y + j, pmadd(v, pg, pb));
  }
  for (; j < n; ++j) y[j] = madd(madd(x[j] - k.pivot, k.rstd, -k.shift), gamma, beta);
}

}  // namespace detail
}  // namespace normcore
