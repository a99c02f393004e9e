# The main job: the policy comparison, built from tools/compare/ (kvpolicy-compare).
include(${PROJECT_SOURCE_DIR}/tools/compare/compare.cmake)

if(TARGET kvpolicy_cpu)
  add_executable(embed_snapkv ${CMAKE_CURRENT_LIST_DIR}/embed_snapkv.cpp)
  target_link_libraries(embed_snapkv PRIVATE kvpolicy::kvpolicy)
  kvp_set_warnings(embed_snapkv)
endif()
