// `loom chat`: an interactive conversation using the model's chat template.
// Each turn re-renders the whole conversation, keeps the KV cache for the
// common token prefix and evaluates only the new tail.
#include <cstdio>
#include <iostream>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "model/model.h"
#include "tokenizer/chat_template.h"
#include <nlohmann/json.hpp>  // complete type for Tokenizer's optional<json> parameters
#include "tokenizer/tokenizer.h"

namespace loom::app {
namespace {

int run_chat(int argc, char** argv) {
  CLI::App app("Chat with a model using its chat template.", "chat");
  std::string system_prompt, template_name, one_prompt;
  int64_t n_predict = 512, ctx = 0, seed = -1;
  GenerateOptions opts;
  DType kv_dtype = DType::f16;
  ModelFlags model_flags;
  add_model_flags(app, model_flags);
  app.add_option("--system", system_prompt, "system message for the conversation");
  app.add_option("--chat-template", template_name, "chatml, llama3, llama2 or mistral (default: from the model's metadata)")
      ->check(CLI::IsMember({"chatml", "llama3", "llama2", "mistral"}));
  app.add_option("-p,--prompt", one_prompt, "ask one question, print the answer and exit");
  add_length_flags(app, n_predict, ctx, "most tokens per answer; -1 = until end of turn");
  add_sampling_flags(app, opts.sampling, seed);
  add_kv_cache_dtype_flag(app, kv_dtype);
  add_run_flags(app, model_flags);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  if (app.count("--prompt") > 0 && one_prompt.empty())  // not the interactive mode a missing -p starts
    fail(ErrorKind::invalid_input, "-p: the prompt is empty");
  finish_generate_options(opts, n_predict, seed);

  const LoadedModel loaded = load_model(model_flags);
  const std::unique_ptr<Model>& model = loaded.model;
  const Tokenizer& tok = model->tokenizer();
  opts.extra_eos = model->extra_eos_ids();
  const std::optional<ChatTemplate> found = resolve_chat_template(tok, template_name, model->chat_template_text());
  if (!found)
    fail(ErrorKind::invalid_input, "{}: the model has no chat template in its metadata; choose one with "
         "--chat-template chatml|llama3|llama2|mistral", model_flags.model_path);
  const ChatTemplate& tmpl = *found;
  if (!template_name.empty())
    if (const auto m = chat_marker_not_a_token(tmpl.kind, tok))
      std::fprintf(
          stderr,
          "loom chat: warning: --chat-template %s: '%s' is no token of this model: it is written as text, "
          "and the model is unlikely to end its turns (leave --chat-template out to use the model's own)\n",
          template_name.c_str(), m->c_str());
  const int64_t n_ctx = resolve_context(model->config(), ctx);
  InferenceSession session(model->config(), model->weights(), *loaded.backend, n_ctx, kv_dtype);

  std::vector<ChatMessage> messages;
  if (!system_prompt.empty()) messages.push_back({"system", system_prompt});
  std::vector<int32_t> evaluated;  // tokens whose keys/values the session holds
  const bool interactive = one_prompt.empty();
  if (interactive)
    std::fprintf(stderr, "loom chat: %s (%s template). Type a message; /reset clears, /exit or Ctrl-D quits.\n",
                 model_flags.model_path.c_str(), chat_template_kind_name(tmpl.kind));
  for (;;) {
    std::string line;
    if (interactive) {
      std::fputs("\n> ", stdout);
      std::fflush(stdout);
      if (!std::getline(std::cin, line)) break;
      if (line == "/exit" || line == "/quit") break;
      if (line == "/reset") {
        messages.resize(system_prompt.empty() ? 0 : 1);
        continue;
      }
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank: nothing to say
    } else {
      line = one_prompt;
    }
    messages.push_back({"user", line});
    const std::string text = apply_chat_template(tmpl, messages, /*add_generation_prompt=*/true);
    // The rendered template already holds BOS where the format wants it.
    const auto ids = tok.encode(text, /*add_special=*/false, /*parse_special=*/true);
    if (static_cast<int64_t>(ids.size()) >= n_ctx) {  // no room to answer: keep the session, drop this message
      messages.pop_back();
      if (!interactive)
        fail(ErrorKind::invalid_input, "the prompt is {} tokens, which leaves no room in the context of {} tokens "
             "(see --ctx-size)", ids.size(), n_ctx);
      std::fprintf(stderr, "loom chat: the conversation with this message is %zu tokens, the context holds %lld; "
                   "the message was not sent. Type /reset to start a new conversation (or use a larger -c).\n",
                   ids.size(), static_cast<long long>(n_ctx));
      continue;
    }
    // Reuse the cached prefix; evaluate only what changed.
    size_t common = 0;
    while (common < evaluated.size() && common < ids.size() && evaluated[common] == ids[common]) ++common;
    if (common == ids.size()) --common;  // at least one token must be evaluated to get logits
    session.truncate(static_cast<int64_t>(common));
    evaluated.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(common));
    std::string answer;
    const std::span<const int32_t> tail(ids.data() + common, ids.size() - common);
    const auto r = generate(session, tok, tail, opts, [&](const std::string& piece) {
      answer += piece;
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
      return true;
    });
    std::fputc('\n', stdout);
    evaluated.insert(evaluated.end(), tail.begin(), tail.end());
    // The session now also holds the generated tokens except the last sampled one.
    evaluated.insert(evaluated.end(), r.tokens.begin(), r.tokens.end());
    evaluated.resize(static_cast<size_t>(session.n_past()));
    messages.push_back({"assistant", answer});
    if (r.finish == FinishReason::context_full && interactive)
      std::fprintf(stderr, "loom chat: the context (%lld tokens) is full; the answer was cut. Type /reset to start "
                   "a new conversation.\n", static_cast<long long>(n_ctx));
    if (!interactive) {
      print_speed(r);
      break;
    }
  }
  return 0;
}

}  // namespace

extern const Command kChatCommand = {"chat", run_chat};

}  // namespace loom::app
