# The minimal engine loop (examples/engine/): kvp-tiny + KV-cache policies. The engine itself is
# kvp_engine_lib (examples/engine/CMakeLists.txt); this is its command-line program.
if(TARGET kvp_engine_lib)
  add_executable(kvp_engine ${CMAKE_CURRENT_LIST_DIR}/engine/kvp_engine.cpp)
  target_link_libraries(kvp_engine PRIVATE kvp_engine_lib)
  kvp_set_warnings(kvp_engine)
endif()
