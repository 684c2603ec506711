// libFuzzer entry for the safetensors reader: any input must either parse or
// raise loom::Error; every view of an accepted file must lie inside the input.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto f = loom::safetensors::File::parse(data, size, "fuzz.safetensors");
    volatile uint8_t sink = 0;
    for (const auto& t : f->tensors()) {
      // Touch every byte so ASan sees any out-of-bounds view.
      for (size_t i = 0; i < t.nbytes(); ++i) sink = static_cast<uint8_t>(sink + t.data[i]);
      if (f->find_tensor(t.name) != &t) __builtin_trap();
      try {
        const loom::Tensor v = t.view(f->path());
        if (v.nbytes() != t.nbytes()) __builtin_trap();
        (void)t.weight_view(f->path());
      } catch (const loom::Error&) {
      }
    }
    for (const auto& [k, v] : f->metadata()) sink = static_cast<uint8_t>(sink + k.size() + v.size());
    (void)sink;
  } catch (const loom::Error&) {
  }
  return 0;
}
