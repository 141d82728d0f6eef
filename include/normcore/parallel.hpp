// normcore: running a layer on several threads.
//
// Every forward and backward takes an optional first argument, a device: any
// object with numThreads() and enqueueNoNotification(f), which is what
// Eigen::ThreadPoolDevice provides (#define EIGEN_USE_THREADS before
// including Eigen's Tensor header):
//
//   Eigen::ThreadPool pool(1);                  // N - 1 pool threads:
//   Eigen::ThreadPoolDevice device(&pool, 2);  // the caller is the Nth
//   ln.forward(device, x, y);
//
// numThreads() is the number of threads that work, the calling thread
// included (it runs parts too), so a pool of N - 1 serves N threads; with a
// pool of N, one pool thread idles (see README, Threads).
//
// Rows are split into contiguous ranges, a few per thread, claimed as threads
// come free, each thread starting with its own block of them (BatchNorm:
// statistics by channel, or by whole chunks of rows when the channels are
// contiguous; then rows); small inputs stay on the calling thread. Cross-row reductions (dweight, dbias, BatchNorm's
// statistics) are summed over fixed blocks of rows in a fixed order, so
// every result is bit-identical for any number of threads. The calling
// thread, out of parts to claim, spins briefly for the running ones before
// it sleeps (Latch::wait).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
#include <immintrin.h>
#endif

#include "normcore/statistics.hpp"

namespace normcore {

/// The default device: the calling thread.
struct Serial {
  int numThreads() const { return 1; }
};

namespace detail {

/// Below this many elements of work, threads cost more than they save
/// (waking a pool thread takes a few microseconds to tens of them).
constexpr Index kMinElementsPerThread = 1 << 15;

/// Elements of work per part of a split input, at least on average (a split
/// cuts at whole rows or packets, so one part may have fewer): about 5-15
/// microseconds of work.
constexpr Index kMinPartElements = 1 << 14;

template <typename D>
struct is_device {
  template <typename U>
  static auto test(int) -> decltype(std::declval<const U&>().numThreads(), std::true_type());
  template <typename>
  static std::false_type test(...);
  static constexpr bool value = decltype(test<D>(0))::value;
};

/// Pause hint for a spinning thread (x86 `pause`; elsewhere nothing).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)
  _mm_pause();
#endif
}

/// How long the calling thread, out of parts to claim, spins for the parts
/// still running before it sleeps. Waking a sleeping thread took 40-150
/// microseconds on this project's VM: longer than the usual wait, one part
/// on a pool thread (a few to tens of microseconds).
constexpr std::chrono::microseconds kSpinWait{500};

class Latch {
 public:
  explicit Latch(int n) : n_(n) {}
  void count_down() {
    if (n_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);  // orders the notify after a waiter's check
      cv_.notify_all();
    }
  }
  void wait() {
    if (n_.load(std::memory_order_acquire) == 0) return;
    const auto until = std::chrono::steady_clock::now() + kSpinWait;
    for (int polls = 1;; ++polls) {
      cpu_relax();
      if (n_.load(std::memory_order_acquire) == 0) return;
      if (polls % 64 == 0 && std::chrono::steady_clock::now() >= until) break;
    }
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return n_.load(std::memory_order_acquire) == 0; });
  }

 private:
  std::atomic<int> n_;
  std::mutex mu_;
  std::condition_variable cv_;
};

/// Parts per thread for row splits: the threads claim parts as they come
/// free (run_parts), so a thread that starts late or is descheduled for a
/// while (a busy VM) leaves less of the work waiting on it.
constexpr Index kPartsPerThread = 4;

/// How many parts to split `work` elements into on this device: at most
/// per_thread parts per thread, at most one per kMinPartElements, and one
/// part for less than kMinElementsPerThread.
template <typename Device>
Index parts_for(const Device& d, Index work, Index max_parts, Index per_thread = 1) {
  const Index threads = static_cast<Index>(d.numThreads());
  const Index by_size = work < kMinElementsPerThread ? 1 : std::max<Index>(1, work / kMinPartElements);
  const Index most = threads > 1 ? threads * per_thread : 1;
  return std::max<Index>(1, std::min<Index>({most, by_size, max_parts}));
}

/// Runs fn(part) for part = 0..parts-1 and returns when all are done. Of T
/// threads (the calling one and up to numThreads()-1 tasks on the device's
/// threads), thread t has a home block of parts starting at t * parts / T:
/// it takes its own block first, in order, and then any part still free,
/// walking the other blocks from the last part back. A part is claimed by
/// whoever gets to it first, so a pool thread that is slow to wake (tens of
/// microseconds on a busy VM) costs nothing: the calling thread runs what
/// the late thread has not started, and the call is never much slower than
/// on one thread. Home blocks keep each thread on the same rows from call
/// to call, so its output lines stay in its own cache instead of moving
/// between cores (LayerNorm 512x768 with 2 threads: 0.8x the time of parts
/// claimed in one shared order). Which thread runs a part does not matter
/// to the result, so results stay bit-identical. A task that wakes after
/// every part was claimed returns at once: it touches only the shared claim
/// state, which it co-owns.
template <typename Device, typename F>
void run_parts(const Device& d, Index parts, F&& fn) {
  if constexpr (std::is_same<Device, Serial>::value) {
    for (Index p = 0; p < parts; ++p) fn(p);
  } else {
    if (parts <= 1) {
      if (parts == 1) fn(Index(0));
      return;
    }
    using Fn = std::remove_reference_t<F>;
    struct Claims {
      std::unique_ptr<std::atomic<bool>[]> taken;
      Latch done;
      explicit Claims(Index n)
          : taken(new std::atomic<bool>[static_cast<std::size_t>(n)]), done(static_cast<int>(n)) {
        for (Index p = 0; p < n; ++p) taken[static_cast<std::size_t>(p)].store(false, std::memory_order_relaxed);
      }
      bool claim(Index p) {
        std::atomic<bool>& t = taken[static_cast<std::size_t>(p)];
        return !t.load(std::memory_order_relaxed) && !t.exchange(true, std::memory_order_acq_rel);
      }
      // The home block [b, e) in order, then the rest from the last part back.
      // fn is dereferenced only for a claimed part: fn is alive while a part
      // is unfinished (the caller waits for all).
      void work(Fn* fn, Index parts, Index b, Index e) {
        for (Index p = b; p < e; ++p) run(fn, p);
        for (Index p = parts - 1; p >= 0; --p)
          if (p < b || p >= e) run(fn, p);
      }
      void run(Fn* fn, Index p) {
        if (!claim(p)) return;
        (*fn)(p);
        done.count_down();
      }
    };
    auto claims = std::make_shared<Claims>(parts);
    Fn* f = &fn;
    const Index threads = std::min<Index>(parts, static_cast<Index>(d.numThreads()));
    for (Index t = 1; t < threads; ++t) {
      const Index b = t * parts / threads, e = (t + 1) * parts / threads;
      d.enqueueNoNotification([claims, f, parts, b, e] { claims->work(f, parts, b, e); });
    }
    claims->work(f, parts, 0, parts / threads);
    claims->done.wait();
  }
}

/// Splits [0, n) into `parts` contiguous ranges whose boundaries are
/// multiples of `align`; range p is [begin(p), begin(p + 1)).
struct Split {
  Index n, parts, align;
  Index begin(Index p) const {
    if (p <= 0) return 0;  // no division on the one-part path
    if (p >= parts) return n;
    const Index units = (n + align - 1) / align;
    return std::min(n, (units * p / parts) * align);
  }
};

}  // namespace detail
}  // namespace normcore
