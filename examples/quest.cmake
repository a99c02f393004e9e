# Quest decode loop over a paged cache (CPU backend).
if(TARGET kvpolicy_cpu)
  add_executable(quest_decode ${CMAKE_CURRENT_LIST_DIR}/quest_decode.cpp)
  target_link_libraries(quest_decode PRIVATE kvpolicy::kvpolicy)
  kvp_set_warnings(quest_decode)
endif()
