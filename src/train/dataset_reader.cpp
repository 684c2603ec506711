// JSONL records -> token ids + loss labels (see data.h): format detection, field
// checks, chat rendering with assistant spans, and per-line error reporting.
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "core/mapped_file.h"
#include "train/data.h"

namespace loom {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxSkippedExamples = 5;

// A character range of the text whose tokens are trained.
struct Span {
  size_t begin, end;
};

std::string excerpt(std::string_view s) {
  std::string out(s.substr(0, 60));
  return s.size() > 60 ? out + "..." : out;
}

// `where` prefixes the key in messages ("messages[2].").
const std::string& string_field(const json& obj, const char* key, const std::string& where = {}) {
  const auto it = obj.find(key);
  if (it == obj.end()) fail(ErrorKind::invalid_input, "missing field \"{}{}\"", where, key);
  if (!it->is_string())
    fail(ErrorKind::invalid_input, "field \"{}{}\" must be a string, found {}", where, key, it->type_name());
  return it->get_ref<const std::string&>();
}

// The token index where the tokens of text[0, b) end inside `ids` (the whole
// text's tokens). When a token straddles b, a span start takes it into the
// span and a span end keeps it (it holds text of the span either way).
size_t token_boundary(const Tokenizer& tok, std::string_view text, std::span<const int32_t> ids, size_t b,
                      bool parse_special, bool is_end) {
  if (b == 0) return 0;
  if (b >= text.size()) return ids.size();
  const std::vector<int32_t> prefix = tok.encode(text.substr(0, b), false, parse_special);
  size_t lcp = 0;
  while (lcp < prefix.size() && lcp < ids.size() && prefix[lcp] == ids[lcp]) ++lcp;
  if (lcp == prefix.size() || !is_end) return lcp;
  return std::min(lcp + 1, ids.size());
}

// Tokenizes `text` at once; labels are the ids inside `spans` (all of them when
// train_all). `trim_after_eog`: a span ends at its last end-of-generation token
// (drops the "\n" after ChatML's <|im_end|>).
TokenizedSample encode_with_spans(const Tokenizer& tok, std::string_view text, std::span<const Span> spans,
                                  bool train_all, bool add_bos, bool add_eos, bool parse_special,
                                  bool trim_after_eog) {
  const std::vector<int32_t> body = tok.encode(text, false, parse_special);
  TokenizedSample s;
  const bool bos = add_bos && tok.add_bos() && tok.bos() >= 0;
  if (bos) s.ids.push_back(tok.bos());
  s.ids.insert(s.ids.end(), body.begin(), body.end());
  s.labels.assign(s.ids.size(), kIgnoreLabel);
  const size_t shift = bos ? 1 : 0;
  if (train_all) {
    s.labels = s.ids;
  } else {
    for (const Span& sp : spans) {
      const size_t a = token_boundary(tok, text, body, sp.begin, parse_special, false);
      size_t e = token_boundary(tok, text, body, sp.end, parse_special, true);
      if (trim_after_eog)
        for (size_t t = e; t > a; --t)
          if (tok.is_eog(body[t - 1])) {
            e = t;
            break;
          }
      for (size_t t = a; t < e; ++t) s.labels[t + shift] = s.ids[t + shift];
    }
  }
  if (add_eos && tok.eos() >= 0) {
    s.ids.push_back(tok.eos());
    s.labels.push_back(tok.eos());
  }
  if (!s.labels.empty()) s.labels[0] = kIgnoreLabel;  // nothing predicts the first token
  return s;
}

TokenizedSample encode_prompt_completion(const Tokenizer& tok, const std::string& prompt,
                                         const std::string& completion, const DataOptions& opt) {
  const std::string text = prompt + completion;
  const Span span{prompt.size(), text.size()};
  return encode_with_spans(tok, text, {&span, 1}, opt.train_on_prompt, true, true, opt.parse_special, false);
}

std::vector<ChatMessage> read_messages(const json& rec) {
  const json& m = rec.at("messages");
  if (!m.is_array()) fail(ErrorKind::invalid_input, "field \"messages\" must be an array, found {}", m.type_name());
  if (m.empty()) fail(ErrorKind::invalid_input, "field \"messages\" is empty");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < m.size(); ++i) {
    const json& e = m[i];
    if (!e.is_object())
      fail(ErrorKind::invalid_input, "messages[{}] must be an object, found {}", i, e.type_name());
    const std::string where = fmt::format("messages[{}].", i);
    out.push_back({string_field(e, "role", where), string_field(e, "content", where)});
  }
  return out;
}

TokenizedSample encode_messages(const json& rec, const Tokenizer& tok, const ChatTemplate* tmpl,
                                const DataOptions& opt) {
  const std::vector<ChatMessage> msgs = read_messages(rec);
  if (!tmpl)
    fail(ErrorKind::invalid_input,
         "a \"messages\" record needs a chat template, and the model has none (choose one with "
         "data.chat_template: chatml, llama3, llama2 or mistral)");
  const bool has_assistant =
      std::any_of(msgs.begin(), msgs.end(), [](const ChatMessage& m) { return m.role == "assistant"; });
  if (!has_assistant && !opt.train_on_prompt)
    fail(ErrorKind::invalid_input,
         "\"messages\" has no assistant message, so nothing would be trained (set train_on_prompt to train on it)");
  const std::string text = apply_chat_template(*tmpl, msgs, false);
  // Each reply is the text between the conversation rendered up to it (with the
  // generation prompt) and the conversation rendered through it.
  std::vector<Span> spans;
  const std::span<const ChatMessage> all(msgs);
  for (size_t i = 0; i < msgs.size(); ++i) {
    if (msgs[i].role != "assistant") continue;
    const std::string before = apply_chat_template(*tmpl, all.first(i), true);
    const std::string through = apply_chat_template(*tmpl, all.first(i + 1), false);
    if (!text.starts_with(before) || !text.starts_with(through) || through.size() < before.size())
      fail(ErrorKind::unsupported,
           "chat template {} does not render this conversation prefix by prefix, so the reply in messages[{}] "
           "cannot be located",
           chat_template_kind_name(tmpl->kind), i);
    spans.push_back({before.size(), through.size()});
  }
  return encode_with_spans(tok, text, spans, opt.train_on_prompt, false, false, true, true);
}

DataFormat detect_format(const json& rec) {
  if (rec.contains("messages")) return DataFormat::messages;
  if (rec.contains("prompt") || rec.contains("completion")) return DataFormat::prompt_completion;
  if (rec.contains("instruction") || rec.contains("output")) return DataFormat::alpaca;
  if (rec.contains("text")) return DataFormat::text;
  std::string keys;
  for (const auto& [k, v] : rec.items()) keys += (keys.empty() ? "" : ", ") + k;
  fail(ErrorKind::invalid_input,
       "no known fields: expected \"text\", \"prompt\"+\"completion\", \"messages\" or "
       "\"instruction\"+\"output\" (Alpaca); found {}",
       keys.empty() ? std::string("an empty object") : "keys " + keys);
}

json parse_line(std::string_view line) {
  try {
    return json::parse(line.begin(), line.end());
  } catch (const json::parse_error& e) {
    const size_t col = e.byte > 0 ? e.byte : 1;
    fail(ErrorKind::invalid_input, "invalid JSON at column {} ({}): {}", col, excerpt(line), e.what());
  } catch (const json::exception& e) {
    fail(ErrorKind::invalid_input, "invalid JSON ({}): {}", excerpt(line), e.what());
  }
}

}  // namespace

const char* data_format_name(DataFormat f) {
  switch (f) {
    case DataFormat::auto_detect:
      return "auto";
    case DataFormat::text:
      return "text";
    case DataFormat::prompt_completion:
      return "prompt_completion";
    case DataFormat::messages:
      return "messages";
    case DataFormat::alpaca:
      return "alpaca";
  }
  return "?";
}

std::optional<DataFormat> data_format_from_name(std::string_view name) {
  for (DataFormat f : {DataFormat::auto_detect, DataFormat::text, DataFormat::prompt_completion,
                       DataFormat::messages, DataFormat::alpaca})
    if (name == data_format_name(f)) return f;
  return std::nullopt;
}

std::string alpaca_prompt(std::string_view instruction, std::string_view input) {
  if (input.empty())
    return fmt::format(
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\n{}\n\n### Response:\n",
        instruction);
  return fmt::format(
      "Below is an instruction that describes a task, paired with an input that provides further context. "
      "Write a response that appropriately completes the request.\n\n### Instruction:\n{}\n\n### Input:\n{}\n\n"
      "### Response:\n",
      instruction, input);
}

std::string format_data_stats(const DataStats& s) {
  return fmt::format(
      "{} samples from {} lines ({} blank, {} skipped as bad, {} truncated, {} dropped with nothing to learn), "
      "{} tokens ({} masked)",
      s.samples, s.lines, s.blank_lines, s.skipped, s.truncated, s.dropped, s.tokens, s.masked_tokens);
}

std::span<const int32_t> SampleSet::ids_of(int64_t i) const {
  return {ids.data() + offsets[i], static_cast<size_t>(length(i))};
}
std::span<const int32_t> SampleSet::labels_of(int64_t i) const {
  return {labels.data() + offsets[i], static_cast<size_t>(length(i))};
}
void SampleSet::add(std::span<const int32_t> sample_ids, std::span<const int32_t> sample_labels) {
  LOOM_ASSERT(sample_ids.size() == sample_labels.size());
  ids.insert(ids.end(), sample_ids.begin(), sample_ids.end());
  labels.insert(labels.end(), sample_labels.begin(), sample_labels.end());
  offsets.push_back(static_cast<int64_t>(ids.size()));
}

TokenizedSample tokenize_record(const json& rec, const Tokenizer& tok, const ChatTemplate* tmpl,
                                const DataOptions& opt) {
  if (!rec.is_object())
    fail(ErrorKind::invalid_input, "each line must be a JSON object, found {}", rec.type_name());
  const DataFormat f = opt.format == DataFormat::auto_detect ? detect_format(rec) : opt.format;
  switch (f) {
    case DataFormat::text: {
      const std::string& text = string_field(rec, "text");
      const Span all{0, text.size()};
      return encode_with_spans(tok, text, {&all, 1}, true, true, true, opt.parse_special, false);
    }
    case DataFormat::prompt_completion:
      return encode_prompt_completion(tok, string_field(rec, "prompt"), string_field(rec, "completion"), opt);
    case DataFormat::alpaca: {
      const std::string& instruction = string_field(rec, "instruction");
      const std::string& output = string_field(rec, "output");
      std::string input;
      if (const auto it = rec.find("input"); it != rec.end() && !it->is_null()) input = string_field(rec, "input");
      return encode_prompt_completion(tok, alpaca_prompt(instruction, input), output, opt);
    }
    case DataFormat::messages:
      if (!rec.contains("messages")) fail(ErrorKind::invalid_input, "missing field \"messages\"");
      return encode_messages(rec, tok, tmpl, opt);
    case DataFormat::auto_detect:
      break;
  }
  LOOM_ASSERT(false);
  return {};
}

SampleSet read_jsonl_text(std::string_view text, const std::string& path, const Tokenizer& tok,
                          const ChatTemplate* tmpl, const DataOptions& opt, DataStats& stats) {
  if (opt.seq_len < 2) fail(ErrorKind::invalid_input, "seq_len must be at least 2, got {}", opt.seq_len);
  stats = {};
  if (text.starts_with("\xEF\xBB\xBF")) text.remove_prefix(3);  // UTF-8 byte order mark
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos)
    fail(ErrorKind::invalid_input, "{}: the dataset file is empty", path);
  SampleSet set;
  int64_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    ++stats.lines;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) {
      ++stats.blank_lines;
      continue;
    }
    TokenizedSample s;
    try {
      s = tokenize_record(parse_line(line), tok, tmpl, opt);
    } catch (const Error& e) {
      const std::string msg = fmt::format("{}:{}: {}", path, line_no, e.what());
      if (!opt.skip_bad_lines) throw Error(e.kind(), msg);
      ++stats.skipped;
      if (stats.skipped_examples.size() < kMaxSkippedExamples) stats.skipped_examples.push_back(msg);
      continue;
    }
    if (static_cast<int64_t>(s.ids.size()) > opt.seq_len) {
      s.ids.resize(opt.seq_len);
      s.labels.resize(opt.seq_len);
      ++stats.truncated;
    }
    if (std::all_of(s.labels.begin(), s.labels.end(), [](int32_t l) { return l == kIgnoreLabel; })) {
      ++stats.dropped;
      continue;
    }
    ++stats.samples;
    stats.tokens += static_cast<int64_t>(s.ids.size());
    stats.masked_tokens += std::count(s.labels.begin(), s.labels.end(), kIgnoreLabel);
    set.add(s.ids, s.labels);
  }
  if (set.size() == 0)
    fail(ErrorKind::invalid_input, "{}: no usable samples ({})", path, format_data_stats(stats));
  return set;
}

SampleSet read_jsonl_dataset(const std::string& path, const Tokenizer& tok, const ChatTemplate* tmpl,
                             const DataOptions& opt, DataStats& stats) {
  return read_jsonl_text(read_text_file(path), path, tok, tmpl, opt, stats);
}

}  // namespace loom
