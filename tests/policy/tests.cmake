# policy/: one folder per family, as include/kvpolicy/policy/. Shared helpers
# (random inputs, owning KeepSets, one-call evict wrappers) sit here.
include(${CMAKE_CURRENT_LIST_DIR}/eviction/tests.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/selection/tests.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/budget/tests.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/prefetch/tests.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/merging/tests.cmake)

# Many sequences per call: batched decisions over ragged / paged sequences equal per-sequence ones, on any
# thread count, and continuous batching (sequences joining and leaving between steps).
if(TARGET kvpolicy_cpu)
  kvp_add_test(test_continuous_batching ${CMAKE_CURRENT_LIST_DIR}/test_continuous_batching.cpp)
endif()
