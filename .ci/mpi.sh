#!/usr/bin/env bash
# CI stage: SyncBatchNorm over MPI (include/normcore/mpi.hpp). Installs Open
# MPI when missing, then builds and runs only the MPI tests and example
# (ctest label "mpi": 1, 2, 3 and 4 ranks, and the example on 2 ranks).
# The launcher flags CI needs (root, oversubscription) are in the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in cmake g++ libeigen3-dev libgtest-dev libopenmpi-dev openmpi-bin; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -q
  apt-get install -y -q "${need[@]}"
fi

build=build/mpi
cmake -S . -B "$build" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
  -DNORMCORE_BUILD_TESTS=ON \
  -DNORMCORE_BUILD_EXAMPLES=ON \
  -DNORMCORE_BUILD_BENCHMARKS=OFF \
  -DNORMCORE_WITH_MPI=ON
cmake --build "$build" -j2 --target normcore_mpi_tests sync_batch_norm
ctest --test-dir "$build" -L mpi --output-on-failure --no-tests=error
