// parallel_for without OpenMP: the whole range on the calling thread (see parallel_for.hpp).
#include "core/parallel_for.hpp"

namespace tessera {

void parallel_for(int64_t count, int /*threads*/,
                  const std::function<void(int64_t begin, int64_t end, int slot)>& body) {
  if (count > 0) body(0, count, 0);
}

bool parallel_for_has_threads() {
  return false;
}

}  // namespace tessera
