// Concurrency: forward and backward of one shared layer object are const and
// may run from many threads at once on different data. Eight threads hammer a
// shared LayerNorm, RMSNorm and eval-mode BatchNorm, each thread walking the
// inputs in its own order; every result must equal, bit for bit, the result
// of a single-threaded run. (BatchNorm in training mode updates its running
// statistics and is not thread-safe; it is not exercised here.) Built with
// -fsanitize=thread in CI.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <normcore/normcore.hpp>

namespace {

using normcore::Index;

constexpr int kThreads = 8;
constexpr int kRounds = 3;
constexpr int kInputs = 12;

template <typename T>
std::vector<T> random_values(std::size_t n, unsigned seed, double offset) {
  std::mt19937 g(seed);
  std::normal_distribution<double> d(offset, 1.5);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(g));
  return v;
}

template <typename T>
bool same_bits(const T* a, const T* b, Index n) {
  // memcmp with a null pointer is undefined even for 0 bytes (an empty tensor).
  return n == 0 || std::memcmp(a, b, static_cast<std::size_t>(n) * sizeof(T)) == 0;
}

/// Everything one call produces, flattened.
template <typename T>
struct Result {
  std::vector<T> y, dx, dw, db, mean, rstd;
  bool operator==(const Result& o) const {
    auto eq = [](const std::vector<T>& a, const std::vector<T>& b) {
      return a.size() == b.size() && same_bits(a.data(), b.data(), static_cast<Index>(a.size()));
    };
    return eq(y, o.y) && eq(dx, o.dx) && eq(dw, o.dw) && eq(db, o.db) && eq(mean, o.mean) && eq(rstd, o.rstd);
  }
};

template <typename T, int R, int L>
std::vector<T> flat(const Eigen::Tensor<T, R, L>& t) {
  return std::vector<T>(t.data(), t.data() + t.size());
}

/// Runs `one(i)` for every input on one thread, then on kThreads threads in
/// shuffled orders, and compares.
template <typename T, typename F>
void hammer(F one) {
  std::vector<Result<T>> expected;
  for (int i = 0; i < kInputs; ++i) expected.push_back(one(i));
  std::atomic<int> mismatches{0};
  std::atomic<int> start{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<int> order(kInputs);
      for (int i = 0; i < kInputs; ++i) order[static_cast<std::size_t>(i)] = i;
      std::mt19937 g(static_cast<unsigned>(t) + 1);
      start.fetch_add(1);
      while (start.load() < kThreads) std::this_thread::yield();  // all start together
      for (int round = 0; round < kRounds; ++round) {
        std::shuffle(order.begin(), order.end(), g);
        for (int i : order)
          if (!(one(i) == expected[static_cast<std::size_t>(i)])) mismatches.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

template <typename T, int Layout>
void layer_norm_case() {
  // Inputs of different batch sizes (tails of the ColMajor lane blocks) and a
  // large offset on some, over two normalized dims.
  normcore::LayerNorm<T> ln(normcore::LayerNormOptions({5, 41}).eps(1e-5));
  const auto w = random_values<T>(205, 1, 1.0), b = random_values<T>(205, 2, 0.0);
  std::copy(w.begin(), w.end(), ln.weight().data());
  std::copy(b.begin(), b.end(), ln.bias().data());
  std::vector<Eigen::Tensor<T, 3, Layout>> xs, dys;
  for (int i = 0; i < kInputs; ++i) {
    Eigen::Tensor<T, 3, Layout> x(3 + i, 5, 41), dy(3 + i, 5, 41);
    const auto xv = random_values<T>(static_cast<std::size_t>(x.size()), 10 + i, i % 3 == 0 ? 1e3 : 0.0);
    const auto dv = random_values<T>(static_cast<std::size_t>(x.size()), 100 + i, 0.0);
    std::copy(xv.begin(), xv.end(), x.data());
    std::copy(dv.begin(), dv.end(), dy.data());
    xs.push_back(x);
    dys.push_back(dy);
  }
  const normcore::LayerNorm<T>& shared = ln;
  hammer<T>([&](int i) {
    const auto& x = xs[static_cast<std::size_t>(i)];
    const auto& dy = dys[static_cast<std::size_t>(i)];
    Result<T> r;
    normcore::NormStats<T> st;
    Eigen::Tensor<T, 3, Layout> y(x.dimensions());
    shared.forward(x, y, st);
    auto g = shared.backward(x, dy, &st);
    auto g2 = shared.backward(x, dy);  // recomputing the statistics
    r.y = flat(y);
    r.dx = flat(g.dx);
    r.dw = flat(g.dweight);
    r.db = flat(g.dbias);
    r.mean = flat(st.mean);
    r.rstd = flat(st.rstd);
    if (!same_bits(g.dx.data(), g2.dx.data(), g.dx.size())) r.dx.clear();
    return r;
  });
}

template <typename T, int Layout>
void rms_norm_case() {
  normcore::RMSNorm<T> rn(normcore::RMSNormOptions({67}));
  const auto w = random_values<T>(67, 3, 1.0);
  std::copy(w.begin(), w.end(), rn.weight().data());
  std::vector<Eigen::Tensor<T, 2, Layout>> xs, dys;
  for (int i = 0; i < kInputs; ++i) {
    Eigen::Tensor<T, 2, Layout> x(7 + 3 * i, 67), dy(7 + 3 * i, 67);
    auto xv = random_values<T>(static_cast<std::size_t>(x.size()), 20 + i, 0.0);
    if (i % 4 == 1)  // rows whose squares overflow or underflow T: the exact path
      for (auto& v : xv) v = static_cast<T>(v * (i % 8 == 1 ? 1e30 : 1e-30));
    const auto dv = random_values<T>(static_cast<std::size_t>(x.size()), 200 + i, 0.0);
    std::copy(xv.begin(), xv.end(), x.data());
    std::copy(dv.begin(), dv.end(), dy.data());
    xs.push_back(x);
    dys.push_back(dy);
  }
  const normcore::RMSNorm<T>& shared = rn;
  hammer<T>([&](int i) {
    const auto& x = xs[static_cast<std::size_t>(i)];
    const auto& dy = dys[static_cast<std::size_t>(i)];
    Result<T> r;
    normcore::NormStats<T> st;
    Eigen::Tensor<T, 2, Layout> y(x.dimensions());
    shared.forward(x, y, st);
    auto g = shared.backward(x, dy, &st);
    r.y = flat(y);
    r.dx = flat(g.dx);
    r.dw = flat(g.dweight);
    r.rstd = flat(st.rstd);
    return r;
  });
}

template <typename T, int Layout>
void batch_norm_eval_case(int axis) {
  const Index C = 13;
  normcore::BatchNorm<T> bn(normcore::BatchNormOptions(C).channel_axis(axis));
  const auto w = random_values<T>(C, 4, 1.0), b = random_values<T>(C, 5, 0.0);
  const auto m = random_values<T>(C, 6, 0.0), v = random_values<T>(C, 7, 3.0);
  for (Index c = 0; c < C; ++c) {
    bn.weight()(c) = w[static_cast<std::size_t>(c)];
    bn.bias()(c) = b[static_cast<std::size_t>(c)];
    bn.running_mean()(c) = m[static_cast<std::size_t>(c)];
    bn.running_var()(c) = std::abs(v[static_cast<std::size_t>(c)]) + T(0.1);
  }
  bn.eval();
  std::vector<Eigen::Tensor<T, 4, Layout>> xs, dys;
  for (int i = 0; i < kInputs; ++i) {
    const Index N = 1 + i % 4, H = 3 + i % 3, W = 5 + i;
    Eigen::Tensor<T, 4, Layout> x, dy;
    if (axis == 1) {
      x.resize(N, C, H, W);
      dy.resize(N, C, H, W);
    } else {
      x.resize(N, H, W, C);
      dy.resize(N, H, W, C);
    }
    const auto xv = random_values<T>(static_cast<std::size_t>(x.size()), 30 + i, 0.5);
    const auto dv = random_values<T>(static_cast<std::size_t>(x.size()), 300 + i, 0.0);
    std::copy(xv.begin(), xv.end(), x.data());
    std::copy(dv.begin(), dv.end(), dy.data());
    xs.push_back(x);
    dys.push_back(dy);
  }
  // forward() of BatchNorm is non-const (training updates state); in eval mode
  // it does not modify the object, which is what is shared here.
  hammer<T>([&](int i) {
    const auto& x = xs[static_cast<std::size_t>(i)];
    const auto& dy = dys[static_cast<std::size_t>(i)];
    Result<T> r;
    normcore::NormStats<T> st;
    Eigen::Tensor<T, 4, Layout> y(x.dimensions());
    bn.forward(x, y, st);
    auto g = bn.backward(x, dy, &st);
    r.y = flat(y);
    r.dx = flat(g.dx);
    r.dw = flat(g.dweight);
    r.db = flat(g.dbias);
    r.mean = flat(st.mean);
    r.rstd = flat(st.rstd);
    return r;
  });
  EXPECT_EQ(bn.num_batches_tracked(), 0);
}

TEST(Concurrency, LayerNormSharedFloatRowMajor) { layer_norm_case<float, Eigen::RowMajor>(); }
TEST(Concurrency, LayerNormSharedFloatColMajor) { layer_norm_case<float, Eigen::ColMajor>(); }
TEST(Concurrency, LayerNormSharedDoubleRowMajor) { layer_norm_case<double, Eigen::RowMajor>(); }
TEST(Concurrency, RMSNormSharedFloatRowMajor) { rms_norm_case<float, Eigen::RowMajor>(); }
TEST(Concurrency, RMSNormSharedFloatColMajor) { rms_norm_case<float, Eigen::ColMajor>(); }
TEST(Concurrency, RMSNormSharedDoubleColMajor) { rms_norm_case<double, Eigen::ColMajor>(); }
TEST(Concurrency, BatchNormEvalSharedNCHW) { batch_norm_eval_case<float, Eigen::RowMajor>(1); }
TEST(Concurrency, BatchNormEvalSharedChannelsLast) { batch_norm_eval_case<float, Eigen::RowMajor>(-1); }
TEST(Concurrency, BatchNormEvalSharedColMajor) { batch_norm_eval_case<double, Eigen::ColMajor>(1); }

}  // namespace
