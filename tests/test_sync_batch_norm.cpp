// The BatchNorm reducer seam (SyncBatchNorm): ranks simulated by threads
// with an in-process reducer give what one process gives on the whole batch.
#include <condition_variable>
#include <mutex>
#include <thread>

#include "test_util.hpp"

namespace {

using namespace nctest;
using normcore::BatchNorm;
using normcore::BatchNormOptions;
using normcore::Welford;

// All ranks deposit, the last one to arrive combines in rank order, all leave.
class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : n_(n), moments_(static_cast<std::size_t>(n)), sums_(static_cast<std::size_t>(n)) {}

  class Rank : public normcore::BatchNormReducer {
   public:
    Rank(ThreadGroup* g, int r) : g_(g), r_(r) {}
    void allreduce_moments(Welford<double>* s, Index c) override {
      g_->exchange(r_, [&] { g_->moments_[static_cast<std::size_t>(r_)].assign(s, s + c); },
                   [&] {
                     for (Index i = 0; i < c; ++i) {
                       Welford<double> m;
                       for (const auto& v : g_->moments_) m.merge(v[static_cast<std::size_t>(i)]);
                       s[i] = m;
                     }
                   });
    }
    void allreduce_sums(double* v, Index n) override {
      g_->exchange(r_, [&] { g_->sums_[static_cast<std::size_t>(r_)].assign(v, v + n); },
                   [&] {
                     for (Index i = 0; i < n; ++i) {
                       double t = 0;
                       for (const auto& s : g_->sums_) t += s[static_cast<std::size_t>(i)];
                       v[i] = t;
                     }
                   });
    }

   private:
    ThreadGroup* g_;
    int r_;
  };

 private:
  template <typename Put, typename Get>
  void exchange(int, Put put, Get get) {
    std::unique_lock<std::mutex> lk(mu_);
    const long gen = gen_;
    put();
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lk, [&] { return gen_ != gen; });
    }
    get();  // every rank reads all deposits; the next round waits for all reads
    if (++read_ == n_) {
      read_ = 0;
      ++rgen_;
      cv_.notify_all();
    } else {
      const long rg = rgen_;
      cv_.wait(lk, [&] { return rgen_ != rg; });
    }
  }
  int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0, read_ = 0;
  long gen_ = 0, rgen_ = 0;
  std::vector<std::vector<Welford<double>>> moments_;
  std::vector<std::vector<double>> sums_;
};

void check_shares(const std::vector<Index>& shares) {
  const Index C = 5, S = 6;
  Index N = 0;
  for (Index s : shares) N += s;
  const auto xv = randn<double>(static_cast<std::size_t>(N * C * S), 3, 2.0, 1.5);
  const auto dv = randn<double>(xv.size(), 4);
  // One process on the whole batch.
  BatchNorm<double> whole{BatchNormOptions(C)};
  Eigen::TensorMap<const Eigen::Tensor<double, 3, Eigen::RowMajor>> x(xv.data(), N, C, S), dy(dv.data(), N, C, S);
  normcore::NormStats<double> st;
  Eigen::Tensor<double, 3, Eigen::RowMajor> y(N, C, S);
  whole.forward(x, y, st);
  const auto g = whole.backward(x, dy, &st);
  // Ranks.
  const int R = static_cast<int>(shares.size());
  ThreadGroup group(R);
  std::vector<Eigen::Tensor<double, 3, Eigen::RowMajor>> ys(static_cast<std::size_t>(R)), dxs(static_cast<std::size_t>(R));
  std::vector<Eigen::Tensor<double, 1>> dws(static_cast<std::size_t>(R)), dbs(static_cast<std::size_t>(R));
  std::vector<BatchNorm<double>> bns(static_cast<std::size_t>(R), BatchNorm<double>{BatchNormOptions(C)});
  std::vector<std::thread> th;
  Index offset = 0;
  for (int r = 0; r < R; ++r) {
    const Index n0 = offset, n = shares[static_cast<std::size_t>(r)];
    offset += n;
    th.emplace_back([&, r, n0, n] {
      ThreadGroup::Rank red(&group, r);
      auto& bn = bns[static_cast<std::size_t>(r)];
      bn.set_reducer(&red);
      Eigen::TensorMap<const Eigen::Tensor<double, 3, Eigen::RowMajor>> xr(xv.data() + n0 * C * S, n, C, S),
          dyr(dv.data() + n0 * C * S, n, C, S);
      normcore::NormStats<double> s;
      auto& yr = ys[static_cast<std::size_t>(r)];
      yr.resize(n, C, S);
      bn.forward(xr, yr, s);
      auto gr = bn.backward(xr, dyr, &s);
      dxs[static_cast<std::size_t>(r)] = gr.dx;
      dws[static_cast<std::size_t>(r)] = gr.dweight;
      dbs[static_cast<std::size_t>(r)] = gr.dbias;
      bn.set_reducer(nullptr);
    });
  }
  for (auto& t : th) t.join();
  offset = 0;
  const double tol_y = tol_elem<double>(8, double(N * S));
  for (int r = 0; r < R; ++r) {
    const Index n = shares[static_cast<std::size_t>(r)];
    for (Index i = 0; i < n * C * S; ++i) {
      EXPECT_NEAR(ys[static_cast<std::size_t>(r)].data()[i], y.data()[offset * C * S + i], tol_y);
      EXPECT_NEAR(dxs[static_cast<std::size_t>(r)].data()[i], g.dx.data()[offset * C * S + i], tol_y);
    }
    offset += n;
    for (Index c = 0; c < C; ++c) {
      EXPECT_NEAR(bns[static_cast<std::size_t>(r)].running_mean()(c), whole.running_mean()(c), tol_y);
      EXPECT_NEAR(bns[static_cast<std::size_t>(r)].running_var()(c), whole.running_var()(c), tol_y);
    }
  }
  for (Index c = 0; c < C; ++c) {  // parameter gradients are local: they add up
    double dw = 0, db = 0;
    for (int r = 0; r < R; ++r) {
      dw += dws[static_cast<std::size_t>(r)](c);
      db += dbs[static_cast<std::size_t>(r)](c);
    }
    EXPECT_NEAR(dw, g.dweight(c), tol<double>(8, double(N * S)));
    EXPECT_NEAR(db, g.dbias(c), tol<double>(8, double(N * S)));
  }
}

TEST(SyncBatchNorm, RanksTogetherEqualOneProcess) {
  check_shares({4, 4});
  check_shares({2, 5, 3});
  check_shares({6, 0, 3});  // one rank empty
}

}  // namespace
