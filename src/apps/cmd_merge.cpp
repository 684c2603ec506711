// `loom merge`: merges a PEFT LoRA adapter into a model and writes the result
// as a Hugging Face folder (config.json, model.safetensors, generation_config.json).
#include <cstdio>
#include <filesystem>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "io/file_write.h"
#include "model/model.h"
#include "model/adapter_merge.h"
#include "model/hf_export.h"

namespace loom::app {

namespace {

int run_merge(int argc, char** argv) {
  CLI::App app("Merge a LoRA adapter into a model and write a Hugging Face folder.", "merge");
  std::string model_path, adapter_dir, out_dir, dtype = "f32";
  int threads = 1;
  bool overwrite = false;
  app.add_option("-m,--model", model_path, "a .gguf file or a Hugging Face model folder")->required();
  app.add_option("--adapter", adapter_dir, "a PEFT LoRA adapter folder or a llama.cpp GGUF LoRA file")
      ->required();
  app.add_option("-o,--output", out_dir, "the folder to write")->required();
  app.add_option("--dtype", dtype, "storage type of the written weights")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->capture_default_str();
  app.add_flag("--overwrite", overwrite,
               "the output may be a non-empty folder that is not a loom/PEFT output; it is replaced as a whole");
  add_threads_flag(app, threads);
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  const safetensors::StDType st = dtype == "bf16"  ? safetensors::StDType::bf16
                                  : dtype == "f16" ? safetensors::StDType::f16
                                                   : safetensors::StDType::f32;

  // The folder is replaced as a whole: never the inputs, and check before the (long) merge.
  for (const auto& [input, flag] : {std::pair{model_path, "-m"}, {adapter_dir, "--adapter"}})
    if (path_within(input, out_dir))
      fail(ErrorKind::invalid_input, "-o '{}' holds the {} input '{}'; writing the output would replace it", out_dir,
           flag, input);
  FolderWriteOptions out_opt;
  out_opt.overwrite = overwrite;
  out_opt.what = "-o";
  check_folder_replaceable(out_dir, overwrite, out_opt.what, out_opt.force);
  check_folder_writable(out_dir, out_opt.what);

  ThreadPool pool(threads);
  // A GGUF file's tokenizer supplies the bos/eos ids for config.json and the
  // tokenizer files (tokenizer/tokenizer_export.h); an HF folder's are copied
  // from its config.json, and it may have no tokenizer.json.
  const bool gguf = !std::filesystem::is_directory(model_path);
  Model::LoadOptions load{.tokenizer = gguf, .pack = false};
  load.before_pack = adapter_merge_hook(adapter_dir);
  auto model = Model::load(model_path, load);
  write_hf_folder(*model, out_dir, st, out_opt);
  std::fprintf(stderr, "wrote %s (%s)%s\n", out_dir.c_str(), dtype.c_str(),
               model->is_gguf() ? "; tokenizer files written from the GGUF tokenizer" : "");
  return 0;
}

}  // namespace

extern const Command kMergeCommand = {"merge", run_merge};

}  // namespace loom::app
