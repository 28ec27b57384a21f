// The drawing layer (render.hpp) with PLplot's C API and its cairo PNG device ("pngcairo"): no
// display is needed. PLplot keeps global state (the current stream, its colour maps), so every
// figure is drawn under one process-wide lock in a stream of its own, ended before the lock is
// released. PLplot ends the process on some errors (plexit), which is why plot.cpp checks every
// input before a figure gets here.
#include <fmt/format.h>
#include <plplot.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "apps/plot/render.hpp"

namespace tessera::plot::detail {

namespace {

std::mutex& plplot_lock() {
  static std::mutex lock;
  return lock;
}

/// Colour map 0 slots: 0 background (white), 1 text and axes (black); the slots from 2 on are
/// handed out per figure by Palette.
constexpr int kPaletteSlots = 48;

/// PLplot text treats '#' as its escape character: a literal one is doubled.
std::string escaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    out += c;
    if (c == '#') out += '#';
  }
  return out;
}

/// Hands out colour map 0 slots for the RGB colours of one figure.
class Palette {
 public:
  int index(const Rgb& colour) {
    for (size_t i = 0; i < used_.size(); ++i)
      if (used_[i] == colour) return static_cast<int>(i) + 2;
    if (used_.size() + 2 >= kPaletteSlots) return 1;
    used_.push_back(colour);
    const int slot = static_cast<int>(used_.size()) + 1;
    plscol0(slot, colour[0], colour[1], colour[2]);
    return slot;
  }
  void use(const Rgb& colour) { plcol0(index(colour)); }

 private:
  std::vector<Rgb> used_;
};

/// One PLplot stream drawing to a PNG file, held under the lock; ended on destruction.
class PngStream {
 public:
  PngStream(const ImageSize& size, const std::string& png) : guard_(plplot_lock()) {
    plmkstrm(&stream_);
    plsdev("pngcairo");
    plsfnam(png.c_str());
    const std::string geometry = fmt::format("{}x{}", size.width, size.height);
    plsetopt("geometry", geometry.c_str());
    plscmap0n(kPaletteSlots);
    plscolbg(255, 255, 255);
    plscol0(1, 0, 0, 0);
    plspause(0);
    plinit();
    plfontld(1);
    plcol0(1);
  }
  ~PngStream() { plend1(); }
  PngStream(const PngStream&) = delete;
  PngStream& operator=(const PngStream&) = delete;

 private:
  std::lock_guard<std::mutex> guard_;
  PLINT stream_ = 0;
};

/// Labels of the custom axes: log-scaled values shown as the values themselves.
struct AxisLabels {
  bool log_x = false, log_y = false, integer_x = false;
};

void label_axis(PLINT axis, PLFLT value, char* label, PLINT length, PLPointer data) {
  const auto* labels = static_cast<const AxisLabels*>(data);
  double shown = value;
  bool integer = false;
  if (axis == PL_X_AXIS) {
    if (labels->log_x) shown = std::exp2(value);
    integer = labels->integer_x;
  } else if (axis == PL_Y_AXIS && labels->log_y) {
    shown = std::pow(10.0, value);
  }
  std::string text;
  if (integer && std::fabs(shown - std::round(shown)) < 1e-6 * std::max(1.0, std::fabs(shown)))
    text = fmt::format("{}", static_cast<long long>(std::llround(shown)));
  else if (integer)
    text = "";  // no label between integers
  else
    text = fmt::format("{:.3g}", shown);
  std::snprintf(label, static_cast<size_t>(length), "%s", text.c_str());
}

/// [low, high] of the values, padded by `pad` of the span; a single value gets a unit span.
std::pair<double, double> padded_range(const std::vector<double>& values, double pad) {
  double low = INFINITY, high = -INFINITY;
  for (double value : values)
    if (std::isfinite(value)) {
      low = std::min(low, value);
      high = std::max(high, value);
    }
  if (!(low <= high)) return {0, 1};
  if (high - low < 1e-12 * std::max(1.0, std::fabs(high))) {
    const double half = low == 0 ? 0.5 : 0.1 * std::fabs(low);
    return {low - half, high + half};
  }
  const double span = high - low;
  return {low - pad * span, high + pad * span};
}

/// Tick values of a log axis spanning 10^low .. 10^high: 1-2-5 steps, or only the decades
/// (every second, third ... when they are many) so that about 3 to 10 are labelled.
std::vector<double> log_y_ticks(double low, double high) {
  std::vector<double> ticks;
  const int first = static_cast<int>(std::floor(low)), last = static_cast<int>(std::ceil(high));
  const int decades = last - first;
  const std::vector<double> mantissas =
      decades <= 1 ? std::vector<double>{1, 1.5, 2, 3, 4, 5, 6, 8}
                   : (decades <= 3 ? std::vector<double>{1, 2, 5} : std::vector<double>{1});
  const int stride = std::max(1, decades / 10 + (decades % 10 ? 1 : 0));
  for (int exponent = first; exponent <= last; ++exponent) {
    if (decades > 3 && (exponent - first) % stride) continue;
    for (double mantissa : mantissas) {
      const double value = mantissa * std::pow(10.0, exponent);
      const double position = std::log10(value);
      if (position >= low && position <= high) ticks.push_back(value);
    }
  }
  return ticks;
}

void draw_panel(const LinePanel& panel, double x0, double x1, double y0, double y1,
                Palette& palette) {
  auto transform_x = [&](double x) { return panel.log_x ? std::log2(x) : x; };
  auto transform_y = [&](double y) { return panel.log_y ? std::log10(y) : y; };
  std::vector<double> all_x, all_y;
  for (const LineSeries& series : panel.series) {
    for (double x : series.x) all_x.push_back(transform_x(x));
    for (double y : series.y) all_y.push_back(transform_y(y));
  }
  auto [wx0, wx1] = padded_range(all_x, 0.04);
  auto [wy0, wy1] = padded_range(all_y, 0.06);
  if (!panel.log_y && !panel.log_x && panel.integer_x)
    wx0 = std::max(wx0, all_x.empty() ? 0.0 : *std::min_element(all_x.begin(), all_x.end()) - 0.5);
  plvpor(x0, x1, y0, y1);
  plwind(wx0, wx1, wy0, wy1);
  plcol0(1);
  plwidth(1);
  pllsty(1);
  static AxisLabels labels;  // read by the callback during plbox, under the lock
  labels = {panel.log_x, panel.log_y, panel.integer_x};
  plslabelfunc(label_axis, &labels);
  // A log x axis has a tick per power of two (ranks); a log y axis gets its ticks and labels
  // from log_y_ticks (PLplot's would sit at even steps of the logarithm: 0.0398, 0.0251, ...).
  const double x_tick = panel.log_x ? std::max(1.0, std::ceil((wx1 - wx0) / 8)) : 0;
  plschr(0, 0.85);
  plbox("bcnsto", x_tick, 0, panel.log_y ? "bc" : "bcnstvo", 0, 0);
  plslabelfunc(nullptr, nullptr);
  if (panel.log_y) {
    const double tick = 0.012 * (wx1 - wx0);
    for (double value : log_y_ticks(wy0, wy1)) {
      const double y = std::log10(value);
      pljoin(wx0, y, wx0 + tick, y);
      pljoin(wx1, y, wx1 - tick, y);
      plmtex("lv", 0.6, (y - wy0) / (wy1 - wy0), 1.0, fmt::format("{:g}", value).c_str());
    }
  }
  plschr(0, 0.95);
  pllab(escaped(panel.x_label).c_str(), escaped(panel.y_label).c_str(),
        escaped(panel.title).c_str());

  std::vector<std::string> legend_text;
  std::vector<PLINT> legend_options, legend_colours, legend_styles, text_colours, symbol_numbers;
  std::vector<PLFLT> legend_widths, symbol_scales;
  for (const LineSeries& series : panel.series) {
    std::vector<double> xs, ys;
    for (size_t i = 0; i < series.x.size(); ++i) {
      xs.push_back(transform_x(series.x[i]));
      ys.push_back(transform_y(series.y[i]));
    }
    const int colour = palette.index(series.colour);
    plcol0(colour);
    pllsty(series.dashed ? 2 : 1);
    plwidth(series.dashed ? 1.5 : 2.2);
    if (xs.size() > 1) plline(static_cast<PLINT>(xs.size()), xs.data(), ys.data());
    pllsty(1);
    if (series.markers || xs.size() == 1) {
      plssym(0, 0.9);
      plpoin(static_cast<PLINT>(xs.size()), xs.data(), ys.data(), 17);
    }
    if (!series.label.empty()) {
      legend_text.push_back(escaped(series.label));
      legend_options.push_back(PL_LEGEND_LINE | (series.markers ? PL_LEGEND_SYMBOL : 0));
      legend_colours.push_back(colour);
      legend_styles.push_back(series.dashed ? 2 : 1);
      legend_widths.push_back(2.2);
      text_colours.push_back(1);
      symbol_numbers.push_back(3);
      symbol_scales.push_back(0.9);
    }
  }
  plwidth(1);
  if (legend_text.empty()) return;
  std::vector<const char*> text, symbols(legend_text.size(), "#(229)");
  for (const std::string& line : legend_text) text.push_back(line.c_str());
  PLFLT width = 0, height = 0;
  plschr(0, 0.8);
  pllegend(&width, &height, PL_LEGEND_BACKGROUND | PL_LEGEND_BOUNDING_BOX,
           PL_POSITION_TOP | PL_POSITION_RIGHT | PL_POSITION_INSIDE | PL_POSITION_VIEWPORT, 0.02,
           0.02, 0.08, 0, 1, 1, 0, 0, static_cast<PLINT>(text.size()), legend_options.data(), 1.0,
           0.85, 1.6, 0, text_colours.data(), text.data(), nullptr, nullptr, nullptr, nullptr,
           legend_colours.data(), legend_styles.data(), legend_widths.data(), legend_colours.data(),
           symbol_scales.data(), symbol_numbers.data(), symbols.data());
  plschr(0, 1);
}

/// The colour of `colour` mixed with white: `amount` 0 keeps it, 1 is white.
Rgb tint(const Rgb& colour, double amount) {
  Rgb mixed;
  for (int c = 0; c < 3; ++c)
    mixed[c] = static_cast<uint8_t>(std::lround(colour[c] + (255 - colour[c]) * amount));
  return mixed;
}

void fill_box(double x0, double y0, double x1, double y1) {
  PLFLT xs[4] = {x0, x1, x1, x0}, ys[4] = {y0, y0, y1, y1};
  plfill(4, xs, ys);
}

void outline_box(double x0, double y0, double x1, double y1) {
  PLFLT xs[5] = {x0, x1, x1, x0, x0}, ys[5] = {y0, y0, y1, y1, y0};
  plline(5, xs, ys);
}

}  // namespace

bool compiled() {
  return true;
}

std::string plplot_version() {
  char version[80] = {};
  plgver(version);
  return version;
}

bool has_png_device() {
  std::lock_guard<std::mutex> guard(plplot_lock());
  // plgDevs fills caller arrays of at least as many entries as there are devices.
  std::vector<const char*> menu(128), names(128);
  const char** menu_data = menu.data();
  const char** name_data = names.data();
  int count = static_cast<int>(names.size());
  plgDevs(&menu_data, &name_data, &count);
  for (int i = 0; i < count; ++i)
    if (name_data[i] && std::strcmp(name_data[i], "pngcairo") == 0) return true;
  return false;
}

const std::vector<Rgb>& line_colours() {
  // The Okabe-Ito colours, distinguishable with the common colour-vision deficiencies.
  static const std::vector<Rgb> kColours = {{0, 114, 178},   {213, 94, 0},   {0, 158, 115},
                                            {204, 121, 167}, {230, 159, 0},  {86, 180, 233},
                                            {0, 0, 0},       {153, 153, 153}};
  return kColours;
}

void render_image(const ImageFigure& figure, const ImageSize& size, const std::string& png) {
  PngStream stream(size, png);
  // Colour map 1: the colormap's stops, evenly spaced, interpolated linearly in RGB.
  const size_t stops = figure.colormap.size();
  std::vector<PLFLT> positions, red, green, blue;
  for (size_t i = 0; i < stops; ++i) {
    positions.push_back(stops > 1 ? static_cast<double>(i) / static_cast<double>(stops - 1) : 0);
    red.push_back(figure.colormap[i][0] / 255.0);
    green.push_back(figure.colormap[i][1] / 255.0);
    blue.push_back(figure.colormap[i][2] / 255.0);
  }
  plscmap1n(256);
  plscmap1l(1, static_cast<PLINT>(stops), positions.data(), red.data(), green.data(), blue.data(),
            nullptr);
  pladv(0);
  const double columns = static_cast<double>(figure.columns);
  const double rows = static_cast<double>(figure.rows);
  // Cells are square: the viewport keeps the slice's aspect, leaving room for the colorbar.
  plvpas(0.1, 0.8, 0.1, 0.9, rows / columns);
  plwind(0, columns, 0, rows);
  // Clamped to the colour range (non-finite values to its low end): plimagefr leaves values
  // outside [zmin, zmax] undrawn.
  std::vector<double> values(figure.values);
  for (double& value : values)
    value = std::isfinite(value) ? std::clamp(value, figure.vmin, figure.vmax) : figure.vmin;
  std::vector<const PLFLT*> columns_data(figure.columns);
  for (int64_t c = 0; c < figure.columns; ++c) columns_data[c] = values.data() + c * figure.rows;
  plimagefr(columns_data.data(), static_cast<PLINT>(figure.columns),
            static_cast<PLINT>(figure.rows), 0, columns, 0, rows, figure.vmin, figure.vmax,
            figure.vmin, figure.vmax, nullptr, nullptr);
  plcol0(1);
  plschr(0, 0.85);
  plbox("bcnst", 0, 0, "bcnstv", 0, 0);
  plschr(0, 0.95);
  pllab(escaped(figure.x_label).c_str(), escaped(figure.y_label).c_str(),
        escaped(figure.title).c_str());

  PLFLT bar_values[2] = {figure.vmin, figure.vmax};
  const PLFLT* bar_matrix[1] = {bar_values};
  PLINT value_counts[1] = {2};
  // The colorbar's label, when there is one, above it (beside it, it would cross the ticks).
  const std::string label = escaped(figure.value_label);
  const char* labels[1] = {label.c_str()};
  PLINT label_options[1] = {PL_COLORBAR_LABEL_TOP};
  const char* axis_options[1] = {"bcvtm"};
  PLFLT ticks[1] = {0};
  PLINT sub_ticks[1] = {0};
  PLFLT bar_width = 0, bar_height = 0;
  plschr(0, 0.8);
  plcolorbar(&bar_width, &bar_height, PL_COLORBAR_IMAGE | PL_COLORBAR_BOUNDING_BOX,
             PL_POSITION_RIGHT | PL_POSITION_OUTSIDE | PL_POSITION_VIEWPORT, 0.03, 0, 0.04, 1.0, 0,
             1, 1, 0, 0, 0, 0, label.empty() ? 0 : 1, label_options, labels, 1, axis_options, ticks,
             sub_ticks, value_counts, bar_matrix);
}

void render_panels(const std::vector<LinePanel>& panels, const std::string& title,
                   const ImageSize& size, const std::string& png) {
  PngStream stream(size, png);
  Palette palette;
  pladv(0);
  const double count = static_cast<double>(panels.size());
  for (size_t i = 0; i < panels.size(); ++i) {
    const double left = static_cast<double>(i) / count, right = static_cast<double>(i + 1) / count;
    // Margins in pixels: room for the tick labels and the axis titles.
    draw_panel(panels[i], left + 95.0 / size.width, right - 25.0 / size.width, 0.12, 0.84, palette);
  }
  plvpor(0, 1, 0, 1);
  plwind(0, 1, 0, 1);
  plcol0(1);
  plschr(0, 1.15);
  plptex(0.5, 0.94, 1, 0, 0.5, escaped(title).c_str());
}

void render_mesh(const MeshFigure& figure, const ImageSize& size, const std::string& png) {
  PngStream stream(size, png);
  Palette palette;
  pladv(0);
  // The picture's [0, 1] x [0, 1], y down, in a viewport between the title and the legend.
  constexpr double kLeft = 0.02, kRight = 0.98, kBottom = 0.11, kTop = 0.90;
  plvpor(kLeft, kRight, kBottom, kTop);
  plwind(0, 1, 0, 1);
  auto flip = [](double y) { return 1 - y; };
  // Millimetres per picture unit, to size text to the boxes.
  PLFLT page_x0, page_x1, page_y0, page_y1, default_height, height;
  plgspa(&page_x0, &page_x1, &page_y0, &page_y1);
  plgchr(&default_height, &height);
  const double mm_x = (page_x1 - page_x0) * (kRight - kLeft);
  const double mm_y = (page_y1 - page_y0) * (kTop - kBottom);

  for (const MeshGroupBox& group : figure.layout.groups) {
    const Rgb colour = figure.dim_colours[group.dim];
    palette.use(tint(colour, 0.82 - 0.12 * group.dim));
    fill_box(group.x0, flip(group.y0), group.x1, flip(group.y1));
    palette.use(colour);
    plwidth(2.5);
    outline_box(group.x0, flip(group.y0), group.x1, flip(group.y1));
    plwidth(1);
    const std::string name =
        figure.dim_labels[group.dim].substr(0, figure.dim_labels[group.dim].find(" ("));
    plschr(0, 0.75);
    plcol0(1);
    plptex(group.x0 + 0.006, flip(group.y0) - 0.028, 1, 0, 0,
           escaped(fmt::format("{} {}", name, group.index)).c_str());
  }
  const int inner = static_cast<int>(figure.dim_colours.size()) - 1;
  for (const MeshRankBox& box : figure.layout.ranks) {
    palette.use(tint(figure.dim_colours[inner], 0.9));
    fill_box(box.x0, flip(box.y0), box.x1, flip(box.y1));
    palette.use(figure.dim_colours[inner]);
    plwidth(2);
    outline_box(box.x0, flip(box.y0), box.x1, flip(box.y1));
    plwidth(1);
    std::vector<std::string> coordinate;
    for (int c : box.coordinate) coordinate.push_back(fmt::format("{}", c));
    const std::string rank = fmt::format("rank {}", box.rank);
    const std::string where = fmt::format("({})", fmt::join(coordinate, ","));
    // Text scaled to fit the box: two lines in its height, the longer line in its width
    // (a character is about 0.75 of its height wide).
    const double box_w = (box.x1 - box.x0) * mm_x, box_h = (box.y1 - box.y0) * mm_y;
    const double longest = static_cast<double>(std::max(rank.size(), where.size()));
    const double scale = std::clamp(
        std::min(box_h / (3.4 * default_height), 0.9 * box_w / (0.75 * longest * default_height)),
        0.3, 1.2);
    plschr(0, scale);
    plcol0(1);
    const double middle_x = 0.5 * (box.x0 + box.x1), middle_y = flip(0.5 * (box.y0 + box.y1));
    const double line = 1.3 * scale * default_height / mm_y;
    plptex(middle_x, middle_y + 0.25 * line, 1, 0, 0.5, escaped(rank).c_str());
    plptex(middle_x, middle_y - 0.85 * line, 1, 0, 0.5, escaped(where).c_str());
  }

  // Legend: one swatch per dim, outer to inner, below the picture.
  plvpor(kLeft, kRight, 0.01, kBottom - 0.015);
  plwind(0, 1, 0, 1);
  plschr(0, 0.9);
  const double slot = 1.0 / static_cast<double>(std::max<size_t>(figure.dim_labels.size(), 1));
  for (size_t d = 0; d < figure.dim_labels.size(); ++d) {
    const double x = d * slot + 0.02;
    palette.use(tint(figure.dim_colours[d], d + 1 == figure.dim_labels.size() ? 0.9 : 0.6));
    fill_box(x, 0.25, x + 0.04, 0.75);
    palette.use(figure.dim_colours[d]);
    plwidth(2.5);
    outline_box(x, 0.25, x + 0.04, 0.75);
    plwidth(1);
    plcol0(1);
    plptex(x + 0.05, 0.38, 1, 0, 0, escaped(figure.dim_labels[d]).c_str());
  }
  plvpor(0, 1, 0, 1);
  plwind(0, 1, 0, 1);
  plschr(0, 1.1);
  plcol0(1);
  plptex(0.5, 0.94, 1, 0, 0.5, escaped(figure.title).c_str());
}

}  // namespace tessera::plot::detail
