// main() of tessera_dist_tests. Under the mpi backend every process runs the whole suite; only
// rank 0 prints the usual report, the other ranks print just their failures (tagged with their
// rank), so the output of `mpiexec -n N` stays readable. Every rank's exit status still counts.
#include <gtest/gtest.h>

#include <cstdio>

#include "tests/dist/harness.hpp"

namespace {

/// Prints failed assertions only, each prefixed with the MPI rank that saw it.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::printf("[rank %d] %s:%d: Failure\n%s\n", rank_,
                result.file_name() ? result.file_name() : "?", result.line_number(),
                result.summary());
    std::fflush(stdout);
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    std::printf("[rank %d] [  FAILED  ] %s.%s\n", rank_, info.test_suite_name(), info.name());
    std::fflush(stdout);
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (tessera::testing::mpi_backend()) {
    const int rank = tessera::mpi_world()->rank();
    if (rank != 0) {
      ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new RankFailurePrinter(rank));
    }
  }
  return RUN_ALL_TESTS();
}
