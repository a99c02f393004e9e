kvp_add_test(test_policies
  ${CMAKE_CURRENT_LIST_DIR}/test_snapkv.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_streaming_llm.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_apply.cpp)
