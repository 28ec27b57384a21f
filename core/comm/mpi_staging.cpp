// Staging decisions and the staging pool (see mpi_staging.hpp).
#include "core/comm/mpi_staging.hpp"

#include <algorithm>
#include <bit>
#include <string>

#include "core/errors.hpp"

namespace tessera {

bool choose_mpi_cuda_aware(const char* override_value, int library_answer) {
  const std::string value = override_value ? override_value : "";
  if (value.empty()) return library_answer == 1;
  check_arg(value == "0" || value == "1", "mpi", "TESSERA_MPI_CUDA_AWARE='{}' (expected 0 or 1)",
            value);
  return value == "1";
}

std::vector<ByteRange> written_ranges(std::span<const size_t> counts,
                                      std::span<const size_t> displs, size_t element) {
  std::vector<ByteRange> blocks;
  for (size_t i = 0; i < counts.size() && i < displs.size(); ++i)
    if (counts[i]) blocks.push_back({displs[i] * element, counts[i] * element});
  std::sort(blocks.begin(), blocks.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.offset < b.offset; });
  std::vector<ByteRange> merged;
  for (const ByteRange& block : blocks) {
    if (!merged.empty() && block.offset <= merged.back().offset + merged.back().bytes) {
      ByteRange& last = merged.back();
      last.bytes = std::max(last.offset + last.bytes, block.offset + block.bytes) - last.offset;
    } else {
      merged.push_back(block);
    }
  }
  return merged;
}

struct StagingPool::Lease::State {
  AllocateFn allocate;
  ReleaseFn release;
  mutable std::mutex mu;
  struct Block {
    void* data;
    size_t bytes;
    bool leased;
  };
  std::vector<Block> blocks;

  ~State() {
    for (const Block& block : blocks) release(block.data);
  }
};

StagingPool::StagingPool(AllocateFn allocate, ReleaseFn release)
    : state_(std::make_shared<Lease::State>()) {
  state_->allocate = allocate;
  state_->release = release;
}

StagingPool::Lease StagingPool::acquire(size_t bytes) {
  Lease lease;
  if (bytes == 0) return lease;
  std::lock_guard lock(state_->mu);
  Lease::State::Block* best = nullptr;
  for (auto& block : state_->blocks)
    if (!block.leased && block.bytes >= bytes && (!best || block.bytes < best->bytes))
      best = &block;
  if (!best) {
    const size_t rounded = std::bit_ceil(std::max<size_t>(bytes, 4096));
    state_->blocks.push_back({state_->allocate(rounded), rounded, false});
    best = &state_->blocks.back();
  }
  best->leased = true;
  lease.state_ = state_;
  lease.data_ = best->data;
  return lease;
}

size_t StagingPool::blocks() const {
  std::lock_guard lock(state_->mu);
  return state_->blocks.size();
}

size_t StagingPool::bytes_reserved() const {
  std::lock_guard lock(state_->mu);
  size_t total = 0;
  for (const auto& block : state_->blocks) total += block.bytes;
  return total;
}

StagingPool::Lease::Lease(Lease&& other) noexcept
    : state_(std::move(other.state_)), data_(std::exchange(other.data_, nullptr)) {}

StagingPool::Lease& StagingPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    give_back();
    state_ = std::move(other.state_);
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

StagingPool::Lease::~Lease() {
  give_back();
}

void StagingPool::Lease::give_back() noexcept {
  if (!state_ || !data_) return;
  std::lock_guard lock(state_->mu);
  for (auto& block : state_->blocks)
    if (block.data == data_) block.leased = false;
  data_ = nullptr;
}

}  // namespace tessera
