# Shared by tests/mpi and examples/sync_batch_norm: find MPI and register
# programs that run under the MPI launcher as ctests.
#
# Sets NORMCORE_MPI_ENABLED (TRUE when the option is on and MPI's C++
# bindings are found) and defines
#   normcore_add_mpi_test(<test name> <target> <ranks> [ARGS ...] [LABELS ...])
# which runs
#   ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} <ranks> ${MPIEXEC_PREFLAGS}
#       <launcher flags> <target> ${MPIEXEC_POSTFLAGS} <args>
# The launcher flags are the test's business, not the user's: with Open MPI,
# --allow-run-as-root (CI runs as root) and --oversubscribe (3 ranks on a
# 2-core machine), plus environment variables that keep Open MPI from
# probing hardware a container lacks, and LeakSanitizer suppressions for
# the MPI runtime's own allocations (lsan_openmpi.supp).
include_guard(DIRECTORY)

option(NORMCORE_WITH_MPI "Build and run the MPI adapter's tests and example (normcore/mpi.hpp) when MPI is found" ON)

set(NORMCORE_MPI_ENABLED FALSE)
if(NORMCORE_WITH_MPI)
  find_package(MPI COMPONENTS CXX QUIET)
  if(MPI_CXX_FOUND AND MPIEXEC_EXECUTABLE)
    set(NORMCORE_MPI_ENABLED TRUE)
  else()
    message(STATUS "normcore: MPI (C++ and mpiexec) not found: the MPI tests and example are skipped")
  endif()
endif()

if(NORMCORE_MPI_ENABLED)
  set(NORMCORE_MPI_LAUNCHER_FLAGS "")
  # Under AddressSanitizer (the asan preset): ignore what the MPI runtime
  # keeps past MPI_Finalize; a full unwind reaches its libraries' frames.
  set(NORMCORE_MPI_ENVIRONMENT
    "LSAN_OPTIONS=suppressions=${CMAKE_CURRENT_LIST_DIR}/lsan_openmpi.supp:fast_unwind_on_malloc=0:print_suppressions=0")
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version
                  OUTPUT_VARIABLE _normcore_mpiexec_version ERROR_VARIABLE _normcore_mpiexec_version
                  RESULT_VARIABLE _normcore_mpiexec_rc TIMEOUT 30)
  if(_normcore_mpiexec_version MATCHES "Open MPI|OpenRTE|PRRTE")
    set(NORMCORE_MPI_LAUNCHER_FLAGS --allow-run-as-root --oversubscribe)
  endif()
  if(_normcore_mpiexec_version MATCHES "\\(Open(RTE| MPI)\\) [34]\\.")
    list(APPEND NORMCORE_MPI_ENVIRONMENT
      # Launch on this machine only: no ssh needed (a fresh machine has none).
      "OMPI_MCA_plm=isolated"
      # Shared memory and loopback only: no network or InfiniBand probing.
      "OMPI_MCA_btl=self,vader"
      # No cross-memory attach (ptrace is often denied in containers).
      "OMPI_MCA_btl_vader_single_copy_mechanism=none"
      # Oversubscribed ranks yield the core instead of spinning.
      "OMPI_MCA_mpi_yield_when_idle=1")
  endif()
  get_property(_normcore_mpi_said GLOBAL PROPERTY NORMCORE_MPI_SAID)
  if(NOT _normcore_mpi_said)
    set_property(GLOBAL PROPERTY NORMCORE_MPI_SAID TRUE)
    list(JOIN NORMCORE_MPI_LAUNCHER_FLAGS " " _normcore_flags)
    message(STATUS "normcore: MPI tests and example run with ${MPIEXEC_EXECUTABLE} ${_normcore_flags}")
  endif()
endif()

function(normcore_add_mpi_test name target ranks)
  cmake_parse_arguments(PARSE_ARGV 3 arg "" "" "ARGS;LABELS")
  add_test(NAME ${name}
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${MPIEXEC_PREFLAGS}
                   ${NORMCORE_MPI_LAUNCHER_FLAGS} $<TARGET_FILE:${target}> ${MPIEXEC_POSTFLAGS} ${arg_ARGS})
  set_tests_properties(${name} PROPERTIES
    LABELS "${arg_LABELS}"
    PROCESSORS ${ranks}
    TIMEOUT 180
    ENVIRONMENT "${NORMCORE_MPI_ENVIRONMENT}")
endfunction()
