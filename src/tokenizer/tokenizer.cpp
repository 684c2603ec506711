// Tokenizer construction, encoding and decoding (see tokenizer.h); the
// loaders live in load_json.cpp and load_gguf.cpp.
#include "tokenizer/tokenizer.h"

#include <algorithm>

#include "core/error.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace loom {
namespace {

constexpr int32_t kMaxVocab = 1 << 24;

// HF ByteFallback reads "<0xXX>" with Rust's u8::from_str_radix on the two
// characters after "<0x" (which also accepts a leading '+').
bool parse_byte_token(std::string_view t, unsigned char& byte) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return false;
  const auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (t[3] == '+') {
    const int lo = hex(t[4]);
    if (lo < 0) return false;
    byte = static_cast<unsigned char>(lo);
    return true;
  }
  const int hi = hex(t[3]), lo = hex(t[4]);
  if (hi < 0 || lo < 0) return false;
  byte = static_cast<unsigned char>(hi * 16 + lo);
  return true;
}

std::string replace_matches(std::string_view text, const tok::Regex& re, std::string_view with) {
  std::string out;
  size_t prev = 0;
  for (const auto& [b, e] : re.find_all(text)) {
    out.append(text.substr(prev, b - prev));
    out.append(with);
    prev = e;
  }
  out.append(text.substr(prev));
  return out;
}

void check_id(int32_t id, int32_t n, const std::string& name, const char* what) {
  if (id < -1 || id >= n) fail(ErrorKind::invalid_input, "{}: {} id {} is outside the vocabulary of {}", name, what, id, n);
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
      fail(ErrorKind::invalid_input, "{}: added_tokens[{}] ({:?}): id {} is out of range", name, i, t.content, t.id);
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
  for (size_t i = 0; i < static_cast<size_t>(n); ++i) impl->text_of[i] = i < s.vocab.size() ? &s.vocab[i] : &kEmpty;
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
    if (t.normalized) impl->normalized_matcher.add(impl->normalizer.apply(t.content), &t);
    else impl->raw_matcher.add(t.content, &t);
  }
  for (size_t i = 0; i < s.decoders.size(); ++i) {
    const DecoderStep& d = s.decoders[i];
    if (d.kind == DecoderStep::Kind::replace)
      impl->decoder_regex.emplace_back(std::in_place, d.pattern, !d.pattern_is_regex, fmt::format("{}: decoder step {} (Replace)", name, i));
    else
      impl->decoder_regex.emplace_back();
    if (d.kind == DecoderStep::Kind::byte_level) impl->byte_level_pieces = true;
    if (d.kind == DecoderStep::Kind::strip && (d.start < 0 || d.stop < 0 || tok::utf8_length(d.content) != 1))
      fail(ErrorKind::invalid_input, "{}: decoder step {} (Strip): needs one character and non-negative counts", name, i);
    if (d.kind == DecoderStep::Kind::metaspace && tok::utf8_length(d.replacement) != 1)
      fail(ErrorKind::invalid_input, "{}: decoder step {} (Metaspace): replacement must be one character", name, i);
  }

  check_id(s.bos_id, n, name, "BOS");
  check_id(s.eos_id, n, name, "EOS");
  check_id(s.unk_id, n, name, "unknown-token");
  check_id(s.pad_id, n, name, "padding");
  if (s.add_bos && s.bos_id < 0) fail(ErrorKind::invalid_input, "{}: BOS is to be added but there is no BOS token", name);
  if (s.add_eos && s.eos_id < 0) fail(ErrorKind::invalid_input, "{}: EOS is to be added but there is no EOS token", name);
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
      for (const tok::Piece& p : pieces) m.bpe.encode_word(p.text, ids);
    }
  }
  if (add_special && m.spec.add_eos) ids.push_back(m.spec.eos_id);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& m = *impl_;
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= m.n_vocab)
      fail(ErrorKind::invalid_input, "{}: token id {} is outside the vocabulary of {}", m.spec.name, id, m.n_vocab);
    const AddedToken* added = m.added_of[static_cast<size_t>(id)];
    if (skip_special && added && added->special) continue;
    const std::string& t = *m.text_of[static_cast<size_t>(id)];
    if (t.empty()) continue;  // an unused id has no text (HF: id_to_token is None)
    toks.push_back(t);
  }
  if (!m.spec.has_decoder) {
    std::string out;
    for (size_t i = 0; i < toks.size(); ++i) out.append(i ? " " : "").append(toks[i]);
    return out;
  }
  for (size_t si = 0; si < m.spec.decoders.size(); ++si) {
    const DecoderStep& d = m.spec.decoders[si];
    switch (d.kind) {
      case DecoderStep::Kind::byte_level: {
        std::string bytes;
        for (const std::string& t : toks)
          if (!tok::chars_to_bytes(t, bytes)) bytes += t;
        toks.assign(1, tok::utf8_sanitize(bytes));
        break;
      }
      case DecoderStep::Kind::replace:
        for (std::string& t : toks) t = replace_matches(t, *m.decoder_regex[si], d.content);
        break;
      case DecoderStep::Kind::byte_fallback: {
        std::vector<std::string> out;
        std::string pending;
        const auto flush = [&] {
          if (pending.empty()) return;
          if (tok::utf8_valid(pending)) out.push_back(pending);
          else out.insert(out.end(), pending.size(), "\xEF\xBF\xBD");
          pending.clear();
        };
        for (std::string& t : toks) {
          unsigned char b;
          if (parse_byte_token(t, b)) {
            pending += static_cast<char>(b);
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        toks.swap(out);
        break;
      }
      case DecoderStep::Kind::fuse: {
        std::string all;
        for (const std::string& t : toks) all += t;
        toks.assign(1, std::move(all));
        break;
      }
      case DecoderStep::Kind::strip:
        for (std::string& t : toks) {
          // At most `start` / `stop` copies of the character at each end.
          std::vector<std::string_view> chars;
          for (size_t i = 0; i < t.size();) {
            size_t k = i + 1;
            while (k < t.size() && (static_cast<uint8_t>(t[k]) & 0xC0) == 0x80) ++k;
            chars.push_back(std::string_view(t).substr(i, k - i));
            i = k;
          }
          size_t start_cut = 0, stop_cut = 0;
          while (start_cut < chars.size() && start_cut < static_cast<size_t>(d.start) && chars[start_cut] == d.content)
            ++start_cut;
          while (stop_cut < chars.size() && stop_cut < static_cast<size_t>(d.stop) &&
                 chars[chars.size() - 1 - stop_cut] == d.content)
            ++stop_cut;
          std::string kept;
          for (size_t i = start_cut; i + stop_cut < chars.size(); ++i) kept.append(chars[i]);
          t = std::move(kept);
        }
        break;
      case DecoderStep::Kind::metaspace:
        for (size_t i = 0; i < toks.size(); ++i) {
          const bool drop = i == 0 && d.prepend_scheme != PrependScheme::never;
          std::string out;
          std::string_view t = toks[i];
          for (size_t at = 0; at < t.size();) {
            if (t.compare(at, d.replacement.size(), d.replacement) == 0) {
              if (!drop) out += ' ';
              at += d.replacement.size();
            } else {
              out += t[at++];
            }
          }
          toks[i] = std::move(out);
        }
        break;
    }
  }
  std::string out;
  for (const std::string& t : toks) out += t;
  return out;
}

std::string Tokenizer::token_to_piece(int32_t id) const {
  const Impl& m = *impl_;
  if (id < 0 || id >= m.n_vocab)
    fail(ErrorKind::invalid_input, "{}: token id {} is outside the vocabulary of {}", m.spec.name, id, m.n_vocab);
  if (const AddedToken* added = m.added_of[static_cast<size_t>(id)]) return added->content;
  std::string t = *m.text_of[static_cast<size_t>(id)];
  // The decoder chain applied to this token alone, without the steps that depend
  // on its position (Strip, the first-token rule of Metaspace).
  for (size_t si = 0; si < m.spec.decoders.size(); ++si) {
    const DecoderStep& d = m.spec.decoders[si];
    switch (d.kind) {
      case DecoderStep::Kind::byte_level: {
        std::string bytes;
        if (tok::chars_to_bytes(t, bytes)) t = std::move(bytes);
        break;
      }
      case DecoderStep::Kind::replace: t = replace_matches(t, *m.decoder_regex[si], d.content); break;
      case DecoderStep::Kind::byte_fallback: {
        unsigned char b;
        if (parse_byte_token(t, b)) t.assign(1, static_cast<char>(b));
        break;
      }
      case DecoderStep::Kind::metaspace: {
        std::string out;
        for (size_t at = 0; at < t.size();) {
          if (t.compare(at, d.replacement.size(), d.replacement) == 0) {
            out += ' ';
            at += d.replacement.size();
          } else {
            out += t[at++];
          }
        }
        t = std::move(out);
        break;
      }
      case DecoderStep::Kind::fuse:
      case DecoderStep::Kind::strip: break;
    }
  }
  return t;
}

const std::string& Tokenizer::token_text(int32_t id) const {
  const Impl& m = *impl_;
  if (id < 0 || id >= m.n_vocab)
    fail(ErrorKind::invalid_input, "{}: token id {} is outside the vocabulary of {}", m.spec.name, id, m.n_vocab);
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
    case TokenizerKind::byte_level_bpe: return "byte-level BPE";
    case TokenizerKind::spm_bpe: return "SentencePiece-style BPE";
    case TokenizerKind::bpe: return "BPE";
  }
  return "?";
}

// ---- streaming -------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special) : tok_(tok), skip_special_(skip_special) {
  for (char c : std::string_view("aeiostnrxzAEIOST0123456789")) {
    const std::string text(1, c);
    const int32_t id = tok.token_id(text);
    if (id < 0 || tok.impl_->added_of[static_cast<size_t>(id)]) continue;
    const std::vector<int32_t> two = {id, id};
    if (tok.decode(two, false) == text + text && tok.decode(std::span(two).first(1), false) == text) {
      anchor_ = id;
      anchor_text_ = text;
      break;
    }
  }
}

std::string StreamDecoder::emit(bool force) {
  constexpr size_t kMaxPending = 16;  // give up waiting for a UTF-8 character to complete
  if (pending_.empty()) return {};
  const bool anchored = started_ && anchor_ >= 0;
  std::vector<int32_t> window;
  if (anchored) window.push_back(anchor_);
  window.insert(window.end(), pending_.begin(), pending_.end());
  const std::string text = tok_.decode(window, skip_special_);
  const bool unfinished = text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0;
  if (unfinished && !force && pending_.size() < kMaxPending) return {};
  std::string out = anchored && text.compare(0, anchor_text_.size(), anchor_text_) == 0
                        ? text.substr(anchor_text_.size())
                        : text;
  for (int32_t id : pending_)
    started_ = started_ || (!(skip_special_ && tok_.is_special(id)) && !tok_.token_text(id).empty());
  pending_.clear();
  return out;
}

std::string StreamDecoder::push(int32_t id) {
  tok_.token_text(id);  // range check before the id is queued
  pending_.push_back(id);
  return emit(false);
}

std::string StreamDecoder::finish() { return emit(true); }

}  // namespace loom
