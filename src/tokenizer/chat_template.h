// Chat prompt formats: ChatML (SmolLM2, Qwen2), Llama 3, Llama 2 and Mistral
// [INST]. The model's Jinja template is recognised by inspecting its text
// (never executed); rendering reproduces what that template renders.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace loom {

class Tokenizer;

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

enum class ChatTemplateKind { chatml, llama3, llama2, mistral };

const char* chat_template_kind_name(ChatTemplateKind kind);
// "chatml", "llama3", "llama2", "mistral"; nullopt for anything else.
std::optional<ChatTemplateKind> chat_template_kind_from_name(std::string_view name);

// The format a Jinja chat template implements. Throws unsupported, suggesting
// --chat-template, for a template loom does not recognise.
ChatTemplateKind detect_chat_template(std::string_view template_text);

struct ChatTemplate {
  ChatTemplateKind kind = ChatTemplateKind::chatml;
  // ChatML: the system message the template adds when the conversation does not
  // start with one (SmolLM2, Qwen2 have one); empty for none.
  std::string default_system;
  std::string bos, eos;  // texts of the BOS/EOS tokens the template writes (Llama formats)

  // Recognises `template_text` and reads its default system message.
  static ChatTemplate from_text(std::string_view template_text, std::string bos, std::string eos);
  // A format chosen by name (--chat-template): no default system message; empty
  // bos/eos take the format's usual tokens.
  static ChatTemplate from_kind(ChatTemplateKind kind, std::string bos = {}, std::string eos = {});
};

// The template of a command (chat, serve, train): the format `name` when it is
// not empty (--chat-template or a config field, which `what` names in the error),
// else the model's Jinja `template_text` recognised; nullopt when there is
// neither. BOS/EOS texts are `tok`'s. Throws invalid_input for an unknown name,
// unsupported for a template text loom does not recognise.
std::optional<ChatTemplate> resolve_chat_template(const Tokenizer& tok, std::string_view name,
                                                  const std::optional<std::string>& template_text,
                                                  std::string_view what = "--chat-template");

// The first control marker of `kind` (chatml's <|im_start|> / <|im_end|>, llama3's header and turn
// markers) that is no single token of `tok`, as it would be encoded, or nullopt. A template chosen by name
// for a model without them is written as pieces of text: a model trained or prompted so learns to spell
// "<|eot_id|>" and never ends its turn. (Llama 2 / Mistral markers are plain text: never reported.)
std::optional<std::string> chat_marker_not_a_token(ChatTemplateKind kind, const Tokenizer& tok);

// The prompt text; encode it with parse_special = true and add_special = false
// (the text already holds any BOS). Throws invalid_input where the template
// would raise (Llama 2 / Mistral: roles must alternate user/assistant).
std::string apply_chat_template(const ChatTemplate& tmpl, std::span<const ChatMessage> messages,
                                bool add_generation_prompt);
// Same with ChatTemplate::from_kind(kind).
std::string apply_chat_template(ChatTemplateKind kind, std::span<const ChatMessage> messages,
                                bool add_generation_prompt);

}  // namespace loom
