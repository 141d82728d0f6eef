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
// it sleeps (PartClaims::wait). A call allocates nothing once its thread has
// made one with as many parts (PartClaims).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
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
/// still running before it sleeps (PartClaims::wait). Waking a sleeping thread took 40-150
/// microseconds on this project's VM: longer than the usual wait, one part
/// on a pool thread (a few to tens of microseconds).
constexpr std::chrono::microseconds kSpinWait{500};

/// Parts per thread for row (and BatchNorm's channel) splits: the threads
/// claim parts as they come free (run_parts), so a thread that starts late
/// or is descheduled for a while (a busy VM) leaves less of the work
/// waiting on it.
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

/// The most elements of work per part in the row-wise layers' splits
/// (row_parts_for). A call's parts run until none is left, so when one
/// thread runs out first it waits for the part the other is in; on large
/// inputs kPartsPerThread parts a thread are large (2 MB of floats at
/// 4096x1024 on 2 threads), and that wait is long whenever the threads run
/// at different speeds (a shared VM's vCPUs: on the Zen 5 guest one ran a
/// compute loop 11-33% slower than the other, alone or not) or one starts
/// late. Measured there, 2 threads, float, AVX-512, parts of at most this
/// size against kPartsPerThread alone (one process, the settings in a new
/// random order each round, the median of 41 paired ratios): LayerNorm
/// forward 0.83x the time at 4096x1024 and 0.91x at 4096x4096; RMSNorm
/// forward 0.81x at 4096x1024, 0.91x at 16384x4096 and 0.79x at 65536x64;
/// LayerNorm backward 0.88x at 4096x1024 and 0.93x at 4096x4096; RMSNorm
/// backward 0.87x at 4096x1024; bfloat16 LayerNorm forward 0.96-1.00x;
/// 1.00x on the other shapes of more than 1M elements (LayerNorm forward at
/// 65536x64, the backwards at 65536x64, RMSNorm backward at 4096x4096).
/// The backwards' parts stay whole row groups, of which there are at most
/// 16 (parameter gradients are summed per group): at 4096x4096, 16 parts of
/// 1M elements. Parts of 256K elements gained less (0.85-0.93x the time at
/// 4096x1024), 64K about the same. Smaller inputs
/// (up to 1M elements on 2 threads) keep their parts. BatchNorm's splits
/// keep kPartsPerThread: eight or sixteen parts a thread there took
/// 0.92-1.23x the time (the most at 256x256x14x14, channels-first
/// backward, whose channel parts then cut every sample's run shorter).
constexpr Index kMaxRowPartElements = Index(1) << 17;

/// parts_for a row-wise split (LayerNorm, RMSNorm, their 16-bit and fused
/// forms): kPartsPerThread parts a thread, or more, of at most
/// kMaxRowPartElements elements each, on inputs that large (never more
/// than max_parts). One part stays one part.
template <typename Device>
Index row_parts_for(const Device& d, Index work, Index max_parts) {
  const Index parts = parts_for(d, work, max_parts, kPartsPerThread);
  if (parts <= 1) return parts;
  return std::min(max_parts, std::max(parts, (work + kMaxRowPartElements - 1) / kMaxRowPartElements));
}

/// Whether a call of `work` elements on device d runs on the calling thread
/// alone: fewer elements than kMinElementsPerThread (parts_for's one part),
/// or a device of one thread. The layers' device overloads then take their
/// Serial path: the same results and the same code as a call without a
/// device. (The device path's own code cost a few nanoseconds a call:
/// measured on an AMD Zen 5 guest, AVX-512, both in one process, a
/// ThreadPoolDevice of 2 threads took 1.04-1.09x the Serial time at 1x768
/// forward, LayerNorm and RMSNorm, and 1.00-1.04x at backward.) False for
/// Serial itself.
template <typename Device>
bool to_serial(const Device& d, Index work) {
  if constexpr (std::is_same<Device, Serial>::value) {
    return false;
  } else {
    return work < kMinElementsPerThread || d.numThreads() <= 1;
  }
}

/// How many threads run `parts` parts on this device (run_parts): the
/// device's threads, at most one per part, at least one.
template <typename Device>
Index threads_for(const Device& d, Index parts) {
  return std::max<Index>(1, std::min<Index>(parts, static_cast<Index>(d.numThreads())));
}

/// The claim state of one run_parts call, shared by the calling thread and
/// the tasks it enqueues, and counted by hand (refs) so that a task is two
/// words: it then fits in std::function's own storage, and enqueueing it
/// allocates nothing. Each calling thread keeps one in a thread-local slot
/// and reuses it when nothing else holds it; a task that wakes late still
/// holds its reference, and the next call then takes a new state.
class PartClaims {
 public:
  using Call = void (*)(void*, Index);

  /// The state for a call of `parts` parts that enqueues `tasks` tasks:
  /// this thread's cached one when no task still holds it, else a new one
  /// for the slot (the old one goes when its last task lets go). A call made
  /// from inside a part on this thread (a part that splits again) finds the
  /// slot's state busy and gets one of its own instead, which done()
  /// releases. References: the slot's (or the one-off call's) and one per
  /// task.
  static PartClaims* acquire(Index parts, Index tasks) {
    PartClaims*& slot = cached();
    PartClaims* c;
    if (slot && slot->busy_) {
      c = new PartClaims(parts);
      c->one_off_ = true;
    } else {
      if (!slot || slot->refs_.load(std::memory_order_acquire) != 1 || slot->capacity_ < parts) {
        PartClaims* fresh = new PartClaims(std::max<Index>(parts, 16));  // first: it may throw
        if (slot) slot->release();
        slot = fresh;
      }
      c = slot;
      c->busy_ = true;
    }
    c->refs_.store(static_cast<int>(1 + tasks), std::memory_order_relaxed);  // no other holder now
    for (Index p = 0; p < parts; ++p) c->taken_[static_cast<std::size_t>(p)].store(false, std::memory_order_relaxed);
    c->left_.store(static_cast<int>(parts), std::memory_order_relaxed);
    return c;
  }

  /// The end of the call that acquired this state, on the same thread.
  void done() {
    if (one_off_) {
      release();
    } else {
      busy_ = false;
    }
  }

  /// A task's (or the slot's) reference; the last one deletes the state.
  void release() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  /// The caller's function and split, set before any task is enqueued.
  void set(void* fn, Call call, Index parts, Index threads) {
    fn_ = fn;
    call_ = call;
    parts_ = parts;
    threads_ = threads;
  }

  /// Thread t's home block [t * parts / T, (t + 1) * parts / T) in order,
  /// then the rest from the last part back. fn is called only for a
  /// claimed part: it is alive while a part is unfinished (the caller waits
  /// for all).
  void work(Index t) {
    const Index b = t * parts_ / threads_, e = (t + 1) * parts_ / threads_;
    for (Index p = b; p < e; ++p) run(p);
    for (Index p = parts_ - 1; p >= 0; --p)
      if (p < b || p >= e) run(p);
  }

  /// After an exception from a part on the calling thread: claims every part
  /// not started yet, so that none starts, and counts it as finished.
  void abandon() {
    for (Index p = 0; p < parts_; ++p)
      if (claim(p)) finish_one();
  }

  /// Returns once every part has run: spins briefly (kSpinWait), then sleeps.
  void wait() {
    if (left_.load(std::memory_order_acquire) == 0) return;
    const auto until = std::chrono::steady_clock::now() + kSpinWait;
    for (int polls = 1;; ++polls) {
      cpu_relax();
      if (left_.load(std::memory_order_acquire) == 0) return;
      if (polls % 64 == 0 && std::chrono::steady_clock::now() >= until) break;
    }
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return left_.load(std::memory_order_acquire) == 0; });
  }

 private:
  explicit PartClaims(Index capacity)
      : capacity_(capacity), taken_(new std::atomic<bool>[static_cast<std::size_t>(capacity)]) {}

  static PartClaims*& cached() {
    struct Slot {
      PartClaims* p = nullptr;
      ~Slot() {
        if (p) p->release();
        p = nullptr;
      }
    };
    thread_local Slot slot;
    return slot.p;
  }

  bool claim(Index p) {
    std::atomic<bool>& t = taken_[static_cast<std::size_t>(p)];
    return !t.load(std::memory_order_relaxed) && !t.exchange(true, std::memory_order_acq_rel);
  }
  void finish_one() {
    if (left_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);  // orders the notify after a waiter's check
      cv_.notify_all();
    }
  }
  void run(Index p) {
    if (!claim(p)) return;
    struct Finish {  // a part that throws is finished too
      PartClaims* c;
      ~Finish() { c->finish_one(); }
    } finish{this};
    call_(fn_, p);
  }

  // What a call reads (set before its tasks are enqueued), then what it
  // counts, each on a cache line of its own.
  alignas(64) void* fn_ = nullptr;
  Call call_ = nullptr;
  Index parts_ = 0;
  Index threads_ = 1;
  Index capacity_;
  bool busy_ = false;     // a call on the slot's thread is using it (only that thread reads it)
  bool one_off_ = false;  // not in a slot: the call's own
  std::unique_ptr<std::atomic<bool>[]> taken_;
  alignas(64) std::atomic<int> refs_{0};
  alignas(64) std::atomic<int> left_{0};
  alignas(64) std::mutex mu_;
  std::condition_variable cv_;
};

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
/// state (PartClaims), which it co-owns.
template <typename Device, typename F>
void run_parts(const Device& d, Index parts, F&& fn) {
  if constexpr (std::is_same<Device, Serial>::value) {
    for (Index p = 0; p < parts; ++p) fn(p);
  } else {
    if (parts <= 1) {
      if (parts == 1) fn(Index(0));
      return;
    }
    // fn through a lambda of our own: an object whose address the tasks
    // can hold, whatever F is (a function too).
    const auto call = [&fn](Index p) { fn(p); };
    using Call = decltype(call);
    const Index threads = threads_for(d, parts);
    PartClaims* c = PartClaims::acquire(parts, threads - 1);
    c->set(const_cast<void*>(static_cast<const void*>(&call)),
           [](void* f, Index p) { (*static_cast<const Call*>(f))(p); }, parts, threads);
    // The end of the call on every way out, built before any task can run
    // (a device may run a task inside enqueueNoNotification, on this
    // thread). An exception from a part on this thread (fn must not throw
    // on the device's threads) abandons the parts not started and waits for
    // the running ones, so that no part runs on fn once the exception has
    // left: fn may be gone then.
    struct End {
      PartClaims* c;
      int unwinding;
      ~End() {
        if (std::uncaught_exceptions() > unwinding) c->abandon();
        c->wait();
        c->done();
      }
    } end{c, std::uncaught_exceptions()};
    // Each task owns one reference from the moment it is handed over (it
    // releases it however it ends); if an enqueue throws, the references of
    // the tasks after it are released here. (The task whose enqueue threw
    // counts as handed over: if it never runs, the state leaks, which is
    // safer than releasing a reference twice.)
    struct Unsent {
      PartClaims* c;
      Index left;
      ~Unsent() {
        for (; left > 0; --left) c->release();
      }
    } unsent{c, threads - 1};
    for (Index t = 1; t < threads; ++t) {
      --unsent.left;
      d.enqueueNoNotification([c, t] {
        struct Release {
          PartClaims* c;
          ~Release() { c->release(); }
        } release{c};
        c->work(t);
      });
    }
    c->work(0);
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
