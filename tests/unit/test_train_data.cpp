// Fine-tuning data pipeline: every JSONL format on real tokenizers (ids equal
// tokenizing the whole text, labels only on completions / assistant replies),
// packing positions and attention starts, seeded shuffles and resume, eval
// splits, the token cache (hit, miss, corruption) and every bad-data report.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "io/gguf.h"
#include "test_tokenizer_util.h"
#include "train/data.h"

namespace loom {
namespace {

using namespace tok_test;
namespace fs = std::filesystem;

std::string data_fixture(const std::string& f) { return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/train_data/" + f; }

const json& chat() {
  static const json j = read_json_file(fixture("chat_templates.json"));
  return j;
}

const Tokenizer& qwen2() {
  static const Tokenizer t = Tokenizer::from_tokenizer_json(fixture("qwen2_style.json"));
  return t;
}
const Tokenizer& llama3() {
  static const Tokenizer t = Tokenizer::from_tokenizer_json(fixture("llama3_style.json"));
  return t;
}
const Tokenizer& spm() {
  static const Tokenizer t = Tokenizer::from_tokenizer_json(fixture("spm_style.json"));
  return t;
}

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The maximal runs of trained labels, as [begin, end) token ranges.
std::vector<std::pair<size_t, size_t>> trained_runs(const std::vector<int32_t>& labels) {
  std::vector<std::pair<size_t, size_t>> runs;
  for (size_t i = 0; i < labels.size();) {
    if (labels[i] == kIgnoreLabel) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < labels.size() && labels[j] != kIgnoreLabel) ++j;
    runs.push_back({i, j});
    i = j;
  }
  return runs;
}

void expect_labels_are_ids_or_masked(const TokenizedSample& s) {
  ASSERT_EQ(s.ids.size(), s.labels.size());
  ASSERT_FALSE(s.ids.empty());
  EXPECT_EQ(s.labels[0], kIgnoreLabel);
  for (size_t i = 0; i < s.ids.size(); ++i) {
    if (s.labels[i] != kIgnoreLabel) {
      EXPECT_EQ(s.labels[i], s.ids[i]) << i;
    }
  }
}

std::string trim(std::string s) {
  const size_t a = s.find_first_not_of(" ");
  const size_t b = s.find_last_not_of(" ");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

// A fresh, empty directory for one test.
std::string temp_dir(const std::string& name) {
  const fs::path p = fs::path(testing::TempDir()) / ("loom_train_data_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// ---- formats -------------------------------------------------------------

TEST(TrainData, TextSamplesEndWithEosAndTrainEverything) {
  for (const Tokenizer* tok : {&qwen2(), &llama3(), &spm()}) {
    SCOPED_TRACE(tok->spec().name);
    const std::string text = "Hello world! 123 numbers and\nnew lines.";
    const TokenizedSample s = tokenize_record(json{{"text", text}}, *tok, nullptr, {});
    std::vector<int32_t> want;
    if (tok->add_bos()) want.push_back(tok->bos());
    want = cat(want, tok->encode(text, false, true));
    ASSERT_GE(tok->eos(), 0);
    want.push_back(tok->eos());
    EXPECT_EQ(s.ids, want);
    expect_labels_are_ids_or_masked(s);
    for (size_t i = 1; i < s.ids.size(); ++i) EXPECT_EQ(s.labels[i], s.ids[i]);
  }
  EXPECT_TRUE(llama3().add_bos());  // the fixtures cover both ways
  EXPECT_FALSE(qwen2().add_bos());
}

TEST(TrainData, ParseSpecialOption) {
  const std::string text = "a <|im_end|> b";
  DataOptions opt;
  const auto with = tokenize_record(json{{"text", text}}, qwen2(), nullptr, opt);
  opt.parse_special = false;
  const auto without = tokenize_record(json{{"text", text}}, qwen2(), nullptr, opt);
  const int32_t im_end = qwen2().token_id("<|im_end|>");
  EXPECT_NE(std::find(with.ids.begin(), with.ids.end(), im_end), with.ids.end());
  EXPECT_EQ(std::find(without.ids.begin(), without.ids.end(), im_end), without.ids.end());
}

TEST(TrainData, PromptCompletionMasksThePrompt) {
  const std::string prompt = "Question: what is 2 + 2?\nAnswer:", completion = " 4 and some more words";
  for (const Tokenizer* tok : {&qwen2(), &llama3(), &spm()}) {
    SCOPED_TRACE(tok->spec().name);
    const json rec{{"prompt", prompt}, {"completion", completion}};
    const TokenizedSample s = tokenize_record(rec, *tok, nullptr, {});
    std::vector<int32_t> want;
    if (tok->add_bos()) want.push_back(tok->bos());
    want = cat(want, tok->encode(prompt + completion, false, true));
    want.push_back(tok->eos());
    EXPECT_EQ(s.ids, want);  // the whole text at once, not prompt and completion apart
    expect_labels_are_ids_or_masked(s);
    const auto runs = trained_runs(s.labels);
    ASSERT_EQ(runs.size(), 1u);
    EXPECT_EQ(runs[0].second, s.ids.size());
    const std::vector<int32_t> run(s.ids.begin() + runs[0].first, s.ids.end() - 1);
    EXPECT_EQ(trim(tok->decode(run)), trim(completion));
    // The prompt's tokens are all masked and make up the rest.
    const size_t n_prompt = tok->encode(prompt, false, true).size() + (tok->add_bos() ? 1 : 0);
    EXPECT_EQ(runs[0].first, n_prompt);

    DataOptions all;
    all.train_on_prompt = true;
    const TokenizedSample t = tokenize_record(rec, *tok, nullptr, all);
    EXPECT_EQ(t.ids, s.ids);
    EXPECT_EQ(trained_runs(t.labels), (std::vector<std::pair<size_t, size_t>>{{1, t.ids.size()}}));
  }
}

TEST(TrainData, AlpacaUsesTheStandardPrompt) {
  EXPECT_EQ(alpaca_prompt("Give the opposite word.", "hot"),
            "Below is an instruction that describes a task, paired with an input that provides further context. "
            "Write a response that appropriately completes the request.\n\n### Instruction:\nGive the opposite "
            "word.\n\n### Input:\nhot\n\n### Response:\n");
  EXPECT_EQ(alpaca_prompt("Name a fruit.", ""),
            "Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.\n\n### Instruction:\nName a fruit.\n\n### Response:\n");
  const TokenizedSample a =
      tokenize_record(json{{"instruction", "Give the opposite word."}, {"input", "hot"}, {"output", "cold"}},
                      llama3(), nullptr, {});
  const TokenizedSample b = tokenize_record(
      json{{"prompt", alpaca_prompt("Give the opposite word.", "hot")}, {"completion", "cold"}}, llama3(), nullptr, {});
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.labels, b.labels);
  const auto runs = trained_runs(a.labels);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(llama3().decode(std::vector<int32_t>(a.ids.begin() + runs[0].first, a.ids.end()), true), "cold");
  // Missing and empty input mean the same.
  const json no_input{{"instruction", "Name a fruit."}, {"output", "An apple."}};
  const json empty_input{{"instruction", "Name a fruit."}, {"input", ""}, {"output", "An apple."}};
  EXPECT_EQ(tokenize_record(no_input, qwen2(), nullptr, {}).ids, tokenize_record(empty_input, qwen2(), nullptr, {}).ids);
}

struct ChatCase {
  const Tokenizer* tok;
  ChatTemplate tmpl;
  std::string end_of_turn;
};

std::vector<ChatCase> chat_cases() {
  return {{&qwen2(), ChatTemplate::from_kind(ChatTemplateKind::chatml), "<|im_end|>"},
          {&qwen2(), ChatTemplate::from_text(chat()["templates"]["chatml_qwen2"].get<std::string>(), "", ""),
           "<|im_end|>"},
          {&llama3(), ChatTemplate::from_kind(ChatTemplateKind::llama3), "<|eot_id|>"},
          {&spm(), ChatTemplate::from_kind(ChatTemplateKind::llama2), "</s>"},
          {&spm(), ChatTemplate::from_kind(ChatTemplateKind::mistral), "</s>"}};
}

std::vector<ChatMessage> conversation_of(const json& rec) {
  std::vector<ChatMessage> m;
  for (const auto& e : rec["messages"]) m.push_back({e["role"].get<std::string>(), e["content"].get<std::string>()});
  return m;
}

// Checks one conversation: ids are the rendered text's, each assistant reply is
// one trained run that decodes to the reply and ends with the end-of-turn token.
void check_conversation(const ChatCase& c, const json& rec, const DataOptions& opt = {}) {
  const auto msgs = conversation_of(rec);
  const TokenizedSample s = tokenize_record(rec, *c.tok, &c.tmpl, opt);
  EXPECT_EQ(s.ids, c.tok->encode(apply_chat_template(c.tmpl, msgs, false), false, true));
  expect_labels_are_ids_or_masked(s);
  const auto runs = trained_runs(s.labels);
  std::vector<std::string> replies;
  for (const auto& m : msgs)
    if (m.role == "assistant") replies.push_back(m.content);
  ASSERT_EQ(runs.size(), replies.size());
  const int32_t eot = c.tok->token_id(c.end_of_turn);
  ASSERT_GE(eot, 0);
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::vector<int32_t> run(s.ids.begin() + runs[i].first, s.ids.begin() + runs[i].second);
    EXPECT_EQ(run.back(), eot);
    EXPECT_EQ(trim(c.tok->decode(run, true)), trim(replies[i])) << "reply " << i;
  }
}

TEST(TrainData, MessagesTrainOnAssistantRepliesOnly) {
  std::ifstream f(data_fixture("messages.jsonl"));
  std::vector<json> recs;
  for (std::string line; std::getline(f, line);) recs.push_back(json::parse(line));
  ASSERT_EQ(recs.size(), 3u);
  for (const ChatCase& c : chat_cases()) {
    SCOPED_TRACE(chat_template_kind_name(c.tmpl.kind) + std::string(" default system: ") + c.tmpl.default_system);
    for (const json& rec : recs) {
      // Mistral refuses a system message, as its template does.
      if (c.tmpl.kind == ChatTemplateKind::mistral && rec["messages"][0]["role"] == "system") {
        expect_error([&] { tokenize_record(rec, *c.tok, &c.tmpl, {}); }, ErrorKind::invalid_input, {"mistral"});
        continue;
      }
      check_conversation(c, rec);
    }
  }
}

TEST(TrainData, MessagesTrainOnPrompt) {
  const json rec = json::parse(R"({"messages": [{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]})");
  const ChatTemplate t = ChatTemplate::from_kind(ChatTemplateKind::chatml);
  DataOptions opt;
  opt.train_on_prompt = true;
  const TokenizedSample s = tokenize_record(rec, qwen2(), &t, opt);
  EXPECT_EQ(trained_runs(s.labels), (std::vector<std::pair<size_t, size_t>>{{1, s.ids.size()}}));
  // A conversation without a reply trains nothing unless train_on_prompt.
  const json user_only = json::parse(R"({"messages": [{"role": "user", "content": "Hi"}]})");
  EXPECT_NO_THROW(tokenize_record(user_only, qwen2(), &t, opt));
  expect_error([&] { tokenize_record(user_only, qwen2(), &t, {}); }, ErrorKind::invalid_input, {"no assistant"});
}

TEST(TrainData, MessagesWithAwkwardReplies) {
  // Replies starting with white space or newlines, empty replies, special-token text.
  const ChatCase cases[] = {{&qwen2(), ChatTemplate::from_kind(ChatTemplateKind::chatml), "<|im_end|>"},
                            {&llama3(), ChatTemplate::from_kind(ChatTemplateKind::llama3), "<|eot_id|>"}};
  for (const ChatCase& c : cases) {
    SCOPED_TRACE(chat_template_kind_name(c.tmpl.kind));
    for (const char* reply : {"\n\nline after blank lines", "  spaced", "x", "ends with newline\n", "tabs\tand 123"}) {
      const json rec{{"messages", json::array({{{"role", "user"}, {"content", "q"}},
                                               {{"role", "assistant"}, {"content", reply}}})}};
      SCOPED_TRACE(show(reply));
      const TokenizedSample s = tokenize_record(rec, *c.tok, &c.tmpl, {});
      EXPECT_EQ(s.ids, c.tok->encode(apply_chat_template(c.tmpl, conversation_of(rec), false), false, true));
      const auto runs = trained_runs(s.labels);
      ASSERT_EQ(runs.size(), 1u);
      EXPECT_EQ(s.ids[runs[0].second - 1], c.tok->token_id(c.end_of_turn));
    }
  }
}

TEST(TrainData, SmolLM2ChatTemplate) {
  if (!fs::exists(smollm2_path())) GTEST_SKIP() << "models/SmolLM2-135M-Instruct.Q4_1.gguf is absent";
  const Tokenizer tok = Tokenizer::from_gguf(*gguf::File::open(smollm2_path()));
  ASSERT_FALSE(tok.chat_template().empty());
  const ChatCase c{&tok, ChatTemplate::from_text(tok.chat_template(), "", ""), "<|im_end|>"};
  EXPECT_FALSE(c.tmpl.default_system.empty());
  std::ifstream f(data_fixture("messages.jsonl"));
  for (std::string line; std::getline(f, line);) check_conversation(c, json::parse(line));
}

// ---- reading files ---------------------------------------------------------

TEST(TrainData, ReadsEachFormatFile) {
  const ChatTemplate t = ChatTemplate::from_kind(ChatTemplateKind::chatml);
  for (const char* file : {"text.jsonl", "prompt_completion.jsonl", "messages.jsonl", "alpaca.jsonl", "mixed.jsonl"}) {
    SCOPED_TRACE(file);
    DataStats st;
    const SampleSet set = read_jsonl_dataset(data_fixture(file), qwen2(), &t, {}, st);
    EXPECT_EQ(set.size(), std::string(file) == "mixed.jsonl" ? 4 : 3);
    EXPECT_EQ(st.samples, set.size());
    EXPECT_EQ(st.tokens, static_cast<int64_t>(set.ids.size()));
    EXPECT_EQ(st.masked_tokens, std::count(set.labels.begin(), set.labels.end(), kIgnoreLabel));
    EXPECT_EQ(st.skipped + st.truncated + st.dropped, 0);
    EXPECT_EQ(st.lines, std::string(file) == "text.jsonl" ? 4 : st.samples);
    EXPECT_EQ(st.blank_lines, std::string(file) == "text.jsonl" ? 1 : 0);
    if (std::string(file) != "text.jsonl") {
      EXPECT_GT(st.masked_tokens, st.samples);  // prompts are masked
    }
  }
  DataOptions forced;
  forced.format = DataFormat::text;
  expect_error([&] { DataStats st; read_jsonl_dataset(data_fixture("alpaca.jsonl"), qwen2(), &t, forced, st); },
               ErrorKind::invalid_input, {"alpaca.jsonl:1:", "missing field \"text\""});
  EXPECT_EQ(data_format_from_name("prompt_completion"), DataFormat::prompt_completion);
  EXPECT_EQ(data_format_from_name("auto"), DataFormat::auto_detect);
  EXPECT_FALSE(data_format_from_name("csv"));
}

TEST(TrainData, TruncatesAndDropsLongSamplesAndCountsThem) {
  DataOptions opt;
  opt.seq_len = 6;
  const std::string text =
      "{\"text\": \"one two three four five six seven eight nine ten\"}\n"
      "{\"text\": \"hi\"}\n"
      "{\"prompt\": \"a very long prompt that fills the whole row and more\", \"completion\": \" done\"}\n";
  DataStats st;
  const SampleSet set = read_jsonl_text(text, "mem.jsonl", qwen2(), nullptr, opt, st);
  EXPECT_EQ(st.truncated, 2);
  EXPECT_EQ(st.dropped, 1);  // the truncated prompt/completion kept no completion token
  EXPECT_EQ(st.samples, 2);
  ASSERT_EQ(set.size(), 2);
  EXPECT_EQ(set.length(0), 6);
  const std::string s = format_data_stats(st);
  EXPECT_NE(s.find("2 truncated"), std::string::npos) << s;
  EXPECT_NE(s.find("1 dropped"), std::string::npos) << s;
}

// ---- bad data --------------------------------------------------------------

TEST(TrainData, MalformedJsonNamesFileAndLine) {
  expect_error([] { DataStats st; read_jsonl_dataset(data_fixture("bad_json.jsonl"), qwen2(), nullptr, {}, st); },
               ErrorKind::invalid_input, {"bad_json.jsonl:3:", "invalid JSON"});
  DataOptions skip;
  skip.skip_bad_lines = true;
  DataStats st;
  const SampleSet set = read_jsonl_dataset(data_fixture("bad_json.jsonl"), qwen2(), nullptr, skip, st);
  EXPECT_EQ(set.size(), 3);
  EXPECT_EQ(st.skipped, 1);
  ASSERT_EQ(st.skipped_examples.size(), 1u);
  EXPECT_NE(st.skipped_examples[0].find("bad_json.jsonl:3:"), std::string::npos);
}

TEST(TrainData, EveryBadFieldIsReportedWithItsLine) {
  const ChatTemplate t = ChatTemplate::from_kind(ChatTemplateKind::chatml);
  const std::string path = data_fixture("bad_fields.jsonl");
  std::ifstream f(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(f, l);) lines.push_back(l);
  const std::vector<std::vector<std::string>> want = {
      {},
      {"field \"text\" must be a string, found number"},
      {"missing field \"completion\""},
      {"missing field \"prompt\""},
      {"must be a JSON object, found array"},
      {"field \"messages\" must be an array, found string"},
      {"missing field \"messages[0].content\""},
      {"field \"messages[0].content\" must be a string, found number"},
      {"no assistant message"},
      {"missing field \"output\""},
      {"no known fields", "keys title"},
      {}};
  ASSERT_EQ(lines.size(), want.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    if (want[i].empty()) continue;
    std::vector<std::string> needles = want[i];
    needles.push_back("bad_fields.jsonl:" + std::to_string(i + 1) + ": ");
    // Each bad line alone after a good one: the error names its line.
    std::string text;
    for (size_t k = 0; k <= i; ++k) text += (k == i || want[k].empty() ? lines[k] : "") + "\n";
    expect_error([&] { DataStats st; read_jsonl_text(text, path, qwen2(), &t, {}, st); }, ErrorKind::invalid_input,
                 needles);
  }
  DataOptions skip;
  skip.skip_bad_lines = true;
  DataStats st;
  const SampleSet set = read_jsonl_dataset(path, qwen2(), &t, skip, st);
  EXPECT_EQ(set.size(), 2);
  EXPECT_EQ(st.skipped, 10);
  EXPECT_EQ(st.skipped_examples.size(), 5u);
  EXPECT_NE(st.skipped_examples[0].find("bad_fields.jsonl:2: "), std::string::npos);
}

TEST(TrainData, EmptyAndUnusableFiles) {
  expect_error([] { DataStats st; read_jsonl_dataset(data_fixture("empty.jsonl"), qwen2(), nullptr, {}, st); },
               ErrorKind::invalid_input, {"empty.jsonl", "empty"});
  expect_error([] { DataStats st; read_jsonl_dataset(data_fixture("blank.jsonl"), qwen2(), nullptr, {}, st); },
               ErrorKind::invalid_input, {"blank.jsonl", "empty"});
  expect_error([] { DataStats st; read_jsonl_dataset(data_fixture("no_such.jsonl"), qwen2(), nullptr, {}, st); },
               ErrorKind::not_found, {"no_such.jsonl"});
  DataOptions skip;
  skip.skip_bad_lines = true;
  expect_error([&] { DataStats st; read_jsonl_text("{\"x\": 1}\n[]\n", "bad.jsonl", qwen2(), nullptr, skip, st); },
               ErrorKind::invalid_input, {"bad.jsonl: no usable samples", "2 skipped"});
  // Messages need a template.
  expect_error(
      [] {
        DataStats st;
        read_jsonl_dataset(data_fixture("messages.jsonl"), qwen2(), nullptr, {}, st);
      },
      ErrorKind::invalid_input, {"messages.jsonl:1:", "chat template"});
  DataOptions tiny;
  tiny.seq_len = 1;
  expect_error([&] { DataStats st; read_jsonl_dataset(data_fixture("text.jsonl"), qwen2(), nullptr, tiny, st); },
               ErrorKind::invalid_input, {"seq_len"});
}

TEST(TrainData, TemplateErrorsNameTheLine) {
  const ChatTemplate t = ChatTemplate::from_kind(ChatTemplateKind::llama2);
  const std::string text =
      "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}]}\n"
      "{\"messages\": [{\"role\": \"assistant\", \"content\": \"b\"}]}\n";
  expect_error([&] { DataStats st; read_jsonl_text(text, "chat.jsonl", spm(), &t, {}, st); },
               ErrorKind::invalid_input, {"chat.jsonl:2: ", "alternate"});
}

// ---- packing and batches ---------------------------------------------------

// Samples of the given lengths: ids 1000*k + i, labels masked on the first
// half (and the first token).
SampleSet synthetic_samples(const std::vector<int>& lengths) {
  SampleSet set;
  for (size_t k = 0; k < lengths.size(); ++k) {
    std::vector<int32_t> ids, labels;
    for (int i = 0; i < lengths[k]; ++i) {
      ids.push_back(static_cast<int32_t>(1000 * (k + 1) + i));
      labels.push_back(i == 0 || i < lengths[k] / 2 ? kIgnoreLabel : ids.back());
    }
    set.add(ids, labels);
  }
  return set;
}

TEST(TrainData, PackingPositionsAndSequenceStarts) {
  const std::vector<int> lengths = {3, 5, 2, 7, 1, 4, 7};
  auto set = std::make_shared<const SampleSet>(synthetic_samples(lengths));
  std::vector<int64_t> order = {0, 1, 2, 3, 4, 5, 6};
  const PackedRows rows = pack_samples(*set, order, 7, true);
  // Greedy in order: [3] can't take 5 -> {0}; {1,2}; {3}; {4,5}; {6}.
  EXPECT_EQ(rows.row_offsets, (std::vector<int64_t>{0, 1, 3, 4, 6, 7}));
  DataSplit split{set, rows, {}, 7};
  const int32_t pad = 77;
  Batch b;
  const std::vector<int64_t> row_ids = {1, 3};
  fill_batch(split, row_ids, pad, b);
  ASSERT_EQ(b.rows, 2);
  ASSERT_EQ(b.seq_len, 7);
  // Row 1: sample 1 (5 tokens) then sample 2 (2 tokens).
  EXPECT_EQ(std::vector<int32_t>(b.tokens.begin(), b.tokens.begin() + 7),
            (std::vector<int32_t>{2000, 2001, 2002, 2003, 2004, 3000, 3001}));
  EXPECT_EQ(std::vector<int32_t>(b.positions.begin(), b.positions.begin() + 7),
            (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1}));
  EXPECT_EQ(std::vector<int32_t>(b.seq_start.begin(), b.seq_start.begin() + 7),
            (std::vector<int32_t>{0, 0, 0, 0, 0, 5, 5}));
  // Sample 1 labels: masked at 0, 1 (first half of 5 = 2); trained 2, 3, 4. Target t = label t+1;
  // the last token of a sample predicts nothing (no crossing into the next sample).
  EXPECT_EQ(std::vector<int32_t>(b.targets.begin(), b.targets.begin() + 7),
            (std::vector<int32_t>{kIgnoreLabel, 2002, 2003, 2004, kIgnoreLabel, 3001, kIgnoreLabel}));
  // Row 3 is sample 4 (1 token) + sample 5 (4 tokens) + 2 pad.
  const int32_t* t1 = b.tokens.data() + 7;
  EXPECT_EQ(std::vector<int32_t>(t1, t1 + 7), (std::vector<int32_t>{5000, 6000, 6001, 6002, 6003, pad, pad}));
  EXPECT_EQ(std::vector<int32_t>(b.positions.begin() + 7, b.positions.end()),
            (std::vector<int32_t>{0, 0, 1, 2, 3, 0, 0}));
  EXPECT_EQ(std::vector<int32_t>(b.seq_start.begin() + 7, b.seq_start.end()),
            (std::vector<int32_t>{0, 1, 1, 1, 1, 5, 6}));
  EXPECT_EQ(std::vector<int32_t>(b.targets.begin() + 7, b.targets.end()),
            (std::vector<int32_t>{kIgnoreLabel, kIgnoreLabel, 6002, 6003, kIgnoreLabel, kIgnoreLabel, kIgnoreLabel}));
  EXPECT_EQ(b.target_tokens, 4 + 2);

  // Without packing: one sample per row.
  const PackedRows single = pack_samples(*set, order, 7, false);
  EXPECT_EQ(single.rows(), 7);
  EXPECT_EQ(single.samples, order);

  // Every token of every sample lands in exactly one row, none over seq_len.
  for (int64_t T : {7, 8, 11, 40}) {
    const PackedRows r = pack_samples(*set, order, T, true);
    EXPECT_EQ(r.samples, order);
    for (int64_t i = 0; i < r.rows(); ++i) {
      int64_t used = 0;
      for (int64_t k = r.row_offsets[i]; k < r.row_offsets[i + 1]; ++k) used += set->length(r.samples[k]);
      EXPECT_LE(used, T);
      EXPECT_GT(used, 0);
    }
  }
}

TEST(TrainData, SeededPermutations) {
  for (int64_t n : {0, 1, 2, 7, 100}) {
    const auto p = seeded_permutation(n, 42, 3);
    EXPECT_EQ(p, seeded_permutation(n, 42, 3));
    auto sorted = p;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(sorted[i], i);
  }
  EXPECT_NE(seeded_permutation(100, 42, 3), seeded_permutation(100, 43, 3));
  EXPECT_NE(seeded_permutation(100, 42, 3), seeded_permutation(100, 42, 4));
  // Pinned values: a change of the stream would silently change every run.
  const auto p = seeded_permutation(10, 1234, 1);
  EXPECT_EQ(p, (std::vector<int64_t>{4, 6, 3, 9, 1, 7, 8, 2, 0, 5}));
}

std::vector<std::vector<int32_t>> epoch_tokens(DataLoader& dl) {
  std::vector<std::vector<int32_t>> out;
  for (int64_t i = 0; i < dl.batches_per_epoch(); ++i) out.push_back(dl.next().tokens);
  return out;
}

TEST(TrainData, DataLoaderShufflesDeterministicallyAndResumes) {
  std::vector<int> lengths;
  for (int i = 0; i < 23; ++i) lengths.push_back(1 + (i * 7) % 5);
  auto set = std::make_shared<const SampleSet>(synthetic_samples(lengths));
  std::vector<int64_t> order(23);
  for (int i = 0; i < 23; ++i) order[i] = i;
  const DataSplit split{set, pack_samples(*set, order, 6, false), {}, 23};
  DataLoader a(split, 0, 5, true, 9), b(split, 0, 5, true, 9), c(split, 0, 5, true, 10);
  EXPECT_EQ(a.batches_per_epoch(), 5);
  const auto e0 = epoch_tokens(a);
  EXPECT_EQ(e0, epoch_tokens(b));
  EXPECT_NE(e0, epoch_tokens(c));
  EXPECT_EQ(e0.back().size(), 3u * 6);  // 23 rows = 4 * 5 + 3
  EXPECT_EQ(a.cursor(), (DataCursor{1, 0}));
  const auto e1 = epoch_tokens(a);
  EXPECT_NE(e0, e1);  // a new order each epoch
  // Every row once per epoch.
  std::multiset<int32_t> firsts;
  for (const auto& batch : e1)
    for (size_t r = 0; r < batch.size() / 6; ++r) firsts.insert(batch[r * 6]);
  EXPECT_EQ(firsts.size(), 23u);
  EXPECT_EQ(std::set<int32_t>(firsts.begin(), firsts.end()).size(), 23u);

  // Resume mid-epoch from a saved cursor: the same batches follow.
  DataLoader run(split, 0, 5, true, 9);
  for (int i = 0; i < 7; ++i) run.next();
  const DataCursor saved = run.cursor();
  EXPECT_EQ(saved, (DataCursor{1, 10}));
  std::vector<std::vector<int32_t>> rest;
  for (int i = 0; i < 6; ++i) rest.push_back(run.next().tokens);
  DataLoader resumed(split, 0, 5, true, 9, saved);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(resumed.next().tokens, rest[i]) << i;

  // No shuffle: file order, every epoch.
  DataLoader plain(split, 0, 5, false, 9);
  const auto p0 = epoch_tokens(plain);
  EXPECT_EQ(p0, epoch_tokens(plain));
  EXPECT_EQ(p0[0][0], 1000);
  expect_error([&] { plain.seek({0, 23}); }, ErrorKind::invalid_input, {"cursor"});
  expect_error([&] { DataLoader bad(split, 0, 0, true, 1); }, ErrorKind::invalid_input, {"batch size"});
}

TEST(TrainData, PrepareWithEvalSplitAndEvalFile) {
  std::string text;
  for (int i = 0; i < 20; ++i) text += fmt::format("{{\"text\": \"sample number {} {}\"}}\n", i, std::string(i % 4, 'x'));
  const std::string dir = temp_dir("prepare");
  const std::string path = dir + "/train.jsonl";
  std::ofstream(path) << text;
  DataOptions opt;
  opt.seq_len = 32;
  opt.seed = 5;
  opt.eval_count = 4;
  const TrainData d = prepare_train_data(path, qwen2(), nullptr, opt);
  ASSERT_TRUE(d.eval);
  EXPECT_EQ(d.train.n_samples, 16);
  EXPECT_EQ(d.eval->n_samples, 4);
  EXPECT_EQ(d.pad_id, qwen2().eos());
  std::set<int64_t> all(d.train.rows.samples.begin(), d.train.rows.samples.end());
  for (int64_t s : d.eval->rows.samples) EXPECT_TRUE(all.insert(s).second) << "sample in both splits: " << s;
  EXPECT_EQ(all.size(), 20u);
  EXPECT_LT(d.train.rows.rows(), 16);  // packed
  // Same seed, same split and order; another seed, another.
  const TrainData again = prepare_train_data(path, qwen2(), nullptr, opt);
  EXPECT_EQ(again.train.rows.samples, d.train.rows.samples);
  EXPECT_EQ(again.eval->rows.samples, d.eval->rows.samples);
  opt.seed = 6;
  EXPECT_NE(prepare_train_data(path, qwen2(), nullptr, opt).train.rows.samples, d.train.rows.samples);

  opt.eval_count = 0;
  opt.eval_fraction = 0.25;
  EXPECT_EQ(prepare_train_data(path, qwen2(), nullptr, opt).eval->n_samples, 5);
  opt.eval_fraction = 0;
  EXPECT_FALSE(prepare_train_data(path, qwen2(), nullptr, opt).eval);
  opt.eval_file = data_fixture("eval.jsonl");
  const TrainData with_file = prepare_train_data(path, qwen2(), nullptr, opt);
  ASSERT_TRUE(with_file.eval);
  EXPECT_EQ(with_file.eval->n_samples, 3);
  EXPECT_EQ(with_file.train.n_samples, 20);
  EXPECT_EQ(with_file.eval->stats.lines, 3);

  opt.eval_count = 2;
  expect_error([&] { prepare_train_data(path, qwen2(), nullptr, opt); }, ErrorKind::invalid_input, {"not both"});
  opt.eval_file.clear();
  opt.eval_count = 20;
  expect_error([&] { prepare_train_data(path, qwen2(), nullptr, opt); }, ErrorKind::invalid_input,
               {"leaves none"});
  opt.eval_count = 0;
  opt.eval_fraction = 0.01;
  expect_error([&] { prepare_train_data(path, qwen2(), nullptr, opt); }, ErrorKind::invalid_input,
               {"eval fraction"});
  fs::remove_all(dir);
}

// ---- cache -----------------------------------------------------------------

void expect_same(const SampleSet& a, const SampleSet& b) {
  EXPECT_EQ(a.offsets, b.offsets);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.labels, b.labels);
}

TEST(TrainData, CacheHitMissAndCorruption) {
  const std::string dir = temp_dir("cache");
  const ChatTemplate t = ChatTemplate::from_kind(ChatTemplateKind::chatml);
  const std::string data = dir + "/mixed.jsonl";
  fs::copy_file(data_fixture("mixed.jsonl"), data);
  DataOptions opt;
  opt.cache_dir = dir + "/cache";
  DataStats st0;
  const SampleSet fresh = read_jsonl_dataset(data, qwen2(), &t, opt, st0);

  DataStats st;
  CacheInfo ci;
  expect_same(load_jsonl_dataset(data, qwen2(), &t, opt, st, ci), fresh);
  EXPECT_EQ(ci.status, CacheInfo::Status::built) << ci.reason;
  EXPECT_TRUE(fs::exists(ci.path));
  EXPECT_EQ(ci.path, dataset_cache_path(opt.cache_dir, read_text_file(data), qwen2(), &t, opt));

  DataStats st2;
  CacheInfo hit;
  expect_same(load_jsonl_dataset(data, qwen2(), &t, opt, st2, hit), fresh);
  EXPECT_EQ(hit.status, CacheInfo::Status::hit);
  EXPECT_EQ(hit.path, ci.path);
  EXPECT_EQ(format_data_stats(st2), format_data_stats(st0));

  // Anything that changes samples changes the key.
  const std::string bytes = read_text_file(data);
  const auto other = [&](DataOptions o) { return dataset_cache_path(opt.cache_dir, bytes, qwen2(), &t, o); };
  DataOptions o = opt;
  o.seq_len = 100;
  EXPECT_NE(other(o), ci.path);
  o = opt;
  o.train_on_prompt = true;
  EXPECT_NE(other(o), ci.path);
  o = opt;
  o.shuffle = false;  // does not change samples
  EXPECT_EQ(other(o), ci.path);
  EXPECT_NE(dataset_cache_path(opt.cache_dir, bytes + " ", qwen2(), &t, opt), ci.path);
  EXPECT_NE(dataset_cache_path(opt.cache_dir, bytes, llama3(), &t, opt), ci.path);
  const ChatTemplate t2 = ChatTemplate::from_text(chat()["templates"]["chatml_qwen2"].get<std::string>(), "", "");
  EXPECT_NE(dataset_cache_path(opt.cache_dir, bytes, qwen2(), &t2, opt), ci.path);
  EXPECT_NE(tokenizer_fingerprint(qwen2()), tokenizer_fingerprint(llama3()));
  EXPECT_EQ(tokenizer_fingerprint(qwen2()), tokenizer_fingerprint(Tokenizer::from_tokenizer_json(fixture("qwen2_style.json"))));

  // Damaged files are rebuilt, never used.
  const std::string good = read_text_file(ci.path);
  const auto damaged = [&](const std::string& content, const std::string& why) {
    SCOPED_TRACE(why);
    std::ofstream(ci.path, std::ios::binary | std::ios::trunc) << content;
    DataStats s;
    CacheInfo c;
    expect_same(load_jsonl_dataset(data, qwen2(), &t, opt, s, c), fresh);
    EXPECT_EQ(c.status, CacheInfo::Status::rebuilt);
    EXPECT_NE(c.reason.find(why), std::string::npos) << c.reason;
    EXPECT_EQ(read_text_file(ci.path), good);  // rewritten
  };
  std::string flipped = good;
  flipped[flipped.size() / 2] ^= 0x10;
  damaged(flipped, "checksum");
  damaged(good.substr(0, good.size() - 9), "checksum");
  damaged("", "too short");
  damaged(std::string(4096, 'z'), "checksum");
  // A valid file under another key's name (copied, or a hash collision).
  DataOptions o2 = opt;
  o2.seq_len = 100;
  DataStats s2;
  CacheInfo c2;
  load_jsonl_dataset(data, qwen2(), &t, o2, s2, c2);
  damaged(read_text_file(c2.path), "key mismatch");

  // An unwritable cache directory is reported, not fatal.
  DataOptions ro = opt;
  ro.cache_dir = data + "/not_a_dir";
  DataStats s3;
  CacheInfo c3;
  expect_same(load_jsonl_dataset(data, qwen2(), &t, ro, s3, c3), fresh);
  EXPECT_NE(c3.reason.find("cannot"), std::string::npos) << c3.reason;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom
