// The cooperative threads, barriers, warp collectives and asynchronous copies of the cpu
// emulation of a CUDA thread block (see cuda_block_emulator.hpp).
#include "tests/emu/cuda_block_emulator.hpp"

#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <new>
#include <vector>

namespace tessera::emu {
namespace {

constexpr int kWarpSize = 32;

enum class State { runnable, at_collective, at_barrier, exited };

struct Copy {
  void* shared;
  const void* global;
  bool valid;
};

// What the race checks know of one 16-byte granule of shared memory: the cp.async writes into it
// and the ldmatrix reads of it, by barrier interval ("epoch"). Plain loads and stores are not
// seen.
struct Granule {
  int pending_writer = -1;  // a thread whose copy into it has not landed
  std::source_location pending_site;
  int landed_writer = -1;  // the thread whose copy landed last, in landed_epoch
  uint64_t landed_epoch = 0;
  int reader_warp = -1;  // the warp that read it last with ldmatrix (-2: several), in read_epoch
  uint64_t read_epoch = 0;
  std::source_location read_site;
};

struct Thread {
  ucontext_t context{};
  State state = State::runnable;
  uint3 index{};
  std::vector<Copy> open;                // issued, not yet committed
  std::deque<std::vector<Copy>> groups;  // committed, not yet landed (oldest first)
  std::source_location site;             // where it waits
};

struct Warp {
  int arrived = 0, exited = 0;
  const char* name = nullptr;
  WarpOp op = nullptr;
  std::source_location site;
  const void* in[kWarpSize] = {};
  void* out[kWarpSize] = {};
};

struct Block {
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  char* stacks = nullptr;
  size_t stack_bytes = 0;
  unsigned char* shared = nullptr;
  size_t shared_bytes = 0;
  uint3 index{};
  dim3 grid, block;
  int current = 0, barrier_arrived = 0, exited = 0;
  uint64_t epoch = 1;  // barriers completed in this block, plus one
  std::vector<Granule> granules;
  std::source_location barrier_site;
  bool reverse = false;
  const std::function<void()>* kernel = nullptr;
  ucontext_t launcher{};
};

thread_local Block* active = nullptr;
thread_local LaunchStats stats;
// The threads' stacks, kept from launch to launch (a test launches hundreds of grids).
thread_local std::unique_ptr<char[]> stack_pool;
thread_local size_t stack_pool_bytes = 0;

Block& block() {
  if (active == nullptr) {
    std::fprintf(stderr, "tessera emu: a CUDA built-in used outside emu::launch\n");
    std::abort();
  }
  return *active;
}

std::string where(const std::source_location& site) {
  return std::string(site.file_name()) + ":" + std::to_string(site.line());
}

bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() &&
         std::strcmp(a.file_name(), b.file_name()) == 0;
}

std::string thread_name(int t) {
  return "thread " + std::to_string(t) + " (warp " + std::to_string(t / kWarpSize) + " lane " +
         std::to_string(t % kWarpSize) + ")";
}

int warp_lanes(const Block& b, int warp) {
  const int threads = static_cast<int>(b.threads.size());
  return threads - warp * kWarpSize < kWarpSize ? threads - warp * kWarpSize : kWarpSize;
}

// Switches from the current thread (blocked or exited) to the next runnable one in schedule
// order, or back to the launcher once every thread has exited.
void switch_away() {
  Block& b = block();
  const int n = static_cast<int>(b.threads.size()), from = b.current;
  for (int step = 1; step <= n; ++step) {
    const int next = b.reverse ? (from - step + n) % n : (from + step) % n;
    if (b.threads[next].state != State::runnable) continue;
    if (next == from) return;
    b.current = next;
    ++stats.switches;
    swapcontext(&b.threads[from].context, &b.threads[next].context);
    return;
  }
  if (b.exited == n) {
    swapcontext(&b.threads[from].context, &b.launcher);
    return;
  }
  std::string message = "deadlock: no thread can run;";
  for (int t = 0; t < n; ++t)
    if (b.threads[t].state != State::exited)
      message.append(" ")
          .append(thread_name(t))
          .append(" waits at ")
          .append(where(b.threads[t].site))
          .append(";");
  fail(message);
}

void thread_main() {
  Block& b = block();
  (*b.kernel)();
  const int t = b.current;
  const Warp& warp = b.warps[t / kWarpSize];
  if (warp.arrived > 0)
    fail(thread_name(t) + " exited while lanes of its warp wait at " + warp.name + " at " +
         where(warp.site));
  if (b.barrier_arrived > 0)
    fail(thread_name(t) + " exited while threads wait at __syncthreads at " +
         where(b.barrier_site));
  b.threads[t].state = State::exited;
  ++b.warps[t / kWarpSize].exited;
  ++b.exited;
  switch_away();
}

Granule& granule_of(Block& b, const void* shared) {
  return b.granules[(static_cast<const unsigned char*>(shared) - b.shared) / 16];
}

void land(Block& b, int thread, const std::vector<Copy>& group) {
  for (const Copy& copy : group) {
    if (copy.valid)
      std::memcpy(copy.shared, copy.global, 16);
    else
      std::memset(copy.shared, 0, 16);
    Granule& granule = granule_of(b, copy.shared);
    if (granule.pending_writer == thread) granule.pending_writer = -1;
    granule.landed_writer = thread;
    granule.landed_epoch = b.epoch;
  }
}

}  // namespace

void launch(dim3 grid, unsigned threads, size_t shared_bytes, const std::function<void()>& kernel,
            const LaunchOptions& options) {
  if (active != nullptr) fail("emu::launch inside a kernel");
  if (threads == 0 || threads > 1024) {
    std::fprintf(stderr, "tessera emu: a block of %u threads (1 to 1024)\n", threads);
    std::abort();
  }
  stats = LaunchStats{};
  Block b;
  b.threads.resize(threads);
  b.warps.resize((threads + kWarpSize - 1) / kWarpSize);
  b.stack_bytes = options.stack_bytes;
  // Untouched stack pages are never committed: 256 KiB per thread costs what the kernel uses.
  // The pool outlives the launch.
  if (stack_pool_bytes < b.stack_bytes * threads) {
    stack_pool.reset(new char[b.stack_bytes * threads]);
    stack_pool_bytes = b.stack_bytes * threads;
  }
  b.stacks = stack_pool.get();
  const size_t shared_alloc = shared_bytes > 0 ? (shared_bytes + 127) / 128 * 128 : 128;
  std::unique_ptr<unsigned char, void (*)(void*)> shared(
      static_cast<unsigned char*>(::operator new(shared_alloc, std::align_val_t(128))),
      [](void* p) { ::operator delete(p, std::align_val_t(128)); });
  b.shared = shared.get();
  b.shared_bytes = shared_bytes;
  b.granules.resize(shared_alloc / 16);
  b.grid = grid;
  b.block = dim3(threads, 1, 1);
  b.reverse = options.reverse;
  b.kernel = &kernel;
  active = &b;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.index = make_uint3(x, y, z);
        std::memset(b.shared, options.shared_fill, shared_alloc);
        b.barrier_arrived = b.exited = 0;
        b.epoch = 1;
        std::fill(b.granules.begin(), b.granules.end(), Granule{});
        for (Warp& warp : b.warps) warp = Warp{};
        for (unsigned t = 0; t < threads; ++t) {
          Thread& thread = b.threads[t];
          thread.state = State::runnable;
          thread.index = make_uint3(t, 0, 0);
          thread.open.clear();
          thread.groups.clear();
          getcontext(&thread.context);
          thread.context.uc_stack.ss_sp = b.stacks + t * b.stack_bytes;
          thread.context.uc_stack.ss_size = b.stack_bytes;
          thread.context.uc_link = nullptr;
          makecontext(&thread.context, thread_main, 0);
        }
        b.current = options.reverse ? static_cast<int>(threads) - 1 : 0;
        ++stats.blocks;
        swapcontext(&b.launcher, &b.threads[b.current].context);
      }
  active = nullptr;
}

const LaunchStats& last_launch_stats() {
  return stats;
}

const uint3& thread_index() {
  Block& b = block();
  return b.threads[b.current].index;
}
const uint3& block_index() {
  return block().index;
}
const dim3& block_dim() {
  return block().block;
}
const dim3& grid_dim() {
  return block().grid;
}
unsigned char* shared_memory() {
  return block().shared;
}

void fail(const std::string& message) {
  if (active != nullptr) {
    const Block& b = *active;
    std::fprintf(stderr, "tessera emu: block (%u, %u, %u), %s: %s\n", b.index.x, b.index.y,
                 b.index.z, thread_name(b.current).c_str(), message.c_str());
  } else {
    std::fprintf(stderr, "tessera emu: %s\n", message.c_str());
  }
  std::fflush(stderr);
  std::abort();
}

void sync_threads(std::source_location site) {
  Block& b = block();
  const int t = b.current, n = static_cast<int>(b.threads.size());
  const Warp& warp = b.warps[t / kWarpSize];
  if (warp.arrived > 0)
    fail("reached __syncthreads at " + where(site) + " while lanes of its warp wait at " +
         warp.name + " at " + where(warp.site));
  if (b.exited > 0)
    fail("reached __syncthreads at " + where(site) + " after " + std::to_string(b.exited) +
         " thread(s) of the block exited");
  if (b.barrier_arrived == 0)
    b.barrier_site = site;
  else if (!same_site(site, b.barrier_site))
    fail("reached __syncthreads at " + where(site) + " while threads wait at __syncthreads at " +
         where(b.barrier_site));
  b.threads[t].site = site;
  if (++b.barrier_arrived == n) {
    b.barrier_arrived = 0;
    ++b.epoch;
    ++stats.barriers;
    for (Thread& thread : b.threads) thread.state = State::runnable;
    return;
  }
  b.threads[t].state = State::at_barrier;
  switch_away();
}

void warp_collective(const char* name, WarpOp op, const void* in, void* out,
                     std::source_location site) {
  Block& b = block();
  const int t = b.current, lane = t % kWarpSize;
  Warp& warp = b.warps[t / kWarpSize];
  if (warp_lanes(b, t / kWarpSize) != kWarpSize)
    fail(std::string(name) + " at " + where(site) + " in a warp of " +
         std::to_string(warp_lanes(b, t / kWarpSize)) + " threads (full warps only)");
  if (warp.exited > 0)
    fail("reached " + std::string(name) + " at " + where(site) + " after " +
         std::to_string(warp.exited) + " lane(s) of its warp exited");
  for (int other = t - lane; other < t - lane + kWarpSize; ++other)
    if (b.threads[other].state == State::at_barrier)
      fail("reached " + std::string(name) + " at " + where(site) + " while " + thread_name(other) +
           " of its warp waits at __syncthreads at " + where(b.threads[other].site));
  if (warp.arrived == 0) {
    warp.name = name;
    warp.op = op;
    warp.site = site;
  } else if (std::strcmp(name, warp.name) != 0 || !same_site(site, warp.site)) {
    fail("reached " + std::string(name) + " at " + where(site) +
         " while lanes of its warp wait at " + warp.name + " at " + where(warp.site));
  }
  warp.in[lane] = in;
  warp.out[lane] = out;
  b.threads[t].site = site;
  if (++warp.arrived == kWarpSize) {
    warp.op(warp.in, warp.out);
    warp.arrived = 0;
    ++stats.warp_collectives;
    for (int other = t - lane; other < t - lane + kWarpSize; ++other)
      b.threads[other].state = State::runnable;
    return;
  }
  b.threads[t].state = State::at_collective;
  switch_away();
}

void check_shared(const void* address, size_t bytes, size_t alignment, const char* what,
                  std::source_location site) {
  const Block& b = block();
  const auto at = reinterpret_cast<uintptr_t>(address),
             base = reinterpret_cast<uintptr_t>(b.shared);
  if (at < base || at + bytes > base + b.shared_bytes)
    fail(std::string(what) + " at " + where(site) + ": " + std::to_string(bytes) +
         " bytes at shared offset " + std::to_string(static_cast<long long>(at - base)) +
         " outside the block's " + std::to_string(b.shared_bytes) + " bytes");
  if (at % alignment != 0)
    fail(std::string(what) + " at " + where(site) + ": shared offset " + std::to_string(at - base) +
         " is not a multiple of " + std::to_string(alignment));
}

void check_shared_read(const void* address, int warp, std::source_location site) {
  Block& b = block();
  Granule& granule = granule_of(b, address);
  if (granule.pending_writer >= 0)
    fail("ldmatrix at " + where(site) + " reads shared bytes whose cp.async by " +
         thread_name(granule.pending_writer) + " (" + where(granule.pending_site) +
         ") has not landed (no wait_async covers it yet)");
  if (granule.landed_epoch == b.epoch && granule.landed_writer / kWarpSize != warp)
    fail("ldmatrix at " + where(site) + " reads shared bytes " +
         thread_name(granule.landed_writer) +
         "'s cp.async landed in with no __syncthreads between");
  if (granule.read_epoch != b.epoch)
    granule.reader_warp = warp;
  else if (granule.reader_warp != warp)
    granule.reader_warp = -2;
  granule.read_epoch = b.epoch;
  granule.read_site = site;
}

void async_copy(void* shared, const void* global, bool valid, std::source_location site) {
  check_shared(shared, 16, 16, "cp.async destination", site);
  if (valid && reinterpret_cast<uintptr_t>(global) % 16 != 0)
    fail("cp.async at " + where(site) + ": a global source not 16-byte aligned");
  Block& b = block();
  const int t = b.current;
  Granule& granule = granule_of(b, shared);
  // The copy may land at any moment until its wait: an unlanded copy of another thread or a read
  // by another warp since the last barrier is a race.
  if (granule.pending_writer >= 0 && granule.pending_writer != t)
    fail("cp.async at " + where(site) + " into shared bytes " +
         thread_name(granule.pending_writer) + " is still copying into (" +
         where(granule.pending_site) + ")");
  if (granule.read_epoch == b.epoch && granule.reader_warp != t / kWarpSize)
    fail("cp.async at " + where(site) + " into shared bytes another warp read with ldmatrix at " +
         where(granule.read_site) + " with no __syncthreads between");
  granule.pending_writer = t;
  granule.pending_site = site;
  b.threads[t].open.push_back({shared, valid ? global : nullptr, valid});
  ++stats.async_copies;
}

void async_commit() {
  Block& b = block();
  Thread& thread = b.threads[b.current];
  thread.groups.push_back(std::move(thread.open));
  thread.open.clear();
}

void async_wait(int pending) {
  Block& b = block();
  Thread& thread = b.threads[b.current];
  while (static_cast<int>(thread.groups.size()) > pending) {
    land(b, b.current, thread.groups.front());
    thread.groups.pop_front();
  }
}

namespace detail {
void shuffle_xor(const void* const in[32], void* const out[32]) {
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const auto* mine = static_cast<const ShuffleIn*>(in[lane]);
    const auto* source = static_cast<const ShuffleIn*>(in[lane ^ mine->lane_mask]);
    if (source->bytes != mine->bytes) fail("__shfl_xor_sync of values of different sizes");
    std::memcpy(out[lane], source->value, mine->bytes);
  }
}

void reduce_or(const void* const in[32], void* const out[32]) {
  unsigned value = 0;
  for (int lane = 0; lane < kWarpSize; ++lane) value |= *static_cast<const unsigned*>(in[lane]);
  for (int lane = 0; lane < kWarpSize; ++lane) *static_cast<unsigned*>(out[lane]) = value;
}
}  // namespace detail

}  // namespace tessera::emu

namespace tessera::ops::kernels::mma_detail {
namespace {

constexpr int kWarpSize = 32;

struct LoadIn {
  const void* row;
  std::source_location site;
};

template <bool transposed>
void load_op(const void* const in[32], void* const out[32]) {
  // matrix[i][r][c]: element c of the row lane 8 i + r addressed.
  uint16_t matrix[4][8][8];
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const auto* operand = static_cast<const LoadIn*>(in[lane]);
    const std::string what = "ldmatrix row of lane " + std::to_string(lane);
    emu::check_shared(operand->row, 16, 16, what.c_str(), operand->site);
    emu::check_shared_read(operand->row, static_cast<int>(emu::thread_index().x) / kWarpSize,
                           operand->site);
    std::memcpy(matrix[lane / 8][lane % 8], operand->row, 16);
  }
  for (int lane = 0; lane < kWarpSize; ++lane) {
    auto* r = static_cast<uint32_t*>(out[lane]);
    for (int i = 0; i < 4; ++i) {
      const uint16_t low =
          transposed ? matrix[i][2 * (lane % 4)][lane / 4] : matrix[i][lane / 4][2 * (lane % 4)];
      const uint16_t high = transposed ? matrix[i][2 * (lane % 4) + 1][lane / 4]
                                       : matrix[i][lane / 4][2 * (lane % 4) + 1];
      r[i] = uint32_t(low) | uint32_t(high) << 16;
    }
  }
}

struct MmaIn {
  const uint32_t* a;
  uint32_t b0, b1;
  const float* c;
};

float widen_bits(uint16_t bits, __nv_bfloat16) {
  __nv_bfloat16 value;
  std::memcpy(static_cast<void*>(&value), &bits, 2);
  return __bfloat162float(value);
}
float widen_bits(uint16_t bits, __half) {
  __half value;
  std::memcpy(static_cast<void*>(&value), &bits, 2);
  return __half2float(value);
}

template <typename T>
void mma_op(const void* const in[32], void* const out[32]) {
  float a[16][16], b[16][8], c[16][8];
  auto low = [](uint32_t r) { return widen_bits(static_cast<uint16_t>(r & 0xffffu), T{}); };
  auto high = [](uint32_t r) { return widen_bits(static_cast<uint16_t>(r >> 16), T{}); };
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const auto* operand = static_cast<const MmaIn*>(in[lane]);
    const int g = lane / 4, t = lane % 4;
    for (int half = 0; half < 2; ++half) {  // a0..a3: columns 2t..; a4..a7: columns 2t + 8..
      a[g][2 * t + 8 * half] = low(operand->a[2 * half]);
      a[g][2 * t + 8 * half + 1] = high(operand->a[2 * half]);
      a[g + 8][2 * t + 8 * half] = low(operand->a[2 * half + 1]);
      a[g + 8][2 * t + 8 * half + 1] = high(operand->a[2 * half + 1]);
    }
    b[2 * t][g] = low(operand->b0);
    b[2 * t + 1][g] = high(operand->b0);
    b[2 * t + 8][g] = low(operand->b1);
    b[2 * t + 9][g] = high(operand->b1);
    c[g][2 * t] = operand->c[0];
    c[g][2 * t + 1] = operand->c[1];
    c[g + 8][2 * t] = operand->c[2];
    c[g + 8][2 * t + 1] = operand->c[3];
  }
  float d[16][8];
  for (int row = 0; row < 16; ++row)
    for (int col = 0; col < 8; ++col) {
      // Products of two 11-bit (f16) or 8-bit (bf16) significands are exact in double; the sum
      // of 16 of them and c is rounded once.
      double sum = c[row][col];
      for (int k = 0; k < 16; ++k) sum += double(a[row][k]) * double(b[k][col]);
      d[row][col] = static_cast<float>(sum);
    }
  for (int lane = 0; lane < kWarpSize; ++lane) {
    auto* result = static_cast<float*>(out[lane]);
    const int g = lane / 4, t = lane % 4;
    result[0] = d[g][2 * t];
    result[1] = d[g][2 * t + 1];
    result[2] = d[g + 8][2 * t];
    result[3] = d[g + 8][2 * t + 1];
  }
}

}  // namespace

void load_matrices(uint32_t r[4], const void* row, std::source_location site) {
  const LoadIn in{row, site};
  emu::warp_collective("ldmatrix.x4", load_op<false>, &in, r, site);
}

void load_matrices_transposed(uint32_t r[4], const void* row, std::source_location site) {
  const LoadIn in{row, site};
  emu::warp_collective("ldmatrix.x4.trans", load_op<true>, &in, r, site);
}

void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, __nv_bfloat16,
         std::source_location site) {
  const MmaIn in{a, b0, b1, c};
  emu::warp_collective("mma.m16n8k16.bf16", mma_op<__nv_bfloat16>, &in, c, site);
}

void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, __half,
         std::source_location site) {
  const MmaIn in{a, b0, b1, c};
  emu::warp_collective("mma.m16n8k16.f16", mma_op<__half>, &in, c, site);
}

}  // namespace tessera::ops::kernels::mma_detail
