#include "core/dtype.h"

#include <cctype>
#include <string>

#include "core/error.h"

namespace loom {
namespace {

// clang-format off
constexpr DTypeTraits kTraits[] = {
    {DType::f32, "f32", 1, 4, false},           {DType::f16, "f16", 1, 2, false},
    {DType::q4_0, "q4_0", 32, 18, true},        {DType::q4_1, "q4_1", 32, 20, true},
    {DType::q5_0, "q5_0", 32, 22, true},        {DType::q5_1, "q5_1", 32, 24, true},
    {DType::q8_0, "q8_0", 32, 34, true},        {DType::q8_1, "q8_1", 32, 36, true},
    {DType::q2_k, "q2_k", 256, 84, true},       {DType::q3_k, "q3_k", 256, 110, true},
    {DType::q4_k, "q4_k", 256, 144, true},      {DType::q5_k, "q5_k", 256, 176, true},
    {DType::q6_k, "q6_k", 256, 210, true},      {DType::q8_k, "q8_k", 256, 292, true},
    {DType::iq4_nl, "iq4_nl", 32, 18, true},    {DType::iq4_xs, "iq4_xs", 256, 136, true},
    {DType::iq2_xxs, "iq2_xxs", 256, 66, true}, {DType::iq2_xs, "iq2_xs", 256, 74, true},
    {DType::iq2_s, "iq2_s", 256, 82, true},     {DType::iq3_xxs, "iq3_xxs", 256, 98, true},
    {DType::iq3_s, "iq3_s", 256, 110, true},    {DType::iq1_s, "iq1_s", 256, 50, true},
    {DType::iq1_m, "iq1_m", 256, 56, true},     {DType::tq1_0, "tq1_0", 256, 54, true},
    {DType::tq2_0, "tq2_0", 256, 66, true},     {DType::mxfp4, "mxfp4", 32, 17, true},
    {DType::q1_0, "q1_0", 128, 18, true},       {DType::q2_0, "q2_0", 64, 18, true},
    {DType::nvfp4, "nvfp4", 64, 36, true},
    {DType::i8, "i8", 1, 1, false},             {DType::i16, "i16", 1, 2, false},
    {DType::i32, "i32", 1, 4, false},           {DType::i64, "i64", 1, 8, false},
    {DType::f64, "f64", 1, 8, false},           {DType::bf16, "bf16", 1, 2, false},
    {DType::nf4, "nf4", 64, 36, true},          {DType::i8_ch, "i8_ch", 1, 1, true, 8},
};
// clang-format on

}  // namespace

std::optional<DTypeTraits> dtype_traits_of_id(uint32_t id) {
  // loom's own types are not ggml_types.
  if (id == static_cast<uint32_t>(DType::nf4) || id == static_cast<uint32_t>(DType::i8_ch)) return std::nullopt;
  for (const auto& t : kTraits)
    if (static_cast<uint32_t>(t.type) == id) return t;
  return std::nullopt;
}

const DTypeTraits& dtype_traits(DType type) {
  for (const auto& t : kTraits)
    if (t.type == type) return t;
  LOOM_ASSERT(false && "unknown dtype");
  return kTraits[0];
}

size_t dtype_row_bytes(DType t, int64_t n) {
  const auto& tr = dtype_traits(t);
  LOOM_ASSERT(n >= 0 && n % tr.block_size == 0);
  return tr.row_header_bytes + static_cast<size_t>(n / tr.block_size) * tr.block_bytes;
}

std::optional<DType> dtype_from_name(std::string_view name) {
  std::string lower(name);
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const auto& t : kTraits)
    if (lower == t.name) return t.type;
  return std::nullopt;
}

}  // namespace loom
