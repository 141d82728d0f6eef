#!/usr/bin/env bash
# CI stage "robustness" (run by .ci/run after the test and asan workflows):
#   1. static analysis of include/normcore: clang-tidy (.clang-tidy) and cppcheck
#   2. differential fuzzing: a short run of each fuzz target
#   3. the concurrency/determinism tests under ThreadSanitizer
#   4. one program linked from GCC's and Clang's objects: the lambdas'
#      closure layouts compared, then the program run (see "Lambdas" in
#      include/normcore/config.hpp)
# The clang++ -Werror build of the unit tests, the robustness suite and the
# fuzz targets, and their run (with the corpus replay), are the asan
# workflow's (clang++, ASan + UBSan): this stage reuses build/asan, and
# builds what it needs there when run on its own. Any finding, warning or
# failing test fails the stage. Build trees: build/asan, build/tsan.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in cmake g++ libeigen3-dev libgtest-dev clang libclang-rt-14-dev clang-tidy cppcheck llvm-14 python3; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -q
  apt-get install -y -q "${need[@]}"
fi

jobs=2
fuzz_seconds=${NORMCORE_FUZZ_SECONDS:-10}   # per target
common=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG"
        -DNORMCORE_BUILD_TESTS=ON
        -DNORMCORE_BUILD_BENCHMARKS=OFF -DNORMCORE_BUILD_EXAMPLES=OFF -DNORMCORE_INSTALL=OFF)
step() { printf '\n=== robustness: %s ===\n' "$*"; }

# --- 1: static analysis --------------------------------------------------------
step "configure build/asan (clang++, compile_commands.json)"
cmake --preset asan

step "clang-tidy over include/normcore (via tests/robustness/static_analysis.cpp)"
# .clang-tidy: WarningsAsErrors '*', HeaderFilterRegex limited to include/normcore.
clang-tidy --quiet -p build/asan tests/robustness/static_analysis.cpp

step "cppcheck over include/normcore"
# static_analysis.cpp includes every header but mpi.hpp (which needs <mpi.h>),
# and cppcheck reports what it finds in the headers a file includes; checking
# each header on its own as well took 4x as long and found nothing more.
cppcheck -j "$jobs" --quiet --std=c++17 --language=c++ --enable=warning,performance,portability \
  --error-exitcode=1 --inline-suppr --suppressions-list=tests/robustness/cppcheck-suppressions.txt \
  --template='{file}:{line}: {severity} [{id}] {message}' -I include \
  tests/robustness/static_analysis.cpp include/normcore/mpi.hpp

# --- 2: fuzzing ---------------------------------------------------------------
step "the fuzz targets (clang, libFuzzer + ASan + UBSan; built by the asan workflow)"
cmake --build build/asan -j "$jobs" --target fuzz_layer_norm fuzz_rms_norm fuzz_batch_norm
step "fuzz each target for ${fuzz_seconds}s"
artifacts=build/asan/fuzz-artifacts
mkdir -p "$artifacts"
for target in fuzz_layer_norm fuzz_rms_norm fuzz_batch_norm; do
  scratch=$(mktemp -d)  # new inputs go here, not into the committed corpus
  if ! build/asan/tests/fuzz/$target -max_total_time="$fuzz_seconds" -print_final_stats=1 \
       -artifact_prefix="$artifacts/$target-" "$scratch" "tests/fuzz/corpus/$target" \
       > "$artifacts/$target.log" 2>&1; then
    tail -n 60 "$artifacts/$target.log"
    echo "robustness: $target found a failure; reproducer in $artifacts/" >&2
    exit 1
  fi
  grep -E '^(Done|stat::number_of_executed_units)' "$artifacts/$target.log" || true
  rm -rf "$scratch"
done

# --- 3: ThreadSanitizer ---------------------------------------------------------
step "robustness suite under ThreadSanitizer"
cmake -S . -B build/tsan -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" "${common[@]}"
cmake --build build/tsan -j "$jobs" --target normcore_robustness_native
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  ctest --test-dir build/tsan -R '^normcore_robustness_native\.' -j "$jobs" --output-on-failure --timeout 900

# --- 4: GCC and Clang in one program -------------------------------------------
# tests/robustness/mixed_compilers.cpp: side 1 by g++, side 2 by clang++ (the
# same calls), main by g++; linked in both orders so that each compiler's copy
# of every shared inline function is the one kept once. About a minute.
step "one program from GCC's and Clang's objects"
mixed=build/mixed
rm -rf "$mixed"
mkdir -p "$mixed/gcc" "$mixed/clang"
src=tests/robustness/mixed_compilers.cpp
flags=(-std=c++17 -O2 -g -march=native -Wall -Wextra -Wpedantic -Werror -Iinclude -isystem /usr/include/eigen3)
# (GCC 12 reports -Wuninitialized inside its own AVX-512 intrinsics' headers,
# as in tests/CMakeLists.txt.)
g++ "${flags[@]}" -Wno-uninitialized -DNORMCORE_SIDE=1 -c "$src" -o "$mixed/gcc/side.o" &
gcc_pid=$!
clang++ "${flags[@]}" -DNORMCORE_SIDE=2 -c "$src" -o "$mixed/clang/side.o" &
clang_pid=$!
failed=0
wait "$gcc_pid" || failed=1
wait "$clang_pid" || failed=1
if [ "$failed" != 0 ]; then
  echo "robustness: building tests/robustness/mixed_compilers.cpp failed" >&2
  exit 1
fi
g++ -std=c++17 -O2 -Wall -Wextra -Werror -c "$src" -o "$mixed/main.o"
step "closure layouts, GCC against Clang"
python3 tests/robustness/closure_layouts.py "$mixed/gcc" "$mixed/clang"
g++ "$mixed/main.o" "$mixed/gcc/side.o" "$mixed/clang/side.o" -o "$mixed/gcc_first" -pthread
g++ "$mixed/main.o" "$mixed/clang/side.o" "$mixed/gcc/side.o" -o "$mixed/clang_first" -pthread
step "run, GCC's inline functions kept"
"$mixed/gcc_first"
step "run, Clang's inline functions kept"
"$mixed/clang_first"

step "done"
