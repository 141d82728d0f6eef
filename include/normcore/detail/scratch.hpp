// normcore::detail: per-thread scratch memory for the temporaries of one
// call (the backwards' per-group parameter sums and recomputed statistics;
// the ColMajor forwards' per-row moments, coefficients and rstd, and the
// lane statistics' chunk states; the float blocks of 16-bit rows and
// segments, and BatchNorm's whole float copies of 16-bit tensors in its
// Intel-only fused forward when they fit), kept from one call to the next.
//
// Why: those temporaries reach hundreds of KB (16 groups of n doubles for
// each parameter gradient). glibc serves such a block from the top of its
// heap or from mmap, and gives it back to the system when it is freed and
// the heap's free top grows past its trim threshold; the next call then
// page-faults every page again. On this project's VM, LayerNorm's backward
// at 512x4096 spent more than half its time in those faults (2.3x the time
// with glibc's trimming and mmap turned off). A thread's arena grows to the
// largest total it was asked for at once and stays; requests larger than
// kScratchKeepBytes are allocated and freed per call as before.
// normcore::release_scratch() frees the calling thread's arena.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>

namespace normcore {
namespace detail {

/// The most a thread keeps between calls (a request above it is allocated
/// for the call alone).
constexpr std::size_t kScratchKeepBytes = std::size_t(16) << 20;

struct ScratchArena {
  struct Free {
    void operator()(unsigned char* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<unsigned char[], Free> base;
  std::size_t capacity = 0;  // bytes at base
  std::size_t top = 0;       // bytes in use (a stack of live Scratch objects)
  std::size_t want = 0;      // the largest total asked for at once, up to kScratchKeepBytes
};

inline ScratchArena& scratch_arena() {
  thread_local ScratchArena arena;
  return arena;
}

/// `count` values of T for the lifetime of this object, zeroed if asked.
/// From the calling thread's arena when they fit, else from the heap; the
/// first request made while no other Scratch of the thread is alive grows
/// the arena to the largest total (up to kScratchKeepBytes) asked for so
/// far. Scratch objects of one thread must end in the reverse order of
/// their creation, as automatic variables do.
template <typename T>
class Scratch {
  static_assert(std::is_trivially_copyable<T>::value && std::is_trivially_destructible<T>::value,
                "Scratch holds plain values");

 public:
  Scratch(std::size_t count, bool zero) : count_(count) {
    if (count == 0) return;
    bytes_ = (count * sizeof(T) + 63) / 64 * 64;
    ScratchArena& a = scratch_arena();
    if (a.top + bytes_ <= kScratchKeepBytes) a.want = std::max(a.want, a.top + bytes_);
    if (a.top == 0 && a.capacity < a.want) {  // nothing alive: grow to the largest total seen
      auto* p = static_cast<unsigned char*>(::operator new[](a.want, std::align_val_t(64), std::nothrow));
      if (p) {
        a.base.reset(p);
        a.capacity = a.want;
      } else {  // no memory for it: this request and later ones go to the heap
        a.want = a.capacity;
      }
    }
    if (a.top + bytes_ <= a.capacity) {
      p_ = reinterpret_cast<T*>(a.base.get() + a.top);
      a.top += bytes_;
      arena_ = &a;
    } else {
      heap_.reset(new T[count]);
      p_ = heap_.get();
    }
    if (zero) std::memset(static_cast<void*>(p_), 0, count * sizeof(T));
  }
  ~Scratch() {
    if (arena_) arena_->top -= bytes_;
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  T* data() { return p_; }
  const T* data() const { return p_; }
  std::size_t size() const { return count_; }

 private:
  std::size_t count_ = 0;
  std::size_t bytes_ = 0;
  T* p_ = nullptr;
  ScratchArena* arena_ = nullptr;
  std::unique_ptr<T[]> heap_;
};

}  // namespace detail

/// Frees the calling thread's scratch memory, which normcore keeps from one
/// call to the next (up to 16 MiB of temporaries). The next call that needs
/// it allocates it again.
/// Does nothing while a call of this thread is using it.
inline void release_scratch() {
  detail::ScratchArena& a = detail::scratch_arena();
  if (a.top != 0) return;
  a.base.reset();
  a.capacity = 0;
  a.want = 0;
}

}  // namespace normcore
