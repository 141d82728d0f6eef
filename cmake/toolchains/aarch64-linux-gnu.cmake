# Cross-compiling normcore's unit tests for 64-bit Arm (NEON) on an x86-64
# Debian machine: GCC's aarch64 cross compiler (g++-aarch64-linux-gnu) and,
# to run the tests, qemu's user-mode emulator (qemu-user). Used by the
# "neon" presets (CMakePresets.json) and .ci/neon.sh.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(NORMCORE_CROSS_TRIPLE aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${NORMCORE_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${NORMCORE_CROSS_TRIPLE}-g++)

# Libraries and packages from the target's sysroot only: the host's x86-64
# GoogleTest must not be linked. (The presets point Eigen, which is headers
# only, at the host's copy, and build GoogleTest from Debian's sources.)
set(CMAKE_FIND_ROOT_PATH /usr/${NORMCORE_CROSS_TRIPLE})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# ctest and gtest_discover_tests run the test programs through qemu.
find_program(NORMCORE_QEMU qemu-${CMAKE_SYSTEM_PROCESSOR})
if(NORMCORE_QEMU)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${NORMCORE_QEMU} -L /usr/${NORMCORE_CROSS_TRIPLE})
endif()
