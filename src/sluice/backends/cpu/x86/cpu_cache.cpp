// A caching allocator for torch's small CPU tensors (install_cpu_cache).
//
// Why: a decode step of the default model makes ~700 small tensors (each layer's outputs,
// the int8 activations' scales and sums, norms' residuals) and frees them a few
// microseconds later. glibc serves anything over 1 KB outside its per-thread cache: each
// free coalesces chunks and a request over 1 KB consolidates the fast bins first
// (malloc_consolidate, unlink_chunk, _int_free were ~6% of a one-row step's main thread
// in `perf`), and the OpenMP worker waits through it. Here a freed block of up to
// kMaxBlock bytes goes on a free list of its size class and the next request of that
// class takes it back: a lock, a vector pop. Bigger blocks, and blocks past the cache's
// byte bound, are allocated and freed as torch's own allocator does (posix_memalign, 64-byte
// aligned): every block must be this allocator's, since raw_deallocate (oneDNN's scratch)
// frees through one deleter with nothing but the data pointer.
//
// Contents: a reused block holds whatever its last tensor left, as a fresh block from
// malloc does (torch's empty() promises nothing else); blocks this size never come
// zeroed from the OS's mmap (glibc's mmap threshold starts at 128 KB), so no caller can
// have relied on that.
#include "aten.h"  // first: its precompiled form (x86/__init__.py) serves only a file's first include

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pthread.h>

#include <cstdlib>
#include <cstring>
#include <typeinfo>
#include <mutex>
#include <new>
#include <vector>

#include "kernels.h"

namespace sluice {
namespace {

constexpr size_t kAlign = 64;                    // torch's CPU alignment (AVX-512 loads)
constexpr size_t kMaxBlock = 64 * 1024;          // bigger requests are not cached
constexpr size_t kMaxCachedBytes = 64ull << 20;  // free blocks kept at most, in bytes
// Size classes: multiples of 64 bytes to 1 KB, then four per power of two (at most 25%
// over the request) to kMaxBlock.
constexpr int kSmallClasses = 16;

int size_class(size_t n, size_t* rounded) {
  if (n <= 1024) {
    const size_t c = n == 0 ? 0 : (n - 1) / 64;
    *rounded = (c + 1) * 64;
    return static_cast<int>(c);
  }
  int e = 63 - __builtin_clzll(n - 1);  // 2^e < n <= 2^(e + 1), e >= 10
  const size_t step = (size_t{1} << e) / 4;
  const size_t sub = (n - (size_t{1} << e) + step - 1) / step;  // 1..4
  *rounded = (size_t{1} << e) + sub * step;
  return kSmallClasses + (e - 10) * 4 + static_cast<int>(sub) - 1;
}
constexpr int kClasses = kSmallClasses + (16 - 10) * 4;  // to 2^16 = kMaxBlock

// Every block: a 64-byte header (its class, -1 for blocks never cached, and its size) and
// then the tensor's bytes.
struct Header {
  int cls;
  size_t rounded;
};
static_assert(sizeof(Header) <= kAlign, "the header fits before the aligned data");

class CachingCpuAllocator final : public c10::Allocator {
 public:
  CachingCpuAllocator() = default;

  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &release, cpu};
    size_t rounded = n;
    const int cls = n > kMaxBlock ? -1 : size_class(n, &rounded);  // -1: never cached
    void* block = nullptr;
    if (cls >= 0) {
      std::lock_guard<std::mutex> lock(mu_);
      auto& list = free_[cls];
      if (!list.empty()) {
        block = list.back();
        list.pop_back();
        cached_bytes_ -= rounded;
      }
    }
    if (block == nullptr) {
      TORCH_CHECK(posix_memalign(&block, kAlign, kAlign + rounded) == 0, "out of memory allocating ", n, " bytes");
      *static_cast<Header*>(block) = {cls, rounded};
    }
    // Every block is this allocator's, big ones too, and the context is the data pointer
    // itself: raw_allocate (oneDNN's scratch) asserts that, and raw_deallocate frees
    // through raw_deleter with the data pointer alone. The header sits kAlign bytes before.
    void* data = static_cast<char*>(block) + kAlign;
    return {data, data, &release, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void release(void* data) {
    if (data == nullptr) return;
    CachingCpuAllocator* self = instance();
    void* block = static_cast<char*>(data) - kAlign;
    const Header h = *static_cast<Header*>(block);
    if (h.cls >= 0) {
      std::lock_guard<std::mutex> lock(self->mu_);
      if (self->cached_bytes_ + h.rounded <= kMaxCachedBytes) {
        self->free_[h.cls].push_back(block);
        self->cached_bytes_ += h.rounded;
        return;
      }
    }
    std::free(block);
  }

  // A child forked while another thread held the lock would wait on it for ever: it
  // starts with a fresh one (its lists are the parent's, copied with its memory).
  static void after_fork_in_child() {
    if (CachingCpuAllocator* self = instance()) new (&self->mu_) std::mutex();
  }

  static CachingCpuAllocator*& instance() {
    static CachingCpuAllocator* the = nullptr;
    return the;
  }

  void trim() {
    std::vector<void*> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& list : free_) {
        blocks.insert(blocks.end(), list.begin(), list.end());
        list.clear();
      }
      cached_bytes_ = 0;
    }
    for (void* b : blocks) std::free(b);
  }

  size_t cached_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return cached_bytes_;
  }

 private:
  std::mutex mu_;
  std::vector<void*> free_[kClasses];
  size_t cached_bytes_ = 0;
};

}  // namespace

// Installs the cache as torch's CPU allocator, over the one in place, once per process
// (each ISA build is its own module: the first to install wins, later calls find it).
// Never uninstalled: tensors it made may outlive any caller. Returns whether this call
// installed it.
bool install_cpu_cache() {
  static std::mutex once;
  std::lock_guard<std::mutex> lock(once);
  c10::Allocator* current = c10::GetCPUAllocator();
  // Another ISA build's cache is another module's class of the same name.
  if (CachingCpuAllocator::instance() != nullptr ||
      std::strcmp(typeid(*current).name(), typeid(CachingCpuAllocator).name()) == 0)
    return false;
  // Leaked on purpose: blocks it handed out may be freed during interpreter teardown.
  auto* cache = new CachingCpuAllocator();
  CachingCpuAllocator::instance() = cache;
  pthread_atfork(nullptr, nullptr, &CachingCpuAllocator::after_fork_in_child);
  c10::SetCPUAllocator(cache, /*priority=*/1);
  return true;
}

// Bytes held in free blocks (0 where this build's cache is not the one installed).
int64_t cpu_cache_bytes() {
  CachingCpuAllocator* cache = CachingCpuAllocator::instance();
  return cache == nullptr ? 0 : static_cast<int64_t>(cache->cached_bytes());
}

// Frees every cached block (the cache stays installed).
void trim_cpu_cache() {
  if (CachingCpuAllocator* cache = CachingCpuAllocator::instance()) cache->trim();
}

}  // namespace sluice
