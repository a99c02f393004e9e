# Many sequences per call: 64 sequences x 8192 tokens in one batched call
# (SnapKV, PyramidKV, Quest select) on 1 and 2 threads, against per-sequence
# calls in a loop.
if(NOT TARGET kvpolicy_cpu)
  message(STATUS "kvpolicy: CPU backend off, bench_batching not built")
  return()
endif()

find_package(benchmark QUIET)
if(TARGET benchmark::benchmark)
  add_executable(bench_batching ${CMAKE_CURRENT_LIST_DIR}/bench_batching.cpp)
  target_link_libraries(bench_batching PRIVATE kvpolicy::kvpolicy benchmark::benchmark)
  target_include_directories(bench_batching PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  target_compile_features(bench_batching PRIVATE cxx_std_20)
  kvp_set_warnings(bench_batching)
else()
  message(STATUS "kvpolicy: Google Benchmark not found, bench_batching not built")
endif()
