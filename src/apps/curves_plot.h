// `loom plot`'s picture: training and eval loss, eval token accuracy, learning
// rate and gradient norm against the step, one panel each (loss curves share
// one), every run in its own colour with a legend. One cairo drawing writes both
// formats (SVG surface, PNG through an image surface); text in DejaVu Sans.
#pragma once

#include <string>
#include <vector>

#include "apps/curves_data.h"

namespace loom::app {

enum class ImageFormat { svg, png };

struct PlotOptions {
  std::string title = "Training curves";
  int width = 1200, height = 820;  // pixels (SVG: px units)
};

// The stroke colour of run i (tab10 without its grey; cycles after 9 runs), as 0..1 RGB.
struct Rgb {
  double r, g, b;
};
Rgb run_colour(size_t i);

// The image's bytes. Each curve with two or more points is one stroked path in
// its run's colour (train loss solid, eval loss dashed; eval points also as
// dots), plus one legend swatch per run; axes, grid and text are grey or black.
// A panel without any point says so. Throws loom::Error (internal) when cairo fails.
std::string render_curves(const std::vector<MetricsRun>& runs, const PlotOptions& opt, ImageFormat format);

}  // namespace loom::app
