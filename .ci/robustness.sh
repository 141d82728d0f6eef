#!/usr/bin/env bash
# CI stage "robustness" (run by .ci/run after the test and asan workflows):
#   1. static analysis of include/normcore: clang-tidy (.clang-tidy) and cppcheck
#   2. the unit tests built with clang++ -Werror, and the robustness suite
#   3. differential fuzzing: replay the committed corpus, then a short run
#   4. the concurrency/determinism tests under ThreadSanitizer
# Any finding, warning or failing test fails the stage. About 8-10 minutes
# on 2 cores. Build trees: build/clang, build/fuzz, build/tsan.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in cmake g++ libeigen3-dev libgtest-dev clang libclang-rt-14-dev clang-tidy cppcheck; do
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

# --- 1 + 2: clang build (-Werror comes from the test CMakeLists) -------------
step "configure build/clang (clang++, compile_commands.json)"
# The unit tests with clang++: every warning is an error (-Werror in tests/).
cmake -S . -B build/clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DNORMCORE_BUILD_FUZZERS=OFF "${common[@]}"

step "clang-tidy over include/normcore (via tests/robustness/static_analysis.cpp)"
# .clang-tidy: WarningsAsErrors '*', HeaderFilterRegex limited to include/normcore.
clang-tidy --quiet -p build/clang tests/robustness/static_analysis.cpp

step "cppcheck over include/normcore"
cppcheck -j "$jobs" --quiet --std=c++17 --language=c++ --enable=warning,performance,portability \
  --error-exitcode=1 --inline-suppr --suppressions-list=tests/robustness/cppcheck-suppressions.txt \
  --template='{file}:{line}: {severity} [{id}] {message}' -I include \
  tests/robustness/static_analysis.cpp include/normcore/*.hpp include/normcore/*/*.hpp

step "build the unit tests and the robustness suite with clang++ -Werror"
# (The baseline-ISA variants are built with g++ in the test workflow; clang
# builds the native ones: the same sources, so clang's warnings are covered.)
cmake --build build/clang -j "$jobs" --target normcore_tests_native \
  normcore_robustness_native normcore_no_exceptions_handler \
  normcore_no_exceptions_default normcore_static_analysis
step "run them"
ctest --test-dir build/clang -j "$jobs" --output-on-failure --timeout 600 \
  -R '^(normcore_tests_native|normcore_robustness_native)\.|^no_exceptions\.|^static_analysis_tu$'

# --- 3: fuzzing ---------------------------------------------------------------
step "build the fuzz targets (clang, libFuzzer + ASan + UBSan)"
cmake -S . -B build/fuzz -DCMAKE_CXX_COMPILER=clang++ -DNORMCORE_BUILD_FUZZERS=ON "${common[@]}"
cmake --build build/fuzz -j "$jobs" --target fuzz_layer_norm fuzz_rms_norm fuzz_batch_norm
step "replay the committed corpus"
ctest --test-dir build/fuzz -L fuzz --output-on-failure
step "fuzz each target for ${fuzz_seconds}s"
artifacts=build/fuzz/artifacts
mkdir -p "$artifacts"
for target in fuzz_layer_norm fuzz_rms_norm fuzz_batch_norm; do
  scratch=$(mktemp -d)  # new inputs go here, not into the committed corpus
  if ! build/fuzz/tests/fuzz/$target -max_total_time="$fuzz_seconds" -print_final_stats=1 \
       -artifact_prefix="$artifacts/$target-" "$scratch" "tests/fuzz/corpus/$target" \
       > "$artifacts/$target.log" 2>&1; then
    tail -n 60 "$artifacts/$target.log"
    echo "robustness: $target found a failure; reproducer in $artifacts/" >&2
    exit 1
  fi
  grep -E '^(Done|stat::number_of_executed_units)' "$artifacts/$target.log" || true
  rm -rf "$scratch"
done

# --- 4: ThreadSanitizer ---------------------------------------------------------
step "robustness suite under ThreadSanitizer"
cmake -S . -B build/tsan -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" "${common[@]}"
cmake --build build/tsan -j "$jobs" --target normcore_robustness_native
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  ctest --test-dir build/tsan -R '^normcore_robustness_native\.' -j "$jobs" --output-on-failure --timeout 900

step "done"
