#include "model/config.h"

namespace loom {

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::llama: return "llama";
    case Arch::qwen2: return "qwen2";
  }
  return "?";
}

}  // namespace loom
