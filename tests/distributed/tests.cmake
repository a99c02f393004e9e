# Tensor-parallel head shards: the in-process test (ranks as threads) always;
# the MPI test (2 and 4 processes under mpirun) when MPI is found.
if(TARGET kvpolicy_cpu)
  kvp_add_test(test_sharding ${CMAKE_CURRENT_LIST_DIR}/test_sharding.cpp)
endif()

# The same cases over MPI processes (interop/mpi_collective.hpp), 2 and 4 ranks on any machine
# (--oversubscribe: more ranks than cores). OpenMPI refuses to start as root without the two
# variables; LeakSanitizer is off for these runs only (OpenMPI's own allocations are not freed
# at exit; the in-process test above covers the library under LSan).
find_package(MPI QUIET COMPONENTS CXX)
if(TARGET kvpolicy_cpu AND MPI_CXX_FOUND AND MPIEXEC_EXECUTABLE)
  add_executable(test_mpi_sharding ${CMAKE_CURRENT_LIST_DIR}/test_mpi_sharding.cpp)
  target_link_libraries(test_mpi_sharding PRIVATE kvpolicy::kvpolicy MPI::MPI_CXX)
  target_include_directories(test_mpi_sharding PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  kvp_set_warnings(test_mpi_sharding)
  foreach(np 2 4)
    add_test(NAME "test_mpi_sharding: ${np} processes" COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe
                                                               ${MPIEXEC_PREFLAGS} $<TARGET_FILE:test_mpi_sharding> ${MPIEXEC_POSTFLAGS})
    set_tests_properties("test_mpi_sharding: ${np} processes" PROPERTIES TIMEOUT 600 PASS_REGULAR_EXPRESSION "0 mismatches"
      ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;ASAN_OPTIONS=detect_leaks=0")
  endforeach()
else()
  message(STATUS "kvpolicy: MPI not found (Debian: libopenmpi-dev openmpi-bin), test_mpi_sharding not built")
endif()
