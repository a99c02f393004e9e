# Install + export with one export set per component, a build-tree export(),
# and a package config that understands COMPONENTS (core, cpu, cuda, kvpolicy).
set(KVP_CONFIG_INSTALL_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/kvpolicy")

set(_kvp_export_core kvpolicy_core kvpolicy_kvpolicy)

configure_package_config_file("${KVP_CMAKE_DIR}/kvpolicyConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/kvpolicyConfig.cmake"
  INSTALL_DESTINATION "${KVP_CONFIG_INSTALL_DIR}")
write_basic_package_version_file("${PROJECT_BINARY_DIR}/kvpolicyConfigVersion.cmake"
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)

# The umbrella target goes into the last component so its dependencies exist.
export(TARGETS kvpolicy_core NAMESPACE kvpolicy:: FILE "${PROJECT_BINARY_DIR}/kvpolicy-core-targets.cmake")
if(TARGET kvpolicy_cpu)
  export(TARGETS kvpolicy_cpu NAMESPACE kvpolicy:: FILE "${PROJECT_BINARY_DIR}/kvpolicy-cpu-targets.cmake")
endif()
if(TARGET kvpolicy_cuda)
  export(TARGETS kvpolicy_cuda NAMESPACE kvpolicy:: FILE "${PROJECT_BINARY_DIR}/kvpolicy-cuda-targets.cmake")
endif()
export(TARGETS kvpolicy_kvpolicy NAMESPACE kvpolicy:: FILE "${PROJECT_BINARY_DIR}/kvpolicy-umbrella-targets.cmake")

if(KVP_INSTALL)
  install(DIRECTORY include/kvpolicy DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(TARGETS kvpolicy_core EXPORT kvpolicy-core-targets)
  install(EXPORT kvpolicy-core-targets NAMESPACE kvpolicy:: DESTINATION "${KVP_CONFIG_INSTALL_DIR}")
  if(TARGET kvpolicy_cpu)
    install(TARGETS kvpolicy_cpu EXPORT kvpolicy-cpu-targets
            ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
            RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
    install(DIRECTORY backends/cpu/include/kvpolicy DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
    install(EXPORT kvpolicy-cpu-targets NAMESPACE kvpolicy:: DESTINATION "${KVP_CONFIG_INSTALL_DIR}")
  endif()
  if(TARGET kvpolicy_cuda)
    install(TARGETS kvpolicy_cuda EXPORT kvpolicy-cuda-targets
            ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
            RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
    install(DIRECTORY backends/cuda/include/kvpolicy DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
    install(EXPORT kvpolicy-cuda-targets NAMESPACE kvpolicy:: DESTINATION "${KVP_CONFIG_INSTALL_DIR}")
  endif()
  install(TARGETS kvpolicy_kvpolicy EXPORT kvpolicy-umbrella-targets)
  install(EXPORT kvpolicy-umbrella-targets NAMESPACE kvpolicy:: DESTINATION "${KVP_CONFIG_INSTALL_DIR}")
  install(FILES "${PROJECT_BINARY_DIR}/kvpolicyConfig.cmake" "${PROJECT_BINARY_DIR}/kvpolicyConfigVersion.cmake"
          DESTINATION "${KVP_CONFIG_INSTALL_DIR}")
  install(FILES LICENSE DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/kvpolicy)
endif()
