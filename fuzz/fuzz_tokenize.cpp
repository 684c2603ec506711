// libFuzzer entry for text through loom's tokenizers and the training data
// reader: arbitrary bytes (invalid UTF-8, odd Unicode, special-token spellings)
// encoded by four small tokenizers in the styles users have (Llama 3 and GPT-2
// byte-level BPE, Qwen2 with NFC, SentencePiece with byte fallback), from the
// committed fixtures, then decoded whole and streamed; and the same bytes read
// as a JSONL training file. Checked, beyond "no crash, no hang":
//  - invalid UTF-8 encodes as its lossy conversion does (each maximal invalid
//    subpart one U+FFFD), as Hugging Face's tokenizers see Python's text;
//  - byte-level BPE without a normalizer gives the text back exactly;
//  - the stream decoder's pieces add up to the whole decode (tokenizer.h);
//  - a bad data file is a loom::Error naming the file, never anything else.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"
#include "train/data.h"

#ifndef LOOM_FIXTURES_DIR
#error "LOOM_FIXTURES_DIR: the tests/fixtures folder (fuzz/CMakeLists.txt sets it)"
#endif

namespace {

struct Case {
  const char* file;
  bool exact_round_trip;  // byte-level BPE without a normalizer
};
constexpr Case kCases[] = {{"tokenizer/llama3_style.json", true},
                           {"tokenizer/unicode/gpt2_style.json", true},
                           {"tokenizer/qwen2_style.json", false},
                           {"tokenizer/spm_style.json", false}};

struct Loaded {
  std::vector<loom::Tokenizer> toks;
  Loaded() {
    for (const Case& c : kCases)
      toks.push_back(loom::Tokenizer::from_tokenizer_json(std::string(LOOM_FIXTURES_DIR) + "/" + c.file));
  }
};

const Loaded& loaded() {
  static const Loaded l;  // loaded once: the fixtures are not what is fuzzed
  return l;
}

[[noreturn]] void found(const char* what, const char* file, std::string_view text) {
  std::fprintf(stderr, "fuzz_tokenize: %s (%s) for %zu bytes of text\n", what, file, text.size());
  std::abort();
}

void check_tokenizer(const loom::Tokenizer& tok, const Case& c, std::string_view text) {
  const std::string clean = loom::tok::utf8_sanitize(text);
  for (bool parse_special : {false, true}) {
    const std::vector<int32_t> ids = tok.encode(text, false, parse_special);
    if (!loom::tok::utf8_valid(text) && ids != tok.encode(clean, false, parse_special))
      found("invalid UTF-8 encoded differently from its lossy conversion", c.file, text);
    const std::string whole = tok.decode(ids, false);
    if (c.exact_round_trip && !parse_special && whole != clean)
      found("decode(encode(text)) != text", c.file, text);
    for (bool skip : {false, true}) {
      loom::StreamDecoder sd(tok, skip);
      std::string streamed;
      for (int32_t id : ids) streamed += sd.push(id);
      streamed += sd.finish();
      if (streamed != tok.decode(ids, skip))
        found("streamed pieces differ from the whole decode", c.file, text);
    }
    (void)tok.encode(text, true, parse_special);
  }
}

void check_data_reader(const loom::Tokenizer& tok, std::string_view text) {
  const loom::ChatTemplate tmpl = loom::ChatTemplate::from_kind(loom::ChatTemplateKind::chatml);
  for (bool skip_bad : {false, true}) {
    loom::DataOptions opt;
    opt.seq_len = 64;
    opt.skip_bad_lines = skip_bad;
    loom::DataStats stats;
    try {
      (void)loom::read_jsonl_text(text, "fuzz.jsonl", tok, &tmpl, opt, stats);
    } catch (const loom::Error& e) {
      if (std::string_view(e.what()).find("fuzz.jsonl") == std::string_view::npos)
        found("data error without the file's name", "read_jsonl_text", text);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;  // long inputs add time, not paths
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const Loaded& l = loaded();
  for (size_t i = 0; i < l.toks.size(); ++i) check_tokenizer(l.toks[i], kCases[i], text);
  check_data_reader(l.toks[0], text);
  return 0;
}
