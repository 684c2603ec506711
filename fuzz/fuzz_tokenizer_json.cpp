// libFuzzer entry for the tokenizer.json loader: parse arbitrary bytes as JSON,
// build a tokenizer from it, and run encode / decode / streaming over a few
// texts. Malformed input must end in loom::Error, never a crash or a hang.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const nlohmann::json j = nlohmann::json::parse(input, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  try {
    const loom::Tokenizer tok =
        loom::Tokenizer::from_spec(loom::Tokenizer::spec_from_tokenizer_json(j, std::nullopt, "fuzz.json"));
    const std::string texts[] = {"", " ", "Hello, world! 123  \n\n\t x",
                                 "\xE4\xB8\xAD\xF0\x9F\x98\x80 <s></s>", std::string(input.substr(0, 256))};
    for (const std::string& t : texts) {
      for (bool parse_special : {true, false}) {
        const std::vector<int32_t> ids = tok.encode(t, true, parse_special);
        (void)tok.decode(ids, false);
        loom::StreamDecoder sd(tok);
        for (int32_t id : ids) (void)sd.push(id);
        (void)sd.finish();
        for (int32_t id : ids) (void)tok.token_to_piece(id);
      }
    }
    if (!tok.chat_template().empty()) {
      try {
        const loom::ChatTemplate ct = loom::ChatTemplate::from_text(tok.chat_template(), "<s>", "</s>");
        const std::vector<loom::ChatMessage> msgs = {{"user", "hi"}};
        (void)loom::apply_chat_template(ct, msgs, true);
      } catch (const loom::Error&) {
      }
    }
  } catch (const loom::Error&) {
    // Rejected input is the expected outcome for most mutations.
  }
  return 0;
}
