// libFuzzer entry for a PEFT adapter folder's adapter_config.json, as `loom
// serve` (--adapter, the load endpoint), generate, chat and merge read it: the
// bytes are written as the folder's config (no weights file, so the read ends
// after the config is checked, or at the missing weights). Bad input must end
// in loom::Error naming the file and field, never a crash or an escaped
// nlohmann::json exception.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "model/peft_adapter.h"

namespace {

const std::filesystem::path& folder() {
  static const std::filesystem::path dir = [] {
    const auto d =
        std::filesystem::temp_directory_path() / ("loom_fuzz_adapter_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] { std::filesystem::remove_all(folder()); });
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream f(folder() / "adapter_config.json", std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    (void)loom::peft::read_adapter(folder().string());
  } catch (const loom::Error&) {
    // Rejected input (or the missing weights file) is the expected outcome.
  }
  return 0;
}
