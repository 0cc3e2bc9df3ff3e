// WeightBuffer (common.h): packed weights carved out of shared huge-page chunks.
#include <algorithm>
#include <mutex>

#include "common.h"

namespace cpx {
namespace {

// A chunk's size, unless one weight needs more: a few of a model's largest matrices, so that a small
// model's last chunk wastes little (only the huge pages a weight touches become resident).
constexpr size_t kChunkBytes = size_t(64) << 20;

struct Chunk {
  uint8_t* base = nullptr;
  size_t size = 0, used = 0;
  void* map = nullptr;  // what to unmap (base is its first 2 MiB boundary)
  size_t map_size = 0;
  ~Chunk() {
#if __has_include(<sys/mman.h>)
    if (map) munmap(map, map_size);
#else
    std::free(map);
#endif
  }
};

std::mutex g_mutex;
std::weak_ptr<Chunk> g_open;  // the chunk new weights go into, while any weight in it lives

std::shared_ptr<Chunk> new_chunk(size_t size) {
  auto c = std::make_shared<Chunk>();
  c->size = size;
#if __has_include(<sys/mman.h>)
  // Fresh anonymous pages are zero, and a chunk's bytes are never handed out twice: no memset, and
  // the pages a weight never touches stay unallocated.
  c->map_size = size + kHugePage;
  void* m = mmap(nullptr, c->map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  c->map = m;
  c->base = reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<uintptr_t>(m), kHugePage));
#ifdef MADV_HUGEPAGE
  madvise(c->base, size, MADV_HUGEPAGE);  // advice only: a refusal changes nothing
#endif
#else
  c->map = std::aligned_alloc(kHugePage, size);
  if (!c->map) throw std::bad_alloc();
  std::memset(c->map, 0, size);
  c->base = static_cast<uint8_t*>(c->map);
#endif
  return c;
}

}  // namespace

#if defined(__SANITIZE_ADDRESS__)
#define CPX_WEIGHTS_APART 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CPX_WEIGHTS_APART 1
#endif
#endif

void WeightBuffer::resize(size_t bytes) {
  if (p_) throw std::logic_error("a weight buffer is sized once");
  const size_t need = round_up(bytes ? bytes : 64, 64);
#ifdef CPX_WEIGHTS_APART
  // AddressSanitizer builds (`make asan`): one allocation per weight, so that a kernel reading past a
  // weight's end is caught rather than landing on the next weight of the chunk.
  void* q = std::aligned_alloc(64, need);
  if (!q) throw std::bad_alloc();
  std::memset(q, 0, need);
  chunk_ = std::shared_ptr<void>(q, [](void* v) { std::free(v); });
  p_ = static_cast<uint8_t*>(q);
#else
  std::shared_ptr<Chunk> c;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    c = g_open.lock();
    if (!c || c->size - c->used < need) {
      c = new_chunk(std::max(kChunkBytes, round_up(need, kHugePage)));
      // a weight larger than a chunk gets its own; the open chunk stays the one with room left
      if (need < kChunkBytes || !g_open.lock()) g_open = c;
    }
    p_ = c->base + c->used;
    c->used += need;
  }
  chunk_ = std::move(c);
#endif
  n = need;
}

}  // namespace cpx
