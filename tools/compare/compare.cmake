# kvpolicy-compare: the policy comparison (the README's main job).
# Included from examples/compare.cmake; needs the CPU backend and nlohmann-json
# (for kvpolicy/io/, which reads trace files).
find_package(nlohmann_json 3 QUIET)
if(TARGET kvpolicy_cpu AND TARGET nlohmann_json::nlohmann_json)
  add_executable(kvpolicy-compare ${CMAKE_CURRENT_LIST_DIR}/main.cpp)
  target_include_directories(kvpolicy-compare PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(kvpolicy-compare PRIVATE kvpolicy::kvpolicy nlohmann_json::nlohmann_json)
  kvp_set_warnings(kvpolicy-compare)
else()
  message(STATUS "kvpolicy: kvpolicy-compare skipped (needs the CPU backend and nlohmann-json)")
endif()
