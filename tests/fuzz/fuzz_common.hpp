// Shared machinery of normcore's differential fuzz targets.
//
// Every target turns the fuzzer's bytes into a layer configuration (type,
// layout, shape, options, a misaligned start for every TensorMap) and data
// drawn from a palette that mixes moderate values with NaN, +-Inf, denormals
// and huge or tiny magnitudes. It then runs forward and backward and checks:
//  * invalid configurations raise std::invalid_argument (and nothing else);
//  * rows (BatchNorm: channels) whose inputs are finite and moderate match the
//    double/long double reference in normcore::reference within a tolerance
//    of eps(T) x magnitude x log(length), whatever the other rows hold;
//  * backward with saved statistics equals backward that recomputes them, bit
//    for bit.
// A failed check prints what differs and aborts, which libFuzzer reports as a
// crash and saves the input.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <normcore/normcore.hpp>
#include <normcore/reference/reference.hpp>

namespace ncfuzz {

using normcore::Index;
using Dims3 = std::array<Index, 3>;

[[noreturn]] inline void report(const char* what, const std::string& detail) {
  std::fprintf(stderr, "normcore fuzz check failed: %s\n  %s\n", what, detail.c_str());
  std::fflush(stderr);
  std::abort();
}

/// Runs f and requires it to throw std::invalid_argument.
template <typename F>
void expect_invalid(const char* what, F&& f) {
  try {
    f();
  } catch (const std::invalid_argument&) {
    return;
  }
  report("expected std::invalid_argument, nothing thrown", what);
}

/// Largest element count a target builds (keeps one execution well under a
/// millisecond or so with ASan).
constexpr Index kMaxElements = 1 << 14;

/// Row lengths around SIMD widths, accumulator blocks and chunk sizes.
inline Index pick_length(FuzzedDataProvider& p, Index max_len) {
  static const Index interesting[] = {1,  2,  3,  4,  5,   7,   8,   9,   15,  16,  17,  31,
                                      32, 33, 63, 64, 65,  127, 128, 129, 255, 256, 257, 511,
                                      512, 513, 768, 1000, 1024, 2049, 4097, 8193};
  Index n;
  if (p.ConsumeBool()) {
    n = interesting[p.ConsumeIntegralInRange<std::size_t>(0, std::size(interesting) - 1)];
  } else {
    n = p.ConsumeIntegralInRange<Index>(1, 80);
  }
  return std::min(n, max_len);
}

/// Index in memory of logical element (i0, i1, i2) of a rank-3 tensor.
inline Index mem_index(bool row_major, const Dims3& d, Index i0, Index i1, Index i2) {
  return row_major ? (i0 * d[1] + i1) * d[2] + i2 : i0 + d[0] * (i1 + d[1] * i2);
}

/// Copies logical (row-major) values into memory order and back.
template <typename T>
void to_memory(bool row_major, const Dims3& d, const std::vector<T>& logical, T* mem) {
  Index k = 0;
  for (Index a = 0; a < d[0]; ++a)
    for (Index b = 0; b < d[1]; ++b)
      for (Index c = 0; c < d[2]; ++c) mem[mem_index(row_major, d, a, b, c)] = logical[static_cast<std::size_t>(k++)];
}
template <typename T>
std::vector<T> to_logical(bool row_major, const Dims3& d, const T* mem) {
  std::vector<T> out(static_cast<std::size_t>(d[0] * d[1] * d[2]));
  Index k = 0;
  for (Index a = 0; a < d[0]; ++a)
    for (Index b = 0; b < d[1]; ++b)
      for (Index c = 0; c < d[2]; ++c) out[static_cast<std::size_t>(k++)] = mem[mem_index(row_major, d, a, b, c)];
  return out;
}

/// A buffer whose usable part starts `offset` elements in: TensorMaps over it
/// are misaligned for every offset that is not a multiple of the packet size.
/// The slack before and after is filled with a canary and checked, so a write
/// out of bounds that ASan cannot see (inside the allocation) is caught too.
template <typename T>
class Slab {
 public:
  Slab(Index n, Index offset) : n_(n), offset_(offset), buf_(static_cast<std::size_t>(n + offset + kTail)) {
    std::fill(buf_.begin(), buf_.end(), canary());
  }
  T* data() { return buf_.data() + offset_; }
  const T* data() const { return buf_.data() + offset_; }
  void check(const char* name) const {
    for (Index i = 0; i < offset_; ++i)
      if (!same(buf_[static_cast<std::size_t>(i)])) report("write before the start of a tensor", name);
    for (Index i = offset_ + n_; i < static_cast<Index>(buf_.size()); ++i)
      if (!same(buf_[static_cast<std::size_t>(i)])) report("write past the end of a tensor", name);
  }

 private:
  static constexpr Index kTail = 17;
  static T canary() { return static_cast<T>(-12345.678); }
  static bool same(T v) {
    const T c = canary();
    return std::memcmp(&v, &c, sizeof(T)) == 0;
  }
  Index n_, offset_;
  std::vector<T> buf_;
};

/// How the values of one row (or channel) are drawn.
enum class Mode : std::uint8_t {
  kModerate,  // offset + scale * u, |u| <= 1: finite, compared with the reference
  kExtreme,   // finite, any binade from denormal to near max: stress the range
  kWild,      // moderate mixed with NaN, +-Inf, denormals, max, min, zero
  kConstant,  // one value repeated (exactly beta in LayerNorm)
};

template <typename T>
struct RowGen {
  Mode mode = Mode::kModerate;
  double offset = 0;
  double scale = 1;
  T constant = 0;
};

template <typename T>
RowGen<T> pick_row_gen(FuzzedDataProvider& p) {
  RowGen<T> g;
  const int m = p.ConsumeIntegralInRange<int>(0, 15);
  g.mode = m < 10 ? Mode::kModerate : m < 12 ? Mode::kExtreme : m < 14 ? Mode::kWild : Mode::kConstant;
  g.scale = std::ldexp(1.0, p.ConsumeIntegralInRange<int>(-16, 16));
  // Offsets up to 2^20 times the spread: the cancellation regime.
  const int oe = p.ConsumeIntegralInRange<int>(-1, 20);
  g.offset = oe < 0 ? 0.0 : (p.ConsumeBool() ? 1 : -1) * g.scale * std::ldexp(1.0, oe) * (1 + p.ConsumeIntegralInRange<int>(0, 7) / 8.0);
  g.constant = static_cast<T>(g.offset + g.scale * p.ConsumeIntegralInRange<int>(-4, 4));
  return g;
}

template <typename T>
T special(FuzzedDataProvider& p) {
  using lim = std::numeric_limits<T>;
  const T s = p.ConsumeBool() ? T(1) : T(-1);
  switch (p.ConsumeIntegralInRange<int>(0, 9)) {
    case 0: return lim::quiet_NaN();
    case 1: return s * lim::infinity();
    case 2: return s * lim::denorm_min();
    case 3: return s * lim::min();
    case 4: return s * lim::max();
    case 5: return s * lim::min() / T(3);  // denormal
    case 6: return T(0) * s;                // +-0
    case 7: return s * std::sqrt(lim::max());
    case 8: return s * std::sqrt(lim::min());
    default: return s * lim::epsilon();
  }
}

template <typename T>
T draw(FuzzedDataProvider& p, const RowGen<T>& g) {
  using lim = std::numeric_limits<T>;
  const double u = p.ConsumeIntegralInRange<int>(-32768, 32767) / 32768.0;
  switch (g.mode) {
    case Mode::kModerate:
      return static_cast<T>(g.offset + g.scale * u);
    case Mode::kExtreme: {
      const int e = p.ConsumeIntegralInRange<int>(lim::min_exponent - lim::digits, lim::max_exponent - 1);
      return static_cast<T>(std::ldexp(static_cast<T>(u), e));
    }
    case Mode::kWild:
      if (p.ConsumeIntegralInRange<int>(0, 3) == 0) return special<T>(p);
      return static_cast<T>(g.offset + g.scale * u);
    case Mode::kConstant:
      return g.constant;
  }
  return T(0);
}

/// Parameter values: moderate, occasionally zero or negative.
template <typename T>
void fill_params(FuzzedDataProvider& p, T* v, Index n, double center) {
  const int kind = p.ConsumeIntegralInRange<int>(0, 3);
  for (Index i = 0; i < n; ++i) {
    const double u = p.ConsumeIntegralInRange<int>(-256, 256) / 128.0;
    v[i] = static_cast<T>(kind == 0 ? center : kind == 1 ? 0.0 : center + u);
  }
}

template <typename T>
double abs_max(const T* v, Index n) {
  double m = 0;
  for (Index i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(v[i])));
  return m;
}

template <typename T>
bool all_finite(const T* v, Index n) {
  for (Index i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) return false;
  return true;
}

template <typename T>
constexpr double ueps() {
  return static_cast<double>(std::numeric_limits<T>::epsilon());
}

/// The growth factor of a blocked or tree reduction over `length` terms.
inline double growth(double length) { return 4.0 + std::log2(1.0 + length); }

/// Scales every tolerance; building with -DNCFUZZ_TOL_SCALE=1e-9 must make the
/// targets fail at once (a check that the comparisons run at all).
#ifndef NCFUZZ_TOL_SCALE
#define NCFUZZ_TOL_SCALE 1.0
#endif

/// |got - want| <= tol, with NaN equal only to NaN.
inline bool close(double got, double want, double tol) {
  tol *= NCFUZZ_TOL_SCALE;
  if (std::isnan(got) || std::isnan(want)) return std::isnan(got) && std::isnan(want);
  if (std::isinf(want) || std::isinf(got)) return got == want;
  return std::fabs(got - want) <= tol;
}

inline std::string describe(const char* what, Index i, double got, double want, double tol) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s[%lld]: got %.17g, reference %.17g, |diff| %.3g > tol %.3g", what,
                static_cast<long long>(i), got, want, std::fabs(got - want), tol);
  return buf;
}

template <typename T>
bool bit_equal(const T* a, const T* b, Index n) {
  return n == 0 || std::memcmp(a, b, static_cast<std::size_t>(n) * sizeof(T)) == 0;
}

/// A configuration summary for failure messages.
inline std::string shape_note(const char* layer, bool is_float, bool row_major, const Dims3& d,
                              const std::string& extra) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s<%s> %s dims [%lld, %lld, %lld] %s", layer, is_float ? "float" : "double",
                row_major ? "RowMajor" : "ColMajor", static_cast<long long>(d[0]),
                static_cast<long long>(d[1]), static_cast<long long>(d[2]), extra.c_str());
  return buf;
}

}  // namespace ncfuzz
