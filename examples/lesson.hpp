// Two small helpers shared by the lessons, so that each lesson can keep to its
// subject: claim() checks a statement the prose makes and remembers failures;
// fmt() prints numbers the same way everywhere. Not part of normcore.
#pragma once

#include <cmath>
#include <cstdio>
#include <string>

namespace lesson {

struct Tally {
  int claims = 0;
  int failed = 0;
};

inline Tally& tally() {
  static Tally t;
  return t;
}

/// Checks one claim of the prose. A failed claim is printed and makes
/// finish() return non-zero, so that a lesson which stops being true fails
/// its ctest.
inline void claim(bool ok, const char* what) {
  ++tally().claims;
  if (!ok) {
    ++tally().failed;
    std::printf("CLAIM FAILED: %s\n", what);
  }
}

/// The last line of every lesson; its return value is main's.
inline int finish(const char* lesson_name) {
  const Tally& t = tally();
  if (t.failed) {
    std::printf("%s: %d of %d claims FAILED\n", lesson_name, t.failed, t.claims);
    return 1;
  }
  std::printf("%s: all %d claims hold\n", lesson_name, t.claims);
  return 0;
}

/// A number with `digits` decimals; values that round to zero print as
/// 0.0000, never -0.0000.
inline std::string num(double v, int digits = 4) {
  if (std::fabs(v) < 0.5 * std::pow(10.0, -digits)) v = 0.0;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

/// "[a, b, c]" for n values read through get(i).
template <typename Get>
std::string list(long n, Get get, int digits = 4) {
  std::string s = "[";
  for (long i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += num(static_cast<double>(get(i)), digits);
  }
  return s + "]";
}

}  // namespace lesson
