# Online policies (H2O, TOVA), one-shot observed attention, ragged apply.
kvp_add_test(test_online
  ${CMAKE_CURRENT_LIST_DIR}/test_h2o.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_tova.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_observed_attention.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_compact_ragged.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_isa_levels.cpp)

# Cross-validation against the reference fixtures (needs the fixture reader and nlohmann-json).
find_package(nlohmann_json 3 QUIET)
if(TARGET nlohmann_json::nlohmann_json AND EXISTS "${CMAKE_CURRENT_LIST_DIR}/../reference/fixture_reader.hpp")
  kvp_add_test(test_online_fixtures ${CMAKE_CURRENT_LIST_DIR}/test_online_fixtures.cpp)
  target_link_libraries(test_online_fixtures PRIVATE nlohmann_json::nlohmann_json)
endif()
