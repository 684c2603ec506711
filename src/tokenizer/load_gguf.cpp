// Builds a TokenizerSpec from GGUF tokenizer.* metadata: "gpt2" (byte-level
// BPE, pre-tokenizer chosen by tokenizer.ggml.pre) and "llama" (SentencePiece
// BPE with byte fallback, merges derived from the scores the way transformers
// derives them, since llama.cpp stores none; ▁ put before each piece of text
// as llama.cpp puts it).
#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "core/error.h"
#include "io/gguf.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/loader_util.h"
#include "tokenizer/pipeline.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_gguf.h"
#include "tokenizer/unicode.h"

namespace loom {
namespace {

enum TokenType : int32_t {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6
};

const std::string kMetaspace = "\xE2\x96\x81";  // U+2581

}  // namespace

// tokenizer.ggml.pre -> the pre-tokenizer of the model's tokenizer.json.
void set_byte_level_pre(TokenizerSpec& spec, const std::string& pre, const std::string& file) {
  PreTokenizerStep byte_level;
  byte_level.kind = PreTokenizerStep::Kind::byte_level;
  byte_level.add_prefix_space = false;
  const auto split_then_bytes = [&](std::string_view pattern) {
    PreTokenizerStep split;
    split.kind = PreTokenizerStep::Kind::split;
    split.pattern = pattern;
    split.behavior = SplitBehavior::isolated;
    byte_level.use_regex = false;
    spec.pre_tokenizers = {split, byte_level};
  };
  const auto is = [&](std::initializer_list<std::string_view> names) {
    return std::find(names.begin(), names.end(), pre) != names.end();
  };
  if (is({"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"})) {
    spec.pre_tokenizers = {byte_level};
  } else if (is({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"})) {
    split_then_bytes(tok::kLlama3Pattern);
    spec.ignore_merges = true;  // as Llama 3's tokenizer.json (and llama.cpp) do
  } else if (is({"dbrx", "smaug-bpe"})) {
    split_then_bytes(tok::kLlama3Pattern);
  } else if (is({"qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"})) {
    split_then_bytes(tok::kQwen2Pattern);
  } else if (is({"smollm", "starcoder", "refact", "codeshell", "command-r"})) {
    // These tokenizer.json files split every digit off before the GPT-2 regex.
    PreTokenizerStep digits;
    digits.kind = PreTokenizerStep::Kind::digits;
    digits.individual_digits = true;
    spec.pre_tokenizers = {digits, byte_level};
  } else {
    fail(ErrorKind::unsupported,
         "{}: tokenizer.ggml.pre '{}' is not supported (loom knows gpt2, llama3/llama-bpe, qwen2, smollm and "
         "their aliases)",
         file, pre);
  }
}

namespace {

// transformers' generate_merges: every split of every token into two tokens,
// best score first, then longer left part, then longer right part; ties keep
// token order, and the splits of one token are ordered by the two parts' ids.
std::vector<std::pair<std::string, std::string>> merges_from_scores(const std::vector<std::string>& tokens,
                                                                    const std::vector<float>& scores) {
  std::unordered_map<std::string_view, int32_t> id_of;  // last duplicate wins
  for (size_t i = 0; i < tokens.size(); ++i) id_of[tokens[i]] = static_cast<int32_t>(i);
  std::unordered_map<std::string_view, float>
      score_of;  // dict(zip(tokens, scores)): last score, first position
  std::vector<size_t> order;
  for (size_t i = 0; i < tokens.size(); ++i) {
    auto [it, fresh] = score_of.emplace(tokens[i], scores[i]);
    if (fresh)
      order.push_back(i);
    else
      it->second = scores[i];
  }
  struct Cand {
    int32_t l, r;
    float score;
    size_t len_l, len_r;
  };
  std::vector<Cand> all;
  std::vector<Cand> local;
  for (size_t i : order) {
    const std::string_view t = tokens[i];
    const float score = score_of[t];
    local.clear();
    size_t len_l = 0;
    const size_t total = tok::utf8_length(t);
    for (size_t cut = 0; cut < t.size();) {
      size_t next = cut + 1;
      while (next < t.size() && (static_cast<uint8_t>(t[next]) & 0xC0) == 0x80) ++next;
      if (cut > 0) {
        auto l = id_of.find(t.substr(0, cut)), r = id_of.find(t.substr(cut));
        if (l != id_of.end() && r != id_of.end())
          local.push_back({l->second, r->second, score, len_l, total - len_l});
      }
      ++len_l;
      cut = next;
    }
    std::stable_sort(local.begin(), local.end(),
                     [](const Cand& a, const Cand& b) { return a.l != b.l ? a.l < b.l : a.r < b.r; });
    all.insert(all.end(), local.begin(), local.end());
  }
  std::stable_sort(all.begin(), all.end(), [](const Cand& a, const Cand& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.len_l != b.len_l) return a.len_l > b.len_l;
    return a.len_r > b.len_r;
  });
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(all.size());
  for (const Cand& c : all)
    merges.emplace_back(tokens[static_cast<size_t>(c.l)], tokens[static_cast<size_t>(c.r)]);
  return merges;
}

int32_t opt_id(const gguf::File& f, const char* key, size_t n) {
  const auto v = f.opt_uint(key);
  if (!v) return -1;
  if (*v >= n)
    fail(ErrorKind::invalid_input, "{}: key '{}': id {} is outside the vocabulary of {}", f.path(), key, *v,
         n);
  return static_cast<int32_t>(*v);
}

}  // namespace

TokenizerSpec Tokenizer::spec_from_gguf(const gguf::File& f) {
  TokenizerSpec spec;
  spec.name = f.path();
  const std::string model = f.get_string("tokenizer.ggml.model");
  if (model != "gpt2" && model != "llama")
    fail(ErrorKind::unsupported, "{}: tokenizer.ggml.model '{}' is not supported (loom reads gpt2 and llama)",
         f.path(), model);
  const bool byte_level = model == "gpt2";
  std::vector<std::string> tokens = f.get_string_array("tokenizer.ggml.tokens");
  const size_t n = tokens.size();
  if (n == 0) fail(ErrorKind::invalid_input, "{}: key 'tokenizer.ggml.tokens': empty vocabulary", f.path());
  for (size_t i = 0; i < n; ++i)
    if (!tok::utf8_valid(tokens[i]))
      fail(ErrorKind::invalid_input, "{}: key 'tokenizer.ggml.tokens': token {} is not valid UTF-8", f.path(),
           i);
  std::vector<int32_t> types(n, kNormal);
  if (f.find("tokenizer.ggml.token_type")) {
    types = f.get_i32_array("tokenizer.ggml.token_type");
    if (types.size() != n)
      fail(ErrorKind::invalid_input, "{}: key 'tokenizer.ggml.token_type': {} entries for {} tokens",
           f.path(), types.size(), n);
  }
  spec.bos_id = opt_id(f, "tokenizer.ggml.bos_token_id", n);
  spec.eos_id = opt_id(f, "tokenizer.ggml.eos_token_id", n);
  spec.unk_id = opt_id(f, "tokenizer.ggml.unknown_token_id", n);
  spec.pad_id = opt_id(f, "tokenizer.ggml.padding_token_id", n);
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"})
    if (const int32_t id = opt_id(f, key, n); id >= 0) spec.eog_ids.push_back(id);
  spec.add_bos = f.opt_bool("tokenizer.ggml.add_bos_token").value_or(!byte_level);
  spec.add_eos = f.opt_bool("tokenizer.ggml.add_eos_token").value_or(false);
  spec.chat_template = f.opt_string("tokenizer.chat_template").value_or("");

  // Control tokens (and the named BOS/EOS/UNK/PAD) are special added tokens;
  // user-defined ones are matched whole but are not special.
  const auto named = [&](size_t i) {
    const int32_t id = static_cast<int32_t>(i);
    return id == spec.bos_id || id == spec.eos_id || id == spec.unk_id || id == spec.pad_id;
  };
  for (size_t i = 0; i < n; ++i) {
    // A byte-level vocabulary spells every real token in the byte alphabet; a
    // token marked control that is not is a converter mislabel (transformers skips it too).
    const bool spelled = !byte_level || tok::is_byte_level_spelled(tokens[i]);
    const bool special = (types[i] == kControl && spelled) || named(i);
    if (special || (types[i] == kUserDefined && spelled)) {
      AddedToken t;
      t.id = static_cast<int32_t>(i);
      t.content = tokens[i];
      t.special = special;
      t.normalized = false;
      spec.added_tokens.push_back(std::move(t));
    }
  }

  if (byte_level) {
    // Tokens outside the byte alphabet (some converters store raw text) are respelled.
    for (std::string& t : tokens)
      if (!tok::is_byte_level_spelled(t)) {
        std::string spelled;
        tok::bytes_to_chars(t, spelled);
        t = std::move(spelled);
      }
    const std::vector<std::string> merges = f.get_string_array("tokenizer.ggml.merges");
    spec.merges.reserve(merges.size());
    for (size_t i = 0; i < merges.size(); ++i) {
      const std::string& m = merges[i];
      const size_t sp = m.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 >= m.size() ||
          m.find(' ', sp + 1) != std::string::npos)
        fail(ErrorKind::invalid_input,
             "{}: key 'tokenizer.ggml.merges': entry {} ({:?}) is not two tokens separated by "
             "one space",
             f.path(), i, m);
      spec.merges.emplace_back(m.substr(0, sp), m.substr(sp + 1));
    }
    set_byte_level_pre(spec, f.opt_string("tokenizer.ggml.pre").value_or("default"), f.path());
    DecoderStep d;
    d.kind = DecoderStep::Kind::byte_level;
    spec.decoders = {d};
    spec.kind = TokenizerKind::byte_level_bpe;
  } else {
    if (f.find("tokenizer.ggml.merges")) {
      const std::vector<std::string> merges = f.get_string_array("tokenizer.ggml.merges");
      for (size_t i = 0; i < merges.size(); ++i) {
        const size_t sp = merges[i].find(' ');
        if (sp == std::string::npos)
          fail(ErrorKind::invalid_input, "{}: key 'tokenizer.ggml.merges': entry {} has no space", f.path(),
               i);
        spec.merges.emplace_back(merges[i].substr(0, sp), merges[i].substr(sp + 1));
      }
    } else {
      const std::vector<float> scores = f.get_f32_array("tokenizer.ggml.scores");
      if (scores.size() != n)
        fail(ErrorKind::invalid_input, "{}: key 'tokenizer.ggml.scores': {} entries for {} tokens", f.path(),
             scores.size(), n);
      for (size_t i = 0; i < n; ++i)
        if (!std::isfinite(scores[i]))
          fail(ErrorKind::invalid_input, "{}: key 'tokenizer.ggml.scores': entry {} is not finite", f.path(),
               i);
      spec.merges = merges_from_scores(tokens, scores);
      spec.scores = scores;
    }
    spec.byte_fallback = true;
    spec.fuse_unk = true;
    // llama.cpp (llama_vocab::impl::tokenize, LLAMA_VOCAB_TYPE_SPM) cuts the
    // control, unknown and user-defined tokens out of the text first, then puts
    // a space before every remaining piece of text that starts the text or
    // follows such a token when add_space_prefix is set (the default for
    // "llama"), and turns every space into ▁. That is the Prepend("▁") +
    // Replace(" ", "▁") normalizer of the original Llama 2 tokenizer.json,
    // which runs on each piece of text between added tokens (these are all
    // matched in the raw text). Not transformers' GGUF reading (Metaspace,
    // prepend_scheme "first": ▁ only at the very start, and not before a space).
    const bool prefix = f.opt_bool("tokenizer.ggml.add_space_prefix").value_or(true);
    if (prefix) spec.normalizers.push_back({NormalizerStep::Kind::prepend, kMetaspace, false, {}});
    spec.normalizers.push_back({NormalizerStep::Kind::replace, " ", false, kMetaspace});
    DecoderStep replace, fallback, fuse, strip;
    replace.kind = DecoderStep::Kind::replace;
    replace.pattern = kMetaspace;
    replace.content = " ";
    fallback.kind = DecoderStep::Kind::byte_fallback;
    fuse.kind = DecoderStep::Kind::fuse;
    strip.kind = DecoderStep::Kind::strip;
    strip.content = " ";
    strip.start = 1;
    // llama_detokenize drops one leading space of the first token's piece when
    // add_space_prefix is set: the Strip decoder after Fuse. (After a first
    // special token that is not printed llama.cpp keeps that space; loom, as
    // Hugging Face's decode with skip_special_tokens, drops it.)
    spec.decoders = {replace, fallback, fuse};
    if (prefix) spec.decoders.push_back(strip);
    spec.kind = TokenizerKind::spm_bpe;
  }
  spec.vocab = std::move(tokens);
  tok::add_known_eog_tokens(spec);
  return spec;
}

Tokenizer Tokenizer::from_gguf(const gguf::File& f) { return from_spec(spec_from_gguf(f)); }

}  // namespace loom
