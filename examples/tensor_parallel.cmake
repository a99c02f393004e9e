# Tensor parallelism: Ada-KV over MPI ranks (interop/mpi_collective.hpp), built when MPI is found.
find_package(MPI QUIET COMPONENTS CXX)
if(TARGET kvpolicy_cpu AND MPI_CXX_FOUND)
  add_executable(tensor_parallel_adakv ${CMAKE_CURRENT_LIST_DIR}/tensor_parallel_adakv.cpp)
  target_link_libraries(tensor_parallel_adakv PRIVATE kvpolicy::kvpolicy MPI::MPI_CXX)
  kvp_set_warnings(tensor_parallel_adakv)
endif()
if(TARGET tensor_parallel_adakv AND KVP_BUILD_TESTS AND MPIEXEC_EXECUTABLE)
  add_test(NAME "example: tensor_parallel_adakv on 2 processes" COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 --oversubscribe
                                                                        $<TARGET_FILE:tensor_parallel_adakv>)
  set_tests_properties("example: tensor_parallel_adakv on 2 processes" PROPERTIES TIMEOUT 300 PASS_REGULAR_EXPRESSION
    "same allocation as one process" ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;ASAN_OPTIONS=detect_leaks=0")
endif()
