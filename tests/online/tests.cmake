# Online policies (H2O, TOVA), one-shot observed attention, ragged apply.
kvp_add_test(test_online
  ${CMAKE_CURRENT_LIST_DIR}/test_h2o.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_tova.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_observed_attention.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_compact_ragged.cpp)
