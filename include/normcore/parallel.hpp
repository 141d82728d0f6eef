// normcore: running a layer on several threads.
//
// Every forward and backward takes an optional first argument, a device: any
// object with numThreads() and enqueueNoNotification(f), which is what
// Eigen::ThreadPoolDevice provides (#define EIGEN_USE_THREADS before
// including Eigen's Tensor header):
//
//   Eigen::ThreadPool pool(2);
//   Eigen::ThreadPoolDevice device(&pool, 2);
//   ln.forward(device, x, y);
//
// Rows (BatchNorm: channels, then rows) are split into contiguous ranges, one
// per thread; small inputs stay on the calling thread. Cross-row reductions
// (dweight, dbias) are summed over fixed blocks of rows in a fixed order, so
// every result is bit-identical for any number of threads.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <type_traits>

#include "normcore/statistics.hpp"

namespace normcore {

/// The default device: the calling thread.
struct Serial {
  int numThreads() const { return 1; }
};

namespace detail {

/// Below this many elements of work per thread, threads cost more than they
/// save (waking a pool thread takes a few microseconds).
constexpr Index kMinElementsPerThread = 1 << 15;

template <typename D>
struct is_device {
  template <typename U>
  static auto test(int) -> decltype(std::declval<const U&>().numThreads(), std::true_type());
  template <typename>
  static std::false_type test(...);
  static constexpr bool value = decltype(test<D>(0))::value;
};

class Latch {
 public:
  explicit Latch(int n) : n_(n) {}
  void count_down() {
    std::lock_guard<std::mutex> lk(mu_);
    if (--n_ == 0) cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return n_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_;
};

/// How many parts to split `work` elements into on this device.
template <typename Device>
Index parts_for(const Device& d, Index work, Index max_parts) {
  const Index by_size = std::max<Index>(1, work / kMinElementsPerThread);
  return std::max<Index>(1, std::min<Index>({static_cast<Index>(d.numThreads()), by_size, max_parts}));
}

/// Runs fn(part) for part = 0..parts-1, part 0 on the calling thread, the
/// others on the device's threads; returns when all are done.
template <typename Device, typename F>
void run_parts(const Device& d, Index parts, F&& fn) {
  if constexpr (std::is_same<Device, Serial>::value) {
    for (Index p = 0; p < parts; ++p) fn(p);
  } else {
    if (parts <= 1) {
      if (parts == 1) fn(Index(0));
      return;
    }
    Latch latch(static_cast<int>(parts - 1));
    for (Index p = 1; p < parts; ++p) {
      d.enqueueNoNotification([&fn, &latch, p] {
        fn(p);
        latch.count_down();
      });
    }
    fn(Index(0));
    latch.wait();
  }
}

/// Splits [0, n) into `parts` contiguous ranges whose boundaries are
/// multiples of `align`; range p is [begin(p), begin(p + 1)).
struct Split {
  Index n, parts, align;
  Index begin(Index p) const {
    if (p >= parts) return n;
    const Index units = (n + align - 1) / align;
    return std::min(n, (units * p / parts) * align);
  }
};

}  // namespace detail
}  // namespace normcore
