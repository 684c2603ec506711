// llama.cpp's GGUF LoRA adapters (convert_lora_to_gguf.py, `llama-cli --lora`, `loom export-lora`), read
// as PEFT adapter tensors, so that every path that takes a PEFT folder (generate, chat, merge, serve's
// --adapter and load endpoint) takes the GGUF file a llama.cpp user has too.
#pragma once

#include <string>

#include "model/config.h"
#include "model/peft_adapter.h"

namespace loom::peft {

// Reads a GGUF LoRA adapter (general.type "adapter", adapter.type "lora") made for `base`: each
// "blk.N.<projection>.weight.lora_a" [r, in] and ".lora_b" [out, r] of the seven projections, in any
// stored type (dequantized to f32), q/k rows of B back in Hugging Face order where the base's GGUF rows
// are RoPE-interleaved; adapter.lora.alpha as lora_alpha (0, llama.cpp's "no scaling": alpha = r); the
// layers present as layers_to_transform when they are not all of the base's. Throws invalid_input /
// unsupported naming the file and the tensor or key.
AdapterTensors read_gguf_lora(const std::string& path, const ModelConfig& base);

// A PEFT folder (read_adapter) or a GGUF LoRA file (read_gguf_lora), whichever `path` is.
AdapterTensors read_any_adapter(const std::string& path, const ModelConfig& base, bool map_f32 = false);

}  // namespace loom::peft
