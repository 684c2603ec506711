// Tokenizer construction, encoding and decoding (see tokenizer.h); the
// loaders live in load_json.cpp and load_gguf.cpp.
#include "tokenizer/tokenizer.h"

#include <algorithm>

#include "core/error.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace loom {
namespace {

constexpr int32_t kMaxVocab = 1 << 24;

void check_id(int32_t id, int32_t n, const std::string& name, const char* what) {
  if (id < -1 || id >= n)
    fail(ErrorKind::invalid_input, "{}: {} id {} is outside the vocabulary of {}", name, what, id, n);
}

}  // namespace

Tokenizer Tokenizer::from_spec(TokenizerSpec spec) {
  auto impl = std::make_shared<Impl>();
  if (spec.name.empty()) spec.name = "tokenizer";
  const std::string name = spec.name;
  if (spec.vocab.size() > static_cast<size_t>(kMaxVocab))
    fail(ErrorKind::invalid_input, "{}: vocabulary of {} tokens is too large", name, spec.vocab.size());
  for (size_t i = 0; i < spec.vocab.size(); ++i)
    if (!tok::utf8_valid(spec.vocab[i]))
      fail(ErrorKind::invalid_input, "{}: token {} is not valid UTF-8", name, i);

  // Added tokens: unique ids and contents, ids within a sane distance of the vocabulary.
  int64_t max_id = static_cast<int64_t>(spec.vocab.size()) - 1;
  const int64_t id_cap = static_cast<int64_t>(spec.vocab.size() + spec.added_tokens.size()) + 1024;
  for (size_t i = 0; i < spec.added_tokens.size(); ++i) {
    const AddedToken& t = spec.added_tokens[i];
    if (t.id < 0 || t.id >= id_cap || t.id >= kMaxVocab)
      fail(ErrorKind::invalid_input, "{}: added_tokens[{}] ({:?}): id {} is out of range", name, i, t.content,
           t.id);
    if (t.content.empty()) fail(ErrorKind::invalid_input, "{}: added_tokens[{}]: empty content", name, i);
    if (!tok::utf8_valid(t.content))
      fail(ErrorKind::invalid_input, "{}: added_tokens[{}]: content is not valid UTF-8", name, i);
    max_id = std::max<int64_t>(max_id, t.id);
  }
  impl->n_vocab = static_cast<int32_t>(max_id + 1);
  const int32_t n = impl->n_vocab;
  if (n <= 0) fail(ErrorKind::invalid_input, "{}: the vocabulary is empty", name);
  impl->spec = std::move(spec);
  TokenizerSpec& s = impl->spec;

  impl->text_of.assign(static_cast<size_t>(n), nullptr);
  impl->added_of.assign(static_cast<size_t>(n), nullptr);
  static const std::string kEmpty;
  for (size_t i = 0; i < static_cast<size_t>(n); ++i)
    impl->text_of[i] = i < s.vocab.size() ? &s.vocab[i] : &kEmpty;
  for (size_t i = 0; i < s.added_tokens.size(); ++i) {
    const AddedToken& t = s.added_tokens[i];
    if (impl->added_of[static_cast<size_t>(t.id)])
      fail(ErrorKind::invalid_input, "{}: added_tokens[{}]: id {} is given twice", name, i, t.id);
    if (!impl->added_index.emplace(t.content, t.id).second)
      fail(ErrorKind::invalid_input, "{}: added_tokens[{}]: content {:?} is given twice", name, i, t.content);
    impl->added_of[static_cast<size_t>(t.id)] = &t;
    impl->text_of[static_cast<size_t>(t.id)] = &t.content;
  }

  tok::BpeOptions opts;
  opts.byte_fallback = s.byte_fallback;
  opts.fuse_unk = s.fuse_unk;
  opts.ignore_merges = s.ignore_merges;
  if (s.unk_token) {
    for (size_t i = 0; i < s.vocab.size(); ++i)  // the last duplicate wins, as in the model's index
      if (s.vocab[i] == *s.unk_token) opts.unk_id = static_cast<int32_t>(i);
    if (opts.unk_id < 0)
      fail(ErrorKind::invalid_input, "{}: model.unk_token {:?} is not in the vocabulary", name, *s.unk_token);
    if (s.unk_id < 0) s.unk_id = opts.unk_id;
  }
  impl->bpe = tok::BpeModel(s.vocab, s.merges, opts, name);

  impl->normalizer = tok::Normalizer(s.normalizers, name);
  impl->pre_tokenizer = tok::PreTokenizer(s.pre_tokenizers, name);
  for (const AddedToken& t : s.added_tokens) {
    impl->added_decode_text.push_back(t.normalized ? impl->normalizer.apply(t.content) : t.content);
    if (t.normalized)
      impl->normalized_matcher.add(impl->added_decode_text.back(), &t);
    else
      impl->raw_matcher.add(t.content, &t);
  }
  for (size_t i = 0; i < s.decoders.size(); ++i) {
    const DecoderStep& d = s.decoders[i];
    if (d.kind == DecoderStep::Kind::replace)
      impl->decoder_regex.emplace_back(std::in_place, d.pattern, !d.pattern_is_regex,
                                       fmt::format("{}: decoder step {} (Replace)", name, i));
    else
      impl->decoder_regex.emplace_back();
    if (d.kind == DecoderStep::Kind::byte_level) impl->byte_level_pieces = true;
    if (d.kind == DecoderStep::Kind::strip && (d.start < 0 || d.stop < 0 || tok::utf8_length(d.content) != 1))
      fail(ErrorKind::invalid_input,
           "{}: decoder step {} (Strip): needs one character and non-negative counts", name, i);
    if (d.kind == DecoderStep::Kind::metaspace && tok::utf8_length(d.replacement) != 1)
      fail(ErrorKind::invalid_input, "{}: decoder step {} (Metaspace): replacement must be one character",
           name, i);
  }

  check_id(s.bos_id, n, name, "BOS");
  check_id(s.eos_id, n, name, "EOS");
  check_id(s.unk_id, n, name, "unknown-token");
  check_id(s.pad_id, n, name, "padding");
  if (s.add_bos && s.bos_id < 0)
    fail(ErrorKind::invalid_input, "{}: BOS is to be added but there is no BOS token", name);
  if (s.add_eos && s.eos_id < 0)
    fail(ErrorKind::invalid_input, "{}: EOS is to be added but there is no EOS token", name);
  impl->eog.assign(static_cast<size_t>(n), 0);
  if (s.eos_id >= 0) impl->eog[static_cast<size_t>(s.eos_id)] = 1;
  for (int32_t id : s.eog_ids) {
    check_id(id, n, name, "end-of-generation");
    if (id >= 0) impl->eog[static_cast<size_t>(id)] = 1;
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
  const Impl& m = *impl_;
  std::string sanitized;
  if (!tok::utf8_valid(text)) {
    sanitized = tok::utf8_sanitize(text);
    text = sanitized;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 2);
  if (add_special && m.spec.add_bos) ids.push_back(m.spec.bos_id);

  std::vector<tok::TextSpan> spans, sub;
  std::vector<tok::Piece> pieces;
  tok::BpeScratch scratch;
  m.raw_matcher.split(text, parse_special, spans);
  for (const tok::TextSpan& span : spans) {
    if (span.token) {
      ids.push_back(span.token->id);
      continue;
    }
    const std::string normalized = m.normalizer.apply(text.substr(span.begin, span.end - span.begin));
    sub.clear();
    m.normalized_matcher.split(normalized, parse_special, sub);
    for (const tok::TextSpan& part : sub) {
      if (part.token) {
        ids.push_back(part.token->id);
        continue;
      }
      pieces.clear();
      pieces.push_back(tok::Piece{normalized.substr(part.begin, part.end - part.begin),
                                  span.begin == 0 && part.begin == 0});
      m.pre_tokenizer.apply(pieces);
      for (const tok::Piece& p : pieces) m.bpe.encode_word(p.text, ids, scratch);
    }
  }
  if (add_special && m.spec.add_eos) ids.push_back(m.spec.eos_id);
  return ids;
}

const std::string& Tokenizer::token_text(int32_t id) const {
  const Impl& m = *impl_;
  if (id < 0 || id >= m.n_vocab)
    fail(ErrorKind::invalid_input, "{}: token id {} is outside the vocabulary of {}", m.spec.name, id,
         m.n_vocab);
  return *m.text_of[static_cast<size_t>(id)];
}

int32_t Tokenizer::token_id(std::string_view text) const {
  if (auto it = impl_->added_index.find(text); it != impl_->added_index.end()) return it->second;
  return impl_->bpe.find(text);
}

int32_t Tokenizer::vocab_size() const { return impl_->n_vocab; }
int32_t Tokenizer::bos() const { return impl_->spec.bos_id; }
int32_t Tokenizer::eos() const { return impl_->spec.eos_id; }
bool Tokenizer::add_bos() const { return impl_->spec.add_bos; }
TokenizerKind Tokenizer::kind() const { return impl_->spec.kind; }
const std::string& Tokenizer::chat_template() const { return impl_->spec.chat_template; }
const TokenizerSpec& Tokenizer::spec() const { return impl_->spec; }

bool Tokenizer::is_special(int32_t id) const {
  if (id < 0 || id >= impl_->n_vocab) return false;
  const AddedToken* t = impl_->added_of[static_cast<size_t>(id)];
  return t && t->special;
}

bool Tokenizer::is_eog(int32_t id) const {
  return id >= 0 && id < impl_->n_vocab && impl_->eog[static_cast<size_t>(id)];
}

const char* Tokenizer::kind_name() const {
  switch (impl_->spec.kind) {
    case TokenizerKind::byte_level_bpe:
      return "byte-level BPE";
    case TokenizerKind::spm_bpe:
      return "SentencePiece-style BPE";
    case TokenizerKind::bpe:
      return "BPE";
  }
  return "?";
}

}  // namespace loom
