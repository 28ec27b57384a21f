// Helpers shared by the distributed HDF5 tests: a scratch directory per world (created by rank
// 0, usable by local ranks and mpiexec processes alike) and checks of agreed errors.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

#include "tests/dist/harness.hpp"

namespace tessera::testing {

/// Collective: a fresh directory for world `comm`, named from values every rank knows (suite,
/// test, backend, world size, test binary) plus the pid on the local backend; rank 0 creates it.
inline std::string make_test_dir(Comm& comm, const std::string& suite, const std::string& test) {
  namespace fs = std::filesystem;
  std::error_code error;
  const std::string binary = fs::read_symlink("/proc/self/exe", error).string();
  std::string name = fmt::format("tessera_{}_{}_{}_w{}_{:x}", suite, test, comm.backend(),
                                 comm.size(), std::hash<std::string>{}(binary)&0xffffff);
  if (!mpi_backend()) name += fmt::format("_p{}", static_cast<long>(::getpid()));
  const fs::path dir = fs::temp_directory_path() / name;
  if (comm.rank() == 0) {
    fs::remove_all(dir, error);
    fs::create_directories(dir);
  }
  comm.barrier();
  return dir.string();
}

/// Collective: rank 0 removes the directory once every rank is done with it.
inline void remove_test_dir(Comm& comm, const std::string& dir) {
  comm.barrier();
  std::error_code error;
  if (comm.rank() == 0) std::filesystem::remove_all(dir, error);
}

/// Runs `action`; returns the message of the AgreedError it throws ("" when it does not throw).
inline std::string agreed_error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const AgreedError& error) {
    return error.what();
  }
  return "";
}

/// Collective: every rank got a non-empty and identical message.
inline void expect_same_error_everywhere(Comm& comm, const std::string& message,
                                         const std::string& what) {
  EXPECT_FALSE(message.empty()) << what << ": rank " << comm.rank() << " did not throw";
  for (const std::string& other : all_gather_strings(comm, message))
    EXPECT_EQ(other, message) << what << ": rank " << comm.rank();
}

}  // namespace tessera::testing
