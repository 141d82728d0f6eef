// Concurrency on a shared Eigen::ThreadPoolDevice: several threads call
// into one device at once, each call splitting its work into parts that the
// pool's threads and the caller claim (detail::run_parts, detail::PartClaims:
// per-caller claim states, reused between calls, shared with the tasks).
// Every part must run exactly once and every result must equal, bit for
// bit, the single-threaded one. Built with -fsanitize=thread in CI.
#define EIGEN_USE_THREADS
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include <normcore/normcore.hpp>

namespace {

using normcore::Index;

constexpr int kCallers = 4;

/// Runs body(caller) on kCallers threads that start together.
template <typename F>
void on_callers(F body) {
  std::atomic<int> start{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kCallers; ++t) {
    threads.emplace_back([&, t] {
      start.fetch_add(1);
      while (start.load() < kCallers) std::this_thread::yield();
      body(t);
    });
  }
  for (auto& th : threads) th.join();
}

TEST(Concurrency, RunPartsFromManyCallersOnOneDevice) {
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice dev(&pool, 3);
  std::atomic<int> wrong{0};
  on_callers([&](int t) {
    const Index sizes[] = {2, 5, 9, 20};
    for (int call = 0; call < 60; ++call) {
      const Index parts = sizes[(call + t) % 4];
      std::unique_ptr<std::atomic<int>[]> runs(new std::atomic<int>[static_cast<std::size_t>(parts)]);
      std::unique_ptr<std::atomic<int>[]> inner(new std::atomic<int>[static_cast<std::size_t>(parts * 3)]);
      for (Index p = 0; p < parts; ++p) runs[static_cast<std::size_t>(p)].store(0);
      for (Index p = 0; p < parts * 3; ++p) inner[static_cast<std::size_t>(p)].store(0);
      const bool nested = call % 10 == 0;
      normcore::detail::run_parts(dev, parts, [&](Index p) {
        runs[static_cast<std::size_t>(p)].fetch_add(1);
        if (nested)
          normcore::detail::run_parts(dev, 3, [&](Index q) { inner[static_cast<std::size_t>(p * 3 + q)].fetch_add(1); });
      });
      for (Index p = 0; p < parts; ++p) {
        if (runs[static_cast<std::size_t>(p)].load() != 1) wrong.fetch_add(1);
        for (Index q = 0; q < 3; ++q)
          if (inner[static_cast<std::size_t>(p * 3 + q)].load() != (nested ? 1 : 0)) wrong.fetch_add(1);
      }
    }
  });
  EXPECT_EQ(wrong.load(), 0);
}

TEST(Concurrency, LayerNormOnOneDeviceFromManyCallers) {
  const Index rows = 640, n = 96;  // several parts per call
  std::mt19937 g(5);
  std::normal_distribution<float> d(0.5f, 2.f);
  std::vector<float> xv(static_cast<std::size_t>(rows * n)), dv(xv.size());
  for (auto& v : xv) v = d(g);
  for (auto& v : dv) v = d(g);
  Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>> x(xv.data(), rows, n), dy(dv.data(), rows, n);
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({n}));
  for (Index i = 0; i < n; ++i) {
    ln.weight()(i) = 1.f + 0.01f * static_cast<float>(i % 7);
    ln.bias()(i) = 0.1f * static_cast<float>(i % 5);
  }
  Eigen::Tensor<float, 2, Eigen::RowMajor> y0(rows, n), dx0(rows, n);
  Eigen::Tensor<float, 1> dw0, db0;
  ln.forward(x, y0);
  ln.backward(x, dy, &dx0, &dw0, &db0);
  Eigen::ThreadPool pool(1);
  Eigen::ThreadPoolDevice dev(&pool, 2);
  std::atomic<int> wrong{0};
  const auto same = [](const float* a, const float* b, Index count) {
    return std::memcmp(a, b, static_cast<std::size_t>(count) * sizeof(float)) == 0;
  };
  on_callers([&](int) {
    Eigen::Tensor<float, 2, Eigen::RowMajor> y(rows, n), dx(rows, n);
    Eigen::Tensor<float, 1> dw, db;
    for (int call = 0; call < 4; ++call) {
      ln.forward(dev, x, y);
      ln.backward(dev, x, dy, &dx, &dw, &db);
      if (!same(y.data(), y0.data(), rows * n) || !same(dx.data(), dx0.data(), rows * n) ||
          !same(dw.data(), dw0.data(), n) || !same(db.data(), db0.data(), n))
        wrong.fetch_add(1);
    }
  });
  EXPECT_EQ(wrong.load(), 0);
}

}  // namespace
