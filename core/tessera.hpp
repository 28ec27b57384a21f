// Tessera's public API in one include: #include <tessera/tessera.hpp>.
#pragma once

#include "core/agree.hpp"
#include "core/box.hpp"
#include "core/comm/comm.hpp"
#include "core/comm/launch.hpp"
#include "core/comm/local_comm.hpp"
#include "core/comm/mpi_comm.hpp"
#include "core/config.hpp"
#include "core/device.hpp"
#include "core/device_mesh.hpp"
#include "core/dtype.hpp"
#include "core/errors.hpp"
#include "core/halo/halo_exchange.hpp"
#include "core/halo/halo_plan.hpp"
#include "core/layout.hpp"
#include "core/shard_tensor.hpp"
#include "core/tensor.hpp"
