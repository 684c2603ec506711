// Chat templates: recognition from the template text, and rendering compared
// with the strings transformers' Jinja environment renders from SmolLM2's real
// template and the ChatML / Llama 3 / Llama 2 / Mistral reference templates
// (chat_templates.json), including the conversations those templates refuse.
#include <gtest/gtest.h>

#include <algorithm>

#include "test_tokenizer_util.h"
#include "tokenizer/chat_template.h"

namespace loom {
namespace {

using namespace tok_test;

const json& chat() {
  static const json j = read_json_file(fixture("chat_templates.json"));
  return j;
}

std::vector<ChatMessage> conversation(const json& j) {
  std::vector<ChatMessage> out;
  for (const auto& m : j) out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  return out;
}

TEST(ChatTemplate, MatchesJinjaRendering) {
  const json& templates = chat()["templates"];
  ASSERT_TRUE(templates.contains("smollm2")) << "chat_templates.json was generated without the SmolLM2 GGUF";
  int checked = 0;
  for (const auto& c : chat()["cases"]) {
    const std::string name = c["template"].get<std::string>();
    const ChatTemplate t = ChatTemplate::from_text(templates[name].get<std::string>(),
                                                   c["bos"].get<std::string>(), c["eos"].get<std::string>());
    const auto msgs = conversation(chat()["conversations"][c["conversation"].get<size_t>()]);
    const bool gen = c["add_generation_prompt"].get<bool>();
    SCOPED_TRACE(name + " conversation " + std::to_string(c["conversation"].get<int>()) +
                 (gen ? " +gen" : ""));
    if (c["error"].is_null()) {
      EXPECT_EQ(apply_chat_template(t, msgs, gen), c["text"].get<std::string>());
    } else {
      expect_error([&] { apply_chat_template(t, msgs, gen); }, ErrorKind::invalid_input, {name});
    }
    ++checked;
  }
  EXPECT_GE(checked, 100);
}

TEST(ChatTemplate, Detection) {
  const json& t = chat()["templates"];
  EXPECT_EQ(detect_chat_template(t["smollm2"].get<std::string>()), ChatTemplateKind::chatml);
  EXPECT_EQ(detect_chat_template(t["chatml_qwen2"].get<std::string>()), ChatTemplateKind::chatml);
  EXPECT_EQ(detect_chat_template(t["llama3"].get<std::string>()), ChatTemplateKind::llama3);
  EXPECT_EQ(detect_chat_template(t["llama2"].get<std::string>()), ChatTemplateKind::llama2);
  EXPECT_EQ(detect_chat_template(t["mistral"].get<std::string>()), ChatTemplateKind::mistral);
  EXPECT_EQ(ChatTemplate::from_text(t["chatml_qwen2"].get<std::string>(), "", "").default_system,
            "You are a helpful assistant.");
  EXPECT_EQ(ChatTemplate::from_text(t["chatml_plain"].get<std::string>(), "", "").default_system, "");
  expect_error([] { detect_chat_template("{% for m in messages %}<<{{ m.content }}>>{% endfor %}"); },
               ErrorKind::unsupported, {"--chat-template chatml|llama3|llama2"});
  expect_error(
      [] { detect_chat_template("<|start_header_id|>system<|end_header_id|>Cutting Knowledge Date: x"); },
      ErrorKind::unsupported, {"--chat-template"});
}

TEST(ChatTemplate, DefaultSystemOnlyFromAPlainLiteral) {
  // Qwen2.5-style: the first "<|im_start|>system\n" continues with a variable,
  // the literal default comes later.
  const std::string t =
      "{%- if tools %}{{- '<|im_start|>system\\n' }}{{- messages[0]['content'] }}{%- else %}"
      "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
      "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
      "You\\'re "
      "helpful.<|im_end|>\\n' }}{%- endif %}{%- endif %}";
  const ChatTemplate ct = ChatTemplate::from_text(t, "", "");
  EXPECT_EQ(ct.kind, ChatTemplateKind::chatml);
  EXPECT_EQ(ct.default_system, "You are Qwen, created by Alibaba Cloud. You're helpful.");
}

TEST(ChatTemplate, Names) {
  for (ChatTemplateKind k : {ChatTemplateKind::chatml, ChatTemplateKind::llama3, ChatTemplateKind::llama2,
                             ChatTemplateKind::mistral})
    EXPECT_EQ(chat_template_kind_from_name(chat_template_kind_name(k)), k);
  EXPECT_FALSE(chat_template_kind_from_name("vicuna"));
  // A forced format uses its usual BOS/EOS and no default system message.
  const std::vector<ChatMessage> msgs = {{"user", " hi "}};
  EXPECT_EQ(apply_chat_template(ChatTemplateKind::llama2, msgs, true), "<s>[INST] hi [/INST]");
  EXPECT_EQ(apply_chat_template(ChatTemplateKind::llama3, msgs, false),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>");
  EXPECT_EQ(apply_chat_template(ChatTemplateKind::chatml, msgs, false), "<|im_start|>user\n hi <|im_end|>\n");
}

TEST(ChatTemplate, RenderedPromptTokenizesWithSpecialTokens) {
  const Tokenizer tok = json_variant("qwen2_style");
  const ChatTemplate ct = ChatTemplate::from_kind(ChatTemplateKind::chatml);
  const std::vector<ChatMessage> msgs = {{"user", "Hi"}};
  const auto ids = tok.encode(apply_chat_template(ct, msgs, true), false, true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), tok.token_id("<|im_start|>"));
  EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.token_id("<|im_end|>")), 1);
}

}  // namespace
}  // namespace loom
