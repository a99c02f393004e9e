# Selection: Quest (page metadata, selection, paged attention and page metrics).
kvp_add_test(test_selection
  ${CMAKE_CURRENT_LIST_DIR}/test_quest_metadata.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_quest_select.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_quest_attention.cpp)

# Every ISA level of the CPU backend against the scalar reference.
if(TARGET kvpolicy_cpu)
  kvp_add_test(test_selection_cpu ${CMAKE_CURRENT_LIST_DIR}/test_quest_cpu.cpp)
endif()
