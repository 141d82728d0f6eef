#!/usr/bin/env bash
# The unit tests on 64-bit Arm (NEON), from an x86-64 Debian machine: built
# with GCC's aarch64 cross compiler and run under qemu's user-mode emulator
# (the "neon" workflow preset: armv8.2-a with FP16 arithmetic, and the
# baseline armv8-a). About 5 minutes on 2 cores. CI runs the armv8.2-a build
# only (`bash .ci/neon.sh native`, about half that); run both by hand when a
# change touches the packet code (convert.hpp, mixed.hpp, the kernels'
# packet types):
#   bash .ci/neon.sh
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in cmake libeigen3-dev googletest g++-aarch64-linux-gnu qemu-user; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -q
  apt-get install -y -q "${need[@]}"
fi

if [ "${1:-}" = "native" ]; then
  # CI's stage: the armv8.2-a + FP16 build only (the 16-bit arithmetic
  # packets and everything the baseline build runs but its half-precision
  # fallbacks), in about half the time of both.
  cmake --preset neon
  cmake --build --preset neon --target normcore_tests_native
  ctest --preset neon --tests-regex '^normcore_tests_native[.]' --no-tests=error
else
  cmake --workflow --preset neon
fi
