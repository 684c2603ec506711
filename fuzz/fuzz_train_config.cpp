// libFuzzer entry for the training config (train/train_config.h): YAML text and
// `--set key=value` overrides, as `loom train --config F --set ...` reads them.
// Bad input must end in loom::Error naming the key or the place, never a crash,
// a hang or an escaped yaml-cpp exception.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "train/train_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  // A line "#set key=value" at the end becomes an override, so both paths are fuzzed.
  std::vector<std::string> sets;
  const size_t at = input.rfind("\n#set ");
  if (at != std::string_view::npos) sets.emplace_back(input.substr(at + 6));
  try {
    (void)loom::parse_train_config(input, "fuzz.yaml", sets);
  } catch (const loom::Error&) {
    // Rejected input is the expected outcome for most mutations.
  }
  return 0;
}
