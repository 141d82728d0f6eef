# Builds and runs a consumer project against normcore (MODE: find_package or
# add_subdirectory). Fails on any step's failure.
file(REMOVE_RECURSE ${SCRATCH})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()
if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${SCRATCH}/normcore-build -G ${GENERATOR}
      -DNORMCORE_BUILD_TESTS=OFF -DNORMCORE_BUILD_BENCHMARKS=OFF -DNORMCORE_BUILD_EXAMPLES=OFF
      -DNORMCORE_INSTALL=ON -DCMAKE_INSTALL_PREFIX=${SCRATCH}/prefix)
  run(${CMAKE_COMMAND} --build ${SCRATCH}/normcore-build)
  run(${CMAKE_COMMAND} --install ${SCRATCH}/normcore-build)
  run(${CMAKE_COMMAND} -S ${CONSUMER} -B ${SCRATCH}/consumer-build -G ${GENERATOR}
      -DCMAKE_PREFIX_PATH=${SCRATCH}/prefix)
else()
  run(${CMAKE_COMMAND} -S ${CONSUMER} -B ${SCRATCH}/consumer-build -G ${GENERATOR}
      -DNORMCORE_SOURCE_DIR=${SOURCE_DIR})
endif()
run(${CMAKE_COMMAND} --build ${SCRATCH}/consumer-build)
run(${SCRATCH}/consumer-build/app)
