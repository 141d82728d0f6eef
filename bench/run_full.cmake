# Driver of the ctest `bench_full` (label bench_full), run by
# `cmake --workflow --preset bench`: the whole suite with 1 thread, then with
# 2, as Google Benchmark JSON in the build tree (each benchmark's repetitions
# randomly interleaved with the others', so that a slow spell of a shared
# machine lands on single repetitions of many benchmarks, which the medians
# drop, rather than on every repetition of a few), then bench/report.py writes
# bench/RESULTS.md and bench/results.png into the source tree.
#
# Inputs (-D): BENCH (the binary), OUT_DIR, SOURCE_DIR, PYTHON, CXX_FLAGS.
# Environment: NORMCORE_BENCH_THREADS (default "1;2"), NORMCORE_BENCH_REPETITIONS
# (default 5), NORMCORE_BENCH_ARGS (extra benchmark flags, ;-separated, e.g.
# a --benchmark_filter for a partial run).
foreach(v BENCH OUT_DIR SOURCE_DIR PYTHON)
  if(NOT ${v})
    message(FATAL_ERROR "run_full.cmake: -D${v}=... is required")
  endif()
endforeach()

set(threads_list 1 2)
if(DEFINED ENV{NORMCORE_BENCH_THREADS})
  set(threads_list $ENV{NORMCORE_BENCH_THREADS})
endif()
set(reps 5)
if(DEFINED ENV{NORMCORE_BENCH_REPETITIONS})
  set(reps $ENV{NORMCORE_BENCH_REPETITIONS})
endif()
set(extra "")
if(DEFINED ENV{NORMCORE_BENCH_ARGS})
  set(extra $ENV{NORMCORE_BENCH_ARGS})
endif()

set(json_files "")
foreach(t IN LISTS threads_list)
  set(out "${OUT_DIR}/results_t${t}.json")
  message(STATUS "normcore bench: ${t} thread(s) -> ${out}")
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env OMP_NUM_THREADS=${t}
            ${BENCH} --threads=${t}
            --benchmark_repetitions=${reps}
            --benchmark_enable_random_interleaving=true
            --benchmark_min_time=0.1
            --benchmark_display_aggregates_only=true
            --benchmark_out=${out} --benchmark_out_format=json
            ${extra}
    RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "normcore bench: the ${t}-thread run failed (${rc})")
  endif()
  list(APPEND json_files "${out}")
endforeach()

execute_process(
  COMMAND ${PYTHON} ${SOURCE_DIR}/report.py
          --markdown ${SOURCE_DIR}/RESULTS.md
          --png ${SOURCE_DIR}/results.png
          --cxx-flags "${CXX_FLAGS}"
          ${json_files}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "normcore bench: report.py failed (${rc})")
endif()
message(STATUS "normcore bench: wrote ${SOURCE_DIR}/RESULTS.md (and results.png, with matplotlib)")
