// The drawing layer of apps/plot: figures described as plain data (checked and laid out by
// plot.cpp) and drawn to a PNG file by PLplot (render_plplot.cpp), or refused by a build without
// it (no_plplot.cpp). Every input here is valid: the drawing calls raise no user errors.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "apps/plot/plot.hpp"

namespace tessera::plot::detail {

using Rgb = std::array<uint8_t, 3>;

/// A 2-d field drawn as an image with a colorbar.
struct ImageFigure {
  std::vector<double> values;  ///< [columns][rows], row-major: values[c * rows + r]
  int64_t columns = 0, rows = 0;
  double vmin = 0, vmax = 1;
  std::vector<Rgb> colormap;  ///< evenly spaced stops, low to high
  std::string title, x_label, y_label, value_label;
};

/// One curve of a line panel.
struct LineSeries {
  std::string label;  ///< empty: not in the legend
  std::vector<double> x, y;
  Rgb colour{0, 0, 0};
  bool dashed = false;
  bool markers = false;
};

/// A panel of curves; log axes are base 10 for y and base 2 for x (labels show the values).
struct LinePanel {
  std::string title, x_label, y_label;
  bool log_x = false, log_y = false;
  bool integer_x = false;  ///< label x ticks as integers (ranks, steps)
  std::vector<LineSeries> series;
};

/// Boxes and labels of a mesh picture in [0, 1] x [0, 1] (y down).
struct MeshFigure {
  MeshLayout layout;
  std::vector<std::string> dim_labels;  ///< "pp (2)" per dim
  std::vector<Rgb> dim_colours;
  std::string title;
};

/// The qualitative colours of curves and mesh dims, in order.
const std::vector<Rgb>& line_colours();

/// Draws into the file `png` (which may exist; it is replaced).
void render_image(const ImageFigure& figure, const ImageSize& size, const std::string& png);
/// Draws the panels side by side, with `title` above them.
void render_panels(const std::vector<LinePanel>& panels, const std::string& title,
                   const ImageSize& size, const std::string& png);
/// Draws a mesh picture.
void render_mesh(const MeshFigure& figure, const ImageSize& size, const std::string& png);

/// The PLplot version and the pngcairo check behind plot::library_version(); empty without it.
std::string plplot_version();
/// Whether PLplot's pngcairo device is installed.
bool has_png_device();
/// Whether this build has PLplot.
bool compiled();

}  // namespace tessera::plot::detail
