// A model whose config and weights disagree on the layer count is refused at
// load, naming the file and the first layer past the config's count (a folder
// whose num_hidden_layers was lowered ran on part of its layers and wrote
// blanks, without a word).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "expect_error.h"
#include "model/model.h"
#include "temp_dir.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using test_util::expect_error;
using test_util::TempDir;

std::string fixture(const std::string& rel) {
  return std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/" + rel;
}

TEST(ModelLayers, FolderWithWeightsPastItsConfigsLayersIsRefused) {
  TempDir dir("model_layers");
  fs::copy(fixture("model/tiny-llama"), dir.path, fs::copy_options::recursive);
  const std::string cfg_path = dir.str() + "/config.json";
  auto cfg = nlohmann::json::parse(std::ifstream(cfg_path));
  ASSERT_EQ(cfg["num_hidden_layers"], 2);
  EXPECT_NO_THROW(Model::load(dir.str(), {.tokenizer = false, .pack = false}));
  cfg["num_hidden_layers"] = 1;
  std::ofstream(cfg_path, std::ios::trunc) << cfg.dump(2);
  expect_error(
      [&] { Model::load(dir.str(), {.tokenizer = false, .pack = false}); }, ErrorKind::invalid_input,
      {dir.str(), "'model.layers.1.self_attn.q_proj.weight'", "config gives 1 layers", "num_hidden_layers"});
}

}  // namespace
}  // namespace loom
