// The cuda step of the Gray-Scott simulation in a build without CUDA: NotAvailable.
#include "apps/sim/gray_scott_cuda.hpp"

namespace tessera::sim {

void step_cells_cuda(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Box&,
                     const GrayScottParams&) {
  throw NotAvailable("simulate", "cuda step asked for, but this Tessera was built without CUDA");
}

}  // namespace tessera::sim
