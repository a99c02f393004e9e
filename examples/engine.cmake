# The minimal engine loop (examples/engine/): kvp-tiny + KV-cache policies.
# Needs Eigen 3.4 and nlohmann-json (Debian libeigen3-dev, nlohmann-json3-dev).
find_package(Eigen3 3.4 QUIET NO_MODULE)
find_package(nlohmann_json 3 QUIET)
if(TARGET kvpolicy_cpu AND TARGET Eigen3::Eigen AND TARGET nlohmann_json::nlohmann_json)
  add_executable(kvp_engine ${CMAKE_CURRENT_LIST_DIR}/engine/kvp_engine.cpp)
  target_include_directories(kvp_engine PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(kvp_engine PRIVATE kvpolicy::kvpolicy Eigen3::Eigen nlohmann_json::nlohmann_json)
  kvp_set_warnings(kvp_engine)
else()
  message(STATUS "kvpolicy: examples/engine skipped (needs the CPU backend, Eigen 3.4 and nlohmann-json)")
endif()
