// Staging of device buffers for an MPI that is not CUDA-aware: whether to stage (the
// TESSERA_MPI_CUDA_AWARE override or the library's answer) and a reusable pool of page-locked
// host blocks per communicator. Pure host logic (the allocator is a parameter), tested on cpu.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

namespace tessera {

/// Whether device buffers may go to MPI directly: `override_value` (TESSERA_MPI_CUDA_AWARE: "1"
/// yes, "0" no; null or "" when unset) wins; otherwise `library_answer` (1 aware, 0 not, -1 the
/// library cannot tell, which counts as not aware). Throws InvalidArgument for another value.
bool choose_mpi_cuda_aware(const char* override_value, int library_answer);

/// The bytes [offset, offset + bytes) of a buffer.
struct ByteRange {
  size_t offset = 0;
  size_t bytes = 0;
  bool operator==(const ByteRange&) const = default;
};

/// The bytes a v collective writes into its receive buffer: rank p's block of `counts[p]`
/// elements of `element` bytes at element `displs[p]`, in order of offset, empty blocks left out,
/// touching or overlapping blocks merged. A staged receive buffer is copied back to the device
/// over these ranges only, so the bytes between the blocks keep what the device held.
std::vector<ByteRange> written_ranges(std::span<const size_t> counts,
                                      std::span<const size_t> displs, size_t element);

/// Host blocks for staging, kept for reuse: a lease takes the smallest free block that fits (or
/// allocates one, rounded up to a power of two of at least 4 KiB) and gives it back when
/// destroyed. Thread-safe; leases may outlive the pool object (its state is shared).
class StagingPool {
 public:
  using AllocateFn = void* (*)(size_t bytes);
  using ReleaseFn = void (*)(void* pointer) noexcept;

  /// A pool whose blocks come from `allocate` and go back through `release`.
  StagingPool(AllocateFn allocate, ReleaseFn release);

  /// A block of at least `bytes` for the lease's lifetime.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    ~Lease();
    void* data() const { return data_; }

   private:
    friend class StagingPool;
    struct State;
    void give_back() noexcept;
    std::shared_ptr<State> state_;
    void* data_ = nullptr;
  };

  /// Leases a block of at least `bytes` (a null block for 0 bytes).
  Lease acquire(size_t bytes);
  /// Blocks allocated so far (free or leased).
  size_t blocks() const;
  /// Bytes of every block allocated so far.
  size_t bytes_reserved() const;

 private:
  std::shared_ptr<Lease::State> state_;
};

}  // namespace tessera
