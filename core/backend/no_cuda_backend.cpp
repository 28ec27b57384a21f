// Stub of the cuda backend for builds without CUDA: every call throws NotAvailable.
#include "core/backend/backend.hpp"
#include "core/errors.hpp"

namespace tessera {

namespace {

[[noreturn]] void unavailable(const std::string& op) {
  throw NotAvailable(op,
                     "a cuda tensor, but this Tessera was built without CUDA "
                     "(TESSERA_WITH_CUDA=OFF)");
}

class NoCudaBackend final : public DeviceBackend {
 public:
  std::string name() const override { return "cuda"; }
  void* allocate(size_t, Device, const Stream&, const std::string& op) override { unavailable(op); }
  void release(void*, size_t, Device, const Stream&) noexcept override {}
  AllocatorStats allocator_stats(Device) const override { return {}; }
  void clear_cache(Device) override {}
  void copy(const StridedRef&, const StridedRef&, size_t, const Stream&) override {
    unavailable("copy");
  }
  void fill(const StridedRef&, DType, double, const Stream&) override { unavailable("fill"); }
  void accumulate(const StridedRef&, const StridedRef&, DType, ReduceOp, const Stream&) override {
    unavailable("accumulate");
  }
  void scale(const StridedRef&, DType, double, const Stream&) override { unavailable("scale"); }
  void convert(void*, DType, const void*, DType, size_t, const Stream&) override {
    unavailable("convert");
  }
  double sum(const void*, size_t, DType, const Stream&) override { unavailable("sum"); }
};

}  // namespace

DeviceBackend& cuda_backend() {
  static NoCudaBackend backend;
  return backend;
}

}  // namespace tessera
