// Plots of Tessera's outputs as PNG files, drawn with PLplot (its cairo "pngcairo" device):
// a 2-d slice of a field in HDF5, loss curves, scaling curves from benchmark JSON and a picture
// of an N-d device mesh (docs/plots.md). Plain functions, so that `tessera plot`, `tessera
// simulate --plot` and the training commands call the same code.
//
// Every function checks its inputs before drawing and throws InvalidArgument tagged "plot" whose
// message names the option at fault (--index, --at, --size, ...). A PNG is drawn into a
// temporary file next to the output and renamed onto it when complete, so a failure never leaves
// a partial image behind. Without PLplot (TESSERA_WITH_PLPLOT) the drawing functions throw
// NotAvailable "built without plotting (PLplot)"; the parsing and layout functions still work.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/box.hpp"

namespace tessera::plot {

/// True when this build draws plots (PLplot found at configure time).
bool available();
/// "5.15.0 (pngcairo)": the PLplot version and whether its pngcairo device is installed; empty
/// without PLplot.
std::string library_version();
/// Throws NotAvailable ("built without plotting (PLplot)") unless available(), and
/// InvalidArgument when PLplot's pngcairo device is missing (a driver package not installed).
void check_available();

/// The pixel size of an image.
struct ImageSize {
  int width = 800;
  int height = 600;
};

/// "WxH" (each 100 to 8192 pixels); errors name `option`.
ImageSize parse_size(const std::string& text, const std::string& option = "--size");

/// The perceptual colormaps a slice can use: viridis (default), magma, inferno, cividis, gray.
std::vector<std::string> colormap_names();
/// The colour stops of colormap `name` (sRGB, evenly spaced from the low to the high end);
/// InvalidArgument naming --cmap for an unknown name.
std::vector<std::array<uint8_t, 3>> colormap_stops(const std::string& name);

// ---- slice -----------------------------------------------------------------------------------

/// Which 2-d slice of a [T, C, X, Y, Z], [C, X, Y, Z] or [X, Y, Z] dataset to draw.
struct SliceSpec {
  /// The indices of the leading dims (t, c): as many as the dataset has dims before X, Y, Z;
  /// negative values count from the end (-1: the last snapshot).
  std::vector<int64_t> index;
  int axis = 2;     ///< the spatial dim cut across: 0 = x, 1 = y, 2 = z
  double at = 0.5;  ///< where along `axis`, as a fraction in [0, 1]
};

/// The hyperslab of one slice and how it maps onto the image.
struct SlicePlan {
  Box box;                           ///< the dataset's index box that is read (one plane)
  std::vector<int64_t> index;        ///< the leading indices, negative ones resolved
  int64_t position = 0;              ///< the index along `axis`: min(n - 1, floor(at n))
  int horizontal = 0, vertical = 1;  ///< the spatial dims (0..2) along the image's axes
  int64_t columns = 0, rows = 0;     ///< the slice's extents along them
};

/// "x", "y", "z" or "0", "1", "2" -> 0..2 (InvalidArgument naming --axis otherwise).
int parse_axis(const std::string& text);
/// "3,0" or "-1,1" -> {3, 0} / {-1, 1} (InvalidArgument naming --index otherwise).
std::vector<int64_t> parse_index(const std::string& text);

/// The slice of `spec` in a dataset of `shape`: InvalidArgument naming --index (count or range),
/// --at (outside [0, 1] or not finite) or the dataset (fewer than 3 or more than 5 dims, an empty
/// extent).
SlicePlan plan_slice(const Shape& shape, const SliceSpec& spec);

/// How a slice is drawn.
struct SliceStyle {
  ImageSize size;
  std::string colormap = "viridis";
  std::optional<double> vmin, vmax;  ///< the colour range; default the slice's finite range
  std::string title;                 ///< default: file:dataset, indices and axis=at
};

/// Reads only the hyperslab of `spec` from `file`:`dataset` and draws it to `out` with a
/// colorbar, axis labels and a title. InvalidArgument for a missing file or dataset (naming the
/// target), a bad slice, --vmin >= --vmax, an unwritable --out.
void plot_slice(const std::string& file, const std::string& dataset, const SliceSpec& spec,
                const SliceStyle& style, const std::string& out);

// ---- losses ----------------------------------------------------------------------------------

/// One loss curve: `step` and `loss` of each entry, in file order.
struct LossCurve {
  std::string label;
  std::vector<double> step, loss;
};

/// Reads `[{"step": 1, "loss": 0.5}, ...]` (the format of `tessera train --losses-out`; other
/// keys are ignored); the label is the file's name without ".json". InvalidArgument naming the
/// file and the entry for a missing file, malformed JSON, a missing or non-finite number.
LossCurve read_losses(const std::string& file);

/// Draws the curves over each other (a legend when more than one) against the step, with a
/// logarithmic loss axis when every loss is positive (linear otherwise, said in the title).
void plot_losses(const std::vector<LossCurve>& curves, const ImageSize& size,
                 const std::string& out, const std::string& title = "training loss");

/// For `tessera train --plot DIR`: draws `curve` to DIR/loss.png (DIR created if missing).
std::string write_loss_plot(const std::string& directory, const LossCurve& curve);

// ---- scaling ---------------------------------------------------------------------------------

/// One measurement: `ranks` ranks took `seconds` per step on `work` units (cells; 1 when the
/// input says nothing about the problem size).
struct ScalingPoint {
  int64_t ranks = 1;
  double seconds = 0;
  double work = 1;
};

/// Points of one configuration, ordered by ranks.
struct ScalingSeries {
  std::string label;
  std::vector<ScalingPoint> points;
};

/// Reads the accepted forms (docs/plots.md): a list of {"ranks", "step_seconds" [, "cells" |
/// "size"] [, "label"]} objects; one object of `tessera simulate --json` or several, one per line;
/// a `tessera bench ...` document (each table's rows grouped by their configuration, the time
/// from step_seconds, step_ms, forward_backward_ms, forward_ms, ms or time_us, or `time_key`).
/// InvalidArgument naming the file and entry otherwise.
std::vector<ScalingSeries> read_scaling(const std::string& file, const std::string& time_key = "");

/// Parallel efficiency of `point` against the series' first point `base`: per-rank throughput
/// (work / (ranks seconds)) relative to the base's. Strong scaling (same work): base.seconds
/// base.ranks / (ranks seconds); weak scaling (work proportional to ranks): base.seconds / seconds.
double efficiency(const ScalingPoint& base, const ScalingPoint& point);
/// The ideal time of `point` from `base`: base.seconds (work / base.work) (base.ranks / ranks).
double ideal_seconds(const ScalingPoint& base, const ScalingPoint& point);

/// Two panels: time per step against ranks (log-log, the ideal dashed) and efficiency.
void plot_scaling(const std::vector<ScalingSeries>& series, const ImageSize& size,
                  const std::string& out, const std::string& title = "scaling");

// ---- mesh ------------------------------------------------------------------------------------

/// A rank's box in the mesh picture, in picture units (the picture spans [0, 1] x [0, 1]).
struct MeshRankBox {
  int rank = 0;
  std::vector<int> coordinate;
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
};

/// A group of ranks that share their coordinates of dims 0..dim (framed in dim's colour).
struct MeshGroupBox {
  int dim = 0;
  int index = 0;  ///< the group's coordinate along `dim`
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
};

/// The nested layout of a mesh: the last dim runs left to right, the one before top to bottom,
/// and so on alternately outwards, so neighbouring ranks of the innermost dim sit side by side.
struct MeshLayout {
  std::vector<MeshRankBox> ranks;    ///< in rank order (row-major: the last dim fastest)
  std::vector<MeshGroupBox> groups;  ///< outer dims first
};

/// "2x2x2x2" -> {2, 2, 2, 2}: 1 to 4 dims, each >= 1, at most 256 ranks (InvalidArgument naming
/// --shape).
std::vector<int> parse_mesh_shape(const std::string& text);
/// The layout of a mesh of `shape` (1 to 4 dims).
MeshLayout layout_mesh(const std::vector<int>& shape);

/// Draws the mesh of `shape` with dim names `names` (one per dim; empty: dim0, dim1, ...).
void plot_mesh(const std::vector<int>& shape, const std::vector<std::string>& names,
               const ImageSize& size, const std::string& out);

// ---- simulate --plot -------------------------------------------------------------------------

/// For `tessera simulate --plot DIR`: draws the z = 0.5 slice of u and v of snapshot `snapshot`
/// of `file`:`dataset` ([T, 2, X, Y, Z]) to DIR/snapshot_NNNN_u.png and _v.png; returns their
/// paths.
std::vector<std::string> write_snapshot_plots(const std::string& directory, const std::string& file,
                                              const std::string& dataset, int64_t snapshot);

/// Creates `directory` when missing and checks that it is a writable directory (InvalidArgument
/// naming `option` otherwise).
void prepare_plot_directory(const std::string& directory, const std::string& option = "--plot");

}  // namespace tessera::plot
