// BatchNorm against the reference path, finite differences and PyTorch's
// semantics; and the LayerNorm/BatchNorm contrast the library teaches.
#include "test_util.hpp"

namespace {

using namespace nctest;
using normcore::BatchNorm;
using normcore::BatchNormOptions;
using normcore::NormStats;

template <typename T>
class BatchNormTest : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(BatchNormTest, Types, );

template <typename T>
void randomize(BatchNorm<T>& bn, unsigned seed) {
  const auto C = static_cast<std::size_t>(bn.options().num_features());
  const auto g = randn<T>(C, seed, 1.0, 0.5), b = randn<T>(C, seed + 1, 0.0, 0.5);
  std::copy(g.begin(), g.end(), bn.weight().data());
  std::copy(b.begin(), b.end(), bn.bias().data());
}

// NCHW (RowMajor), the same data channels-last (N, H, W, C) and as a ColMajor
// tensor: all against the reference, all giving the same numbers.
template <typename T>
void check_nchw(Index N, Index C, Index H, Index W, unsigned seed, double offset) {
  SCOPED_TRACE(::testing::Message() << N << "x" << C << "x" << H << "x" << W << " offset " << offset);
  BatchNorm<T> bn{BatchNormOptions(C)};
  randomize(bn, seed);
  Eigen::Tensor<T, 4, Eigen::RowMajor> x(N, C, H, W), dy(N, C, H, W);
  const auto xv = randn<T>(static_cast<std::size_t>(x.size()), seed + 2, offset, 2.0);
  const auto dv = randn<T>(static_cast<std::size_t>(x.size()), seed + 3);
  std::copy(xv.begin(), xv.end(), x.data());
  std::copy(dv.begin(), dv.end(), dy.data());
  const Index inner = H * W;
  const auto st = normcore::reference::channel_stats(xv.data(), N, C, inner);
  const auto ref = normcore::reference::batch_norm_forward(xv.data(), N, C, inner, st.mean, st.var,
                                                           bn.weight().data(), bn.bias().data(), 1e-5);
  const auto gref = normcore::reference::batch_norm_backward(xv.data(), dv.data(), N, C, inner, st.mean, st.var,
                                                             bn.weight().data(), 1e-5, true);
  double rmax = 0;
  for (double v : st.var) rmax = std::max(rmax, 1 / std::sqrt(v + 1e-5));
  const double n = double(N * inner);
  const double quant = std::fabs(offset) * rmax;
  const double ytol = tol_elem<T>(max_abs(ref) + 1 + 2 * quant, n);

  Eigen::Tensor<T, 4, Eigen::RowMajor> y(N, C, H, W);
  NormStats<T> s;
  bn.forward(x, y, s);
  EXPECT_LE(max_diff(y.data(), ref), ytol);
  for (Index c = 0; c < C; ++c) EXPECT_NEAR(s.mean(c), st.mean[static_cast<std::size_t>(c)], tol_elem<T>(std::fabs(offset) + 2, n));
  auto g = bn.backward(x, dy, &s);
  const double dxtol = tol_elem<T>(rmax * 8 * (1 + quant), n);
  EXPECT_LE(max_diff(g.dx.data(), gref.dx), dxtol);
  EXPECT_LE(max_diff(g.dweight.data(), gref.dweight), tol<T>(max_abs(gref.dweight) + 4 * (1 + quant), n));
  EXPECT_LE(max_diff(g.dbias.data(), gref.dbias), tol<T>(max_abs(gref.dbias) + 4, n));

  // Channels-last: (N, H, W, C) with the channel axis last.
  const Eigen::array<int, 4> to_nhwc{{0, 2, 3, 1}}, to_nchw{{0, 3, 1, 2}};
  Eigen::Tensor<T, 4, Eigen::RowMajor> xl = x.shuffle(to_nhwc), dyl = dy.shuffle(to_nhwc);
  BatchNorm<T> bl(BatchNormOptions(C).channel_axis(-1));
  bl.weight() = bn.weight();
  bl.bias() = bn.bias();
  Eigen::Tensor<T, 4, Eigen::RowMajor> yl = bl(xl);
  Eigen::Tensor<T, 4, Eigen::RowMajor> yl_nchw = yl.shuffle(to_nchw);
  EXPECT_LE(max_diff(yl_nchw.data(), ref), ytol);
  auto gl = bl.backward(xl, dyl);
  Eigen::Tensor<T, 4, Eigen::RowMajor> dxl = gl.dx.shuffle(to_nchw);
  EXPECT_LE(max_diff(dxl.data(), gref.dx), dxtol);
  EXPECT_LE(max_diff(gl.dweight.data(), gref.dweight), tol<T>(max_abs(gref.dweight) + 4 * (1 + quant), n));
  for (Index c = 0; c < C; ++c) {
    EXPECT_NEAR(bl.running_mean()(c), bn.running_mean()(c), tol_elem<T>(std::fabs(offset) + 2, n));
    EXPECT_NEAR(bl.running_var()(c), bn.running_var()(c), tol_elem<T>(8, n));
  }

  // ColMajor storage of the same logical NCHW tensor.
  const Eigen::array<int, 4> rev{{3, 2, 1, 0}};
  Eigen::Tensor<T, 4, Eigen::ColMajor> xc = x.swap_layout().shuffle(rev);
  BatchNorm<T> bc{BatchNormOptions(C)};
  bc.weight() = bn.weight();
  bc.bias() = bn.bias();
  Eigen::Tensor<T, 4, Eigen::ColMajor> yc = bc(xc);
  Eigen::Tensor<T, 4, Eigen::RowMajor> yc_rm = yc.swap_layout().shuffle(rev);
  EXPECT_LE(max_diff(yc_rm.data(), ref), ytol);
}

TYPED_TEST(BatchNormTest, TrainingForwardBackwardAllLayouts) {
  unsigned seed = 1;
  for (Index hw : {Index(1), Index(3), Index(5), Index(17), Index(33)}) {
    for (Index C : {Index(1), Index(3), Index(16), Index(21)}) {
      check_nchw<TypeParam>(4, C, hw, hw == 1 ? 1 : 2, seed++, 0.5);
    }
  }
  check_nchw<TypeParam>(8, 19, 7, 7, 99, 1e4);
  check_nchw<TypeParam>(300, 5, 1, 1, 98, 3.0);  // (N, C) with many rows
  // Channels-last rows not a multiple of four (the backward's sums take four
  // rows at a time, then the rest one by one): 75 rows, and 297 (a chunk of
  // 256 rows, then 41), with channels short of a packet and with a tail.
  check_nchw<TypeParam>(3, 7, 5, 5, 97, 2.0);
  check_nchw<TypeParam>(3, 21, 11, 9, 96, 1.0);
  // Maps smaller than a packet (AVX-512: 3x3 and 2x2 floats, 2x2 doubles),
  // at a large offset, and over more channels than one tile of lanes (2048
  // floats, 1024 doubles: 512 and 256 channels of 2x2).
  check_nchw<TypeParam>(8, 19, 3, 3, 95, 1e4);
  check_nchw<TypeParam>(5, 600, 2, 2, 94, 3.0);
}

// Inputs of normcore::detail::kStreamingBytes or more write y with streaming
// stores when y is aligned and every packet store lands on a packet
// boundary. In eval mode each sample is normalized on its own, so the bits
// must be those of the same samples in calls below the threshold, with y
// aligned and one element off alignment (ordinary stores): channels-first
// long segments (56x56) and 14x14 ones (the short-segment loop for floats
// with AVX-512; with narrower packets, or doubles, segments that are not
// whole packets, which keep ordinary stores), channels-last with the
// constants in registers (64 channels) and not (1024).
TYPED_TEST(BatchNormTest, LargeEvalInputSameBitsAsSmallCalls) {
  using T = TypeParam;
  struct Shape {
    Index C, S;
    bool last;
  };
  for (const Shape sh : {Shape{8, 3136, false}, Shape{16, 196, false}, Shape{64, 49, true}, Shape{1024, 7, true}}) {
    SCOPED_TRACE(::testing::Message() << "C=" << sh.C << " S=" << sh.S << (sh.last ? " channels-last" : ""));
    const Index per = sh.C * sh.S;  // values per sample
    const Index N = normcore::detail::kStreamingBytes / (per * static_cast<Index>(sizeof(T))) + 2;
    const auto total = static_cast<std::size_t>(N * per);
    BatchNorm<T> bn{BatchNormOptions(sh.C).channel_axis(sh.last ? -1 : 1)};
    randomize(bn, 90);
    const auto m = randn<T>(static_cast<std::size_t>(sh.C), 91, 0.0, 3.0);
    for (Index c = 0; c < sh.C; ++c) {
      bn.running_mean()(c) = m[static_cast<std::size_t>(c)];
      bn.running_var()(c) = T(1) + T(c % 3);
    }
    bn.eval();
    const auto xv = randn<T>(total, 92, 0.5, 2.0);
    const Index d1 = sh.last ? sh.S : sh.C, d2 = sh.last ? sh.C : sh.S;
    std::vector<T> want(total);
    const Index chunk = 4;  // samples per small call
    ASSERT_LT(chunk * per * static_cast<Index>(sizeof(T)), normcore::detail::kStreamingBytes);
    for (Index n0 = 0; n0 < N; n0 += chunk) {
      const Index k = std::min(chunk, N - n0);
      Eigen::TensorMap<const Eigen::Tensor<T, 3, Eigen::RowMajor>> xs(xv.data() + n0 * per, k, d1, d2);
      Eigen::TensorMap<Eigen::Tensor<T, 3, Eigen::RowMajor>> ys(want.data() + n0 * per, k, d1, d2);
      bn.forward(xs, ys);
    }
    Eigen::TensorMap<const Eigen::Tensor<T, 3, Eigen::RowMajor>> x(xv.data(), N, d1, d2);
    std::vector<T, Eigen::aligned_allocator<T>> yb(total + 1);
    for (int off = 0; off < 2; ++off) {
      Eigen::TensorMap<Eigen::Tensor<T, 3, Eigen::RowMajor>> y(yb.data() + off, N, d1, d2);
      bn.forward(x, y);
      EXPECT_EQ(std::memcmp(y.data(), want.data(), total * sizeof(T)), 0) << "offset " << off;
    }
  }
}

// The channels-first backward on an input of normcore::detail::kStreamingBytes
// or more writes dx with streaming stores when dx is aligned and its
// segments are whole packets: the same bits as into a dx one element off
// alignment (ordinary stores), with the per-channel pass that fuses the
// sums and dx (8 channels of 64x64) and the two passes (4 of 56x56).
TYPED_TEST(BatchNormTest, LargeBackwardStreamingSameBitsAsOrdinaryStores) {
  using T = TypeParam;
  for (const auto& [C, S] : {std::pair<Index, Index>{8, 4096}, std::pair<Index, Index>{4, 3136}}) {
    SCOPED_TRACE(::testing::Message() << "C=" << C << " S=" << S);
    const Index N = normcore::detail::kStreamingBytes / (C * S * static_cast<Index>(sizeof(T))) + 1;
    const auto total = static_cast<std::size_t>(N * C * S);
    BatchNorm<T> bn{BatchNormOptions(C)};
    randomize(bn, 95);
    const auto xv = randn<T>(total, 96, 0.5, 2.0), gv = randn<T>(total, 97);
    Eigen::TensorMap<const Eigen::Tensor<T, 3, Eigen::RowMajor>> x(xv.data(), N, C, S), dy(gv.data(), N, C, S);
    NormStats<T> st;
    Eigen::Tensor<T, 3, Eigen::RowMajor> y(N, C, S);
    bn.forward(x, y, st);
    std::vector<T, Eigen::aligned_allocator<T>> a(total), b(total + 1);
    Eigen::TensorMap<Eigen::Tensor<T, 3, Eigen::RowMajor>> da(a.data(), N, C, S), db(b.data() + 1, N, C, S);
    Eigen::Tensor<T, 1> dw, dbias;
    bn.backward(x, dy, &da, &dw, &dbias, &st);
    bn.backward(x, dy, &db, &dw, &dbias, &st);
    EXPECT_EQ(std::memcmp(a.data(), b.data() + 1, total * sizeof(T)), 0);
  }
}

// The channels-last backward on an input of at least half of
// normcore::detail::kStreamingBytes (x; x and dy together at least the whole
// of it) writes dx with streaming stores, when dx is aligned and its rows
// are whole packets:
// the same bits as into a dx one element off alignment (ordinary stores).
// (N, C) and (N, H, W, C) inputs.
template <typename T>
void check_large_channels_last_backward_streaming() {
  constexpr Index C = 64;
  const Index N = normcore::detail::kStreamingBytes / (2 * C * static_cast<Index>(sizeof(T))) / 4 * 4 + 4;
  const auto total = static_cast<std::size_t>(N * C);
  BatchNorm<T> bn{BatchNormOptions(C)};
  randomize(bn, 98);
  const auto xv = randn<T>(total, 99, 0.5, 2.0), gv = randn<T>(total, 100);
  std::vector<T, Eigen::aligned_allocator<T>> a(total), b(total + 1);
  Eigen::Tensor<T, 1> dw, dbias;
  {
    Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> x(xv.data(), N, C), dy(gv.data(), N, C);
    NormStats<T> st;
    Eigen::Tensor<T, 2, Eigen::RowMajor> y(N, C);
    bn.forward(x, y, st);
    Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>> da(a.data(), N, C), db(b.data() + 1, N, C);
    bn.backward(x, dy, &da, &dw, &dbias, &st);
    bn.backward(x, dy, &db, &dw, &dbias, &st);
    EXPECT_EQ(std::memcmp(a.data(), b.data() + 1, total * sizeof(T)), 0);
  }
  {  // channels-last 4-D, without saved statistics (the batch's, recomputed)
    BatchNorm<T> cl{BatchNormOptions(C).channel_axis(-1)};
    randomize(cl, 98);
    const Index Q = N / 4;
    Eigen::TensorMap<const Eigen::Tensor<T, 4, Eigen::RowMajor>> x(xv.data(), Q, 2, 2, C), dy(gv.data(), Q, 2, 2, C);
    Eigen::TensorMap<Eigen::Tensor<T, 4, Eigen::RowMajor>> da(a.data(), Q, 2, 2, C), db(b.data() + 1, Q, 2, 2, C);
    std::fill(a.begin(), a.end(), T(0));
    cl.backward(x, dy, &da, &dw, &dbias);
    cl.backward(x, dy, &db, &dw, &dbias);
    EXPECT_EQ(std::memcmp(a.data(), b.data() + 1, total * sizeof(T)), 0);
  }
}

// Under every set of path choices (BatchNorm's dx_streams_channels_last
// follows none of them since session 53; the sets still choose other paths).
TYPED_TEST(BatchNormTest, LargeChannelsLastBackwardStreamingSameBitsAsOrdinaryStores) {
  for (int tuning : {0, 1, 2, 3}) {
    const nctest::IntelTuning paths(tuning);
    SCOPED_TRACE(::testing::Message() << "Intel tuning " << tuning);
    check_large_channels_last_backward_streaming<TypeParam>();
  }
}

// Channels-last normalize, bit for bit against channels-first in eval mode
// (the same running statistics, so the same per-channel constants): every
// loop applies the same fma(x - pivot, scale, shift) per value, whichever
// runs. Channels below one packet (scalars), one to eight packets of
// channels with their constants in registers (with leftover channels or
// not), more channels a row at a time (small inputs and one just over
// 12 MB, whose output takes streaming stores); the pivot's subtraction left
// out when every pivot is +0, kept when one is not (a large running mean,
// or zero variance). Inputs hold -0 and 0.
TYPED_TEST(BatchNormTest, ChannelsLastEvalSameBitsAsChannelsFirst) {
  using T = TypeParam;
  const Index big = (Index(12) << 20) / (144 * Index(sizeof(T))) + 3;  // 144 channels, just over 12 MB
  // Channels: whole packets 1 to 8 and the register limit (AVX-512 floats: 16 to 128,
  // doubles: 8 to 64; SSE2: 4 to 16 floats, 2 to 8 doubles), with leftovers, and beyond.
  const std::pair<Index, Index> shapes[] = {{7, 3},   {9, 8},   {9, 16},  {9, 21},  {5, 40},  {5, 48},
                                            {6, 56},  {7, 64},  {7, 80},  {7, 112}, {7, 128}, {7, 131},
                                            {9, 144}, {8, 144}, {7, 517}, {6, 517}, {big, 144}};
  unsigned seed = 40;
  for (const auto& [rows, C] : shapes) {
    for (bool pivots : {false, true}) {
      SCOPED_TRACE(::testing::Message() << rows << " rows x " << C << " channels, pivots " << pivots);
      BatchNorm<T> first{BatchNormOptions(C)}, last{BatchNormOptions(C).channel_axis(-1)};
      randomize(first, seed++);
      last.weight() = first.weight();
      last.bias() = first.bias();
      const auto m = randn<T>(static_cast<std::size_t>(C), seed++, 0.0, 0.2);
      for (Index c = 0; c < C; ++c) {
        T mean = m[static_cast<std::size_t>(c)], var = T(1) + T(c % 5) / 4;
        if (pivots && c % 3 == 1) mean = T(40) + T(c);  // |mean| * rstd > 1: pivot = mean
        if (pivots && c == C - 1) var = T(0);  // zero variance: pivot = mean
        const bool signed_zeros = !pivots && c == 0;  // mean 0, bias -0: y = -0 exactly where x = -0
        if (signed_zeros) mean = T(0);
        for (auto* b : {&first, &last}) {
          b->running_mean()(c) = mean;
          b->running_var()(c) = var;
          if (signed_zeros) b->bias()(c) = T(-0.0);
        }
      }
      first.eval();
      last.eval();
      auto xv = randn<T>(static_cast<std::size_t>(rows * C), seed++, 0.3, 2.0);
      for (std::size_t i = 0; i < xv.size(); i += 7) xv[i] = i % 2 ? T(0) : T(-0.0);
      for (Index r = 0; r < rows; r += 2) xv[static_cast<std::size_t>(r * C)] = T(-0.0);  // channel 0
      std::vector<T> xf(xv.size());  // channels first: (1, C, rows)
      for (Index r = 0; r < rows; ++r)
        for (Index c = 0; c < C; ++c) xf[static_cast<std::size_t>(c * rows + r)] = xv[static_cast<std::size_t>(r * C + c)];
      Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>> xl(xv.data(), rows, C);
      Eigen::TensorMap<const Eigen::Tensor<T, 3, Eigen::RowMajor>> xc(xf.data(), 1, C, rows);
      const Eigen::Tensor<T, 2, Eigen::RowMajor> yl = last(xl);
      const Eigen::Tensor<T, 3, Eigen::RowMajor> yc = first(xc);
      std::vector<T> back(xv.size());
      for (Index r = 0; r < rows; ++r)
        for (Index c = 0; c < C; ++c) back[static_cast<std::size_t>(r * C + c)] = yc.data()[c * rows + r];
      EXPECT_TRUE(bit_equal(yl.data(), back.data(), back.size()));
    }
  }
}

// A one-process reducer: it has nothing to add.
class NoReducer : public normcore::BatchNormReducer {
 public:
  void allreduce_moments(normcore::Welford<double>*, Index) override {}
  void allreduce_sums(double*, Index) override {}
};

// Channels first with long segments, backward fuses each channel group's sums
// and dx into one pass, unless a reducer must add up the sums first. Both
// orders must give the same bits, and the reference's numbers.
template <typename T>
void check_fused_backward(Index N, Index C, Index inner) {
  SCOPED_TRACE(::testing::Message() << "N " << N << ", C " << C << ", inner " << inner);
  const auto xv = randn<T>(static_cast<std::size_t>(N * C * inner), 5, 2.0, 3.0);
  const auto dv = randn<T>(xv.size(), 6);
  Eigen::TensorMap<const Eigen::Tensor<T, 3, Eigen::RowMajor>> x(xv.data(), N, C, inner), dy(dv.data(), N, C, inner);
  BatchNorm<T> fused{BatchNormOptions(C)}, two{BatchNormOptions(C)};
  randomize(fused, 7);
  two.weight() = fused.weight();
  two.bias() = fused.bias();
  NoReducer none;
  two.set_reducer(&none);
  Eigen::Tensor<T, 3, Eigen::RowMajor> y(N, C, inner);
  NormStats<T> s;
  fused.forward(x, y, s);
  const auto a = fused.backward(x, dy, &s), b = two.backward(x, dy, &s);
  EXPECT_TRUE(bit_equal(a.dx.data(), b.dx.data(), xv.size()));
  EXPECT_TRUE(bit_equal(a.dweight.data(), b.dweight.data(), static_cast<std::size_t>(C)));
  EXPECT_TRUE(bit_equal(a.dbias.data(), b.dbias.data(), static_cast<std::size_t>(C)));
  // In place: dx written over a copy of dy.
  std::vector<T> inplace(dv);
  Eigen::TensorMap<Eigen::Tensor<T, 3, Eigen::RowMajor>> dxm(inplace.data(), N, C, inner);
  Eigen::TensorMap<const Eigen::Tensor<T, 3, Eigen::RowMajor>> dyin(inplace.data(), N, C, inner);
  Eigen::Tensor<T, 1> dw, db;
  fused.backward(x, dyin, &dxm, &dw, &db, &s);
  EXPECT_TRUE(bit_equal(inplace.data(), a.dx.data(), xv.size()));
  const auto st = normcore::reference::channel_stats(xv.data(), N, C, inner);
  const auto gref = normcore::reference::batch_norm_backward(xv.data(), dv.data(), N, C, inner, st.mean, st.var,
                                                             fused.weight().data(), 1e-5, true);
  double rmax = 0;
  for (double v : st.var) rmax = std::max(rmax, 1 / std::sqrt(v + 1e-5));
  EXPECT_LE(max_diff(a.dx.data(), gref.dx), tol_elem<T>(rmax * 8 * (1 + 2 * rmax), double(N * inner)));
}

TYPED_TEST(BatchNormTest, FusedChannelsFirstBackwardMatchesTwoPasses) {
  for (Index inner : {Index(1024), Index(1031), Index(4100)}) check_fused_backward<TypeParam>(3, 9, inner);
}

// On Intel CPUs a fused group holds no more x and dy than half the L2, and
// short segments fuse when a group's run is long. Segments of 1024 values
// with about a sixth of the L2 a channel: groups of 3 channels instead of
// the 4 that runs of 4096 values need (9 channels: 3 + 3 + 3, against
// 4 + 4 + 1). Segments of 49 values (7x7) with about a fiftieth of it a
// channel: fused in groups of 25 or 26, by the L2's size (runs of about
// 1225 values: 60 channels in 25 + 25 + 10), against two passes elsewhere.
// Both sets of path choices, on any machine; the same bits as two passes.
TYPED_TEST(BatchNormTest, FusedChannelsFirstBackwardGroupsWithinHalfTheL2) {
  using T = TypeParam;
  namespace d = normcore::detail;
  const Index bytes = static_cast<Index>(sizeof(T)), l2 = d::backward_l2_bytes();
  struct Case {
    Index inner, C, share, intel, other;  // share: a channel's x and dy are about l2 / share
  };
  for (const Case& c : {Case{1024, 9, 6, 3, 4}, Case{49, 60, 50, 25, 84}}) {
    const Index N = l2 / (c.share * 2 * c.inner * bytes);
    if (N * c.C * c.inner * bytes > (Index(16) << 20)) GTEST_SKIP() << "an L2 of " << l2 << " bytes";
    // The most channels whose x and dy fit in half the L2: about share / 2,
    // the floor of the division depending on the L2's size.
    const Index fit = l2 / 2 / (2 * N * c.inner * bytes);
    ASSERT_GE(fit, c.intel);
    ASSERT_LE(fit, c.intel + 1);
    for (int tuning : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << "intel tuning " << tuning);
      const nctest::IntelTuning paths(tuning);
      ASSERT_EQ(d::fused_channel_group(c.inner, 2 * N * c.inner * bytes, 4096), tuning ? std::min(fit, c.other) : c.other);
      check_fused_backward<T>(N, c.C, c.inner);
    }
  }
}

// On Intel CPUs the channels-first training forward of an input the L2
// does not hold goes a group of channels at a time (statistics, then the
// group's normalize from the L2), when the group's runs are long enough:
// segments of 3136 values (56x56), about a fifth of the L2 a channel
// (groups of 2: 17 channels in 8 groups of 2 and 1), and of 49 values
// (7x7), about a hundredth (groups of 50 or 51, by the L2's size: runs of
// about 2450 values, 128 channels in 50 + 50 + 28 or 51 + 51 + 26). It
// must give the bits of the two passes, which the other CPUs' path choices
// take: y, the saved and the running statistics, over two steps; and the
// reference's numbers.
TYPED_TEST(BatchNormTest, FusedChannelsFirstTrainingForwardMatchesTwoPasses) {
  using T = TypeParam;
  namespace d = normcore::detail;
  const Index bytes = static_cast<Index>(sizeof(T)), l2 = d::backward_l2_bytes();
  struct Case {
    Index inner, C, share, group;  // share: a channel's x is about l2 / share
  };
  for (const Case& c : {Case{3136, 17, 5, 2}, Case{49, 128, 100, 50}}) {
    const Index N = l2 / (c.share * c.inner * bytes);
    SCOPED_TRACE(::testing::Message() << "N " << N << ", C " << c.C << ", inner " << c.inner);
    const Index M = N * c.C * c.inner;
    if (M * bytes > (Index(32) << 20)) GTEST_SKIP() << "an L2 of " << l2 << " bytes";
    {
      // The most channels whose x fits in half the L2: about share / 2 (the
      // floor of the division depends on the L2's size), fewer than C.
      const Index fit = l2 / 2 / (N * c.inner * bytes);
      ASSERT_GE(fit, c.group);
      ASSERT_LE(fit, c.group + 1);
      ASSERT_LT(fit, c.C);
      const nctest::IntelTuning intel(1);
      ASSERT_EQ(d::fused_channel_group(c.inner, N * c.inner * bytes, 4096), fit);  // runs of >= 2048
      ASSERT_GT(M * bytes, l2);
    }
    const auto xv = randn<T>(static_cast<std::size_t>(M), 8, 1.5, 2.0);
    Eigen::TensorMap<const Eigen::Tensor<T, 3, Eigen::RowMajor>> x(xv.data(), N, c.C, c.inner);
    BatchNorm<T> fused{BatchNormOptions(c.C)}, two{BatchNormOptions(c.C)};
    randomize(fused, 9);
    two.weight() = fused.weight();
    two.bias() = fused.bias();
    Eigen::Tensor<T, 3, Eigen::RowMajor> yf(N, c.C, c.inner), yt(N, c.C, c.inner);
    NormStats<T> sf, st;
    for (int step = 0; step < 2; ++step) {
      {
        const nctest::IntelTuning intel(1);
        fused.forward(x, yf, sf);
      }
      {
        const nctest::IntelTuning other(0);
        two.forward(x, yt, st);
      }
      const auto nc = static_cast<std::size_t>(c.C);
      EXPECT_TRUE(bit_equal(yf.data(), yt.data(), static_cast<std::size_t>(M))) << step;
      EXPECT_TRUE(bit_equal(sf.mean.data(), st.mean.data(), nc)) << step;
      EXPECT_TRUE(bit_equal(sf.rstd.data(), st.rstd.data(), nc)) << step;
      EXPECT_TRUE(bit_equal(fused.running_mean().data(), two.running_mean().data(), nc)) << step;
      EXPECT_TRUE(bit_equal(fused.running_var().data(), two.running_var().data(), nc)) << step;
    }
    const auto ref_st = normcore::reference::channel_stats(xv.data(), N, c.C, c.inner);
    const auto ref = normcore::reference::batch_norm_forward(xv.data(), N, c.C, c.inner, ref_st.mean, ref_st.var,
                                                             fused.weight().data(), fused.bias().data(), 1e-5);
    double rmax = 0;
    for (double v : ref_st.var) rmax = std::max(rmax, 1 / std::sqrt(v + 1e-5));
    EXPECT_LE(max_diff(yf.data(), ref), tol_elem<T>(max_abs(ref) + 1 + 3 * rmax, double(N * c.inner)));
  }
}

// In place: the forward with y over x, the backward with dx over dy and
// dx over x give the bits of a separate output, on every path (channels
// last; maps smaller than a packet; short and long segments; the fused
// channels-first backward at 16x1024), in training and in eval.
TYPED_TEST(BatchNormTest, InPlaceSameBitsAsSeparateOutputs) {
  using T = TypeParam;
  const std::tuple<Index, Index, Index> shapes[] = {{300, 37, 1}, {12, 5, 3}, {8, 6, 49}, {4, 16, 1024}, {3, 4, 3000}};
  for (const auto& shape : shapes) {
    const Index N = std::get<0>(shape), C = std::get<1>(shape), S = std::get<2>(shape);
    const auto n = static_cast<std::size_t>(N * C * S);
    const auto xv = randn<T>(n, 120, 0.5, 2.0), gv = randn<T>(n, 121);
    for (const bool training : {true, false}) {
      SCOPED_TRACE(::testing::Message() << N << "x" << C << "x" << S << (training ? " training" : " eval"));
      BatchNorm<T> bn{BatchNormOptions(C)};
      randomize(bn, 122);
      bn.train(training);
      BatchNorm<T> twin = bn;
      using Map = Eigen::TensorMap<Eigen::Tensor<T, 3, Eigen::RowMajor>>;
      using ConstMap = Eigen::TensorMap<const Eigen::Tensor<T, 3, Eigen::RowMajor>>;
      std::vector<T> y(n), over = xv, dx(n), over_dy = gv, over_x = xv;
      NormStats<T> st, st_twin;
      bn.forward(ConstMap(xv.data(), N, C, S), Map(y.data(), N, C, S), st);
      twin.forward(ConstMap(over.data(), N, C, S), Map(over.data(), N, C, S), st_twin);
      EXPECT_EQ(std::memcmp(y.data(), over.data(), n * sizeof(T)), 0) << "y over x";
      Map d(dx.data(), N, C, S), d_dy(over_dy.data(), N, C, S), d_x(over_x.data(), N, C, S);
      bn.backward(ConstMap(xv.data(), N, C, S), ConstMap(gv.data(), N, C, S), &d, nullptr, nullptr, &st);
      bn.backward(ConstMap(xv.data(), N, C, S), ConstMap(over_dy.data(), N, C, S), &d_dy, nullptr, nullptr, &st);
      bn.backward(ConstMap(over_x.data(), N, C, S), ConstMap(gv.data(), N, C, S), &d_x, nullptr, nullptr, &st);
      EXPECT_EQ(std::memcmp(dx.data(), over_dy.data(), n * sizeof(T)), 0) << "dx over dy";
      EXPECT_EQ(std::memcmp(dx.data(), over_x.data(), n * sizeof(T)), 0) << "dx over x";
    }
  }
}

// Empty tensors go through backward without touching memory: a zero-size
// spatial dim (RowMajor), and N = 0 in ColMajor storage, where the
// contiguous run per channel is the batch itself.
TYPED_TEST(BatchNormTest, EmptyBackwardBothLayouts) {
  using T = TypeParam;
  const Index C = 4;
  NormStats<T> s;
  s.mean = Eigen::Tensor<T, 1>(C);
  s.rstd = Eigen::Tensor<T, 1>(C);
  s.mean.setZero();
  s.rstd.setConstant(T(1));
  for (bool training : {true, false}) {
    BatchNorm<T> bn{BatchNormOptions(C)};
    if (!training) bn.eval();
    Eigen::Tensor<T, 3, Eigen::RowMajor> x(2, C, 0), dy(2, C, 0);
    const auto g = bn.backward(x, dy, &s);
    EXPECT_EQ(g.dx.size(), 0);
    ASSERT_EQ(g.dweight.size(), C);
    for (Index c = 0; c < C; ++c) EXPECT_EQ(g.dweight(c), T(0));
    Eigen::Tensor<T, 4, Eigen::ColMajor> xc(0, C, 3, 3), dyc(0, C, 3, 3);
    const auto gc = bn.backward(xc, dyc, &s);
    EXPECT_EQ(gc.dx.size(), 0);
    ASSERT_EQ(gc.dbias.size(), C);
    for (Index c = 0; c < C; ++c) EXPECT_EQ(gc.dbias(c), T(0));
  }
}

TYPED_TEST(BatchNormTest, RunningStatisticsFollowPyTorch) {
  using T = TypeParam;
  for (std::optional<double> m : {std::optional<double>(0.1), std::optional<double>(0.3), std::optional<double>()}) {
    const Index N = 6, C = 4, S = 5;
    BatchNorm<T> bn(BatchNormOptions(C).momentum(m));
    std::vector<double> rm(C, 0.0), rv(C, 1.0);
    for (int step = 1; step <= 4; ++step) {
      Eigen::Tensor<T, 3, Eigen::RowMajor> x(N, C, S);
      const auto v = randn<T>(static_cast<std::size_t>(x.size()), unsigned(step * 7), step * 0.5, 1.0 + step);
      std::copy(v.begin(), v.end(), x.data());
      (void)bn(x);
      const auto st = normcore::reference::channel_stats(v.data(), N, C, S);
      const double f = m ? *m : 1.0 / step;
      const double n = double(N * S);
      for (Index c = 0; c < C; ++c) {
        const std::size_t cc = static_cast<std::size_t>(c);
        rm[cc] = (1 - f) * rm[cc] + f * st.mean[cc];
        rv[cc] = (1 - f) * rv[cc] + f * st.var[cc] * n / (n - 1);  // unbiased
        EXPECT_NEAR(bn.running_mean()(c), rm[cc], tol_elem<T>(8, n)) << "step " << step;
        EXPECT_NEAR(bn.running_var()(c), rv[cc], tol_elem<T>(32, n)) << "step " << step;
      }
      EXPECT_EQ(bn.num_batches_tracked(), step);
    }
    // Eval: normalize with the running statistics, independent of the batch.
    bn.eval();
    EXPECT_FALSE(bn.is_training());
    Eigen::Tensor<T, 3, Eigen::RowMajor> x(N, C, S);
    const auto v = randn<T>(static_cast<std::size_t>(x.size()), 123, 0.0, 1.0);
    std::copy(v.begin(), v.end(), x.data());
    Eigen::Tensor<T, 3, Eigen::RowMajor> y = bn(x);
    std::vector<double> em(C), ev(C);
    for (Index c = 0; c < C; ++c) {
      em[static_cast<std::size_t>(c)] = bn.running_mean()(c);
      ev[static_cast<std::size_t>(c)] = bn.running_var()(c);
    }
    const auto ref = normcore::reference::batch_norm_forward(v.data(), N, C, S, em, ev, bn.weight().data(),
                                                             bn.bias().data(), 1e-5);
    EXPECT_LE(max_diff(y.data(), ref), tol_elem<T>(max_abs(ref) + 1, 1));
    EXPECT_EQ(bn.num_batches_tracked(), 4);  // eval does not count
    // Eval backward: through fixed statistics.
    Eigen::Tensor<T, 3, Eigen::RowMajor> dy(N, C, S);
    const auto d = randn<T>(static_cast<std::size_t>(x.size()), 124);
    std::copy(d.begin(), d.end(), dy.data());
    auto g = bn.backward(x, dy);
    const auto gref = normcore::reference::batch_norm_backward(v.data(), d.data(), N, C, S, em, ev,
                                                               bn.weight().data(), 1e-5, false);
    EXPECT_LE(max_diff(g.dx.data(), gref.dx), tol_elem<T>(max_abs(gref.dx) + 1, 1));
    EXPECT_LE(max_diff(g.dweight.data(), gref.dweight), tol<T>(max_abs(gref.dweight) + 8, double(N * S)));
  }
}

TYPED_TEST(BatchNormTest, WithoutRunningStatsUsesBatchStatsInBothModes) {
  using T = TypeParam;
  BatchNorm<T> bn(BatchNormOptions(3).track_running_stats(false));
  EXPECT_EQ(bn.running_mean().size(), 0);
  EXPECT_EQ(bn.running_var().size(), 0);
  Eigen::Tensor<T, 2, Eigen::RowMajor> x(10, 3);
  x.setRandom();
  Eigen::Tensor<T, 2, Eigen::RowMajor> a = bn(x);
  bn.eval();
  Eigen::Tensor<T, 2, Eigen::RowMajor> b = bn(x);
  EXPECT_TRUE(bit_equal(a.data(), b.data(), static_cast<std::size_t>(a.size())));
  EXPECT_EQ(bn.num_batches_tracked(), 0);
}

TEST(BatchNormErrors, OneValuePerChannelWhenTrainingAndShapes) {
  BatchNorm<float> bn(BatchNormOptions(10));
  Eigen::Tensor<float, 2, Eigen::RowMajor> x(1, 10);
  x.setRandom();
  try {
    (void)bn(x);
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("more than 1 value per channel when training"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[1, 10]"), std::string::npos) << e.what();
  }
  EXPECT_EQ(bn.num_batches_tracked(), 0);  // nothing changed
  bn.eval();
  EXPECT_NO_THROW((void)bn(x));  // eval with batch size 1 is fine
  Eigen::Tensor<float, 2, Eigen::RowMajor> wrong(4, 9);
  wrong.setZero();
  try {
    (void)bn(wrong);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[4, 9]"), std::string::npos) << e.what();
  }
  Eigen::Tensor<float, 1> r1(10);
  r1.setZero();
  EXPECT_THROW((void)bn(r1), std::invalid_argument);  // rank 1
  EXPECT_THROW(BatchNorm<float>(BatchNormOptions(0)), std::invalid_argument);
  EXPECT_THROW(BatchNorm<float>(BatchNormOptions(4).momentum(1.5)), std::invalid_argument);
}

TEST(BatchNormGradient, TrainingModeMatchesCentralDifferences) {
  const Index N = 3, C = 2, S = 4;
  BatchNorm<double> bn(BatchNormOptions(C).track_running_stats(false));
  randomize(bn, 7);
  auto x = randn<double>(static_cast<std::size_t>(N * C * S), 8, 0.4, 1.3);
  const auto w = randn<double>(x.size(), 9);
  Eigen::TensorMap<Eigen::Tensor<double, 3, Eigen::RowMajor>> xm(x.data(), N, C, S);
  Eigen::TensorMap<const Eigen::Tensor<double, 3, Eigen::RowMajor>> wm(w.data(), N, C, S);
  auto loss = [&]() {
    Eigen::Tensor<double, 3, Eigen::RowMajor> y = bn(xm);
    double s = 0;
    for (Index i = 0; i < y.size(); ++i) s += y.data()[i] * w[static_cast<std::size_t>(i)];
    return s;
  };
  const auto g = bn.backward(xm, wm);
  const double h = 1e-6;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double lp = loss();
    x[i] = keep - h;
    const double lm = loss();
    x[i] = keep;
    EXPECT_NEAR(g.dx.data()[i], (lp - lm) / (2 * h), 1e-6 * (1 + std::fabs(g.dx.data()[i])));
  }
  for (Index c = 0; c < C; ++c) {
    for (int which = 0; which < 2; ++which) {
      double& p = which == 0 ? bn.weight()(c) : bn.bias()(c);
      const double keep = p;
      p = keep + h;
      const double lp = loss();
      p = keep - h;
      const double lm = loss();
      p = keep;
      EXPECT_NEAR(which == 0 ? g.dweight(c) : g.dbias(c), (lp - lm) / (2 * h), 1e-6);
    }
  }
}

// The contrast the library exists to teach.
TEST(Contrast, LayerNormIgnoresTheBatchBatchNormDoesNot) {
  const Index N = 8, H = 16;
  auto v = randn<float>(static_cast<std::size_t>(N * H), 5, 1.0, 2.0);
  Eigen::TensorMap<Eigen::Tensor<float, 2, Eigen::RowMajor>> x(v.data(), N, H);
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({H}));
  BatchNorm<float> bn{BatchNormOptions(H)};
  Eigen::Tensor<float, 2, Eigen::RowMajor> l1 = ln(x), b1 = bn(x);
  for (Index i = H; i < N * H; ++i) v[static_cast<std::size_t>(i)] *= 3.0f;  // change the other examples
  Eigen::Tensor<float, 2, Eigen::RowMajor> l2 = ln(x), b2 = bn(x);
  bool bn_changed = false;
  for (Index j = 0; j < H; ++j) {
    EXPECT_EQ(l1(0, j), l2(0, j));
    bn_changed = bn_changed || b1(0, j) != b2(0, j);
  }
  EXPECT_TRUE(bn_changed);
  // In eval mode BatchNorm no longer depends on the batch.
  bn.eval();
  Eigen::Tensor<float, 2, Eigen::RowMajor> e1 = bn(x);
  for (Index i = H; i < N * H; ++i) v[static_cast<std::size_t>(i)] *= 0.5f;
  Eigen::Tensor<float, 2, Eigen::RowMajor> e2 = bn(x);
  for (Index j = 0; j < H; ++j) EXPECT_EQ(e1(0, j), e2(0, j));
  // BatchNorm differs between train and eval; LayerNorm has no modes.
  bn.train();
  Eigen::Tensor<float, 2, Eigen::RowMajor> t = bn(x);
  bool differs = false;
  for (Index j = 0; j < H; ++j) differs = differs || t(0, j) != e2(0, j);
  EXPECT_TRUE(differs);
}

}  // namespace

namespace {

TEST(BatchNormExtremes, HugeFloatChannels) {
  using nctest::randn;
  for (double scale : {1e25, 1e30}) {
    for (int axis : {1, -1}) {
      const Index N = 4, C = 3, S = 33;
      const auto xv = randn<float>(static_cast<std::size_t>(N * C * S), 8, 0.3 * scale, scale);
      // Logical NCS data; channels-last stores it as (N, S, C).
      std::vector<float> xs = xv;
      if (axis == -1)
        for (Index o = 0; o < N; ++o)
          for (Index c = 0; c < C; ++c)
            for (Index i = 0; i < S; ++i) xs[static_cast<std::size_t>((o * S + i) * C + c)] = xv[static_cast<std::size_t>((o * C + c) * S + i)];
      BatchNorm<float> bn{BatchNormOptions(C).channel_axis(axis)};
      Eigen::TensorMap<const Eigen::Tensor<float, 3, Eigen::RowMajor>> x(xs.data(), N, axis == 1 ? C : S, axis == 1 ? S : C);
      Eigen::Tensor<float, 3, Eigen::RowMajor> y = bn(x);
      const auto st = normcore::reference::channel_stats(xv.data(), N, C, S);
      const auto ref = normcore::reference::batch_norm_forward(xv.data(), N, C, S, st.mean, st.var,
                                                               (const float*)nullptr, (const float*)nullptr, 1e-5);
      double err = 0;
      for (Index o = 0; o < N; ++o)
        for (Index c = 0; c < C; ++c)
          for (Index i = 0; i < S; ++i) {
            const float got = axis == 1 ? y(o, c, i) : y(o, i, c);
            err = std::max(err, std::fabs(double(got) - ref[static_cast<std::size_t>((o * C + c) * S + i)]));
          }
      EXPECT_LE(err, nctest::tol_elem<float>(nctest::max_abs(ref) + 1, double(N * S))) << scale << " axis " << axis;
    }
  }
}

}  // namespace
