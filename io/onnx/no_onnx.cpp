// Stand-in for io/onnx/onnx_file.cpp in a build without the onnx library: reading a model says
// how to get ONNX support.
#include "core/errors.hpp"
#include "io/onnx/onnx_graph.hpp"

namespace tessera::io {

namespace {

[[noreturn]] void no_onnx() {
  throw NotAvailable("onnx",
                     "this Tessera was built without ONNX support (install libonnx-dev and "
                     "libprotobuf-dev, e.g. scripts/install-deps.sh, and reconfigure with "
                     "TESSERA_WITH_ONNX=AUTO or ON)");
}

}  // namespace

bool onnx_available() {
  return false;
}

OnnxGraph parse_onnx(const std::string&, const std::string&) {
  no_onnx();
}

OnnxGraph read_onnx(const std::string&) {
  no_onnx();
}

void write_onnx(const OnnxGraph&, const std::vector<std::pair<std::string, Tensor>>&,
                const std::string&) {
  no_onnx();
}

}  // namespace tessera::io
