// Unit tests of the pure parts of launching (core/comm/launch_env.cpp): the backend named by
// TESSERA_BACKEND and the local rank from the launcher's environment.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "core/comm/launch.hpp"
#include "tests/common/scoped_env.hpp"

namespace tessera {
namespace {

using testing::ScopedEnv;

constexpr const char* local_rank_variables[] = {
    "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
    "PMI_LOCAL_RANK",  "PALS_LOCAL_RANKID",          "FLUX_TASK_LOCAL_ID"};

TEST(LaunchEnv, ParseBackendNamesEveryBackendAndAutoPicksMpiOnlyUnderALauncher) {
  EXPECT_EQ(parse_backend("local", true, true, true), Backend::local);
  EXPECT_EQ(parse_backend("mpi", false, true, false), Backend::mpi);
  EXPECT_EQ(parse_backend("nccl", false, false, true), Backend::nccl);
  EXPECT_EQ(parse_backend("auto", true, true, true), Backend::mpi);
  EXPECT_EQ(parse_backend("", false, true, true), Backend::local);
  // auto never picks nccl, and never mpi in a build without it.
  EXPECT_EQ(parse_backend("auto", true, false, true), Backend::local);
}

TEST(LaunchEnv, ParseBackendRejectsUnknownNamesAndBackendsNotBuilt) {
  EXPECT_THROW(parse_backend("gloo", false, true, true), InvalidArgument);
  EXPECT_THROW(parse_backend("nccl", false, true, false), NotAvailable);
  EXPECT_THROW(parse_backend("mpi", true, false, true), NotAvailable);
  try {
    parse_backend("nccl", false, true, false);
  } catch (const NotAvailable& error) {
    EXPECT_NE(std::string(error.what()).find("without NCCL"), std::string::npos) << error.what();
  }
}

TEST(LaunchEnv, BackendNamesRoundTrip) {
  for (Backend backend : {Backend::local, Backend::mpi, Backend::nccl})
    EXPECT_EQ(parse_backend(backend_name(backend), false, true, true), backend);
}

TEST(LaunchEnv, LocalRankIsZeroWithoutALauncher) {
  std::vector<std::unique_ptr<ScopedEnv>> cleared;
  for (const char* variable : local_rank_variables)
    cleared.push_back(std::make_unique<ScopedEnv>(variable, nullptr));
  EXPECT_EQ(local_rank_from_env(), 0);
}

TEST(LaunchEnv, LocalRankComesFromEachLaunchersVariable) {
  for (const char* variable : local_rank_variables) {
    std::vector<std::unique_ptr<ScopedEnv>> cleared;
    for (const char* other : local_rank_variables)
      cleared.push_back(std::make_unique<ScopedEnv>(other, nullptr));
    ScopedEnv set(variable, "3");
    EXPECT_EQ(local_rank_from_env(), 3) << variable;
  }
}

TEST(LaunchEnv, LocalRankPrefersMpichsThenOpenMpisVariable) {
  ScopedEnv slurm("SLURM_LOCALID", "5");
  ScopedEnv ompi("OMPI_COMM_WORLD_LOCAL_RANK", "2");
  ScopedEnv mpich("MPI_LOCALRANKID", nullptr);
  EXPECT_EQ(local_rank_from_env(), 2);
}

TEST(LaunchEnv, AMalformedLocalRankIsAClearError) {
  ScopedEnv mpich("MPI_LOCALRANKID", "two");
  try {
    local_rank_from_env();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("MPI_LOCALRANKID='two'"), std::string::npos)
        << error.what();
  }
  ScopedEnv negative("MPI_LOCALRANKID", "-1");
  EXPECT_THROW(local_rank_from_env(), InvalidArgument);
}

}  // namespace
}  // namespace tessera
