# The main job: policy comparison on the built-in synthetic workload.
if(TARGET kvpolicy_cpu)
  add_executable(compare_policies ${CMAKE_CURRENT_LIST_DIR}/compare_policies.cpp)
  target_link_libraries(compare_policies PRIVATE kvpolicy::kvpolicy)
  kvp_set_warnings(compare_policies)
endif()

if(TARGET kvpolicy_cpu)
  add_executable(embed_snapkv ${CMAKE_CURRENT_LIST_DIR}/embed_snapkv.cpp)
  target_link_libraries(embed_snapkv PRIVATE kvpolicy::kvpolicy)
  kvp_set_warnings(embed_snapkv)
endif()
