// apps/plot: the checks, input parsing and layouts of the plots (plot.hpp); the drawing itself is
// render_plplot.cpp. Every user error is raised here, before anything is drawn.
#include "apps/plot/plot.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "apps/plot/render.hpp"
#include "core/errors.hpp"
#include "io/hdf5/h5_file.hpp"
#include "io/output_path.hpp"

namespace tessera::plot {

namespace {

constexpr const char* kOp = "plot";

namespace fs = std::filesystem;

/// The message of a Tessera error without its "[op] " tag.
std::string untagged(const std::exception& error) {
  const std::string text = error.what();
  if (!text.empty() && text[0] == '[') {
    const size_t end = text.find("] ");
    if (end != std::string::npos) return text.substr(end + 2);
  }
  return text;
}

/// Draws with `draw(temporary)` into a temporary file beside `out` and renames it onto `out`
/// when complete: a failure leaves no partial image (and an existing `out` untouched).
void write_atomically(const std::string& out, const std::function<void(const std::string&)>& draw) {
  try {
    io::check_output_path(kOp, out);
  } catch (const Error& error) {
    throw InvalidArgument(kOp, "--out: " + untagged(error));
  }
  static std::atomic<int> counter{0};
  const std::string temporary = fmt::format("{}.tmp.{}.{}", out, ::getpid(), counter++);
  try {
    draw(temporary);
    // A PNG starts with its 8-byte signature; anything else means the device wrote nothing.
    std::ifstream written(temporary, std::ios::binary);
    char signature[8] = {};
    written.read(signature, sizeof signature);
    if (!written || std::memcmp(signature, "\x89PNG\r\n\x1a\n", 8) != 0)
      throw InvalidArgument(kOp, fmt::format("--out {}: the PNG device wrote no image", out));
    written.close();
    std::error_code error;
    fs::rename(temporary, out, error);
    if (error)
      throw InvalidArgument(kOp,
                            fmt::format("--out {}: cannot replace it ({})", out, error.message()));
  } catch (...) {
    std::error_code ignored;
    fs::remove(temporary, ignored);
    throw;
  }
}

std::string trim(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  return text.substr(first, text.find_last_not_of(" \t") - first + 1);
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream stream(text);
  while (std::getline(stream, part, separator)) parts.push_back(trim(part));
  if (!text.empty() && text.back() == separator) parts.push_back("");
  return parts;
}

/// A whole-text integer, or nothing.
std::optional<int64_t> to_integer(const std::string& text) {
  try {
    size_t used = 0;
    const long long value = std::stoll(text, &used);
    if (used == text.size() && !text.empty()) return value;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

std::string stem(const std::string& file) {
  std::string name = fs::path(file).filename().string();
  if (name.size() > 5 && name.substr(name.size() - 5) == ".json")
    name = name.substr(0, name.size() - 5);
  return name;
}

/// `file` parsed as JSON, or the values of its non-empty lines (JSON lines) when the whole is not
/// one value. InvalidArgument naming `file` for a missing file or malformed JSON.
nlohmann::json read_json(const std::string& file, bool allow_lines) {
  std::ifstream stream(file);
  if (!stream) {
    std::error_code error;
    throw InvalidArgument(kOp, fs::exists(file, error) ? fmt::format("{}: cannot be read", file)
                                                       : fmt::format("{}: no such file", file));
  }
  std::stringstream buffer;
  buffer << stream.rdbuf();
  const std::string text = buffer.str();
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& whole_error) {
    if (allow_lines) {
      nlohmann::json values = nlohmann::json::array();
      std::istringstream lines(text);
      std::string line;
      bool ok = true;
      while (ok && std::getline(lines, line)) {
        if (trim(line).empty()) continue;
        try {
          values.push_back(nlohmann::json::parse(line));
        } catch (const nlohmann::json::parse_error&) {
          ok = false;
        }
      }
      if (ok && !values.empty()) return values;
    }
    throw InvalidArgument(kOp, fmt::format("{}: malformed JSON ({})", file, whole_error.what()));
  }
}

}  // namespace

// ---- general ---------------------------------------------------------------------------------

bool available() {
  return detail::compiled();
}

std::string library_version() {
  if (!detail::compiled()) return "";
  return fmt::format("{} ({})", detail::plplot_version(),
                     detail::has_png_device() ? "pngcairo" : "no pngcairo device");
}

void check_available() {
  if (!detail::compiled()) throw NotAvailable(kOp, "built without plotting (PLplot)");
  check_arg(detail::has_png_device(), kOp,
            "PLplot has no pngcairo device (Debian: install plplot-driver-cairo)");
}

ImageSize parse_size(const std::string& text, const std::string& option) {
  constexpr int kMin = 100, kMax = 8192;
  const size_t cross = text.find_first_of("xX");
  std::optional<int64_t> width, height;
  if (cross != std::string::npos) {
    width = to_integer(text.substr(0, cross));
    height = to_integer(text.substr(cross + 1));
  }
  check_arg(width && height, kOp, "{} {}: expected WxH in pixels, e.g. 800x600", option, text);
  check_arg(*width >= kMin && *width <= kMax && *height >= kMin && *height <= kMax, kOp,
            "{} {}: width and height must be {} to {} pixels", option, text, kMin, kMax);
  return {static_cast<int>(*width), static_cast<int>(*height)};
}

std::vector<std::string> colormap_names() {
  return {"viridis", "magma", "inferno", "cividis", "gray"};
}

std::vector<std::array<uint8_t, 3>> colormap_stops(const std::string& name) {
  // Ten evenly spaced samples of each published map (sRGB hex values); PLplot interpolates
  // linearly between them, which keeps the lightness monotonic.
  static const std::map<std::string, std::vector<uint32_t>> kStops = {
      {"viridis",
       {0x440154, 0x482878, 0x3e4989, 0x31688e, 0x26828e, 0x1f9e89, 0x35b779, 0x6ece58, 0xb5de2b,
        0xfde725}},
      {"magma",
       {0x000004, 0x180f3d, 0x440f76, 0x721f81, 0x9e2f7f, 0xcd4071, 0xf1605d, 0xfd9668, 0xfeca8d,
        0xfcfdbf}},
      {"inferno",
       {0x000004, 0x1b0c41, 0x4a0c6b, 0x781c6d, 0xa52c60, 0xcf4446, 0xed6925, 0xfb9b06, 0xf7d13d,
        0xfcffa4}},
      {"cividis",
       {0x00224e, 0x123570, 0x3b496c, 0x575d6d, 0x707173, 0x8a8779, 0xa69d75, 0xc4b56c, 0xe4cf5b,
        0xfee838}},
      {"gray", {0x000000, 0xffffff}},
  };
  const auto found = kStops.find(name);
  check_arg(found != kStops.end(), kOp, "--cmap {}: expected one of {}", name,
            fmt::join(colormap_names(), ", "));
  std::vector<std::array<uint8_t, 3>> stops;
  for (uint32_t hex : found->second)
    stops.push_back({static_cast<uint8_t>(hex >> 16), static_cast<uint8_t>(hex >> 8),
                     static_cast<uint8_t>(hex)});
  return stops;
}

// ---- slice -----------------------------------------------------------------------------------

int parse_axis(const std::string& text) {
  static const std::map<std::string, int> kAxes = {{"x", 0}, {"y", 1}, {"z", 2},
                                                   {"0", 0}, {"1", 1}, {"2", 2}};
  const auto found = kAxes.find(text);
  check_arg(found != kAxes.end(), kOp, "--axis {}: expected x, y or z", text);
  return found->second;
}

std::vector<int64_t> parse_index(const std::string& text) {
  std::vector<int64_t> index;
  if (trim(text).empty()) return index;
  for (const std::string& part : split(text, ',')) {
    const std::optional<int64_t> value = to_integer(part);
    check_arg(value.has_value(), kOp, "--index {}: expected integers separated by commas, e.g. 3,0",
              text);
    index.push_back(*value);
  }
  return index;
}

SlicePlan plan_slice(const Shape& shape, const SliceSpec& spec) {
  const int ndim = static_cast<int>(shape.size());
  check_arg(ndim >= 3 && ndim <= 5, kOp,
            "the dataset has shape {}; expected [T, C, X, Y, Z], [C, X, Y, Z] or [X, Y, Z]", shape);
  const int leading = ndim - 3;
  static const char* kLeadingNames[2][2] = {{"c", ""}, {"t", "c"}};
  check_arg(static_cast<int>(spec.index.size()) == leading, kOp,
            "--index has {} value(s) but the dataset of shape {} needs {} ({})", spec.index.size(),
            shape, leading,
            leading == 0 ? "none: it is [X, Y, Z]"
                         : (leading == 1 ? "c of [C, X, Y, Z]" : "t,c of [T, C, X, Y, Z]"));
  check_arg(spec.axis >= 0 && spec.axis < 3, kOp, "--axis {}: expected x, y or z", spec.axis);
  check_arg(std::isfinite(spec.at) && spec.at >= 0 && spec.at <= 1, kOp,
            "--at {}: expected a fraction in [0, 1]", spec.at);
  for (int d = 0; d < ndim; ++d)
    check_arg(shape[d] > 0, kOp, "the dataset of shape {} is empty", shape);
  SlicePlan plan;
  plan.box.lo.assign(ndim, 0);
  plan.box.hi = shape;
  for (int d = 0; d < leading; ++d) {
    const int64_t extent = shape[d];
    int64_t value = spec.index[d];
    const char* name = kLeadingNames[leading - 1][d];
    check_arg(value >= -extent && value < extent, kOp,
              "--index {}: {} = {} is out of range for {} of extent {} (0 to {}, or -1 for the "
              "last)",
              fmt::join(spec.index, ","), name, value, name, extent, extent - 1);
    if (value < 0) value += extent;
    plan.index.push_back(value);
    plan.box.lo[d] = value;
    plan.box.hi[d] = value + 1;
  }
  const int cut = leading + spec.axis;
  const int64_t extent = shape[cut];
  plan.position = std::min<int64_t>(extent - 1, static_cast<int64_t>(std::floor(spec.at * extent)));
  plan.box.lo[cut] = plan.position;
  plan.box.hi[cut] = plan.position + 1;
  // The two remaining spatial dims in order: the first runs along the image's x axis, so the
  // box's elements (row-major) are already the image's columns.
  std::vector<int> rest;
  for (int d = 0; d < 3; ++d)
    if (d != spec.axis) rest.push_back(d);
  plan.horizontal = rest[0];
  plan.vertical = rest[1];
  plan.columns = shape[leading + rest[0]];
  plan.rows = shape[leading + rest[1]];
  return plan;
}

namespace {

const char* kAxisNames[3] = {"x", "y", "z"};

/// The finite range of `values`, widened when it is a single value; (0, 1) when none is finite.
std::pair<double, double> finite_range(const std::vector<double>& values) {
  double low = INFINITY, high = -INFINITY;
  for (double value : values)
    if (std::isfinite(value)) {
      low = std::min(low, value);
      high = std::max(high, value);
    }
  if (!(low <= high)) return {0, 1};
  if (low == high) {
    const double half = low == 0 ? 0.5 : 0.05 * std::fabs(low);
    return {low - half, high + half};
  }
  return {low, high};
}

}  // namespace

void plot_slice(const std::string& file, const std::string& dataset, const SliceSpec& spec,
                const SliceStyle& style, const std::string& out) {
  check_available();
  const std::vector<std::array<uint8_t, 3>> colormap = colormap_stops(style.colormap);
  for (const auto& [value, option] :
       {std::pair{style.vmin, "--vmin"}, std::pair{style.vmax, "--vmax"}})
    check_arg(!value || std::isfinite(*value), kOp, "{} {}: expected a finite number", option,
              *value);
  if (style.vmin && style.vmax)
    check_arg(*style.vmin < *style.vmax, kOp, "--vmin {} must be below --vmax {}", *style.vmin,
              *style.vmax);
  Shape shape;
  try {
    shape = io::dataset_info(file, dataset).shape;
  } catch (const Error& error) {
    throw InvalidArgument(kOp, fmt::format("{}:{}: {}", file, dataset, untagged(error)));
  }
  const SlicePlan plan = plan_slice(shape, spec);

  detail::ImageFigure figure;
  // Only the plane of the slice is read, converted to f64 by HDF5.
  const Tensor plane = io::read_hyperslab(file, dataset, plan.box, DType::f64);
  const double* data = plane.data<double>();
  figure.values.assign(data, data + plane.numel());
  figure.columns = plan.columns;
  figure.rows = plan.rows;
  auto [low, high] = finite_range(figure.values);
  if (style.vmin) low = *style.vmin;
  if (style.vmax) high = *style.vmax;
  check_arg(low < high, kOp, "{} = {} must be below {} = {} (the other end is the slice's {})",
            style.vmin ? "--vmin" : "the slice's minimum", low,
            style.vmax ? "--vmax" : "the slice's maximum", high,
            style.vmin ? "maximum" : "minimum");
  figure.vmin = low;
  figure.vmax = high;
  figure.colormap = colormap;
  const int leading = static_cast<int>(shape.size()) - 3;
  std::string indices;
  if (leading == 2) indices = fmt::format(" t={} c={}", plan.index[0], plan.index[1]);
  if (leading == 1) indices = fmt::format(" c={}", plan.index[0]);
  figure.title = !style.title.empty() ? style.title
                                      : fmt::format("{}:{}{}, {}={} (index {} of {})",
                                                    fs::path(file).filename().string(), dataset,
                                                    indices, kAxisNames[spec.axis], spec.at,
                                                    plan.position, shape[leading + spec.axis]);
  figure.x_label = kAxisNames[plan.horizontal];
  figure.y_label = kAxisNames[plan.vertical];
  write_atomically(out,
                   [&](const std::string& png) { detail::render_image(figure, style.size, png); });
}

// ---- losses ----------------------------------------------------------------------------------

LossCurve read_losses(const std::string& file) {
  const nlohmann::json json = read_json(file, false);
  check_arg(json.is_array(), kOp,
            "{}: expected a list of {{\"step\": N, \"loss\": L}} objects (tessera train "
            "--losses-out)",
            file);
  LossCurve curve;
  curve.label = stem(file);
  for (size_t i = 0; i < json.size(); ++i) {
    const nlohmann::json& entry = json[i];
    for (const char* key : {"step", "loss"}) {
      check_arg(entry.is_object() && entry.contains(key) && entry[key].is_number() &&
                    std::isfinite(entry[key].get<double>()),
                kOp, "{}: entry {} has no finite number \"{}\"", file, i, key);
    }
    curve.step.push_back(entry["step"].get<double>());
    curve.loss.push_back(entry["loss"].get<double>());
  }
  check_arg(!curve.step.empty(), kOp, "{}: no losses (an empty list)", file);
  return curve;
}

void plot_losses(const std::vector<LossCurve>& curves, const ImageSize& size,
                 const std::string& out, const std::string& title) {
  check_available();
  check_arg(!curves.empty(), kOp, "losses: no loss file given");
  detail::LinePanel panel;
  panel.x_label = "step";
  panel.y_label = "loss";
  panel.integer_x = true;
  panel.log_y = true;
  for (const LossCurve& curve : curves) {
    check_arg(!curve.step.empty() && curve.step.size() == curve.loss.size(), kOp,
              "losses: curve {} has {} steps and {} losses", curve.label, curve.step.size(),
              curve.loss.size());
    for (double loss : curve.loss) panel.log_y = panel.log_y && loss > 0;
  }
  const auto& colours = detail::line_colours();
  for (size_t i = 0; i < curves.size(); ++i) {
    detail::LineSeries series;
    series.label = curves.size() > 1 ? curves[i].label : "";
    series.x = curves[i].step;
    series.y = curves[i].loss;
    series.colour = colours[i % colours.size()];
    series.markers = curves[i].step.size() <= 30;
    panel.series.push_back(std::move(series));
  }
  panel.title = panel.log_y ? "" : "(linear axis: a loss is <= 0)";
  write_atomically(
      out, [&](const std::string& png) { detail::render_panels({panel}, title, size, png); });
}

std::string write_loss_plot(const std::string& directory, const LossCurve& curve) {
  prepare_plot_directory(directory);
  const std::string out = (fs::path(directory) / "loss.png").string();
  plot_losses({curve}, ImageSize{800, 500}, out);
  return out;
}

// ---- scaling ---------------------------------------------------------------------------------

double efficiency(const ScalingPoint& base, const ScalingPoint& point) {
  const double base_rate = base.work / (static_cast<double>(base.ranks) * base.seconds);
  const double rate = point.work / (static_cast<double>(point.ranks) * point.seconds);
  return rate / base_rate;
}

double ideal_seconds(const ScalingPoint& base, const ScalingPoint& point) {
  return base.seconds * (point.work / base.work) *
         (static_cast<double>(base.ranks) / static_cast<double>(point.ranks));
}

namespace {

/// The time column of a record and its unit in seconds.
std::optional<std::pair<std::string, double>> time_column(const nlohmann::json& record,
                                                          const std::string& time_key) {
  auto unit_of = [](const std::string& key) -> std::optional<double> {
    auto ends = [&](const std::string& suffix) {
      return key.size() >= suffix.size() &&
             key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (ends("seconds")) return 1.0;
    if (ends("ms")) return 1e-3;
    if (ends("us")) return 1e-6;
    return std::nullopt;
  };
  if (!time_key.empty()) {
    const std::optional<double> unit = unit_of(time_key);
    check_arg(unit.has_value(), kOp,
              "--time {}: its unit is unknown (expected a key ending in seconds, ms or us)",
              time_key);
    if (!record.contains(time_key)) return std::nullopt;
    return std::pair{time_key, *unit};
  }
  for (const char* key :
       {"step_seconds", "step_ms", "forward_backward_ms", "forward_ms", "ms", "time_us"})
    if (record.contains(key)) return std::pair{std::string(key), *unit_of(key)};
  return std::nullopt;
}

/// The work of a record: "cells", or the product of "size" or "shape"; 1 when none is given.
double work_of(const nlohmann::json& record) {
  if (record.contains("cells") && record["cells"].is_number()) return record["cells"].get<double>();
  for (const char* key : {"size", "shape"})
    if (record.contains(key) && record[key].is_array() && !record[key].empty()) {
      double product = 1;
      for (const auto& extent : record[key])
        product *= extent.is_number() ? extent.get<double>() : 1;
      if (product > 0) return product;
    }
  return 1;
}

/// The series a record belongs to: its "label", or its configuration fields.
std::string series_label(const nlohmann::json& record, const std::string& prefix) {
  if (record.contains("label") && record["label"].is_string())
    return record["label"].get<std::string>();
  std::vector<std::string> parts;
  if (!prefix.empty()) parts.push_back(prefix);
  for (const char* key : {"shape", "reduction", "op", "kernel", "dtype", "device"}) {
    if (!record.contains(key)) continue;
    const nlohmann::json& value = record[key];
    std::string text = value.is_string() ? value.get<std::string>() : value.dump();
    if (value.is_array()) {
      std::vector<std::string> extents;
      for (const auto& extent : value) extents.push_back(extent.dump());
      text = fmt::format("{}", fmt::join(extents, "x"));
    }
    parts.push_back(text);
  }
  return parts.empty() ? "measured" : fmt::format("{}", fmt::join(parts, " "));
}

}  // namespace

std::vector<ScalingSeries> read_scaling(const std::string& file, const std::string& time_key) {
  const nlohmann::json json = read_json(file, true);
  // The records with their series prefix (a bench document's benchmark name).
  std::vector<std::pair<const nlohmann::json*, std::string>> records;
  auto take_object = [&](const nlohmann::json& object) {
    if (object.contains("ranks")) {  // one record: a simulate --json object or a list entry
      records.push_back({&object, ""});
      return;
    }
    const std::string benchmark = object.contains("benchmark") && object["benchmark"].is_string()
                                      ? object["benchmark"].get<std::string>()
                                      : "";
    for (const auto& [key, table] : object.items())
      if (table.is_array())
        for (const auto& row : table)
          if (row.is_object() && row.contains("ranks")) records.push_back({&row, benchmark});
  };
  if (json.is_object()) {
    take_object(json);
  } else if (json.is_array()) {
    for (const auto& entry : json) {
      check_arg(entry.is_object(), kOp, "{}: entry {} is not an object", file, records.size());
      take_object(entry);
    }
  }
  check_arg(!records.empty(), kOp,
            "{}: no measurements; expected a list of {{\"ranks\": P, \"step_seconds\": t}}, the "
            "JSON of tessera simulate --json (one per line) or of a tessera bench command",
            file);
  std::map<std::string, std::map<int64_t, ScalingPoint>> by_series;
  std::vector<std::string> order;
  for (size_t i = 0; i < records.size(); ++i) {
    const nlohmann::json& record = *records[i].first;
    const auto column = time_column(record, time_key);
    check_arg(column.has_value(), kOp,
              "{}: measurement {} has {} (expected step_seconds, step_ms, forward_backward_ms, "
              "forward_ms, ms or time_us; --time names another)",
              file, i, time_key.empty() ? "no time" : fmt::format("no \"{}\"", time_key));
    const nlohmann::json& ranks = record["ranks"];
    const nlohmann::json& time = record[column->first];
    check_arg(ranks.is_number_integer() && ranks.get<int64_t>() >= 1, kOp,
              "{}: measurement {} has \"ranks\": {} (expected an integer >= 1)", file, i,
              ranks.dump());
    check_arg(time.is_number() && std::isfinite(time.get<double>()) && time.get<double>() > 0, kOp,
              "{}: measurement {} has \"{}\": {} (expected a positive number)", file, i,
              column->first, time.dump());
    ScalingPoint point{ranks.get<int64_t>(), time.get<double>() * column->second, work_of(record)};
    const std::string label = series_label(record, records[i].second);
    if (!by_series.count(label)) order.push_back(label);
    auto& points = by_series[label];
    // Repeated measurements of one rank count: the fastest stands for them.
    const auto existing = points.find(point.ranks);
    if (existing == points.end() || existing->second.seconds > point.seconds)
      points[point.ranks] = point;
  }
  std::vector<ScalingSeries> series;
  for (const std::string& label : order) {
    ScalingSeries one{label, {}};
    for (const auto& [ranks, point] : by_series[label]) one.points.push_back(point);
    series.push_back(std::move(one));
  }
  return series;
}

void plot_scaling(const std::vector<ScalingSeries>& series, const ImageSize& size,
                  const std::string& out, const std::string& title) {
  check_available();
  check_arg(!series.empty(), kOp, "scaling: no measurements");
  detail::LinePanel time_panel, efficiency_panel;
  time_panel.title = "time per step (dashed: ideal)";
  time_panel.x_label = efficiency_panel.x_label = "ranks";
  time_panel.y_label = "seconds";
  time_panel.log_x = time_panel.log_y = efficiency_panel.log_x = true;
  time_panel.integer_x = efficiency_panel.integer_x = true;
  efficiency_panel.title = "parallel efficiency (per-rank throughput)";
  efficiency_panel.y_label = "efficiency";
  const auto& colours = detail::line_colours();
  int64_t min_ranks = INT64_MAX, max_ranks = 1;
  for (size_t s = 0; s < series.size(); ++s) {
    const ScalingSeries& one = series[s];
    check_arg(!one.points.empty(), kOp, "scaling: series {} has no points", one.label);
    detail::LineSeries measured, ideal, relative;
    measured.label = series.size() > 1 ? one.label : "";
    measured.colour = ideal.colour = relative.colour = colours[s % colours.size()];
    measured.markers = relative.markers = true;
    ideal.dashed = true;
    for (const ScalingPoint& point : one.points) {
      const double ranks = static_cast<double>(point.ranks);
      min_ranks = std::min(min_ranks, point.ranks);
      max_ranks = std::max(max_ranks, point.ranks);
      measured.x.push_back(ranks);
      measured.y.push_back(point.seconds);
      ideal.x.push_back(ranks);
      ideal.y.push_back(ideal_seconds(one.points.front(), point));
      relative.x.push_back(ranks);
      relative.y.push_back(efficiency(one.points.front(), point));
    }
    time_panel.series.push_back(std::move(ideal));
    time_panel.series.push_back(std::move(measured));
    efficiency_panel.series.push_back(std::move(relative));
  }
  detail::LineSeries perfect;
  perfect.x = {static_cast<double>(min_ranks), static_cast<double>(max_ranks)};
  perfect.y = {1.0, 1.0};
  perfect.colour = {150, 150, 150};
  perfect.dashed = true;
  efficiency_panel.series.insert(efficiency_panel.series.begin(), perfect);
  write_atomically(out, [&](const std::string& png) {
    detail::render_panels({time_panel, efficiency_panel}, title, size, png);
  });
}

// ---- mesh ------------------------------------------------------------------------------------

std::vector<int> parse_mesh_shape(const std::string& text) {
  std::vector<int> shape;
  int64_t ranks = 1;
  for (const std::string& part : split(text, 'x')) {
    const std::optional<int64_t> extent = to_integer(part);
    check_arg(extent && *extent >= 1 && *extent <= 256, kOp,
              "--shape {}: expected extents >= 1 separated by x, e.g. 2x2x2x2", text);
    shape.push_back(static_cast<int>(*extent));
    ranks *= *extent;
  }
  check_arg(!shape.empty() && shape.size() <= 4, kOp, "--shape {}: expected 1 to 4 dims", text);
  check_arg(ranks <= 256, kOp, "--shape {}: {} ranks; a picture shows at most 256", text, ranks);
  return shape;
}

MeshLayout layout_mesh(const std::vector<int>& shape) {
  check_arg(!shape.empty() && shape.size() <= 4, kOp, "--shape: expected 1 to 4 dims, got {}",
            shape.size());
  const int ndim = static_cast<int>(shape.size());
  // Room around each group: a gap between siblings, a band at the top of each group for its
  // label (picture units).
  constexpr double kGap = 0.012, kLabelBand = 0.045, kInset = 0.008;
  MeshLayout layout;
  std::vector<int> coordinate(ndim, 0);
  std::function<void(int, double, double, double, double)> place =
      [&](int dim, double x0, double y0, double x1, double y1) {
        // The last dim runs left to right, the one before it top to bottom, alternately outwards.
        const bool horizontal = (ndim - 1 - dim) % 2 == 0;
        const int parts = shape[dim];
        const double length = horizontal ? x1 - x0 : y1 - y0;
        const double step = (length - kGap * (parts - 1)) / parts;
        for (int i = 0; i < parts; ++i) {
          coordinate[dim] = i;
          const double start = (horizontal ? x0 : y0) + i * (step + kGap);
          const double a0 = horizontal ? start : x0, a1 = horizontal ? start + step : x1;
          const double b0 = horizontal ? y0 : start, b1 = horizontal ? y1 : start + step;
          if (dim == ndim - 1) {
            int rank = 0;
            for (int d = 0; d < ndim; ++d) rank = rank * shape[d] + coordinate[d];
            layout.ranks.push_back({rank, coordinate, a0, b0, a1, b1});
          } else {
            layout.groups.push_back({dim, i, a0, b0, a1, b1});
            place(dim + 1, a0 + kInset, b0 + kLabelBand, a1 - kInset, b1 - kInset);
          }
        }
      };
  place(0, 0, 0, 1, 1);
  std::sort(layout.ranks.begin(), layout.ranks.end(),
            [](const MeshRankBox& a, const MeshRankBox& b) { return a.rank < b.rank; });
  return layout;
}

void plot_mesh(const std::vector<int>& shape, const std::vector<std::string>& names,
               const ImageSize& size, const std::string& out) {
  check_available();
  const MeshLayout layout = layout_mesh(shape);
  check_arg(names.empty() || names.size() == shape.size(), kOp,
            "--names has {} name(s) for a {}-d mesh (one per dim)", names.size(), shape.size());
  detail::MeshFigure figure;
  figure.layout = layout;
  const auto& colours = detail::line_colours();
  int ranks = 1;
  std::vector<std::string> shape_text;
  for (size_t d = 0; d < shape.size(); ++d) {
    const std::string name = names.empty() ? fmt::format("dim{}", d) : names[d];
    check_arg(!name.empty(), kOp, "--names: dim {} has an empty name", d);
    figure.dim_labels.push_back(fmt::format("{} ({})", name, shape[d]));
    figure.dim_colours.push_back(colours[d % colours.size()]);
    ranks *= shape[d];
    shape_text.push_back(fmt::format("{}", shape[d]));
  }
  std::vector<std::string> name_text;
  for (size_t d = 0; d < shape.size(); ++d)
    name_text.push_back(names.empty() ? fmt::format("dim{}", d) : names[d]);
  figure.title = fmt::format("{} mesh ({}, outermost first): {} ranks", fmt::join(shape_text, "x"),
                             fmt::join(name_text, ", "), ranks);
  write_atomically(out, [&](const std::string& png) { detail::render_mesh(figure, size, png); });
}

// ---- simulate --plot -------------------------------------------------------------------------

void prepare_plot_directory(const std::string& directory, const std::string& option) {
  check_arg(!directory.empty(), kOp, "{}: the directory name is empty", option);
  std::error_code error;
  if (!fs::exists(directory, error)) fs::create_directories(directory, error);
  check_arg(!error && fs::is_directory(directory, error), kOp, "{} {}: cannot create a directory{}",
            option, directory, error ? fmt::format(" ({})", error.message()) : std::string());
  if (::access(directory.c_str(), W_OK | X_OK) != 0) {
    const int code = errno;
    throw InvalidArgument(kOp, fmt::format("{} {}: the directory is not writable ({})", option,
                                           directory, std::strerror(code)));
  }
}

std::vector<std::string> write_snapshot_plots(const std::string& directory, const std::string& file,
                                              const std::string& dataset, int64_t snapshot) {
  const io::DatasetInfo info = io::dataset_info(file, dataset);
  int64_t every = 0;
  if (const auto found = info.attributes.find("every"); found != info.attributes.end())
    every = to_integer(found->second).value_or(0);
  std::vector<std::string> written;
  static const char* kSpecies[2] = {"u", "v"};
  for (int species = 0; species < 2; ++species) {
    SliceSpec spec;
    spec.index = {snapshot, species};
    spec.axis = 2;
    spec.at = 0.5;
    SliceStyle style;
    const SlicePlan plan = plan_slice(info.shape, spec);
    style.title = fmt::format("{}, snapshot {}{}: z = {} of {}", kSpecies[species], snapshot,
                              every > 0 ? fmt::format(" (step {})", snapshot * every) : "",
                              plan.position, info.shape.back());
    const std::string out =
        (fs::path(directory) / fmt::format("snapshot_{:04d}_{}.png", snapshot, kSpecies[species]))
            .string();
    plot_slice(file, dataset, spec, style, out);
    written.push_back(out);
  }
  return written;
}

}  // namespace tessera::plot
