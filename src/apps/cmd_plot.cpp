// `loom plot`: training curves (loss, eval loss, token accuracy, learning rate,
// gradient norm) from one or more metrics_file JSONL files, as SVG or PNG.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "apps/cli_common.h"
#include "apps/commands.h"
#include "apps/curves_data.h"
#include "apps/curves_plot.h"
#include "core/error.h"
#include "io/file_write.h"

namespace loom::app {
namespace {

std::string lower_extension(const std::string& path) {
  std::string e = std::filesystem::path(path).extension().string();
  std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return e;
}

int run_plot(int argc, char** argv) {
  CLI::App app(
      "Draw training curves from loom train metrics files (metrics_file): training and eval loss, eval token "
      "accuracy, learning rate and gradient norm against the step; several files are overlaid.",
      "plot");
  std::vector<std::string> inputs, labels;
  std::string out, title = PlotOptions{}.title;
  PlotOptions opt;
  app.add_option("metrics", inputs, "metrics_file JSONL files written by loom train")->required();
  app.add_option("-o,--output", out, "the picture to write: a .svg or .png file")
      ->required()
      ->check(CLI::Validator(
          [](std::string& p) {
            const std::string e = lower_extension(p);
            return e == ".svg" || e == ".png" ? std::string()
                                              : "'" + p + "' must end in .svg or .png (the format is chosen by it)";
          },
          "FILE.svg|FILE.png"));
  app.add_option("--title", title, "the picture's title")->capture_default_str();
  app.add_option("--label", labels, "legend name of each file, in order (default: the file names)");
  app.add_option("--width", opt.width, "width in pixels")->capture_default_str()->check(CLI::Range(400, 8000));
  app.add_option("--height", opt.height, "height in pixels")->capture_default_str()->check(CLI::Range(300, 8000));
  int code = 0;
  if (!parse_cli(app, argc, argv, code)) return code;
  if (!labels.empty() && labels.size() != inputs.size()) {
    std::fprintf(stderr, "loom plot: error: --label given %zu times for %zu metrics files (give one per file)\n",
                 labels.size(), inputs.size());
    return 2;
  }
  for (const std::string& in : inputs)
    if (path_within(out, in)) {
      std::fprintf(stderr, "loom plot: error: --output '%s' is the metrics file '%s'; it would be replaced\n",
                   out.c_str(), in.c_str());
      return 2;
    }

  std::vector<MetricsRun> runs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<std::string> warnings;
    runs.push_back(read_metrics_jsonl(inputs[i], &warnings));
    for (const std::string& w : warnings) std::fprintf(stderr, "loom plot: warning: %s\n", w.c_str());
    if (!labels.empty()) runs.back().label = labels[i];
  }
  opt.title = title;
  const ImageFormat format = lower_extension(out) == ".svg" ? ImageFormat::svg : ImageFormat::png;
  write_file_atomic(out, render_curves(runs, opt, format));
  int64_t steps = 0;
  for (const MetricsRun& r : runs) steps = std::max(steps, r.max_step());
  std::printf("wrote %s: %zu run%s, steps 0..%lld\n", out.c_str(), runs.size(), runs.size() == 1 ? "" : "s",
              static_cast<long long>(steps));
  return 0;
}

}  // namespace

extern const Command kPlotCommand = {"plot", run_plot};

}  // namespace loom::app
