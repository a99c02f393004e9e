# Merging family: kvpress MergingPress / CAMPress, CaM, D2O, LOOK-M, the nearest-kept
# weighted merge, MiniCache; apply/merge.hpp and the evict -> merge -> quantize pipeline.
kvp_add_test(test_merging
  ${CMAKE_CURRENT_LIST_DIR}/test_merging.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_apply_merge.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_pipeline.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_merging_device.cpp
  ${CMAKE_CURRENT_LIST_DIR}/test_merging_device_more.cpp)

# Cross-checks against kvpress 0.5.5 and the original repositories (committed fixtures; need nlohmann-json).
find_package(nlohmann_json 3 QUIET)
if(TARGET nlohmann_json::nlohmann_json)
  kvp_add_test(test_merging_fixtures ${CMAKE_CURRENT_LIST_DIR}/test_merge_fixtures.cpp)
  target_link_libraries(test_merging_fixtures PRIVATE nlohmann_json::nlohmann_json)
  # CaM, LOOK-M and MiniCache against the original code's arithmetic (make_merge_original_fixtures.py).
  kvp_add_test(test_merging_original_fixtures ${CMAKE_CURRENT_LIST_DIR}/test_merge_original_fixtures.cpp)
  target_link_libraries(test_merging_original_fixtures PRIVATE nlohmann_json::nlohmann_json)
endif()
