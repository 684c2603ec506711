// A tokenizer described as data, mirroring Hugging Face `tokenizers`' pipeline:
// added tokens -> normalizer -> pre-tokenizer -> BPE model -> decoder. Both
// loaders (tokenizer.json, GGUF metadata) produce a TokenizerSpec, and
// Tokenizer::from_spec validates it and builds the lookup tables.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace loom {

// How a Split pre-tokenizer treats the matched delimiters.
enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };
// When Metaspace prepends the replacement character.
enum class PrependScheme { always, first, never };

struct NormalizerStep {
  enum class Kind { prepend, replace, nfc };
  Kind kind = Kind::prepend;
  std::string pattern;  // replace: what to find; prepend: the text to put in front
  bool pattern_is_regex = false;
  std::string content;  // replace: the replacement
};

struct PreTokenizerStep {
  enum class Kind { split, byte_level, digits, metaspace };
  Kind kind = Kind::split;
  // split
  std::string pattern;
  bool pattern_is_regex = true;
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
  // byte_level
  bool add_prefix_space = false;
  bool use_regex = true;  // split with the GPT-2 pattern first
  // digits
  bool individual_digits = false;
  // metaspace
  std::string replacement = "\xE2\x96\x81";  // U+2581
  PrependScheme prepend_scheme = PrependScheme::always;
  bool split = true;
};

struct DecoderStep {
  enum class Kind { byte_level, replace, byte_fallback, fuse, strip, metaspace };
  Kind kind = Kind::byte_level;
  std::string pattern, content;  // replace; strip: content is the character stripped
  bool pattern_is_regex = false;
  int start = 0, stop = 0;                   // strip: at most this many characters at each end of every token
  std::string replacement = "\xE2\x96\x81";  // metaspace
  PrependScheme prepend_scheme = PrependScheme::always;
};

// A token matched in the raw text before the model runs (Hugging Face AddedToken).
struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;      // skipped by decode(skip_special) and by encode(parse_special=false)
  bool single_word = false;  // only when not inside a word
  bool lstrip = false;       // swallows the white space before it
  bool rstrip = false;       // swallows the white space after it
  bool normalized = false;   // matched in the normalized text (after the normalizer)
};

enum class TokenizerKind { byte_level_bpe, spm_bpe, bpe };

struct TokenizerSpec {
  std::string name;  // file the tokenizer came from, for messages
  TokenizerKind kind = TokenizerKind::bpe;

  // Model: BPE over `vocab` (id -> token text; empty string = unused id).
  std::vector<std::string> vocab;
  std::vector<std::pair<std::string, std::string>> merges;  // by rank, best first
  bool byte_fallback = false;                               // unknown characters become <0xXX> byte tokens
  bool fuse_unk = false;
  bool ignore_merges = false;  // a word already in the vocabulary is one token
  std::optional<std::string> unk_token;
  // SentencePiece piece scores (id -> score) when the tokenizer came from a
  // GGUF "llama" vocabulary; kept so that writing it to GGUF again gives back
  // the very scores it had. Empty otherwise (the merges are the model).
  std::vector<float> scores;

  std::vector<AddedToken> added_tokens;
  std::vector<NormalizerStep> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizers;
  std::vector<DecoderStep> decoders;
  bool has_decoder = true;  // without one, decode joins token texts with spaces (as HF does)

  int32_t bos_id = -1, eos_id = -1, unk_id = -1, pad_id = -1;
  std::vector<int32_t> eog_ids;  // besides eos: end-of-turn tokens (<|im_end|>, <|eot_id|>, ...)
  bool add_bos = false, add_eos = false;
  std::string chat_template;  // the model's Jinja template text, if it has one
};

}  // namespace loom
