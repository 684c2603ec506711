// libFuzzer entry for the JSON files of a Hugging Face model folder: the same
// bytes as config.json (the model's shape, RoPE scaling), tokenizer_config.json
// (special tokens, chat template) and generation_config.json (sampling
// defaults). Bad input must end in loom::Error naming the file and key, never a
// crash or an escaped nlohmann::json exception; a config that loads passes
// validate_config.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "core/error.h"
#include "io/hf_folder.h"
#include "model/config_load.h"

namespace {

template <typename Parse>
void parse(Parse p) {
  try {
    p();
  } catch (const loom::Error&) {
    // Rejected input is the expected outcome for most mutations.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  nlohmann::json j;
  try {
    j = loom::parse_json_text(text, "config.json");
  } catch (const loom::Error&) {
    return 0;
  }
  parse([&] { loom::validate_config(loom::config_from_hf(j, "config.json"), "config.json"); });
  parse([&] { (void)loom::parse_tokenizer_settings(j, "tokenizer_config.json"); });
  parse([&] { (void)loom::parse_generation_defaults(j, "generation_config.json"); });
  return 0;
}
