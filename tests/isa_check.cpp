// Part of the ISA-variant test binaries (tests/CMakeLists.txt): built
// without their ISA flags, it checks before any other static initializer
// runs (the binary's own may already use the variant's instructions) that
// this CPU has the instructions the variant was compiled for, and otherwise
// ends the process with ctest's skip code, 77, instead of an illegal
// instruction. The features come as NORMCORE_NEED_<FEATURE> definitions.
#include <cpuid.h>

#include <cstdio>
#include <cstdlib>

namespace {

bool cpu_has_variant_isa() {
  __builtin_cpu_init();
  bool ok = true;
#ifdef NORMCORE_NEED_AVX2
  ok = ok && __builtin_cpu_supports("avx2");
#endif
#ifdef NORMCORE_NEED_FMA
  ok = ok && __builtin_cpu_supports("fma");
#endif
#ifdef NORMCORE_NEED_F16C
  // CPUID leaf 1, ECX, read directly: not every GCC's __builtin_cpu_supports
  // knows "f16c" (its VEX encoding needs the OS's AVX state, checked with avx2).
  unsigned a = 0, b = 0, c = 0, d = 0;
  ok = ok && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
#endif
  return ok;
}

__attribute__((constructor(101))) void skip_without_variant_isa() {
  if (!cpu_has_variant_isa()) {
    std::fprintf(stderr, "normcore: this CPU lacks the ISA this test binary was built for; skipped\n");
    std::_Exit(77);
  }
}

}  // namespace
