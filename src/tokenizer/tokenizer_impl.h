// Internal state of a Tokenizer (shared by tokenizer.cpp and the loaders).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pipeline.h"
#include "tokenizer/tokenizer.h"

namespace loom {

struct Tokenizer::Impl {
  TokenizerSpec spec;
  int32_t n_vocab = 0;
  std::vector<const std::string*> text_of;  // id -> token text (added tokens override the model)
  std::vector<const AddedToken*> added_of;  // id -> added token, nullptr if none
  // Per spec.added_tokens entry: the text decode() gives the decoder chain. HF reads
  // a normalized added token as its normalized form ("▁<|im_end|>" after a
  // Prepend("▁") normalizer), so decoding keeps the space that form stands for.
  std::vector<std::string> added_decode_text;
  std::vector<uint8_t> eog;     // id -> end of generation
  tok::TokenIndex added_index;  // added token content -> id
  tok::BpeModel bpe;
  tok::AddedTokenMatcher raw_matcher;         // tokens matched before normalization
  tok::AddedTokenMatcher normalized_matcher;  // tokens matched in normalized text
  tok::Normalizer normalizer;
  tok::PreTokenizer pre_tokenizer;
  std::vector<std::optional<tok::Regex>> decoder_regex;  // per decoder step (Replace)
  bool byte_level_pieces = false;                        // token_to_piece maps byte-level spelling back
};

}  // namespace loom
