// Tokenizer -> grammar mask inputs (grammar_vocab.h).
#include "serve/grammar_vocab.h"

namespace loom {

std::unique_ptr<TokenTrie> make_token_trie(const Tokenizer& tok) {
  const int32_t n = tok.vocab_size();
  std::vector<std::string> pieces(static_cast<size_t>(n));
  std::vector<bool> special(static_cast<size_t>(n));
  for (int32_t id = 0; id < n; ++id) {
    special[static_cast<size_t>(id)] = tok.is_special(id);
    if (!special[static_cast<size_t>(id)]) pieces[static_cast<size_t>(id)] = tok.token_to_piece(id);
  }
  return std::make_unique<TokenTrie>(pieces, special);
}

std::vector<int32_t> grammar_end_ids(const Tokenizer& tok, std::span<const int32_t> extra_eos,
                                     const GenerationRequest& request) {
  std::vector<int32_t> ids(request.stop_token_ids.begin(), request.stop_token_ids.end());
  if (!request.ignore_eos) {
    ids.insert(ids.end(), extra_eos.begin(), extra_eos.end());
    for (int32_t id = 0; id < tok.vocab_size(); ++id)
      if (tok.is_eog(id)) ids.push_back(id);
  }
  return ids;
}

}  // namespace loom
