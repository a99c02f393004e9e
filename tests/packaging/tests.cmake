# Packaging: a small consumer built through find_package (install prefix and
# build tree) and through add_subdirectory. Skipped in sanitizer builds (the
# consumer would need the same flags) via KVP_PACKAGING_TESTS=OFF.
option(KVP_PACKAGING_TESTS "Run the find_package / add_subdirectory consumer tests" ON)
if(KVP_PACKAGING_TESTS AND TARGET kvpolicy_cpu)
  foreach(mode install build_tree add_subdirectory)
    add_test(NAME "packaging: ${mode}"
             COMMAND "${CMAKE_COMMAND}" -DMODE=${mode} -DSOURCE_DIR=${PROJECT_SOURCE_DIR} -DBUILD_DIR=${PROJECT_BINARY_DIR}
                     -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/packaging_${mode} "-DGENERATOR=${CMAKE_GENERATOR}"
                     -DCXX=${CMAKE_CXX_COMPILER} -P ${CMAKE_CURRENT_LIST_DIR}/run_consumer.cmake)
    set_tests_properties("packaging: ${mode}" PROPERTIES TIMEOUT 600 RUN_SERIAL TRUE LABELS packaging)
  endforeach()
endif()
