// Devices: every layer on an Eigen::ThreadPoolDevice gives results
// bit-identical to the calling thread alone, for any number of threads.
#ifndef EIGEN_USE_THREADS
#define EIGEN_USE_THREADS
#endif
#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <functional>
#include <memory>
#include <utility>

#include "test_util.hpp"

namespace {

using namespace nctest;

template <typename T, int Layout>
void check_row_layers(Index rows, Index n) {
  SCOPED_TRACE(::testing::Message() << rows << "x" << n << (Layout == Eigen::RowMajor ? " RowMajor" : " ColMajor"));
  const auto xv = randn<T>(static_cast<std::size_t>(rows * n), 1, 3.0, 2.0);
  const auto dv = randn<T>(xv.size(), 2);
  Eigen::TensorMap<const Eigen::Tensor<T, 2, Layout>> x(xv.data(), rows, n), dy(dv.data(), rows, n);
  normcore::LayerNorm<T> ln(normcore::LayerNormOptions({n}));
  ln.weight().setRandom();
  ln.bias().setRandom();
  normcore::RMSNorm<T> rn(normcore::RMSNormOptions({n}));
  rn.weight().setRandom();
  Eigen::Tensor<T, 2, Layout> y0(rows, n), dx0(rows, n), r0(rows, n), rdx0(rows, n);
  Eigen::Tensor<T, 1> dw0, db0, rdw0;
  normcore::NormStats<T> s0;
  ln.forward(x, y0, s0);
  ln.backward(x, dy, &dx0, &dw0, &db0, &s0);
  rn.forward(x, r0);
  rn.backward(x, dy, &rdx0, &rdw0);
  // {pool threads, device threads}: pools of N, and of N - 1 (the calling
  // thread as the Nth, the configuration the README recommends).
  const std::pair<int, int> configs[] = {{1, 1}, {2, 2}, {3, 3}, {4, 4}, {1, 2}, {2, 3}};
  for (const auto& [pool_threads, threads] : configs) {
    Eigen::ThreadPool pool(pool_threads);
    Eigen::ThreadPoolDevice dev(&pool, threads);
    Eigen::Tensor<T, 2, Layout> y(rows, n), dx(rows, n), r(rows, n), rdx(rows, n);
    Eigen::Tensor<T, 1> dw, db, rdw;
    normcore::NormStats<T> s;
    ln.forward(dev, x, y, s);
    ln.backward(dev, x, dy, &dx, &dw, &db);  // recomputed statistics
    rn.forward(dev, x, r);
    rn.backward(dev, x, dy, &rdx, &rdw);
    const auto N = static_cast<std::size_t>(rows * n);
    EXPECT_TRUE(bit_equal(y.data(), y0.data(), N)) << threads;
    EXPECT_TRUE(bit_equal(s.rstd.data(), s0.rstd.data(), static_cast<std::size_t>(rows))) << threads;
    EXPECT_TRUE(bit_equal(dx.data(), dx0.data(), N)) << threads;
    EXPECT_TRUE(bit_equal(dw.data(), dw0.data(), static_cast<std::size_t>(n))) << threads;
    EXPECT_TRUE(bit_equal(db.data(), db0.data(), static_cast<std::size_t>(n))) << threads;
    EXPECT_TRUE(bit_equal(r.data(), r0.data(), N)) << threads;
    EXPECT_TRUE(bit_equal(rdx.data(), rdx0.data(), N)) << threads;
    EXPECT_TRUE(bit_equal(rdw.data(), rdw0.data(), static_cast<std::size_t>(n))) << threads;
  }
}

TEST(Threads, RowLayersBitIdenticalForAnyThreadCount) {
  check_row_layers<float, Eigen::RowMajor>(1000, 333);
  check_row_layers<float, Eigen::ColMajor>(1003, 129);
  check_row_layers<double, Eigen::RowMajor>(517, 768);
  check_row_layers<float, Eigen::RowMajor>(1, 768);  // tiny: stays on the calling thread
  // Over kPartsPerThread parts a thread of kMaxRowPartElements: more parts
  // than that on 2 threads (11 and 10); at 4096x600 the forwards take 19
  // parts and the backwards 16, their most (one per row group).
  check_row_layers<float, Eigen::RowMajor>(2048, 700);
  check_row_layers<float, Eigen::ColMajor>(4100, 300);
  // RMSNorm's ColMajor backward, the whole part at once; in double, whose
  // dweight sums (unlike float terms summed in double) round.
  check_row_layers<float, Eigen::ColMajor>(2048, 300);
  check_row_layers<double, Eigen::ColMajor>(1024, 300);
  check_row_layers<float, Eigen::RowMajor>(4096, 600);
  // RMSNorm's ColMajor backward in chunks of 4 KB of each feature's values
  // (narrow rows, a leading dimension of a multiple of 4 KB).
  check_row_layers<float, Eigen::ColMajor>(3072, 50);
  check_row_layers<double, Eigen::ColMajor>(1536, 50);
}

// The ColMajor forwards write y with streaming stores on inputs of 12 MiB or
// more (AVX-512 builds: detail::can_stream_colmajor), each thread's part
// fencing its own. On 2 and 3 threads they give the bits of the calling
// thread alone. 3200 rows of float make every feature's column whole 64-byte
// lines; 13.1 MB in all.
TEST(Threads, ColMajorStreamingForwardsBitIdenticalForAnyThreadCount) {
  using T = float;
  const nctest::StreamThreshold streaming(normcore::detail::kStreamingBytes);
  const Index rows = 3200, n = 1024;
  const auto xv = randn<T>(static_cast<std::size_t>(rows * n), 7, 2.0, 3.0);
  Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::ColMajor>> x(xv.data(), rows, n);
  normcore::LayerNorm<T> ln(normcore::LayerNormOptions({n}));
  ln.weight().setRandom();
  ln.bias().setRandom();
  normcore::RMSNorm<T> rn(normcore::RMSNormOptions({n}));
  rn.weight().setRandom();
  Eigen::Tensor<T, 2, Eigen::ColMajor> y0(rows, n), r0(rows, n);
  normcore::NormStats<T> s0;
  ln.forward(x, y0, s0);
  rn.forward(x, r0);
  EXPECT_EQ(normcore::detail::can_stream_colmajor(xv.data(), y0.data(), rows, n),
            sizeof(normcore::detail::simd<T>::Packet) >= 64);
  const auto N = static_cast<std::size_t>(rows * n);
  for (const int threads : {2, 3}) {
    Eigen::ThreadPool pool(threads - 1);
    Eigen::ThreadPoolDevice dev(&pool, threads);
    Eigen::Tensor<T, 2, Eigen::ColMajor> y(rows, n), r(rows, n);
    normcore::NormStats<T> s;
    ln.forward(dev, x, y, s);
    rn.forward(dev, x, r);
    EXPECT_TRUE(bit_equal(y.data(), y0.data(), N)) << threads;
    EXPECT_TRUE(bit_equal(s.mean.data(), s0.mean.data(), static_cast<std::size_t>(rows))) << threads;
    EXPECT_TRUE(bit_equal(s.rstd.data(), s0.rstd.data(), static_cast<std::size_t>(rows))) << threads;
    EXPECT_TRUE(bit_equal(r.data(), r0.data(), N)) << threads;
  }
}

TEST(Threads, RowSplitsCapTheSizeOfTheirParts) {
  struct Threads {  // all that parts_for asks of a device
    int n;
    int numThreads() const { return n; }
  };
  using normcore::detail::kMaxRowPartElements;
  using normcore::detail::kPartsPerThread;
  const Index works[] = {0, 1000, 32768, 1 << 20, (1 << 20) + 1, 3 << 20, 40000000};
  const Index maxima[] = {1, 7, 64, 1 << 20};
  for (int threads : {1, 2, 3, 8}) {
    for (Index work : works) {
      for (Index most : maxima) {
        SCOPED_TRACE(::testing::Message() << threads << " threads, " << work << " elements, at most " << most);
        const Index base = normcore::detail::parts_for(Threads{threads}, work, most, kPartsPerThread);
        const Index parts = normcore::detail::row_parts_for(Threads{threads}, work, most);
        EXPECT_GE(parts, base);
        EXPECT_LE(parts, std::max<Index>(1, most));
        if (base <= 1 || work <= threads * kPartsPerThread * kMaxRowPartElements) {
          EXPECT_EQ(parts, base);  // one part stays one; smaller inputs keep their split
        } else if (parts < most) {
          EXPECT_LE((work + parts - 1) / parts, kMaxRowPartElements);
        }
      }
    }
  }
  // 4096x1024 on 2 threads: 32 parts of 128K elements instead of 8.
  EXPECT_EQ(normcore::detail::row_parts_for(Threads{2}, 4096 * 1024, 4096), 32);
}

template <int Axis, typename T = float>
void check_batch_norm(Index N, Index C, Index S) {
  SCOPED_TRACE(::testing::Message() << N << "x" << C << "x" << S << " axis " << Axis);
  const auto xv = randn<T>(static_cast<std::size_t>(N * C * S), 3, 1.0, 2.0);
  const auto dv = randn<T>(xv.size(), 4);
  const Index d1 = Axis == 1 ? C : S, d2 = Axis == 1 ? S : C;
  Eigen::TensorMap<const Eigen::Tensor<T, 3, Eigen::RowMajor>> x(xv.data(), N, d1, d2), dy(dv.data(), N, d1, d2);
  normcore::BatchNorm<T> b0{normcore::BatchNormOptions(C).channel_axis(Axis)};
  Eigen::Tensor<T, 3, Eigen::RowMajor> y0(N, d1, d2);
  normcore::NormStats<T> s0;
  b0.forward(x, y0, s0);
  const auto g0 = b0.backward(x, dy, &s0);
  for (int threads : {1, 2, 3}) {
    Eigen::ThreadPool pool(threads);
    Eigen::ThreadPoolDevice dev(&pool, threads);
    normcore::BatchNorm<T> b{normcore::BatchNormOptions(C).channel_axis(Axis)};
    Eigen::Tensor<T, 3, Eigen::RowMajor> y(N, d1, d2), dx(N, d1, d2);
    Eigen::Tensor<T, 1> dw, db;
    normcore::NormStats<T> s;
    b.forward(dev, x, y, s);
    b.backward(dev, x, dy, &dx, &dw, &db, &s);
    const auto M = static_cast<std::size_t>(N * C * S);
    EXPECT_TRUE(bit_equal(y.data(), y0.data(), M)) << threads;
    EXPECT_TRUE(bit_equal(dx.data(), g0.dx.data(), M)) << threads;
    EXPECT_TRUE(bit_equal(dw.data(), g0.dweight.data(), static_cast<std::size_t>(C))) << threads;
    EXPECT_TRUE(bit_equal(db.data(), g0.dbias.data(), static_cast<std::size_t>(C))) << threads;
    EXPECT_TRUE(bit_equal(b.running_var().data(), b0.running_var().data(), static_cast<std::size_t>(C))) << threads;
  }
}

TEST(Threads, BatchNormBitIdenticalForAnyThreadCount) {
  check_batch_norm<1>(16, 37, 300);   // NCHW-like
  check_batch_norm<-1>(16, 37, 300);  // channels-last
  check_batch_norm<1>(3, 40, 1500);   // the fused channels-first backward
  check_batch_norm<1>(16, 37, 49);    // short segments: the grouped statistics
  // Short segments over several parts of channels (116032 values: seven
  // parts on 2 and 3 threads, 5-6 channels each, so groups of the short-row
  // kernel cut short at the parts' edges).
  check_batch_norm<1>(64, 37, 49);
  check_batch_norm<1>(128, 40, 9);    // maps smaller than a packet: lanes of positions
  // Channels last, 12 full chunks of 256 rows and a partial one: on 2 and 3
  // threads the rows are split in whole chunks, merged in windows of 10 and
  // 12 chunks (24 KB of results per chunk at 1024 channels; 256 KB, or four
  // chunks per thread), so two windows.
  // In double, so that a change in the order of the merges (in double)
  // shows in the outputs.
  check_batch_norm<-1, double>(1, 1024, 12 * 256 + 17);
  // Channels last on an input of detail::kStreamingBytes (float, 300
  // channels: tiles of rows, which then request the next tile ahead, up to
  // the end of the input on the calling thread and of a part's chunks on
  // several).
  check_batch_norm<-1>(1, 300, normcore::detail::kStreamingBytes / (300 * 4) + 17);
  // Fewer values than one thread's share: the calling thread's path.
  check_batch_norm<1>(2, 8, 30);
  check_batch_norm<-1>(2, 8, 30);
}

// With the Intel path choices, channels-first inputs the L2 does not hold
// take the fused training forward and the backward's groups within half the
// L2 (segments of 56x56 and 7x7; sizes from the L2 the tests see), on every
// thread count; 3 threads keep 8 channels a thread.
TEST(Threads, BatchNormFusedChannelsFirstBitIdenticalForAnyThreadCount) {
  const nctest::IntelTuning intel(1);
  const Index l2 = normcore::detail::backward_l2_bytes();
  check_batch_norm<1>(std::max<Index>(2, l2 / (20 * 3136 * 4)), 40, 3136);
  check_batch_norm<1>(std::max<Index>(2, l2 / (100 * 49 * 4)), 128, 49);
}

// Channels-first segments of a few packets are normalized as one run of
// packets aligned on y, a packet that straddles two channels selecting each
// lane's constants; segments shorter than a packet, a tile of channels at a
// time with the constants expanded to one per value. Eval mode (the running statistics: the same constants in
// any layout): the output must be the channels-last layout's bit for bit,
// whatever the alignment of x and y, the segment length, or the thread count
// (parts start at any segment, so at any channel and alignment).
template <typename T>
void check_short_segments(Index N, Index C, Index S, int threads) {
  SCOPED_TRACE(::testing::Message() << N << "x" << C << "x" << S << " threads " << threads);
  normcore::BatchNorm<T> bn{normcore::BatchNormOptions(C)}, bl{normcore::BatchNormOptions(C).channel_axis(-1)};
  const auto stats = randn<T>(static_cast<std::size_t>(4 * C), 11, 1.0, 0.5);
  for (Index c = 0; c < C; ++c) {
    const std::size_t k = static_cast<std::size_t>(4 * c);
    bn.running_mean()(c) = stats[k] - T(1);
    bn.running_var()(c) = std::fabs(stats[k + 1]) + T(0.1);
    bn.weight()(c) = stats[k + 2];
    bn.bias()(c) = stats[k + 3] - T(1);
  }
  bn.eval();
  bl.running_mean() = bn.running_mean();
  bl.running_var() = bn.running_var();
  bl.weight() = bn.weight();
  bl.bias() = bn.bias();
  bl.eval();
  const std::size_t count = static_cast<std::size_t>(N * C * S);
  const auto xv = randn<T>(count, 12, 1.0, 2.0);
  std::vector<T> xl(count);  // (N, S, C)
  for (Index o = 0; o < N; ++o)
    for (Index c = 0; c < C; ++c)
      for (Index i = 0; i < S; ++i)
        xl[static_cast<std::size_t>((o * S + i) * C + c)] = xv[static_cast<std::size_t>((o * C + c) * S + i)];
  Eigen::ThreadPool pool(std::max(1, threads - 1));
  Eigen::ThreadPoolDevice dev(&pool, threads);
  Eigen::TensorMap<const Eigen::Tensor<T, 3, Eigen::RowMajor>> xlm(xl.data(), N, S, C);
  Eigen::Tensor<T, 3, Eigen::RowMajor> yl(N, S, C);
  bl.forward(dev, xlm, yl);
  // y at every element offset from a 64-byte boundary (every head length up
  // to AVX-512 floats), x at two.
  constexpr std::size_t kOffsets = 64 / sizeof(T);
  std::vector<T, Eigen::aligned_allocator<T>> xbuf(count + 2), ybuf(count + kOffsets + 4);
  ASSERT_EQ(reinterpret_cast<std::uintptr_t>(ybuf.data()) % EIGEN_MAX_ALIGN_BYTES, 0u);
  for (std::size_t ox : {0, 1}) {
    for (std::size_t oy = 0; oy < (threads == 1 ? kOffsets : 4); ++oy) {
      std::copy(xv.begin(), xv.end(), xbuf.begin() + static_cast<std::ptrdiff_t>(ox));
      std::fill(ybuf.begin(), ybuf.end(), T(-7));
      Eigen::TensorMap<const Eigen::Tensor<T, 3, Eigen::RowMajor>> x(xbuf.data() + ox, N, C, S);
      Eigen::TensorMap<Eigen::Tensor<T, 3, Eigen::RowMajor>> y(ybuf.data() + oy, N, C, S);
      bn.forward(dev, x, y);
      bool same = true;
      for (Index o = 0; o < N; ++o)
        for (Index c = 0; c < C; ++c)
          for (Index i = 0; i < S; ++i) same = same && bit_equal(&y(o, c, i), &yl(o, i, c), 1);
      EXPECT_TRUE(same) << "x offset " << ox << ", y offset " << oy;
      // Nothing written outside y.
      for (std::size_t k = 0; k < oy; ++k) EXPECT_EQ(ybuf[k], T(-7));
      for (std::size_t k = oy + count; k < ybuf.size(); ++k) EXPECT_EQ(ybuf[k], T(-7));
    }
  }
}

TEST(Threads, BatchNormShortSegmentsMatchChannelsLastAtAnyAlignment) {
  for (Index S : {3, 4, 5, 8, 9, 15, 16, 17, 49, 63, 64, 65, 127, 128, 129}) {
    check_short_segments<float>(3, 5, S, 1);
    check_short_segments<double>(3, 5, S, 1);
  }
  // Parts on several threads start at arbitrary segments.
  check_short_segments<float>(64, 37, 49, 3);
  check_short_segments<double>(64, 37, 25, 2);
  check_short_segments<float>(160, 29, 9, 2);  // 41760 values: two parts
  // Maps smaller than a packet (with AVX-512: 3x3 floats, 2x3 doubles) over
  // more channels than one tile of expanded constants (2048 floats, 1024
  // doubles: 227 and 170 channels), alone and in parts that start inside a
  // sample and inside a tile.
  check_short_segments<float>(3, 700, 9, 1);
  check_short_segments<double>(3, 400, 6, 1);
  check_short_segments<float>(6, 700, 9, 3);   // 37800 values: two parts
  check_short_segments<double>(9, 700, 6, 2);  // 37800 values: two parts
}

/// How many times each part ran.
struct PartCounts {
  std::unique_ptr<std::atomic<int>[]> n;
  Index parts;
  explicit PartCounts(Index p) : n(new std::atomic<int>[static_cast<std::size_t>(p)]), parts(p) {
    for (Index i = 0; i < p; ++i) n[static_cast<std::size_t>(i)].store(0);
  }
  void add(Index p) { n[static_cast<std::size_t>(p)].fetch_add(1); }
  bool each_once() const {
    for (Index i = 0; i < parts; ++i)
      if (n[static_cast<std::size_t>(i)].load() != 1) return false;
    return true;
  }
};

TEST(Threads, RunPartsRunsEveryPartOnce) {
  // Repeated calls reuse the calling thread's claim state; more parts than
  // it holds make it grow (its first capacity is 16 parts).
  const std::pair<int, int> configs[] = {{1, 2}, {3, 4}, {2, 2}};
  for (const auto& [pool_threads, threads] : configs) {
    Eigen::ThreadPool pool(pool_threads);
    Eigen::ThreadPoolDevice dev(&pool, threads);
    for (Index parts : {2, 3, 7, 16, 17, 40, 5}) {
      for (int call = 0; call < 50; ++call) {
        PartCounts c(parts);
        normcore::detail::run_parts(dev, parts, [&](Index p) { c.add(p); });
        ASSERT_TRUE(c.each_once()) << threads << " threads, " << parts << " parts, call " << call;
      }
    }
  }
}

TEST(Threads, RunPartsNestedInAPart) {
  // A part that splits again on the same device, from the calling thread or
  // a pool thread: the inner call gets a claim state of its own.
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice dev(&pool, 3);
  for (int call = 0; call < 20; ++call) {
    PartCounts outer(6);
    std::vector<std::unique_ptr<PartCounts>> inner;
    for (int i = 0; i < 6; ++i) inner.push_back(std::make_unique<PartCounts>(5));
    normcore::detail::run_parts(dev, 6, [&](Index p) {
      outer.add(p);
      normcore::detail::run_parts(dev, 5, [&](Index q) { inner[static_cast<std::size_t>(p)]->add(q); });
    });
    ASSERT_TRUE(outer.each_once()) << call;
    for (const auto& c : inner) ASSERT_TRUE(c->each_once()) << call;
  }
}

/// A device whose tasks run only when the test says so: they wake after the
/// call that enqueued them has returned, as a pool thread may on a busy
/// machine.
struct LateDevice {
  int threads;
  mutable std::vector<std::function<void()>> tasks;
  int numThreads() const { return threads; }
  template <typename F>
  void enqueueNoNotification(F&& f) const {
    tasks.emplace_back(std::forward<F>(f));
  }
  void run_late() {
    auto t = std::move(tasks);
    tasks.clear();
    for (auto& f : t) f();
  }
};

TEST(Threads, RunPartsTasksThatWakeLate) {
  // The calling thread runs every part; the late tasks then find nothing to
  // claim and only let go of their claim state, which a call made while
  // they were pending must not have reused (AddressSanitizer checks the
  // frees in CI).
  LateDevice dev{3, {}};
  for (int round = 0; round < 3; ++round) {
    PartCounts a(9);
    normcore::detail::run_parts(dev, 9, [&](Index p) { a.add(p); });
    EXPECT_TRUE(a.each_once());
    EXPECT_EQ(dev.tasks.size(), 2u);
    PartCounts b(4);  // while the first call's tasks are pending
    normcore::detail::run_parts(dev, 4, [&](Index p) { b.add(p); });
    EXPECT_TRUE(b.each_once());
    EXPECT_EQ(dev.tasks.size(), 4u);
    dev.run_late();
    EXPECT_TRUE(a.each_once());
    EXPECT_TRUE(b.each_once());
  }
}

/// run_parts over c's parts with part `at` throwing (and counted).
template <typename Device>
void expect_throw_at(const Device& dev, Index at, PartCounts& c) {
  EXPECT_THROW(normcore::detail::run_parts(dev, c.parts,
                                           [&](Index p) {
                                             c.add(p);
                                             if (p == at) throw std::runtime_error("part");
                                           }),
               std::runtime_error);
}

TEST(Threads, RunPartsExceptionOnTheCallingThread) {
  // A part that throws on the calling thread: the parts not started never
  // start, the running ones finish before the exception leaves run_parts,
  // and the next call on the thread works.
  {
    LateDevice dev{3, {}};
    PartCounts c(9);
    expect_throw_at(dev, 1, c);
    dev.run_late();  // the tasks find every part taken
    for (Index p = 0; p < 9; ++p) EXPECT_EQ(c.n[static_cast<std::size_t>(p)].load(), p <= 1 ? 1 : 0) << p;
    PartCounts d(5);
    normcore::detail::run_parts(dev, 5, [&](Index p) { d.add(p); });
    EXPECT_TRUE(d.each_once());
    dev.run_late();
  }
  Eigen::ThreadPool pool(1);
  Eigen::ThreadPoolDevice dev(&pool, 2);
  const auto caller = std::this_thread::get_id();
  for (int call = 0; call < 20; ++call) {
    std::atomic<int> running{0}, after{0};
    std::atomic<bool> left{false};
    PartCounts c(8);
    EXPECT_THROW(normcore::detail::run_parts(dev, 8,
                                             [&](Index p) {
                                               c.add(p);
                                               if (std::this_thread::get_id() == caller && p == 0)
                                                 throw std::runtime_error("part 0");
                                               running.fetch_add(1);
                                               std::this_thread::sleep_for(std::chrono::microseconds(200));
                                               if (left.load()) after.fetch_add(1);
                                               running.fetch_sub(1);
                                             }),
                 std::runtime_error);
    left.store(true);
    EXPECT_EQ(running.load(), 0) << call;
    EXPECT_EQ(after.load(), 0) << call;
    for (Index p = 0; p < 8; ++p) EXPECT_LE(c.n[static_cast<std::size_t>(p)].load(), 1) << p;
  }
  PartCounts d(8);
  normcore::detail::run_parts(dev, 8, [&](Index p) { d.add(p); });
  EXPECT_TRUE(d.each_once());
}

/// A device that runs each task inside enqueueNoNotification, on the
/// calling thread (as Eigen's pool does when a queue is full).
struct InlineDevice {
  int threads;
  int numThreads() const { return threads; }
  template <typename F>
  void enqueueNoNotification(F&& f) const {
    f();
  }
};

TEST(Threads, RunPartsTasksRunInsideTheEnqueue) {
  InlineDevice dev{3};
  for (int call = 0; call < 3; ++call) {
    PartCounts c(7);
    normcore::detail::run_parts(dev, 7, [&](Index p) { c.add(p); });
    EXPECT_TRUE(c.each_once());
    // A part that throws inside the first task's run: the exception leaves
    // through the enqueue; the parts not started never start, and the next
    // call on the thread works (AddressSanitizer and its leak check watch
    // the claim states in CI).
    PartCounts t(7);
    expect_throw_at(dev, 3, t);
    for (Index p = 0; p < 7; ++p) EXPECT_LE(t.n[static_cast<std::size_t>(p)].load(), 1) << p;
    EXPECT_EQ(t.n[3].load(), 1);
  }
}

}  // namespace
