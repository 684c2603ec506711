// Decoding (see tokenizer.h): Hugging Face's decoder chain step by step,
// the bytes of a single token, and the streaming decoder.
#include <string_view>

#include "core/error.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace loom {
namespace {

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

// `t` without up to `start` leading and `stop` trailing copies of the one-character `c`.
std::string strip_chars(std::string_view t, std::string_view c, int start, int stop) {
  size_t b = 0, e = t.size();
  for (int k = 0; k < start && t.substr(b).starts_with(c); ++k) b += c.size();
  for (int k = 0; k < stop && e >= b + c.size() && t.substr(0, e).ends_with(c); ++k) e -= c.size();
  return std::string(t.substr(b, e - b));
}

// Every `replacement` in `t` turned into a space, or dropped.
std::string replace_metaspace(std::string_view t, std::string_view replacement, bool drop) {
  std::string out;
  for (size_t at = 0; at < t.size();) {
    if (t.substr(at).starts_with(replacement)) {
      if (!drop) out += ' ';
      at += replacement.size();
    } else {
      out += t[at++];
    }
  }
  return out;
}

// One step of HF's decoder chain over the token strings.
void apply_decoder_step(const DecoderStep& d, const tok::Regex* re, std::vector<std::string>& toks) {
  switch (d.kind) {
    case DecoderStep::Kind::byte_level: {
      // Bytes of every token (a token outside the byte alphabet, like an added
      // token, contributes its own UTF-8), then one lossy conversion.
      std::string bytes;
      for (const std::string& t : toks)
        if (!tok::chars_to_bytes(t, bytes)) bytes += t;
      toks.assign(1, tok::utf8_sanitize(bytes));
      break;
    }
    case DecoderStep::Kind::replace:
      for (std::string& t : toks) t = replace_matches(t, *re, d.content);
      break;
    case DecoderStep::Kind::byte_fallback: {
      // A run of <0xXX> tokens becomes its text, or one U+FFFD per byte if invalid.
      std::vector<std::string> out;
      std::string pending;
      const auto flush = [&] {
        if (pending.empty()) return;
        if (tok::utf8_valid(pending))
          out.push_back(pending);
        else
          out.insert(out.end(), pending.size(), "\xEF\xBF\xBD");
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
      for (std::string& t : toks) t = strip_chars(t, d.content, d.start, d.stop);
      break;
    case DecoderStep::Kind::metaspace:
      // The replacement becomes a space, except in the first token, where HF
      // drops every replacement character when a prefix was prepended.
      for (size_t i = 0; i < toks.size(); ++i)
        toks[i] =
            replace_metaspace(toks[i], d.replacement, i == 0 && d.prepend_scheme != PrependScheme::never);
      break;
  }
}

}  // namespace

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& m = *impl_;
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= m.n_vocab)
      fail(ErrorKind::invalid_input, "{}: token id {} is outside the vocabulary of {}", m.spec.name, id,
           m.n_vocab);
    const AddedToken* added = m.added_of[static_cast<size_t>(id)];
    if (skip_special && added && added->special) continue;
    const std::string& t = added
                               ? m.added_decode_text[static_cast<size_t>(added - m.spec.added_tokens.data())]
                               : *m.text_of[static_cast<size_t>(id)];
    if (t.empty()) continue;  // an unused id has no text (HF: id_to_token is None)
    toks.push_back(t);
  }
  if (!m.spec.has_decoder) {
    std::string out;
    for (size_t i = 0; i < toks.size(); ++i) out.append(i ? " " : "").append(toks[i]);
    return out;
  }
  for (size_t si = 0; si < m.spec.decoders.size(); ++si) {
    const auto& re = m.decoder_regex[si];
    apply_decoder_step(m.spec.decoders[si], re ? &*re : nullptr, toks);
  }
  std::string out;
  for (const std::string& t : toks) out += t;
  return out;
}

std::string Tokenizer::token_to_piece(int32_t id) const {
  const Impl& m = *impl_;
  if (id < 0 || id >= m.n_vocab)
    fail(ErrorKind::invalid_input, "{}: token id {} is outside the vocabulary of {}", m.spec.name, id,
         m.n_vocab);
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
      case DecoderStep::Kind::replace:
        t = replace_matches(t, *m.decoder_regex[si], d.content);
        break;
      case DecoderStep::Kind::byte_fallback: {
        unsigned char b;
        if (parse_byte_token(t, b)) t.assign(1, static_cast<char>(b));
        break;
      }
      case DecoderStep::Kind::metaspace:
        t = replace_metaspace(t, d.replacement, false);
        break;
      case DecoderStep::Kind::fuse:
      case DecoderStep::Kind::strip:
        break;
    }
  }
  return t;
}

// ---- streaming -------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special)
    : tok_(tok), skip_special_(skip_special) {
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
  // Unfinished: the pending tokens' bytes end inside a UTF-8 character that more
  // bytes could complete. Judged on the bytes, not on a decoded text ending in
  // U+FFFD: a real U+FFFD in the text (scraped data has them) then held tokens
  // back until kMaxPending forced them out in the middle of a character.
  std::string bytes;
  for (int32_t id : pending_)
    if (!(skip_special_ && tok_.is_special(id))) bytes += tok_.token_to_piece(id);
  const bool unfinished = tok::utf8_complete_prefix(bytes) < bytes.size();
  if (unfinished && !force && pending_.size() < kMaxPending) return {};
  std::vector<int32_t> window;
  if (anchored) window.push_back(anchor_);
  window.insert(window.end(), pending_.begin(), pending_.end());
  const std::string text = tok_.decode(window, skip_special_);
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
