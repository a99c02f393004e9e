# Adds examples/engine/ (the kvp_engine_lib target) once, whichever part of the build asks first: the engine
# tests (tests/engine/tests.cmake, configured before examples/) or examples/CMakeLists.txt.
get_property(_kvp_engine_lib_added GLOBAL PROPERTY KVP_ENGINE_LIB_ADDED)
if(NOT _kvp_engine_lib_added)
  set_property(GLOBAL PROPERTY KVP_ENGINE_LIB_ADDED TRUE)
  add_subdirectory(${CMAKE_CURRENT_LIST_DIR} ${PROJECT_BINARY_DIR}/examples/engine)
endif()
