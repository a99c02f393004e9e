# policy/: one folder per family, as include/kvpolicy/policy/. Shared helpers
# (random inputs, owning KeepSets, one-call evict wrappers) sit here.
include(${CMAKE_CURRENT_LIST_DIR}/eviction/tests.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/selection/tests.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/budget/tests.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/prefetch/tests.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/merging/tests.cmake)
