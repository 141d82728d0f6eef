// Devices: every layer on an Eigen::ThreadPoolDevice gives results
// bit-identical to the calling thread alone, for any number of threads.
#define EIGEN_USE_THREADS
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
  // Channels last, 12 full chunks of 256 rows and a partial one: on 2 and 3
  // threads the rows are split in whole chunks, merged in windows of 10 and
  // 12 chunks (24 KB of results per chunk at 1024 channels; 256 KB, or four
  // chunks per thread), so two windows.
  // In double, so that a change in the order of the merges (in double)
  // shows in the outputs.
  check_batch_norm<-1, double>(1, 1024, 12 * 256 + 17);
}

}  // namespace
