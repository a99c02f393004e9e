kvp_add_test(test_quest
  ${CMAKE_CURRENT_LIST_DIR}/test_quest_metadata.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_quest_select.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_quest_attention.cpp)
