// SPDX-License-Identifier: Apache-2.0
// `QuantRole`: which half of the cache a quantizer stores, for formats whose
// layout or defaults differ between keys and values (KIVI's grouping axis,
// llama.cpp's Hadamard block size); the parameter names of the rotation
// modes (quant/hadamard.hpp).
#pragma once

#include <cstdint>
#include <span>

#include "kvpolicy/policy/params.hpp"
#include "kvpolicy/quant/hadamard.hpp"

KVP_NAMESPACE_BEGIN

enum class QuantRole : std::uint8_t { kKeys, kValues };
inline constexpr EnumName<QuantRole> kQuantRoleNames[] = {{"keys", QuantRole::kKeys}, {"values", QuantRole::kValues}};
constexpr std::span<const EnumName<QuantRole>> enum_names(QuantRole) noexcept { return kQuantRoleNames; }

inline constexpr EnumName<HadamardMode> kHadamardModeNames[] = {
    {"none", HadamardMode::kNone}, {"llama_cpp", HadamardMode::kLlamaCpp}, {"block", HadamardMode::kBlock}};
constexpr std::span<const EnumName<HadamardMode>> enum_names(HadamardMode) noexcept { return kHadamardModeNames; }

KVP_NAMESPACE_END
