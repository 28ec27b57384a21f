// Output path checks (output_path.hpp); plain filesystem calls, no HDF5.
#include "io/output_path.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/errors.hpp"

namespace tessera::io {

void check_output_path(const std::string& op, const std::string& file) {
  namespace fs = std::filesystem;
  check_arg(!file.empty(), op, "the output file name is empty");
  std::error_code error;
  check_arg(!fs::is_directory(file, error), op,
            "output {} is a directory; expected the path of a file to write", file);
  fs::path directory = fs::path(file).parent_path();
  if (directory.empty()) directory = ".";
  check_arg(fs::is_directory(directory, error), op,
            "cannot write {}: the directory {} does not exist", file, directory.string());
  if (::access(directory.c_str(), W_OK | X_OK) != 0) {
    const int code = errno;
    throw InvalidArgument(op, fmt::format("cannot write {}: the directory {} is not writable ({})",
                                          file, directory.string(), std::strerror(code)));
  }
}

void check_output_is_not_input(const std::string& op, const std::string& input,
                               const std::string& output) {
  namespace fs = std::filesystem;
  std::error_code input_error, output_error, error;
  const fs::path input_path = fs::weakly_canonical(input, input_error);
  const fs::path output_path = fs::weakly_canonical(output, output_error);
  const bool same_path =
      input == output || (!input_error && !output_error && input_path == output_path);
  const bool same_inode = fs::exists(input, error) && fs::exists(output, error) &&
                          fs::equivalent(input, output, error) && !error;
  check_arg(!same_path && !same_inode, op,
            "--out {} is the input file {}; writing it would destroy the input (choose another "
            "output path)",
            output, input);
}

}  // namespace tessera::io
