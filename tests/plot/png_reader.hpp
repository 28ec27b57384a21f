// Reads a PNG back with libpng's simplified API, for the plot tests: its size and its pixels as
// RGB triples.
#pragma once

#include <png.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace tessera::test {

struct PngImage {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  ///< height rows of width RGB triples

  /// How many different RGB values the image holds.
  size_t distinct_colours() const {
    std::set<uint32_t> colours;
    for (size_t i = 0; i + 2 < rgb.size(); i += 3)
      colours.insert(uint32_t{rgb[i]} << 16 | uint32_t{rgb[i + 1]} << 8 | rgb[i + 2]);
    return colours.size();
  }
};

/// The image in `path`; width 0 when it cannot be read as PNG.
inline PngImage read_png(const std::string& path) {
  PngImage result;
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&image, path.c_str())) return result;
  image.format = PNG_FORMAT_RGB;
  std::vector<uint8_t> pixels(PNG_IMAGE_SIZE(image));
  if (!png_image_finish_read(&image, nullptr, pixels.data(), 0, nullptr)) {
    png_image_free(&image);
    return result;
  }
  result.width = static_cast<int>(image.width);
  result.height = static_cast<int>(image.height);
  result.rgb = std::move(pixels);
  return result;
}

}  // namespace tessera::test
