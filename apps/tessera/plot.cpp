// `tessera plot slice|losses|scaling|mesh`: PNG plots of a field slice in HDF5, loss curves,
// scaling measurements and a device mesh (apps/plot, docs/plots.md). Bad input gives one error
// line naming the option and exit code 2; no partial PNG is left behind.
#include "apps/plot/plot.hpp"

#include <cmath>
#include <memory>

#include "apps/tessera/commands.hpp"
#include "core/errors.hpp"

namespace tessera::cli {

namespace {

constexpr const char* kOp = "plot";

/// FILE.h5:/dataset split at the last colon.
std::pair<std::string, std::string> split_target(const std::string& target) {
  const size_t colon = target.rfind(':');
  check_arg(colon != std::string::npos && colon > 0 && colon + 1 < target.size(), kOp,
            "expected FILE.h5:/dataset, got '{}'", target);
  return {target.substr(0, colon), target.substr(colon + 1)};
}

/// A finite number given as text to `option`, or nothing for empty text.
std::optional<double> parse_number(const std::string& text, const std::string& option) {
  if (text.empty()) return std::nullopt;
  double value = 0;
  size_t used = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  check_arg(used == text.size() && std::isfinite(value), kOp, "{} {}: expected a finite number",
            option, text);
  return value;
}

std::vector<std::string> split_names(const std::string& text) {
  std::vector<std::string> names;
  if (text.empty()) return names;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    names.push_back(
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return names;
}

struct SliceCliOptions {
  std::string target, index, axis = "z", out, size = "800x600", cmap = "viridis", vmin, vmax, title;
  double at = 0.5;
};

struct CurvesCliOptions {
  std::vector<std::string> files;
  std::string out, size, title, time_key;
};

struct MeshCliOptions {
  std::string shape, names, out, size = "900x650";
};

void add_size_option(CLI::App& command, std::string& size) {
  command.add_option("--size", size, "Image size WxH in pixels (100 to 8192 each)")
      ->capture_default_str();
}

}  // namespace

void register_plot(CLI::App& app) {
  auto* plot = app.add_subcommand("plot", "PNG plots: a field slice, losses, scaling, a mesh");
  plot->require_subcommand(1);

  auto slice_options = std::make_shared<SliceCliOptions>();
  auto* slice = plot->add_subcommand(
      "slice", "A 2-d slice of a [T, C, X, Y, Z], [C, X, Y, Z] or [X, Y, Z] dataset");
  slice->add_option("target", slice_options->target, "FILE.h5:/dataset")->required();
  slice->add_option("--index", slice_options->index,
                    "Indices of the dims before X, Y, Z: t,c / c / none (negative: from the end)");
  slice->add_option("--axis", slice_options->axis, "The dim cut across: x, y or z")
      ->capture_default_str();
  slice->add_option("--at", slice_options->at, "Where along --axis, a fraction in [0, 1]")
      ->capture_default_str();
  slice->add_option("--out", slice_options->out, "The PNG file")->required();
  add_size_option(*slice, slice_options->size);
  slice->add_option("--cmap", slice_options->cmap, "viridis, magma, inferno, cividis or gray")
      ->capture_default_str();
  slice->add_option("--vmin", slice_options->vmin, "Low end of the colour range (default: data)");
  slice->add_option("--vmax", slice_options->vmax, "High end of the colour range (default: data)");
  slice->add_option("--title", slice_options->title, "Title (default: dataset, indices, axis)");
  slice->callback([slice_options] {
    const SliceCliOptions& options = *slice_options;
    plot::check_available();
    const auto [file, dataset] = split_target(options.target);
    plot::SliceSpec spec;
    spec.index = plot::parse_index(options.index);
    spec.axis = plot::parse_axis(options.axis);
    spec.at = options.at;
    plot::SliceStyle style;
    style.size = plot::parse_size(options.size);
    style.colormap = options.cmap;
    style.vmin = parse_number(options.vmin, "--vmin");
    style.vmax = parse_number(options.vmax, "--vmax");
    style.title = options.title;
    plot::plot_slice(file, dataset, spec, style, options.out);
  });

  auto loss_options = std::make_shared<CurvesCliOptions>();
  loss_options->size = "800x500";
  loss_options->title = "training loss";
  auto* losses = plot->add_subcommand(
      "losses", "Loss against step from tessera train --losses-out files (overlaid, log scale)");
  losses->add_option("files", loss_options->files, "L.json files: [{\"step\": 1, \"loss\": ..}]")
      ->required();
  losses->add_option("--out", loss_options->out, "The PNG file")->required();
  add_size_option(*losses, loss_options->size);
  losses->add_option("--title", loss_options->title, "Title")->capture_default_str();
  losses->callback([loss_options] {
    plot::check_available();
    const plot::ImageSize size = plot::parse_size(loss_options->size);
    std::vector<plot::LossCurve> curves;
    for (const std::string& file : loss_options->files) curves.push_back(plot::read_losses(file));
    plot::plot_losses(curves, size, loss_options->out, loss_options->title);
  });

  auto scaling_options = std::make_shared<CurvesCliOptions>();
  scaling_options->size = "1100x450";
  scaling_options->title = "scaling";
  auto* scaling = plot->add_subcommand(
      "scaling", "Time per step and efficiency against ranks from bench or simulate --json output");
  scaling
      ->add_option("files", scaling_options->files,
                   "JSON: [{\"ranks\": P, \"step_seconds\": t}], simulate --json lines or a "
                   "bench document")
      ->required();
  scaling->add_option("--out", scaling_options->out, "The PNG file")->required();
  add_size_option(*scaling, scaling_options->size);
  scaling->add_option("--time", scaling_options->time_key,
                      "The time key of each row (default: step_seconds, step_ms, "
                      "forward_backward_ms, forward_ms, ms or time_us)");
  scaling->add_option("--title", scaling_options->title, "Title")->capture_default_str();
  scaling->callback([scaling_options] {
    plot::check_available();
    const plot::ImageSize size = plot::parse_size(scaling_options->size);
    std::vector<plot::ScalingSeries> series;
    const bool several = scaling_options->files.size() > 1;
    for (const std::string& file : scaling_options->files)
      for (plot::ScalingSeries& one : plot::read_scaling(file, scaling_options->time_key)) {
        // Series of several files are told apart by their file.
        if (several) one.label = file.substr(file.find_last_of('/') + 1) + ": " + one.label;
        series.push_back(std::move(one));
      }
    plot::plot_scaling(series, size, scaling_options->out, scaling_options->title);
  });

  auto mesh_options = std::make_shared<MeshCliOptions>();
  auto* mesh = plot->add_subcommand("mesh", "A picture of an N-d device mesh (1 to 4 dims)");
  mesh->add_option("--shape", mesh_options->shape, "Mesh shape, e.g. 2x2x2x2")->required();
  mesh->add_option("--names", mesh_options->names, "Dim names, e.g. pp,dp,tp,domain");
  mesh->add_option("--out", mesh_options->out, "The PNG file")->required();
  add_size_option(*mesh, mesh_options->size);
  mesh->callback([mesh_options] {
    plot::check_available();
    const std::vector<int> shape = plot::parse_mesh_shape(mesh_options->shape);
    const plot::ImageSize size = plot::parse_size(mesh_options->size);
    plot::plot_mesh(shape, split_names(mesh_options->names), size, mesh_options->out);
  });
}

}  // namespace tessera::cli
