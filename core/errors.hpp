// Error types of Tessera: every failure is an exception whose message starts with the op in
// brackets and names the offending values, e.g. "[redistribute] extents sum to 9, expected 10".
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace tessera {

/// Base class of every error Tessera raises; `op()` is the op the message is tagged with.
class Error : public std::runtime_error {
 public:
  Error(std::string op, const std::string& message)
      : std::runtime_error(fmt::format("[{}] {}", op, message)), op_(std::move(op)) {}
  /// The op (or subsystem) that raised the error.
  const std::string& op() const { return op_; }

 private:
  std::string op_;
};

/// Bad arguments: shapes, extents, dtypes, attributes that cannot work.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A collective or point-to-point wait exceeded TESSERA_COMM_TIMEOUT.
class CommTimeout : public Error {
 public:
  using Error::Error;
};

/// A failure reported by a communication library (MPI, NCCL) or the local backend.
class CommError : public Error {
 public:
  using Error::Error;
};

/// A feature that was not compiled in (no CUDA, no HDF5, ...).
class NotAvailable : public Error {
 public:
  using Error::Error;
};

/// Throws InvalidArgument tagged with `op` when `condition` is false. Its arguments are
/// evaluated on every call: where one costs something to build (a str(), a nested format), on a
/// path every op call takes, use TESSERA_CHECK_ARG.
template <typename... Args>
inline void check_arg(bool condition, std::string_view op, fmt::format_string<Args...> format,
                      Args&&... args) {
  if (!condition)
    throw InvalidArgument(std::string(op), fmt::format(format, std::forward<Args>(args)...));
}

/// check_arg(condition, op, format, args...) whose op, format and arguments are evaluated only
/// when `condition` is false (as TORCH_CHECK's): a message built from str() costs nothing while
/// the check passes.
#define TESSERA_CHECK_ARG(condition, op, ...)                                        \
  do {                                                                               \
    if (!(condition))                                                                \
      throw ::tessera::InvalidArgument(std::string(op), ::fmt::format(__VA_ARGS__)); \
  } while (false)

}  // namespace tessera
