# Dependencies: find_package first; FetchContent with pinned versions only as a
# fallback for systems that lack the package (CI never takes the fallback).
# FETCHCONTENT_SOURCE_DIR_<NAME> (CMake's own override) points the fallback at
# local sources instead of a download: the neon preset builds GoogleTest from
# Debian's /usr/src/googletest that way.
include(FetchContent)
if(POLICY CMP0135)
  cmake_policy(SET CMP0135 NEW)  # downloaded archives' files get the extraction time
endif()

# The fallback's status line: where the sources come from.
function(normcore_fetch_message name pkg version)
  string(TOUPPER "${name}" upper)
  if(FETCHCONTENT_SOURCE_DIR_${upper})
    message(STATUS "normcore: ${pkg} not found, building it from ${FETCHCONTENT_SOURCE_DIR_${upper}}")
  else()
    message(STATUS "normcore: ${pkg} not found, fetching ${version}")
  endif()
endfunction()

macro(normcore_find_eigen)
  if(NOT TARGET Eigen3::Eigen)
    find_package(Eigen3 3.4 CONFIG QUIET)
    if(NOT Eigen3_FOUND)
      normcore_fetch_message(Eigen3 Eigen3 "Eigen 3.4.0")
      FetchContent_Declare(Eigen3
        URL https://gitlab.com/libeigen/eigen/-/archive/3.4.0/eigen-3.4.0.tar.gz
        URL_HASH SHA256=8586084f71f9bde545ee7fa6d00288b264a2b7ac3607b974e54d13e7162c1c72)
      set(EIGEN_BUILD_DOC OFF CACHE BOOL "" FORCE)
      set(BUILD_TESTING OFF CACHE BOOL "" FORCE)
      set(EIGEN_BUILD_PKGCONFIG OFF CACHE BOOL "" FORCE)
      FetchContent_MakeAvailable(Eigen3)
    endif()
  endif()
endmacro()

macro(normcore_find_gtest)
  if(NOT TARGET GTest::gtest_main)
    find_package(GTest 1.10 QUIET)
    if(NOT GTest_FOUND)
      normcore_fetch_message(googletest GoogleTest v1.14.0)
      FetchContent_Declare(googletest
        URL https://github.com/google/googletest/archive/refs/tags/v1.14.0.tar.gz
        URL_HASH SHA256=8ad598c73ad796e0d8280b082cebd82a630d73e73cd3c70057938a6501bba5d7)
      set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
      FetchContent_MakeAvailable(googletest)
    endif()
  endif()
endmacro()

macro(normcore_find_benchmark)
  if(NOT TARGET benchmark::benchmark)
    find_package(benchmark 1.6 QUIET)
    if(NOT benchmark_FOUND)
      normcore_fetch_message(benchmark "Google Benchmark" v1.8.3)
      FetchContent_Declare(benchmark
        URL https://github.com/google/benchmark/archive/refs/tags/v1.8.3.tar.gz
        URL_HASH SHA256=6bc180a57d23d4d9515519f92b0c83d61b05b5bab188961f36ac7b06b0d9e9ce)
      set(BENCHMARK_ENABLE_TESTING OFF CACHE BOOL "" FORCE)
      set(BENCHMARK_ENABLE_INSTALL OFF CACHE BOOL "" FORCE)
      FetchContent_MakeAvailable(benchmark)
    endif()
  endif()
endmacro()
