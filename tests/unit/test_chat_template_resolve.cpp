// resolve_chat_template: the one place chat, serve and train pick their chat
// template (a name first, else the model's template text) with the tokenizer's
// BOS/EOS texts.
#include <gtest/gtest.h>

#include "test_tokenizer_util.h"
#include "tokenizer/chat_template.h"

namespace loom {
namespace {

using namespace tok_test;

TEST(ChatTemplateResolve, ANameWinsAndTakesTheTokenizersBosEos) {
  const Tokenizer tok = json_variant("spm_style");
  ASSERT_GE(tok.bos(), 0);
  ASSERT_GE(tok.eos(), 0);
  const std::optional<std::string> chatml_text = "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}";
  const auto t = resolve_chat_template(tok, "llama2", chatml_text);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->kind, ChatTemplateKind::llama2);
  EXPECT_EQ(t->bos, tok.token_text(tok.bos()));
  EXPECT_EQ(t->eos, tok.token_text(tok.eos()));
  EXPECT_TRUE(t->default_system.empty());
}

TEST(ChatTemplateResolve, TheModelTemplateWhenNoName) {
  const Tokenizer tok = json_variant("qwen2_style");
  const std::string text =
      "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
      "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}";
  const auto t = resolve_chat_template(tok, "", text);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->kind, ChatTemplateKind::chatml);
  const ChatTemplate same = ChatTemplate::from_text(text, tok.bos() >= 0 ? tok.token_text(tok.bos()) : "",
                                                    tok.eos() >= 0 ? tok.token_text(tok.eos()) : "");
  EXPECT_EQ(t->default_system, same.default_system);
  EXPECT_EQ(t->bos, same.bos);
  EXPECT_EQ(t->eos, same.eos);
  EXPECT_FALSE(resolve_chat_template(tok, "", std::nullopt)) << "no name and no template text: nothing";
}

TEST(ChatTemplateResolve, BadNamesAndUnknownTemplatesAreErrors) {
  const Tokenizer tok = json_variant("qwen2_style");
  expect_error([&] { resolve_chat_template(tok, "vicuna", std::nullopt); }, ErrorKind::invalid_input,
               {"--chat-template 'vicuna'", "chatml, llama3, llama2 or mistral"});
  expect_error([&] { resolve_chat_template(tok, "vicuna", std::nullopt, "train.yaml: chat_template"); },
               ErrorKind::invalid_input, {"train.yaml: chat_template 'vicuna'"});
  expect_error([&] { resolve_chat_template(tok, "", std::string("USER: {{ messages }}")); },
               ErrorKind::unsupported, {"unrecognised chat template"});
}

}  // namespace
}  // namespace loom
