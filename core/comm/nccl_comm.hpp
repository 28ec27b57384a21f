// The `nccl` backend's entry points. Built from nccl_comm.cpp when TESSERA_HAVE_NCCL and from
// no_nccl.cpp otherwise (where make_nccl_comm throws NotAvailable).
//
// An NCCL communicator wraps a bootstrap Comm (mpi or local): the ncclUniqueId travels over the
// bootstrap, device buffers move through NCCL on the rank's comm stream, and host buffers (small
// agreement messages) go to the bootstrap. Every rank needs its own GPU (NCCL refuses two ranks
// of one communicator on one device) and all ranks of a call pass buffers in the same memory
// space (a null buffer counts as device memory).
#pragma once

#include <memory>

#include "core/comm/comm.hpp"

namespace tessera {

/// True when Tessera was built with NCCL.
bool nccl_compiled();

/// Collective over `bootstrap`: an NCCL communicator of the same ranks on each rank's device
/// (current_rank_context().device(), which must be cuda).
std::shared_ptr<Comm> make_nccl_comm(std::shared_ptr<Comm> bootstrap);

}  // namespace tessera
