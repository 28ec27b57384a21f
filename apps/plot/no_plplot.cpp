// The drawing layer (render.hpp) of a build without PLplot: plot::check_available() refuses
// every plot before a figure is drawn, so these are never reached with a figure.
#include "apps/plot/render.hpp"
#include "core/errors.hpp"

namespace tessera::plot::detail {

namespace {

[[noreturn]] void refuse() {
  throw NotAvailable("plot", "built without plotting (PLplot)");
}

}  // namespace

bool compiled() {
  return false;
}
std::string plplot_version() {
  return "";
}
bool has_png_device() {
  return false;
}

const std::vector<Rgb>& line_colours() {
  static const std::vector<Rgb> kColours = {{0, 0, 0}};
  return kColours;
}

void render_image(const ImageFigure&, const ImageSize&, const std::string&) {
  refuse();
}
void render_panels(const std::vector<LinePanel>&, const std::string&, const ImageSize&,
                   const std::string&) {
  refuse();
}
void render_mesh(const MeshFigure&, const ImageSize&, const std::string&) {
  refuse();
}

}  // namespace tessera::plot::detail
