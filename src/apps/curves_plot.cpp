// Drawing `loom plot`'s panels with cairo (curves_plot.h).
#include "apps/curves_plot.h"

#include <cairo-svg.h>
#include <cairo.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace loom::app {

namespace {

constexpr const char* kFont = "DejaVu Sans";
constexpr Rgb kText{0.1, 0.1, 0.1}, kAxis{0.35, 0.35, 0.35}, kGrid{0.88, 0.88, 0.88}, kMuted{0.45, 0.45, 0.45};

void set_colour(cairo_t* cr, Rgb c) { cairo_set_source_rgb(cr, c.r, c.g, c.b); }

void set_font(cairo_t* cr, double size, bool bold = false) {
  cairo_select_font_face(cr, kFont, CAIRO_FONT_SLANT_NORMAL, bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
}

// Text with its anchor at (x, y): ax 0 / 0.5 / 1 = left / centre / right,
// ay 0 / 0.5 / 1 = top / middle / baseline-ish bottom. Returns its width.
double text(cairo_t* cr, double x, double y, const std::string& s, double ax, double ay) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  cairo_font_extents_t f;
  cairo_font_extents(cr, &f);
  const double h = f.ascent;  // cap-height-ish box, so labels of one row line up
  cairo_move_to(cr, x - ax * e.x_advance, y + (1 - ay) * h);
  cairo_show_text(cr, s.c_str());
  cairo_new_path(cr);
  return e.x_advance;
}

double text_width(cairo_t* cr, const std::string& s) {
  cairo_text_extents_t e;
  cairo_text_extents(cr, s.c_str(), &e);
  return e.x_advance;
}

struct Rect {
  double x, y, w, h;
};

// One curve of a panel.
struct Line {
  const Curve* curve;
  size_t run;
  bool eval;  // dashed, with dots
};

struct Panel {
  std::string title, y_label, empty_note;
  double scale = 1;  // eval_accuracy drawn in percent
  double top = std::numeric_limits<double>::infinity();  // no value above (100 %)
  std::vector<Line> lines;
};

// Finite values of the panel (scaled): the y range, or none. Every metric is
// >= 0, so a single value widens into [0, top], never below 0 or above `top`.
bool y_range(const Panel& p, double& lo, double& hi) {
  lo = std::numeric_limits<double>::infinity();
  hi = -lo;
  for (const Line& l : p.lines)
    for (const auto& [s, v] : *l.curve)
      if (std::isfinite(v)) {
        lo = std::min(lo, v * p.scale);
        hi = std::max(hi, v * p.scale);
      }
  if (lo > hi) return false;
  if (hi - lo <= 1e-12 * std::max(1.0, std::fabs(hi))) {
    const double pad = hi == 0 ? 1 : std::fabs(hi) * 0.1;
    lo = std::max(std::min(lo, 0.0), lo - pad);
    hi = std::min(p.top, hi + pad);
    if (hi <= lo) lo = hi - pad;
  }
  return true;
}

// `a`: the inner plot area, where the tick range maps (inset from the frame so
// points on the range's ends stay visible).
void draw_curve(cairo_t* cr, const Line& l, double scale, const Rect& a, const Ticks& xt, const Ticks& yt) {
  auto X = [&](double s) { return a.x + (s - xt.lo) / (xt.hi - xt.lo) * a.w; };
  auto Y = [&](double v) { return a.y + a.h - (v * scale - yt.lo) / (yt.hi - yt.lo) * a.h; };
  const Curve& c = *l.curve;
  set_colour(cr, run_colour(l.run));
  // One path per curve; NaN values break it into pieces.
  bool pen = false;
  int segments = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    if (!std::isfinite(c[i].second)) {
      pen = false;
      continue;
    }
    if (pen) {
      cairo_line_to(cr, X(static_cast<double>(c[i].first)), Y(c[i].second));
      ++segments;
    } else {
      cairo_move_to(cr, X(static_cast<double>(c[i].first)), Y(c[i].second));
      pen = true;
    }
  }
  if (segments > 0) {
    cairo_set_line_width(cr, 1.8);
    cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
    const double dash[] = {7, 4};
    cairo_set_dash(cr, dash, l.eval ? 2 : 0, 0);
    cairo_stroke(cr);
    cairo_set_dash(cr, nullptr, 0, 0);
  }
  cairo_new_path(cr);
  if (!l.eval) return;
  for (const auto& [s, v] : c) {
    if (!std::isfinite(v)) continue;
    cairo_new_sub_path(cr);
    cairo_arc(cr, X(static_cast<double>(s)), Y(v), 3.2, 0, 2 * M_PI);
  }
  cairo_fill(cr);
}

void draw_panel(cairo_t* cr, const Panel& p, const Rect& box, const Ticks& xt) {
  // Title above, y ticks left, x ticks and "step" below.
  set_colour(cr, kText);
  set_font(cr, 14, true);
  text(cr, box.x + box.w / 2, box.y, p.title, 0.5, 0);
  const Rect frame{box.x + 78, box.y + 28, box.w - 92, box.h - 28 - 46};
  constexpr double kInset = 7;
  const Rect a{frame.x + kInset, frame.y + kInset, frame.w - 2 * kInset, frame.h - 2 * kInset};
  double lo = 0, hi = 0;
  const bool has = y_range(p, lo, hi);
  const int target = std::clamp(static_cast<int>(a.h / 45), 2, 6);  // labels at least ~45 px apart
  const Ticks yt = has ? nice_ticks(lo, hi, target) : nice_ticks(0, 1, target);

  set_font(cr, 11);
  cairo_set_line_width(cr, 1);
  const double span = std::max(std::fabs(yt.lo), std::fabs(yt.hi));  // one notation for the axis
  for (double v : yt.values) {
    const double y = a.y + a.h - (v - yt.lo) / (yt.hi - yt.lo) * a.h;
    set_colour(cr, kGrid);
    cairo_move_to(cr, frame.x, y);
    cairo_line_to(cr, frame.x + frame.w, y);
    cairo_stroke(cr);
    set_colour(cr, kText);
    if (has) text(cr, frame.x - 6, y, format_tick(v, yt.step, span), 1, 0.5);
  }
  for (double s : xt.values) {
    const double x = a.x + (s - xt.lo) / (xt.hi - xt.lo) * a.w;
    set_colour(cr, kGrid);
    cairo_move_to(cr, x, frame.y);
    cairo_line_to(cr, x, frame.y + frame.h);
    cairo_stroke(cr);
    set_colour(cr, kText);
    text(cr, x, frame.y + frame.h + 6, format_tick(s, xt.step), 0.5, 0);
  }
  set_colour(cr, kAxis);
  cairo_rectangle(cr, frame.x, frame.y, frame.w, frame.h);
  cairo_stroke(cr);
  set_colour(cr, kText);
  set_font(cr, 12);
  text(cr, frame.x + frame.w / 2, frame.y + frame.h + 26, "step", 0.5, 0);
  cairo_save(cr);
  cairo_translate(cr, box.x + 12, frame.y + frame.h / 2);
  cairo_rotate(cr, -M_PI / 2);
  text(cr, 0, 0, p.y_label, 0.5, 0.5);
  cairo_restore(cr);

  if (!has) {
    set_colour(cr, kMuted);
    set_font(cr, 13);
    text(cr, a.x + a.w / 2, a.y + a.h / 2, p.empty_note, 0.5, 0.5);
    return;
  }
  cairo_save(cr);
  cairo_rectangle(cr, frame.x, frame.y, frame.w, frame.h);
  cairo_clip(cr);
  for (const Line& l : p.lines) draw_curve(cr, l, p.scale, a, xt, yt);
  cairo_restore(cr);
}

// One row under the title: a swatch and the label of every run, then the
// line-style key. Wraps onto more rows when it is wider than the picture.
double draw_legend(cairo_t* cr, const std::vector<MetricsRun>& runs, double width, double y) {
  set_font(cr, 12);
  const double swatch = 26, gap = 22, row_h = 20;
  double x = 24;
  auto fit = [&](double w) {
    if (x + w > width - 24 && x > 24) {
      x = 24;
      y += row_h;
    }
  };
  for (size_t i = 0; i < runs.size(); ++i) {
    const double w = swatch + 6 + text_width(cr, runs[i].label);
    fit(w);
    set_colour(cr, run_colour(i));
    cairo_set_line_width(cr, 3);
    cairo_move_to(cr, x, y + 7);
    cairo_line_to(cr, x + swatch, y + 7);
    cairo_stroke(cr);
    set_colour(cr, kText);
    text(cr, x + swatch + 6, y + 7, runs[i].label, 0, 0.5);
    x += w + gap;
  }
  // Key: solid = training, dashed with dots = evaluation.
  const std::string train = "training", eval = "evaluation";
  fit(2 * swatch + 12 + text_width(cr, train) + text_width(cr, eval) + gap);
  set_colour(cr, kMuted);
  cairo_set_line_width(cr, 1.8);
  cairo_move_to(cr, x, y + 7);
  cairo_line_to(cr, x + swatch, y + 7);
  cairo_stroke(cr);
  x += swatch + 6 + text(cr, x + swatch + 6, y + 7, train, 0, 0.5) + gap;
  const double dash[] = {7, 4};
  cairo_set_dash(cr, dash, 2, 0);
  cairo_move_to(cr, x, y + 7);
  cairo_line_to(cr, x + swatch, y + 7);
  cairo_stroke(cr);
  cairo_set_dash(cr, nullptr, 0, 0);
  cairo_arc(cr, x + swatch / 2, y + 7, 3.2, 0, 2 * M_PI);
  cairo_fill(cr);
  text(cr, x + swatch + 6, y + 7, eval, 0, 0.5);
  return y + row_h;
}

std::vector<Panel> make_panels(const std::vector<MetricsRun>& runs) {
  std::vector<Panel> p(4);
  const double inf = std::numeric_limits<double>::infinity();
  p[0] = {"Loss", "nats / token", "no loss records", 1, inf, {}};
  p[1] = {"Eval token accuracy", "argmax = target (%)", "no eval_accuracy records", 100, 100, {}};
  p[2] = {"Learning rate", "learning rate", "no lr records", 1, inf, {}};
  p[3] = {"Gradient norm", "L2 norm before clipping", "no grad_norm records", 1, inf, {}};
  for (size_t i = 0; i < runs.size(); ++i) {
    p[0].lines.push_back({&runs[i].loss, i, false});
    p[0].lines.push_back({&runs[i].eval_loss, i, true});
    p[1].lines.push_back({&runs[i].eval_accuracy, i, true});
    p[2].lines.push_back({&runs[i].lr, i, false});
    p[3].lines.push_back({&runs[i].grad_norm, i, false});
  }
  return p;
}

void draw(cairo_t* cr, const std::vector<MetricsRun>& runs, const PlotOptions& opt) {
  const double W = opt.width, H = opt.height;
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  set_colour(cr, kText);
  set_font(cr, 20, true);
  text(cr, W / 2, 14, opt.title, 0.5, 0);
  const double top = draw_legend(cr, runs, W, 48) + 14;

  int64_t max_step = 1;
  for (const MetricsRun& r : runs) max_step = std::max(max_step, r.max_step());
  // Whole steps; the axis ends at the last step (ticks beyond it dropped).
  Ticks xt = nice_ticks(0, static_cast<double>(max_step), 6, /*min_step=*/1);
  xt.hi = static_cast<double>(max_step);
  std::erase_if(xt.values, [&](double v) { return v > xt.hi; });
  const std::vector<Panel> panels = make_panels(runs);
  const double pw = (W - 30) / 2, ph = (H - top - 10) / 2;
  for (size_t i = 0; i < panels.size(); ++i)
    draw_panel(cr, panels[i], {15 + static_cast<double>(i % 2) * pw, top + static_cast<double>(i / 2) * ph, pw - 10, ph - 14},
               xt);
}

cairo_status_t append(void* closure, const unsigned char* data, unsigned int length) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), length);
  return CAIRO_STATUS_SUCCESS;
}

void check(cairo_status_t s, const char* what) {
  if (s != CAIRO_STATUS_SUCCESS) fail(ErrorKind::internal, "cairo: {}: {}", what, cairo_status_to_string(s));
}

}  // namespace

Rgb run_colour(size_t i) {
  static constexpr Rgb kPalette[] = {{0.122, 0.467, 0.706}, {1.000, 0.498, 0.055}, {0.173, 0.627, 0.173},
                                     {0.839, 0.153, 0.157}, {0.580, 0.404, 0.741}, {0.549, 0.337, 0.294},
                                     {0.890, 0.467, 0.761}, {0.737, 0.741, 0.133}, {0.090, 0.745, 0.812}};
  return kPalette[i % std::size(kPalette)];
}

std::string render_curves(const std::vector<MetricsRun>& runs, const PlotOptions& opt, ImageFormat format) {
  LOOM_ASSERT(!runs.empty() && opt.width > 0 && opt.height > 0);
  std::string out;
  cairo_surface_t* surface =
      format == ImageFormat::svg
          ? cairo_svg_surface_create_for_stream(append, &out, opt.width, opt.height)
          : cairo_image_surface_create(CAIRO_FORMAT_RGB24, opt.width, opt.height);
  check(cairo_surface_status(surface), "create surface");
  if (format == ImageFormat::svg) cairo_svg_surface_set_document_unit(surface, CAIRO_SVG_UNIT_PX);
  cairo_t* cr = cairo_create(surface);
  draw(cr, runs, opt);
  const cairo_status_t drawn = cairo_status(cr);
  cairo_destroy(cr);
  if (drawn != CAIRO_STATUS_SUCCESS) cairo_surface_destroy(surface);
  check(drawn, "draw");
  if (format == ImageFormat::png) {
    const cairo_status_t s = cairo_surface_write_to_png_stream(surface, append, &out);
    cairo_surface_destroy(surface);
    check(s, "write PNG");
  } else {
    cairo_surface_finish(surface);  // flushes the SVG document into `out`
    const cairo_status_t s = cairo_surface_status(surface);
    cairo_surface_destroy(surface);
    check(s, "write SVG");
  }
  return out;
}

}  // namespace loom::app
