// A tokenizer as GGUF tokenizer.* metadata, the way llama.cpp's
// convert_hf_to_gguf.py writes it, so that llama.cpp (and loom) read back the
// same token ids: byte-level BPE as model "gpt2" (tokens, merges, the
// tokenizer.ggml.pre name), SentencePiece-style BPE (Llama 2, Mistral,
// TinyLlama) as model "llama" (tokens, scores, token types, add_space_prefix);
// and the mapping between llama.cpp's tokenizer.ggml.pre names and
// pre-tokenizer steps both ways.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "io/gguf_writer.h"
#include "tokenizer/spec.h"

namespace loom {

class Tokenizer;

// Sets spec.pre_tokenizers (and ignore_merges) to what llama.cpp's
// tokenizer.ggml.pre name `pre` stands for. Throws unsupported naming `file`
// for a name loom does not know.
void set_byte_level_pre(TokenizerSpec& spec, const std::string& pre, const std::string& file);

// The tokenizer.ggml.pre name whose steps equal spec's pre-tokenizer
// ("smollm", "llama-bpe", "qwen2", "dbrx", "default"), nullopt if none does.
std::optional<std::string> gguf_pre_name(const TokenizerSpec& spec);

// Writes tokenizer.ggml.{model, pre, tokens, token_type, bos/eos/unknown/
// padding ids, add_bos_token, add_eos_token} and tokenizer.chat_template
// (`chat_template` when not empty, else the tokenizer's own). The token list is
// `n_vocab` long (the embedding rows): ids the tokenizer lacks become
// "[PAD<id>]" of type unused, as the converter writes them.
// Byte-level BPE adds tokenizer.ggml.merges. SentencePiece-style BPE adds
// tokenizer.ggml.scores and add_space_prefix, and types unknown/byte: llama.cpp
// merges the pair whose result scores highest, so the piece made by merge rank
// k scores -k and every other token scores below all merges (scores read from
// a GGUF source are written back unchanged); see spm_scores in the .cpp.
// Throws unsupported naming `source` for a pre-tokenizer llama.cpp has no name
// for, a SentencePiece pipeline llama.cpp cannot reproduce (a splitting
// Metaspace, other normalizers, no byte fallback, ignore_merges), or another
// kind of tokenizer.
void set_gguf_tokenizer(gguf::Writer& w, const Tokenizer& tok, int64_t n_vocab, const std::string& chat_template,
                        const std::string& source);

}  // namespace loom
