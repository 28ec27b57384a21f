// Checks of an output file path before anything is written: the errors say what the user gave
// and why it cannot be written (a directory, a missing or read-only directory), instead of the
// low-level failure of the first file operation.
#pragma once

#include <string>

namespace tessera::io {

/// Throws InvalidArgument tagged with `op` unless `file` can be created or replaced: it must not
/// be a directory, and its directory must exist and be writable (checked with access(2), so a
/// read-only file system is named as such).
void check_output_path(const std::string& op, const std::string& file);

/// Throws InvalidArgument tagged with `op` when `output` is the same file as `input` (the same
/// path, or another name of the same inode), so that writing the output cannot destroy the
/// input it is computed from.
void check_output_is_not_input(const std::string& op, const std::string& input,
                               const std::string& output);

}  // namespace tessera::io
