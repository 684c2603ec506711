// Chat template recognition and rendering (see chat_template.h). Each renderer
// transcribes one reference Jinja template; the unit tests compare them with
// the strings transformers renders from those templates.
#include "tokenizer/chat_template.h"

#include "core/error.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace loom {
namespace {

constexpr std::string_view kSuggestion = "choose a format with --chat-template chatml|llama3|llama2|mistral";

std::string excerpt(std::string_view t) {
  std::string s(t.substr(0, 80));
  for (char& c : s)
    if (c == '\n') c = ' ';
  return t.size() > 80 ? s + "..." : s;
}

// The default system message in a ChatML template: the literal text between
// "<|im_start|>system\n" and "<|im_end|>" inside one Jinja string, e.g.
// {{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}.
std::string chatml_default_system(std::string_view t) {
  constexpr std::string_view kHead = "<|im_start|>system";
  for (size_t at = t.find(kHead); at != std::string_view::npos; at = t.find(kHead, at + 1)) {
    size_t p = at + kHead.size();
    if (t.compare(p, 2, "\\n") == 0)
      p += 2;
    else if (t.compare(p, 1, "\n") == 0)
      p += 1;
    else
      continue;
    std::string text;
    bool literal = true;
    while (p < t.size() && t.compare(p, 10, "<|im_end|>") != 0) {
      const char c = t[p];
      if (c == '\\' && p + 1 < t.size()) {  // Jinja (Python) string escapes
        const char e = t[p + 1];
        text += e == 'n' ? '\n' : e == 't' ? '\t' : e;
        p += 2;
        continue;
      }
      if (c == '\'' || c == '"' || c == '{' || c == '}') {  // the string ends: not a plain literal
        literal = false;
        break;
      }
      text += c;
      ++p;
    }
    if (literal && p < t.size() && !text.empty()) return text;
  }
  return {};
}

void check_alternation(const std::span<const ChatMessage> loop, const char* format) {
  for (size_t i = 0; i < loop.size(); ++i)
    if ((loop[i].role == "user") != (i % 2 == 0))
      fail(ErrorKind::invalid_input,
           "chat template {}: conversation roles must alternate user/assistant/user/... "
           "(message {} is '{}')",
           format, i, loop[i].role);
}

std::string render_chatml(const ChatTemplate& t, std::span<const ChatMessage> msgs, bool gen) {
  std::string out;
  for (size_t i = 0; i < msgs.size(); ++i) {
    if (i == 0 && msgs[0].role != "system" && !t.default_system.empty())
      out += "<|im_start|>system\n" + t.default_system + "<|im_end|>\n";
    out += "<|im_start|>" + msgs[i].role + "\n" + msgs[i].content + "<|im_end|>\n";
  }
  if (gen) out += "<|im_start|>assistant\n";
  return out;
}

std::string render_llama3(const ChatTemplate& t, std::span<const ChatMessage> msgs, bool gen) {
  std::string out;
  for (size_t i = 0; i < msgs.size(); ++i) {
    if (i == 0) out += t.bos;
    out += "<|start_header_id|>" + msgs[i].role + "<|end_header_id|>\n\n";
    out += tok::strip_python_space(msgs[i].content);
    out += "<|eot_id|>";
  }
  if (gen) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

std::string render_llama2(const ChatTemplate& t, std::span<const ChatMessage> msgs) {
  // The template reads messages[0] unconditionally, so it fails on an empty conversation.
  if (msgs.empty()) fail(ErrorKind::invalid_input, "chat template llama2: the conversation is empty");
  std::optional<std::string> system;
  if (!msgs.empty() && msgs[0].role == "system") {
    system = msgs[0].content;
    msgs = msgs.subspan(1);
  }
  check_alternation(msgs, "llama2");
  std::string out;
  for (size_t i = 0; i < msgs.size(); ++i) {
    const std::string content =
        i == 0 && system ? "<<SYS>>\n" + *system + "\n<</SYS>>\n\n" + msgs[i].content : msgs[i].content;
    if (msgs[i].role == "user") {
      out += t.bos + "[INST] ";
      out += tok::strip_python_space(content);
      out += " [/INST]";
    } else if (msgs[i].role == "assistant") {
      out += " ";
      out += tok::strip_python_space(content);
      out += " " + t.eos;
    }
  }
  return out;
}

std::string render_mistral(const ChatTemplate& t, std::span<const ChatMessage> msgs) {
  std::string out = t.bos;
  for (size_t i = 0; i < msgs.size(); ++i) {
    if ((msgs[i].role == "user") != (i % 2 == 0)) check_alternation(msgs.subspan(0, i + 1), "mistral");
    if (msgs[i].role == "user")
      out += "[INST] " + msgs[i].content + " [/INST]";
    else if (msgs[i].role == "assistant")
      out += msgs[i].content + t.eos;
    else
      fail(ErrorKind::invalid_input,
           "chat template mistral: only user and assistant roles are supported (message {} "
           "is '{}')",
           i, msgs[i].role);
  }
  return out;
}

}  // namespace

const char* chat_template_kind_name(ChatTemplateKind kind) {
  switch (kind) {
    case ChatTemplateKind::chatml:
      return "chatml";
    case ChatTemplateKind::llama3:
      return "llama3";
    case ChatTemplateKind::llama2:
      return "llama2";
    case ChatTemplateKind::mistral:
      return "mistral";
  }
  return "?";
}

std::optional<ChatTemplateKind> chat_template_kind_from_name(std::string_view name) {
  for (ChatTemplateKind k : {ChatTemplateKind::chatml, ChatTemplateKind::llama3, ChatTemplateKind::llama2,
                             ChatTemplateKind::mistral})
    if (name == chat_template_kind_name(k)) return k;
  return std::nullopt;
}

ChatTemplateKind detect_chat_template(std::string_view t) {
  const auto has = [&](std::string_view s) { return t.find(s) != std::string_view::npos; };
  if (has("<|im_start|>")) return ChatTemplateKind::chatml;
  if (has("<|start_header_id|>")) {
    // Llama 3.1+ templates always write a dated system block and tool text.
    if (has("Cutting Knowledge Date"))
      fail(ErrorKind::unsupported,
           "the chat template is Llama 3.1-style (dated system block), which loom does not "
           "reproduce; {} (llama3 gives the plain Llama 3 format)",
           kSuggestion);
    return ChatTemplateKind::llama3;
  }
  if (has("[INST]")) return has("<<SYS>>") ? ChatTemplateKind::llama2 : ChatTemplateKind::mistral;
  fail(ErrorKind::unsupported, "unrecognised chat template \"{}\"; {}", excerpt(t), kSuggestion);
}

ChatTemplate ChatTemplate::from_kind(ChatTemplateKind kind, std::string bos, std::string eos) {
  ChatTemplate t;
  t.kind = kind;
  if (kind == ChatTemplateKind::llama3) {
    t.bos = bos.empty() ? "<|begin_of_text|>" : std::move(bos);
    t.eos = eos.empty() ? "<|eot_id|>" : std::move(eos);
  } else if (kind != ChatTemplateKind::chatml) {
    t.bos = bos.empty() ? "<s>" : std::move(bos);
    t.eos = eos.empty() ? "</s>" : std::move(eos);
  }
  return t;
}

ChatTemplate ChatTemplate::from_text(std::string_view template_text, std::string bos, std::string eos) {
  ChatTemplate t = from_kind(detect_chat_template(template_text), std::move(bos), std::move(eos));
  if (t.kind == ChatTemplateKind::chatml) t.default_system = chatml_default_system(template_text);
  return t;
}

std::optional<std::string> chat_marker_not_a_token(ChatTemplateKind kind, const Tokenizer& tok) {
  std::vector<std::string_view> markers;
  if (kind == ChatTemplateKind::chatml) markers = {"<|im_start|>", "<|im_end|>"};
  if (kind == ChatTemplateKind::llama3) markers = {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
  for (std::string_view m : markers)
    if (tok.encode(m, /*add_special=*/false, /*parse_special=*/true).size() != 1) return std::string(m);
  return std::nullopt;
}

std::optional<ChatTemplate> resolve_chat_template(const Tokenizer& tok, std::string_view name,
                                                  const std::optional<std::string>& template_text,
                                                  std::string_view what) {
  const std::string bos = tok.bos() >= 0 ? tok.token_text(tok.bos()) : std::string();
  const std::string eos = tok.eos() >= 0 ? tok.token_text(tok.eos()) : std::string();
  if (!name.empty()) {
    const auto kind = chat_template_kind_from_name(name);
    if (!kind)
      fail(ErrorKind::invalid_input, "{} '{}': expected chatml, llama3, llama2 or mistral", what, name);
    return ChatTemplate::from_kind(*kind, bos, eos);
  }
  if (template_text) return ChatTemplate::from_text(*template_text, bos, eos);
  return std::nullopt;
}

std::string apply_chat_template(const ChatTemplate& t, std::span<const ChatMessage> messages,
                                bool add_generation_prompt) {
  switch (t.kind) {
    case ChatTemplateKind::chatml:
      return render_chatml(t, messages, add_generation_prompt);
    case ChatTemplateKind::llama3:
      return render_llama3(t, messages, add_generation_prompt);
    case ChatTemplateKind::llama2:
      return render_llama2(t, messages);
    case ChatTemplateKind::mistral:
      return render_mistral(t, messages);
  }
  return {};
}

std::string apply_chat_template(ChatTemplateKind kind, std::span<const ChatMessage> messages,
                                bool add_generation_prompt) {
  return apply_chat_template(ChatTemplate::from_kind(kind), messages, add_generation_prompt);
}

}  // namespace loom
