// Stub of the nccl backend for builds without NCCL.
#include "core/comm/nccl_comm.hpp"
#include "core/comm/nccl_support.hpp"

namespace tessera {

std::string nccl_version() {
  return "";
}

bool nccl_compiled() {
  return false;
}

std::shared_ptr<Comm> make_nccl_comm(std::shared_ptr<Comm>) {
  throw NotAvailable("nccl",
                     "this Tessera was built without NCCL (TESSERA_WITH_NCCL=OFF or NCCL not "
                     "found); use TESSERA_BACKEND=local or mpi");
}

}  // namespace tessera
