// The memory roofline: a memcpy moving the case's minimum traffic. A memcpy
// of B bytes reads B and writes B, so a forward (x in, y out) is one copy of
// x, and a backward (x, dy in, dx out: 3 tensors) is a copy of x plus a copy
// of half of dy. With more than one thread the copy is split into equal
// contiguous chunks, one per OpenMP thread.
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "bench_common.hpp"

namespace nbench {
namespace {

void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  const int t = threads();
  if (t <= 1 || bytes < (1u << 16)) {
    std::memcpy(dst, src, bytes);
    return;
  }
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const std::size_t chunk = (bytes / static_cast<std::size_t>(t) + 63) / 64 * 64;
#pragma omp parallel for num_threads(t) schedule(static, 1)
  for (int i = 0; i < t; ++i) {
    const std::size_t off = chunk * static_cast<std::size_t>(i);
    if (off < bytes) std::memcpy(d + off, s + off, std::min(chunk, bytes - off));
  }
}

class CopyRunner : public Runner {
 public:
  CopyRunner(const Case& c, const Inputs& in)
      : c_(c), in_(in), out_(static_cast<std::size_t>(c.elements())),
        half_(is_backward(c.op) ? static_cast<std::size_t>(c.elements() / 2) : 0) {}
  void run() override {
    copy_bytes(out_.data(), in_.x, out_.size() * sizeof(float));
    if (!half_.empty()) copy_bytes(half_.data(), in_.dy, half_.size() * sizeof(float));
  }
  void collect(Result& r) override { r.out.assign(out_.begin(), out_.end()); }

 private:
  Case c_;
  Inputs in_;
  Buffer out_, half_;
};

}  // namespace

void add_copy_impl(std::vector<Impl>& out) {
  out.push_back({"memcpy", [](const Case&) { return true; },
                 [](const Case& c, const Inputs& in) -> RunnerPtr {
                   return std::make_unique<CopyRunner>(c, in);
                 }});
}

}  // namespace nbench
