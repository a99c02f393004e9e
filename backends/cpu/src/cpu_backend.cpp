#include "kvpolicy/backends/cpu.hpp"
KVP_NAMESPACE_BEGIN
const char* backend::Cpu::isa_name() noexcept { return "scalar"; }
KVP_NAMESPACE_END
