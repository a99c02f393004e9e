# apply: compaction of contiguous and paged caches from a KeepSet (uniform and ragged).
kvp_add_test(test_apply
  ${CMAKE_CURRENT_LIST_DIR}/test_apply.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_compact_ragged.cpp)
