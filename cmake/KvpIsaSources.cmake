# kvp_set_isa_source_flags(<source>...): gives every source named *_sse2.cpp, *_avx2.cpp or *_avx512.cpp its
# instruction-set level's flags and KVP_CPU_TU_ISA (0, 1, 2), as the run-time dispatch expects (see
# backends/cpu/src/isa_dispatch.hpp); other sources are left as they are. Used by the CPU backend and the
# example engine's matrix kernels. GCC/Clang spell the levels -m...; MSVC has only the /arch levels.
function(kvp_set_isa_source_flags)
  if(MSVC)
    set(_flags_avx512 /arch:AVX512)
    set(_flags_avx2 /arch:AVX2)
  else()
    set(_flags_avx512 -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c -mavx2)
    set(_flags_avx2 -mavx2 -mfma -mf16c)
  endif()
  set(_flags_sse2 "")
  set(_level_sse2 0)
  set(_level_avx2 1)
  set(_level_avx512 2)
  foreach(_src IN LISTS ARGN)
    foreach(_isa sse2 avx2 avx512)
      if(_src MATCHES "_${_isa}\\.cpp$")
        set_source_files_properties("${_src}" PROPERTIES
          COMPILE_OPTIONS "${_flags_${_isa}}"
          COMPILE_DEFINITIONS "KVP_CPU_TU_ISA=${_level_${_isa}}")
      endif()
    endforeach()
  endforeach()
endfunction()
