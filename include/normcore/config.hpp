// normcore: configuration, version and error reporting.
//
// Errors: every invalid argument (a shape mismatch, a bad option, BatchNorm
// training on one value per channel) goes through detail::fail(). With C++
// exceptions enabled it throws std::invalid_argument. Built with
// -fno-exceptions it calls the handler installed with set_error_handler()
// (default: print the message to stderr and abort); the handler must not
// return, and if it does, normcore aborts.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#if defined(__cpp_exceptions) || defined(__EXCEPTIONS) || defined(_CPPUNWIND)
#define NORMCORE_HAS_EXCEPTIONS 1
#include <stdexcept>
#else
#define NORMCORE_HAS_EXCEPTIONS 0
#endif

/// Put before a loop over a compile-time count (a kernel's accumulators, the
/// rows of a group, the lanes of a packet): the loop is unrolled by 16, which
/// is completely when it runs at most 16 times, so that each iteration's
/// packets stay in registers. GCC unrolls such loops by itself only at -O3;
/// at -O2 it kept the kernels' accumulators in arrays on the stack, each
/// update a store and a load, and LayerNorm's forward took 1.25-1.9x its -O3
/// time. Unrolling changes no operation and no order; float
/// outputs keep their bits, while in double GCC's default -ffp-contract=fast
/// may fuse other products into sums in the unrolled code (last-place
/// differences, as between -O2 and -O3 builds). `#pragma GCC unroll` is
/// GCC 8's and is understood by Clang; elsewhere the macro is empty. Define
/// NORMCORE_UNROLL before including normcore to override it.
#ifndef NORMCORE_UNROLL
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8 && !defined(__INTEL_COMPILER))
#define NORMCORE_UNROLL _Pragma("GCC unroll 16")
#else
#define NORMCORE_UNROLL
#endif
#endif

/// On a function whose callees must all be inlined into it (the short-row
/// statistics: Eigen's ptranspose, which GCC 12 calls out of line at -O2,
/// its PacketBlock then passed through memory). GCC and Clang, not the Intel
/// classic compiler (as NORMCORE_UNROLL); define NORMCORE_FLATTEN before
/// including normcore to override it.
#ifndef NORMCORE_FLATTEN
#if defined(__clang__) || (defined(__GNUC__) && !defined(__INTEL_COMPILER))
#define NORMCORE_FLATTEN __attribute__((flatten))
#else
#define NORMCORE_FLATTEN
#endif
#endif

/// Lambdas. A lambda in a header is one type in every translation unit,
/// and its call operator one function that the linker keeps a single copy
/// of; so a program that links objects from GCC and from Clang runs one
/// compiler's operator on a closure that the other compiler's inlined code
/// built. The Itanium C++ ABI does not fix the order of a closure's captured
/// members, and the two compilers differ where a lambda captures by default
/// (`[&]`): GCC captures `this` last when a member is called with dependent
/// arguments, Clang where it appears; GCC captures what a discarded
/// `if constexpr` branch names and some constexpr locals, Clang does not.
/// Where the defaults differ, normcore's lambdas list their captures: GCC 12
/// and Clang 14 lay out an explicit list in its order (the standard leaves
/// that open too, but both do). `static_cast<void>(v)` marks a capture that
/// some instantiations do not read, for Clang's -Wunused-lambda-capture. The
/// robustness stage of CI compares the layouts of the closures that
/// tests/robustness/mixed_compilers.cpp instantiates (every layer, float and
/// bfloat16, both layouts, with and without a device; CI's own ISA) in the
/// two compilers' debug information (tests/robustness/closure_layouts.py),
/// and runs that program linked from both compilers' objects.

/// After a lambda's parameter list: the lambda is always inlined. The
/// per-packet bodies that detail::for_packets calls carry it. Without it, GCC
/// 12 at -O3 inlined them in a small program but called them out of line,
/// one call a packet, in the bench suite's larger translation unit, where
/// its inlining budget had run out. There, the forward of one row of 768
/// floats took 0.20-0.23 us against 0.14 us inlined. GCC and Clang; define
/// NORMCORE_INLINE_LAMBDA before including normcore to override it.
#ifndef NORMCORE_INLINE_LAMBDA
#if defined(__clang__) || (defined(__GNUC__) && !defined(__INTEL_COMPILER))
#define NORMCORE_INLINE_LAMBDA __attribute__((always_inline))
#else
#define NORMCORE_INLINE_LAMBDA
#endif
#endif

/// On the functions that build an error's message: out of line and laid
/// out apart from the code of every call, so that the checks that call them
/// stay small enough to be inlined (a one-row forward's shape checks were
/// calls of their own in the bench suite's large translation unit). GCC
/// and Clang; define NORMCORE_COLD before including normcore to override
/// it.
#ifndef NORMCORE_COLD
#if defined(__clang__) || (defined(__GNUC__) && !defined(__INTEL_COMPILER))
#define NORMCORE_COLD __attribute__((noinline, cold))
#else
#define NORMCORE_COLD
#endif
#endif

#define NORMCORE_VERSION_MAJOR 0
#define NORMCORE_VERSION_MINOR 1
#define NORMCORE_VERSION_PATCH 0

namespace normcore {

/// Called with the message of an invalid-argument error when exceptions are
/// disabled. Must not return.
using error_handler = void (*)(const char* message);

namespace detail {

inline void default_error_handler(const char* message) {
  std::fprintf(stderr, "normcore: %s\n", message);
  std::abort();
}

inline error_handler& current_error_handler() {
  static error_handler handler = &default_error_handler;
  return handler;
}

/// Reports an invalid argument: throws std::invalid_argument, or (without
/// exceptions) calls the installed handler and aborts if it returns.
[[noreturn]] inline void fail(const std::string& message) {
#if NORMCORE_HAS_EXCEPTIONS
  throw std::invalid_argument(message);
#else
  current_error_handler()(message.c_str());
  std::abort();
#endif
}

template <typename Dims>
std::string shape_string(const Dims& dims) {
  std::ostringstream os;
  os << '[';
  bool first = true;
  for (auto d : dims) {
    if (!first) os << ", ";
    os << d;
    first = false;
  }
  os << ']';
  return os.str();
}

}  // namespace detail

/// Installs the handler used for errors when normcore is compiled without
/// exceptions; returns the previous one. Not thread-safe: call it at start-up.
inline error_handler set_error_handler(error_handler handler) {
  error_handler old = detail::current_error_handler();
  detail::current_error_handler() = handler ? handler : &detail::default_error_handler;
  return old;
}

}  // namespace normcore
