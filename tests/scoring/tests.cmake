# Scoring policies: budget vocabulary (schedules, allocation), Ada-KV, PyramidKV,
# Expected Attention, and the kvpress fixture cross-validation.
kvp_add_test(test_scoring
  ${CMAKE_CURRENT_LIST_DIR}/test_budget.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_adakv.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_pyramidkv.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_expected_attention.cpp)

# Cross-validation against tests/data/fixtures (needs the fixture reader and nlohmann-json).
find_package(nlohmann_json 3 QUIET)
if(TARGET nlohmann_json::nlohmann_json AND EXISTS "${CMAKE_CURRENT_LIST_DIR}/../reference/fixture_reader.hpp")
  kvp_add_test(test_scoring_fixtures ${CMAKE_CURRENT_LIST_DIR}/test_fixtures.cpp)
  target_link_libraries(test_scoring_fixtures PRIVATE nlohmann_json::nlohmann_json)
else()
  message(STATUS "kvpolicy: nlohmann-json or tests/reference/fixture_reader.hpp missing, test_scoring_fixtures not built")
endif()
