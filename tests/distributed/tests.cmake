# Tensor-parallel head shards: the in-process test (ranks as threads) always;
# the MPI test (2 and 4 processes under mpirun) when MPI is found.
if(TARGET kvpolicy_cpu)
  kvp_add_test(test_sharding ${CMAKE_CURRENT_LIST_DIR}/test_sharding.cpp)
endif()
