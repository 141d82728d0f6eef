// 16-bit storage (bfloat16, half) and the fused residual norms.
#ifndef EIGEN_USE_THREADS
#define EIGEN_USE_THREADS
#endif
#include "test_util.hpp"

namespace {

using namespace nctest;

template <typename S>
std::uint16_t bits_of(S v) {
  return Eigen::numext::bit_cast<std::uint16_t>(v);
}

// A 16-bit value's bits, with a NaN's sign bit cleared.
template <typename S>
std::uint16_t nan_blind_sign(S v) {
  return static_cast<std::uint16_t>(Eigen::numext::isnan(v) ? bits_of(v) & 0x7fff : bits_of(v));
}

template <typename S>
constexpr int mantissa_bits() {
  return std::is_same<S, Eigen::bfloat16>::value ? 7 : 10;
}

// Share of outputs equal to the double reference rounded to S, and the
// largest distance in units of S's ulp among outputs off by more than 1e-5.
template <typename S>
struct Agreement {
  double equal_share;
  double worst_ulps;
};

template <typename S>
Agreement<S> agreement(const S* got, const std::vector<double>& ref) {
  std::size_t equal = 0;
  double worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const float want = static_cast<float>(static_cast<S>(static_cast<float>(ref[i])));
    const float g = static_cast<float>(got[i]);
    if (g == want) {
      ++equal;
      continue;
    }
    const double err = std::fabs(double(g) - ref[i]);
    if (err < 1e-5) continue;
    const double ulp = std::ldexp(1.0, std::ilogb(std::fabs(want) > 0 ? want : 1.0f) - mantissa_bits<S>());
    worst = std::max(worst, std::fabs(double(g) - double(want)) / ulp);
  }
  return {double(equal) / double(ref.size()), worst};
}

template <typename S>
std::vector<S> to16(const std::vector<float>& v) {
  std::vector<S> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = static_cast<S>(v[i]);
  return o;
}
template <typename S>
std::vector<float> to32(const std::vector<S>& v) {
  std::vector<float> o(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) o[i] = static_cast<float>(v[i]);
  return o;
}

template <typename S>
void check_row_norms(double min_share) {
  const Index rows = 64, n = 768;
  for (double mean : {0.0, 30.0}) {
    SCOPED_TRACE(::testing::Message() << "mean " << mean);
    const auto xs = to16<S>(randn<float>(static_cast<std::size_t>(rows * n), 3, mean, 1.0));
    const auto xw = to32(xs);  // the values as stored
    Eigen::TensorMap<const Eigen::Tensor<S, 2, Eigen::RowMajor>> x(xs.data(), rows, n);
    normcore::LayerNorm<float> ln(normcore::LayerNormOptions({n}));
    Eigen::Tensor<S, 2, Eigen::RowMajor> y = ln(x);
    const auto ref = normcore::reference::layer_norm_forward(xw.data(), rows, n, (const float*)nullptr,
                                                             (const float*)nullptr, 1e-5);
    const auto a = agreement(y.data(), ref);
    std::printf("  %s mean %g: LayerNorm %.4f%% equal to the rounded reference\n",
                mantissa_bits<S>() == 7 ? "bfloat16" : "half", mean, 100 * a.equal_share);
    EXPECT_GE(a.equal_share, min_share) << "LayerNorm";
    EXPECT_LE(a.worst_ulps, 1.0) << "LayerNorm";
    normcore::RMSNorm<float> rn(normcore::RMSNormOptions({n}).eps(1e-6));
    Eigen::Tensor<S, 2, Eigen::RowMajor> z = rn(x);
    const auto rref = normcore::reference::rms_norm_forward(xw.data(), rows, n, (const float*)nullptr, 1e-6);
    const auto b = agreement(z.data(), rref);
    std::printf("  %s mean %g: RMSNorm %.4f%% equal to the rounded reference\n",
                mantissa_bits<S>() == 7 ? "bfloat16" : "half", mean, 100 * b.equal_share);
    EXPECT_GE(b.equal_share, min_share) << "RMSNorm";
    EXPECT_LE(b.worst_ulps, 1.0) << "RMSNorm";
    // Backward: the float path on the widened values, rounded once.
    const auto dys = to16<S>(randn<float>(xs.size(), 4));
    Eigen::TensorMap<const Eigen::Tensor<S, 2, Eigen::RowMajor>> dy(dys.data(), rows, n);
    Eigen::Tensor<S, 2, Eigen::RowMajor> dx(rows, n);
    Eigen::Tensor<float, 1> dw, db;
    ln.backward(x, dy, &dx, &dw, &db);
    const auto dyw = to32(dys);
    const auto gref = normcore::reference::layer_norm_backward(xw.data(), dyw.data(), rows, n,
                                                               (const float*)nullptr, 1e-5);
    EXPECT_GE(agreement(dx.data(), gref.dx).equal_share, min_share) << "LayerNorm dx";
    EXPECT_LE(max_diff(dw.data(), gref.dweight), tol<float>(max_abs(gref.dweight) + 4, double(rows)));
  }
}

TEST(Mixed, BFloat16RowNorms) { check_row_norms<Eigen::bfloat16>(0.999); }
TEST(Mixed, HalfRowNorms) { check_row_norms<Eigen::half>(0.995); }

TEST(Mixed, BatchNormBFloat16IsTheFloatPathRoundedOnce) {
  const Index N = 8, C = 5, S = 40;
  const auto xs = to16<Eigen::bfloat16>(randn<float>(static_cast<std::size_t>(N * C * S), 6, 2.0, 3.0));
  const auto xw = to32(xs);
  Eigen::TensorMap<const Eigen::Tensor<Eigen::bfloat16, 3, Eigen::RowMajor>> x(xs.data(), N, C, S);
  Eigen::TensorMap<const Eigen::Tensor<float, 3, Eigen::RowMajor>> xf(xw.data(), N, C, S);
  normcore::BatchNorm<float> a{normcore::BatchNormOptions(C)}, b{normcore::BatchNormOptions(C)};
  Eigen::Tensor<Eigen::bfloat16, 3, Eigen::RowMajor> y = a(x);
  Eigen::Tensor<float, 3, Eigen::RowMajor> yf = b(xf);
  for (Index i = 0; i < y.size(); ++i)
    ASSERT_EQ(static_cast<float>(y.data()[i]), static_cast<float>(static_cast<Eigen::bfloat16>(yf.data()[i])));
  EXPECT_TRUE(bit_equal(a.running_var().data(), b.running_var().data(), static_cast<std::size_t>(C)));
}

// The 16-bit forward reads x as it is stored, its statistics a block at a
// time widened (BatchNorm::channel_moments), its normalize one pass per
// packet or a block at a time (BatchNorm::normalize_blocks): the float path
// on the widened input, rounded once, bit for bit, on every kernel of it.
// NCHW maps of 1 (rank 2: channels last), 3 (smaller than a packet; with
// 300 samples, two chunks of them), 20 and 49 (with a tail: the kernel's
// overlapping tail, or in place the blocks), 32 (whole packets), 196
// (with a tail of 4: overlapping, or in place padded) and 3000 values
// (more than a block; maps of 20 with 300 channels: blocks, in place,
// that start mid-sample); channels last with 5, 37 (2000 rows:
// on 3 threads, chunks of rows) and 3000 channels (a row longer than a
// block); the training forward, then the forward with running statistics
// (pivots), then with fresh running statistics (every pivot +0); 1 and 3
// threads, each also in place (y over x). And the backward
// (BatchNorm::channel_sums, dx16_part: x, dy and dx read and written as
// stored) after the training forward and with running statistics, with dy
// apart from x, without dx, and in place over dy and over x.
template <typename S>
void check_batch_norm_16bit_forward() {
  const std::tuple<Index, Index, Index, int> shapes[] = {  // N, C, inner (0: rank 2), channel axis
      {40, 6, 0, 1},     {12, 5, 3, 1},   {300, 40, 3, 1},  {9, 7, 20, 1},    {8, 6, 49, 1},
      {100, 16, 49, 1},  {6, 5, 32, 1},   {24, 40, 196, 1}, {4, 3, 3000, 1},  {900, 5, 1, -1},
      {2000, 37, 1, -1}, {12, 3000, 1, -1}, {9, 300, 20, 1}};
  for (const auto& shape : shapes) {
    // (locals, not structured bindings: C++17 lambdas cannot capture those)
    const Index N = std::get<0>(shape), C = std::get<1>(shape), inner = std::get<2>(shape);
    const int axis = std::get<3>(shape);
    const Index count = N * C * std::max<Index>(inner, 1);
    const auto xs = to16<S>(randn<float>(static_cast<std::size_t>(count), 41, 3.0, 2.0));
    const auto xw = to32(xs);
    const auto dys = to16<S>(randn<float>(static_cast<std::size_t>(count), 42, 1.0, 0.5));
    const auto dyw = to32(dys);
    for (const int threads : {1, 3}) {
      Eigen::ThreadPool pool(threads);
      Eigen::ThreadPoolDevice dev(&pool, threads);
      normcore::BatchNorm<S> b16{normcore::BatchNormOptions(C).channel_axis(axis)};
      normcore::BatchNorm<float> b32{normcore::BatchNormOptions(C).channel_axis(axis)};
      for (Index c = 0; c < C; ++c) {
        b16.weight()(c) = static_cast<S>(1.0f + 0.01f * static_cast<float>(c));
        b16.bias()(c) = static_cast<S>(0.5f - 0.02f * static_cast<float>(c));
        b32.weight()(c) = static_cast<float>(b16.weight()(c));
        b32.bias()(c) = static_cast<float>(b16.bias()(c));
      }
      normcore::BatchNorm<S> fresh16 = b16;
      normcore::BatchNorm<float> fresh32 = b32;
      fresh16.eval();
      fresh32.eval();
      std::vector<S> y16(static_cast<std::size_t>(count));
      std::vector<float> y32(static_cast<std::size_t>(count));
      std::vector<S> want(static_cast<std::size_t>(count));
      // f(x, xf, y, yf): maps of the 16-bit and float inputs and outputs, in
      // the case's shape.
      const auto dims = inner == 0 ? std::vector<Index>{N, C} : axis == 1 ? std::vector<Index>{N, C, inner}
                                                                         : std::vector<Index>{N, inner, C};
      const auto with_maps = [&](auto&& f) {
        if (dims.size() == 2) {
          f(Eigen::TensorMap<const Eigen::Tensor<S, 2, Eigen::RowMajor>>(xs.data(), dims[0], dims[1]),
            Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>>(xw.data(), dims[0], dims[1]),
            Eigen::TensorMap<Eigen::Tensor<S, 2, Eigen::RowMajor>>(y16.data(), dims[0], dims[1]),
            Eigen::TensorMap<Eigen::Tensor<float, 2, Eigen::RowMajor>>(y32.data(), dims[0], dims[1]));
        } else {
          f(Eigen::TensorMap<const Eigen::Tensor<S, 3, Eigen::RowMajor>>(xs.data(), dims[0], dims[1], dims[2]),
            Eigen::TensorMap<const Eigen::Tensor<float, 3, Eigen::RowMajor>>(xw.data(), dims[0], dims[1], dims[2]),
            Eigen::TensorMap<Eigen::Tensor<S, 3, Eigen::RowMajor>>(y16.data(), dims[0], dims[1], dims[2]),
            Eigen::TensorMap<Eigen::Tensor<float, 3, Eigen::RowMajor>>(y32.data(), dims[0], dims[1], dims[2]));
        }
      };
      // y16 (or dx) against y32 rounded once.
      const auto check_rounded = [&](const char* what) {
        normcore::detail::convert_n(y32.data(), want.data(), count);
        for (Index i = 0; i < count; ++i)
          ASSERT_EQ(Eigen::numext::bit_cast<std::uint16_t>(y16[static_cast<std::size_t>(i)]),
                    Eigen::numext::bit_cast<std::uint16_t>(want[static_cast<std::size_t>(i)]))
              << what << ", shape " << N << "x" << C << "x" << inner << " axis " << axis << ", " << threads
              << " threads, value " << i;
      };
      // And the same forward in place (y over x: the kernels' padded tails
      // instead of overlapping ones), on a copy of the layer.
      const auto run = [&](normcore::BatchNorm<S>& a, normcore::BatchNorm<float>& b, const char* what) {
        normcore::BatchNorm<S> twin = a;
        std::vector<S> over = xs;
        with_maps([&](auto x, auto xf, auto y, auto yf) {
          a.forward(dev, x, y);
          b.forward(xf, yf);
          twin.forward(dev, decltype(x)(over.data(), x.dimensions()), decltype(y)(over.data(), y.dimensions()));
        });
        check_rounded(what);
        EXPECT_TRUE(bit_equal(a.running_var().data(), b.running_var().data(), static_cast<std::size_t>(C)));
        for (Index i = 0; i < count; ++i)
          ASSERT_EQ(bits_of(over[static_cast<std::size_t>(i)]), bits_of(y16[static_cast<std::size_t>(i)]))
              << what << " in place, value " << i;
      };
      // The backward: dx (in y16 and y32) against the float layer's on the
      // widened inputs, rounded once; dweight and dbias rounded once.
      const auto backward = [&](normcore::BatchNorm<S>& a, normcore::BatchNorm<float>& b, const char* what) {
        Eigen::Tensor<S, 1> dw16, db16, dw16b;
        Eigen::Tensor<float, 1> dw32, db32;
        std::vector<S> in_place = dys, x_place(xs.size());
        with_maps([&](auto x, auto xf, auto dx, auto dxf) {
          const decltype(x) dy(dys.data(), x.dimensions());
          const decltype(xf) dyf(dyw.data(), xf.dimensions());
          a.backward(dev, x, dy, &dx, &dw16, &db16);
          b.backward(xf, dyf, &dxf, &dw32, &db32);
          a.backward(dev, x, dy, nullptr, &dw16b, nullptr);
          const decltype(x) dy_over(in_place.data(), x.dimensions());  // dx over dy
          decltype(dx) over(in_place.data(), dx.dimensions());
          a.backward(dev, x, dy_over, &over, nullptr, nullptr);
          std::copy(xs.begin(), xs.end(), x_place.begin());  // dx over x
          const decltype(x) x_over(x_place.data(), x.dimensions());
          decltype(dx) over_x(x_place.data(), dx.dimensions());
          a.backward(dev, x_over, dy, &over_x, nullptr, nullptr);
        });
        check_rounded(what);
        for (Index i = 0; i < count; ++i) {
          ASSERT_EQ(bits_of(in_place[static_cast<std::size_t>(i)]), bits_of(y16[static_cast<std::size_t>(i)]))
              << what << " over dy, value " << i;
          ASSERT_EQ(bits_of(x_place[static_cast<std::size_t>(i)]), bits_of(y16[static_cast<std::size_t>(i)]))
              << what << " over x, value " << i;
        }
        for (Index c = 0; c < C; ++c) {
          ASSERT_EQ(bits_of(dw16(c)), bits_of(static_cast<S>(dw32(c)))) << what << ", channel " << c;
          ASSERT_EQ(bits_of(db16(c)), bits_of(static_cast<S>(db32(c)))) << what << ", channel " << c;
          ASSERT_EQ(bits_of(dw16b(c)), bits_of(dw16(c))) << what << " without dx, channel " << c;
        }
      };
      run(b16, b32, "training");
      backward(b16, b32, "dx, training");
      b16.eval();
      b32.eval();
      run(b16, b32, "running statistics");
      backward(b16, b32, "dx, running statistics");
      run(fresh16, fresh32, "fresh running statistics");
    }
  }
}

// NaNs keep their payloads and signs through the 16-bit BatchNorm as
// through the float layer rounded once, wherever they fall (bodies and
// overlapping tails of rows and segments; in place, padded tails and
// blocks and their tails): in eval, where
// every output has a single NaN source (x's or dy's value), so that its
// bits are defined. (In training a NaN spreads through its channel's
// statistics, and an operation may meet two NaNs, where which one it keeps
// depends on the instruction's operand order.) With GCC, whose Eigen
// converts half without F16C, detail::convert_n's scalar tail used to give
// every NaN the default payload. A NaN's sign is not compared: a negation
// flips it, and compilers fold negations into fused instructions that do
// not (Arm's fnmadd and kin) in some places and not others (on NEON, the
// float layer's scalar tail and the 16-bit blocks' gave -NaN and +NaN).
template <typename S>
void check_batch_norm_nan_payloads() {
  const std::uint16_t nan = std::is_same<S, Eigen::half>::value ? 0x7e55 : 0x7fd5;
  const std::tuple<Index, Index, Index, int> shapes[] = {  // N, C, inner, channel axis
      {12, 5, 3, 1}, {9, 7, 20, 1}, {8, 6, 49, 1}, {6, 5, 32, 1}, {4, 3, 3000, 1}, {100, 13, 1, -1}, {40, 37, 2, -1}};
  for (const auto& shape : shapes) {
    const Index N = std::get<0>(shape), C = std::get<1>(shape), inner = std::get<2>(shape);
    const int axis = std::get<3>(shape);
    const Index count = N * C * inner;
    const auto n = static_cast<std::size_t>(count);
    auto xs = to16<S>(randn<float>(n, 51, 1.0, 2.0));
    auto dys = to16<S>(randn<float>(n, 52, 0.0, 1.0));
    const auto xw0 = to32(xs);
    for (std::size_t i = 0; i < n; ++i) {  // x's NaNs and dy's never at one place
      const auto sign = static_cast<std::uint16_t>(i % 2 ? 0x8000 : 0);
      if (i % 7 == 0 || i + 1 == n) xs[i] = Eigen::numext::bit_cast<S>(static_cast<std::uint16_t>(nan | sign));
      if (i % 7 == 3 || i + 2 == n) dys[i] = Eigen::numext::bit_cast<S>(static_cast<std::uint16_t>(nan ^ sign));
    }
    const auto xw = to32(xs), dyw = to32(dys);
    std::vector<S> y16(n), dx16(n), want(n);
    std::vector<float> y32(n), dx32(n);
    const std::array<Index, 3> d = axis == 1 ? std::array<Index, 3>{N, C, inner} : std::array<Index, 3>{N, inner, C};
    using M16 = Eigen::TensorMap<Eigen::Tensor<S, 3, Eigen::RowMajor>>;
    using C16 = Eigen::TensorMap<const Eigen::Tensor<S, 3, Eigen::RowMajor>>;
    using M32 = Eigen::TensorMap<Eigen::Tensor<float, 3, Eigen::RowMajor>>;
    using C32 = Eigen::TensorMap<const Eigen::Tensor<float, 3, Eigen::RowMajor>>;
    normcore::BatchNorm<S> b16{normcore::BatchNormOptions(C).channel_axis(axis)};
    normcore::BatchNorm<float> b32{normcore::BatchNormOptions(C).channel_axis(axis)};
    M32 y32m(y32.data(), d);
    b32.forward(C32(xw0.data(), d), y32m);  // running statistics from NaN-free values
    b16.forward(C16(to16<S>(xw0).data(), d), M16(y16.data(), d));
    b16.eval();
    b32.eval();
    b16.forward(C16(xs.data(), d), M16(y16.data(), d));
    b32.forward(C32(xw.data(), d), y32m);
    M16 dx16m(dx16.data(), d);
    M32 dx32m(dx32.data(), d);
    b16.backward(C16(xs.data(), d), C16(dys.data(), d), &dx16m, nullptr, nullptr);
    b32.backward(C32(xw.data(), d), C32(dyw.data(), d), &dx32m, nullptr, nullptr);
    std::vector<S> y_over = xs, dx_over = dys;  // in place: y over x, dx over dy
    b16.forward(C16(y_over.data(), d), M16(y_over.data(), d));
    M16 dx_over_m(dx_over.data(), d);
    b16.backward(C16(xs.data(), d), C16(dx_over.data(), d), &dx_over_m, nullptr, nullptr);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(nan_blind_sign(y_over[i]), nan_blind_sign(y16[i])) << "y in place, value " << i;
      ASSERT_EQ(nan_blind_sign(dx_over[i]), nan_blind_sign(dx16[i])) << "dx in place, value " << i;
    }
    for (const auto& out : {std::make_pair(&y16, &y32), std::make_pair(&dx16, &dx32)}) {
      normcore::detail::convert_n(out.second->data(), want.data(), count);
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_EQ(nan_blind_sign((*out.first)[i]), nan_blind_sign(want[i]))
            << (out.first == &y16 ? "y" : "dx") << ", shape " << N << "x" << C << "x" << inner << " axis " << axis
            << ", value " << i;
    }
  }
}

TEST(Mixed, BatchNormBFloat16NaNPayloads) { check_batch_norm_nan_payloads<Eigen::bfloat16>(); }
TEST(Mixed, BatchNormHalfNaNPayloads) { check_batch_norm_nan_payloads<Eigen::half>(); }

TEST(Mixed, BatchNormBFloat16ForwardKernelsAreTheFloatPathRoundedOnce) {
  check_batch_norm_16bit_forward<Eigen::bfloat16>();
}
TEST(Mixed, BatchNormHalfForwardKernelsAreTheFloatPathRoundedOnce) { check_batch_norm_16bit_forward<Eigen::half>(); }

// The 16-bit backward reads x and dy as stored: the thread's scratch
// arena holds a few float blocks, not copies of the input (here 10 MB of
// floats each, which the backward copied before).
TEST(Mixed, BatchNormBackwardMakesNoFloatCopies) {
  const Index N = 80, C = 32, S = 1024;  // 2.6M values
  const auto xs = to16<Eigen::bfloat16>(randn<float>(static_cast<std::size_t>(N * C * S), 43, 1.0, 2.0));
  for (const int axis : {1, -1}) {  // channels first, then channels last (the same values as N x 1024 x 32)
    Eigen::TensorMap<const Eigen::Tensor<Eigen::bfloat16, 3, Eigen::RowMajor>> x(xs.data(), N,
                                                                                  axis == 1 ? C : S, axis == 1 ? S : C);
    normcore::BatchNorm<Eigen::bfloat16> bn{normcore::BatchNormOptions(C).channel_axis(axis)};
    normcore::release_scratch();
    const auto g = bn.backward(x, x);
    EXPECT_LT(normcore::detail::scratch_arena().capacity, std::size_t(1) << 20) << "axis " << axis;
    EXPECT_EQ(g.dx.size(), N * C * S);
  }
  normcore::release_scratch();
}

// 16-bit BatchNorm with an empty dim: the forward with running statistics
// returns an empty output (as the float layer does), the training forward
// reports its error.
TEST(Mixed, BatchNormBFloat16EmptyInput) {
  normcore::BatchNorm<Eigen::bfloat16> bn{normcore::BatchNormOptions(3)};
  Eigen::Tensor<Eigen::bfloat16, 3, Eigen::RowMajor> x(2, 3, 0), y(2, 3, 0);
  Eigen::Tensor<Eigen::bfloat16, 3, Eigen::ColMajor> xc(0, 3, 5), yc(0, 3, 5);
  EXPECT_THROW(bn.forward(x, y), std::invalid_argument);
  bn.eval();
  bn.forward(x, y);
  bn.forward(xc, yc);
  normcore::NormStats<float> st;
  bn.forward(x, y, st);
  EXPECT_EQ(st.mean.size(), 3);
  // The backward of an empty input writes nothing and sums nothing (maps
  // with a data pointer, as a caller's buffers have: empty tensors of
  // their own have none).
  std::vector<Eigen::bfloat16> one(1);
  Eigen::TensorMap<const Eigen::Tensor<Eigen::bfloat16, 4, Eigen::RowMajor>> xm(one.data(), 2, 3, 0, 4);
  Eigen::TensorMap<Eigen::Tensor<Eigen::bfloat16, 4, Eigen::RowMajor>> dxm(one.data(), 2, 3, 0, 4);
  Eigen::TensorMap<const Eigen::Tensor<Eigen::bfloat16, 3, Eigen::ColMajor>> xcm(one.data(), 0, 3, 5);
  Eigen::TensorMap<Eigen::Tensor<Eigen::bfloat16, 3, Eigen::ColMajor>> dxcm(one.data(), 0, 3, 5);
  for (const bool training : {false, true}) {
    bn.train(training);
    Eigen::Tensor<Eigen::bfloat16, 1> dw, db;
    EXPECT_NO_THROW(bn.backward(xm, xm, &dxm, &dw, &db)) << "training " << training;
    EXPECT_NO_THROW(bn.backward(xcm, xcm, &dxcm, &dw, &db)) << "training " << training;
    for (Index c = 0; c < 3; ++c) EXPECT_EQ(static_cast<float>(db(c)), 0.0f);
  }
}

TEST(Fused, AddLayerNormEqualsAddThenNorm) {
  const Index rows = 50, n = 96;
  const auto xv = randn<float>(static_cast<std::size_t>(rows * n), 7);
  auto rv = randn<float>(xv.size(), 8, 1.0, 2.0);
  Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>> x(xv.data(), rows, n);
  Eigen::TensorMap<Eigen::Tensor<float, 2, Eigen::RowMajor>> res(rv.data(), rows, n);
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({n}));
  ln.weight().setRandom();
  normcore::RMSNorm<float> rn(normcore::RMSNormOptions({n}));
  // Unfused.
  Eigen::Tensor<float, 2, Eigen::RowMajor> h0 = x + res;
  Eigen::Tensor<float, 2, Eigen::RowMajor> y0 = ln(h0), z0 = rn(h0);
  normcore::NormStats<float> s0;
  Eigen::Tensor<float, 2, Eigen::RowMajor> tmp(rows, n);
  ln.forward(h0, tmp, s0);
  // Fused, into a separate h, then in place over the residual.
  Eigen::Tensor<float, 2, Eigen::RowMajor> h(rows, n), y(rows, n), z(rows, n);
  normcore::NormStats<float> s;
  ln.forward_add(x, res, h, y, &s);
  rn.forward_add(x, res, h, z);
  const auto N = static_cast<std::size_t>(rows * n);
  EXPECT_TRUE(bit_equal(h.data(), h0.data(), N));
  EXPECT_TRUE(bit_equal(y.data(), y0.data(), N));
  EXPECT_TRUE(bit_equal(z.data(), z0.data(), N));
  EXPECT_TRUE(bit_equal(s.rstd.data(), s0.rstd.data(), static_cast<std::size_t>(rows)));
  ln.forward_add(x, res, res, y);  // in place: res becomes h
  EXPECT_TRUE(bit_equal(rv.data(), h0.data(), N));
  EXPECT_TRUE(bit_equal(y.data(), y0.data(), N));
  // Backward: dx = LayerNorm'(h) dy + dh_next.
  const auto dyv = randn<float>(N, 9), dhv = randn<float>(N, 10);
  Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>> dy(dyv.data(), rows, n), dh(dhv.data(), rows, n);
  Eigen::Tensor<float, 2, Eigen::RowMajor> dx(rows, n), dx0(rows, n);
  Eigen::Tensor<float, 1> dw, db, dw0, db0;
  ln.backward_add(h0, dy, &dh, &dx, &dw, &db, &s0);
  ln.backward(h0, dy, &dx0, &dw0, &db0, &s0);
  for (Index i = 0; i < dx.size(); ++i) ASSERT_EQ(dx.data()[i], dx0.data()[i] + dhv[static_cast<std::size_t>(i)]);
  EXPECT_TRUE(bit_equal(dw.data(), dw0.data(), static_cast<std::size_t>(n)));
  // RMSNorm adds dh_next inside dx's last multiply-add on RowMajor rows:
  // rstd * t + dh rounded once where the build has FMA (else twice, as
  // above), so within half an ulp of rstd * t (and the sum's own rounding)
  // of the unfused result; its weight gradient is the same.
  Eigen::Tensor<float, 2, Eigen::RowMajor> dr(rows, n), dr0(rows, n);
  Eigen::Tensor<float, 1> rw, rw0;
  rn.backward_add(h0, dy, &dh, &dr, &rw);
  rn.backward(h0, dy, &dr0, &rw0);
  for (Index i = 0; i < dr.size(); ++i) {
    const double want = static_cast<double>(dr0.data()[i]) + dhv[static_cast<std::size_t>(i)];
    const double ulp = std::numeric_limits<float>::epsilon() * std::max(std::abs(want), 1e-30);
    ASSERT_NEAR(dr.data()[i], want, ulp + std::numeric_limits<float>::epsilon() * std::abs(dr0.data()[i])) << i;
  }
  EXPECT_TRUE(bit_equal(rw.data(), rw0.data(), static_cast<std::size_t>(n)));
}

// The 16-bit fused forward normalizes rows from h itself (no float buffer,
// where the build converts whole packets): h is x + residual rounded once, y and the statistics are the
// plain forward's on h, bit for bit, also with h over the residual and y
// over x.
template <typename S, typename Layer>
void check_fused16(Layer& layer, Index rows, Index n, float scale = 1.0f) {
  SCOPED_TRACE(::testing::Message() << rows << "x" << n << " scale " << scale);
  using M16 = Eigen::TensorMap<Eigen::Tensor<S, 2, Eigen::RowMajor>>;
  const std::size_t N = static_cast<std::size_t>(rows * n);
  auto xv = randn<float>(N, 51, 0.5, 1.0), rv = randn<float>(N, 52, 0.0, 3.0);
  for (std::size_t i = 0; i < N; ++i) {
    xv[i] *= scale;
    rv[i] *= scale;
  }
  const auto xs = to16<S>(xv);
  const auto rs = to16<S>(rv);
  for (int mode = 0; mode < 3; ++mode) {  // apart; h over residual; and y over x
    auto xw = xs, rw = rs;
    std::vector<S> hb(N), yb(N);
    M16 x(xw.data(), rows, n), r(rw.data(), rows, n);
    M16 h(mode ? rw.data() : hb.data(), rows, n), y(mode == 2 ? xw.data() : yb.data(), rows, n);
    normcore::NormStats<float> st, st0;
    layer.forward_add(x, r, h, y, &st);
    std::vector<S> hwant(N);
    for (std::size_t i = 0; i < N; ++i)
      hwant[i] = static_cast<S>(static_cast<float>(xs[i]) + static_cast<float>(rs[i]));
    Eigen::Tensor<S, 2, Eigen::RowMajor> y0(rows, n);
    M16 hm(hwant.data(), rows, n);
    layer.forward(hm, y0, st0);
    for (std::size_t i = 0; i < N; ++i) {
      ASSERT_EQ(static_cast<float>(h.data()[i]), static_cast<float>(hwant[i])) << "mode " << mode << " at " << i;
      ASSERT_EQ(static_cast<float>(y.data()[i]), static_cast<float>(y0.data()[i])) << "mode " << mode << " at " << i;
    }
    EXPECT_TRUE(bit_equal(st.rstd.data(), st0.rstd.data(), static_cast<std::size_t>(rows)));
    if (st0.mean.size()) {
      EXPECT_TRUE(bit_equal(st.mean.data(), st0.mean.data(), static_cast<std::size_t>(rows)));
    }
  }
}
template <typename S>
void check_fused16_layers() {
  for (Index n : {Index(5), Index(64), Index(300), Index(768), Index(1000)}) {
    normcore::LayerNorm<float> ln(normcore::LayerNormOptions({n}));
    ln.weight().setRandom();
    ln.bias().setRandom();
    normcore::RMSNorm<float> rn(normcore::RMSNormOptions({n}));
    rn.weight().setRandom();
    for (Index rows : {Index(1), Index(9)}) {
      check_fused16<S>(ln, rows, n);
      check_fused16<S>(rn, rows, n);
    }
  }
}
TEST(Fused, BFloat16RowsFromHItself) {
  check_fused16_layers<Eigen::bfloat16>();
  // 12 MB or more as float: one row per block.
  normcore::RMSNorm<float> rn(normcore::RMSNormOptions({1024}));
  rn.weight().setRandom();
  check_fused16<Eigen::bfloat16>(rn, 3200, 1024);
}
// Rows whose squares leave float's range (bfloat16 at 1e25 and 1e-25): the
// exact paths widen rows of h, short and long ones.
TEST(Fused, BFloat16RowsBeyondFloatSquaresFromHItself) {
  for (Index n : {Index(64), Index(300), Index(768)}) {
    normcore::LayerNorm<float> ln(normcore::LayerNormOptions({n}));
    ln.weight().setRandom();
    ln.bias().setRandom();
    normcore::RMSNorm<float> rn(normcore::RMSNormOptions({n}));
    rn.weight().setRandom();
    for (float scale : {1e25f, 1e-25f}) {
      check_fused16<Eigen::bfloat16>(ln, 9, n, scale);
      check_fused16<Eigen::bfloat16>(rn, 9, n, scale);
    }
  }
}
TEST(Fused, HalfRowsFromHItself) {
  check_fused16_layers<Eigen::half>();
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({1024}));
  ln.weight().setRandom();
  ln.bias().setRandom();
  check_fused16<Eigen::half>(ln, 3200, 1024);
}

TEST(Fused, BFloat16ResidualSumsInFloatAndRoundsOnce) {
  const Index rows = 9, n = 64;
  const auto xs = to16<Eigen::bfloat16>(randn<float>(static_cast<std::size_t>(rows * n), 11));
  const auto rs = to16<Eigen::bfloat16>(randn<float>(xs.size(), 12, 0.0, 4.0));
  Eigen::TensorMap<const Eigen::Tensor<Eigen::bfloat16, 2, Eigen::RowMajor>> x(xs.data(), rows, n), r(rs.data(), rows, n);
  normcore::RMSNorm<float> rn(normcore::RMSNormOptions({n}));
  Eigen::Tensor<Eigen::bfloat16, 2, Eigen::RowMajor> h(rows, n), y(rows, n);
  rn.forward_add(x, r, h, y);
  for (Index i = 0; i < h.size(); ++i) {
    const auto want = static_cast<Eigen::bfloat16>(static_cast<float>(xs[static_cast<std::size_t>(i)]) +
                                                   static_cast<float>(rs[static_cast<std::size_t>(i)]));
    ASSERT_EQ(static_cast<float>(h.data()[i]), static_cast<float>(want));
  }
  Eigen::Tensor<Eigen::bfloat16, 2, Eigen::RowMajor> y0 = rn(h);
  for (Index i = 0; i < y.size(); ++i) ASSERT_EQ(static_cast<float>(y.data()[i]), static_cast<float>(y0.data()[i]));
}

// ---------------------------------------------------------------- staging

template <typename S>
std::vector<float> widened(const std::vector<S>& v) {
  return to32(v);
}

// The 16-bit forwards' outputs (y: LayerNorm, z: RMSNorm) are the float
// forwards' (yf, zf) rounded once, and their statistics the same bits.
template <typename S>
void expect_forwards_rounded_once(const Eigen::Tensor<S, 2, Eigen::RowMajor>& y,
                                  const Eigen::Tensor<float, 2, Eigen::RowMajor>& yf,
                                  const normcore::NormStats<float>& s, const normcore::NormStats<float>& sf,
                                  const Eigen::Tensor<S, 2, Eigen::RowMajor>& z,
                                  const Eigen::Tensor<float, 2, Eigen::RowMajor>& zf,
                                  const normcore::NormStats<float>& t, const normcore::NormStats<float>& tf) {
  for (Index i = 0; i < y.size(); ++i) {
    ASSERT_EQ(static_cast<float>(y.data()[i]), static_cast<float>(static_cast<S>(yf.data()[i]))) << i;
    ASSERT_EQ(static_cast<float>(z.data()[i]), static_cast<float>(static_cast<S>(zf.data()[i]))) << i;
  }
  const std::size_t rows = static_cast<std::size_t>(y.dimension(0));
  EXPECT_TRUE(bit_equal(s.mean.data(), sf.mean.data(), rows));
  EXPECT_TRUE(bit_equal(s.rstd.data(), sf.rstd.data(), rows));
  EXPECT_TRUE(bit_equal(t.rstd.data(), tf.rstd.data(), rows));
}

// RowMajor 16-bit rows are read directly, each packet widened as it is
// loaded (where the build converts whole packets: short rows through the
// short-row kernels, long rows through the long-row ones), or widened a
// block at a time into float buffers (builds without packet conversions);
// either way the result must be the float path on the whole widened
// tensor, rounded once, bit for bit. Rows of 5 have no whole 256-bit
// packet; 300 is a short row for LayerNorm and a long one for RMSNorm. `scale` multiplies x: 1e25 and 1e-25 put the rows' squares
// outside float's range, so their statistics take the exact paths, which
// read the row again as float. With `one_row`, only row 3 (or the last row
// of shorter inputs) is scaled: a group of rows of which one leaves the
// group path, in the forwards and in the backwards' recomputation.
template <typename S>
void check_staged_equals_whole(float scale = 1.0f, bool one_row = false) {
  for (Index n : {Index(1), Index(5), Index(50), Index(64), Index(300), Index(768), Index(5000)}) {
    for (Index rows : {Index(1), Index(7), Index(130)}) {
      SCOPED_TRACE(::testing::Message() << rows << "x" << n << " scale " << scale << (one_row ? " (one row)" : ""));
      const std::size_t N = static_cast<std::size_t>(rows * n);
      auto xg = randn<float>(N, 21, 3.0, 2.0);
      const std::size_t scaled = static_cast<std::size_t>(std::min<Index>(3, rows - 1));
      for (std::size_t i = 0; i < N; ++i) {
        if (!one_row || i / static_cast<std::size_t>(n) == scaled) xg[i] *= scale;
      }
      const auto xs = to16<S>(xg);
      const auto dys = to16<S>(randn<float>(N, 22));
      const auto dhs = to16<S>(randn<float>(N, 23));
      const auto xw = to32(xs), dyw = to32(dys), dhw = to32(dhs);
      using M16 = Eigen::TensorMap<const Eigen::Tensor<S, 2, Eigen::RowMajor>>;
      using MF = Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>>;
      M16 x(xs.data(), rows, n), dy(dys.data(), rows, n), dh(dhs.data(), rows, n);
      MF xf(xw.data(), rows, n), dyf(dyw.data(), rows, n), dhf(dhw.data(), rows, n);
      normcore::LayerNorm<float> ln(normcore::LayerNormOptions({n}));
      ln.weight().setRandom();
      ln.bias().setRandom();
      normcore::RMSNorm<float> rn(normcore::RMSNormOptions({n}));
      rn.weight().setRandom();
      // Forward, statistics saved.
      Eigen::Tensor<S, 2, Eigen::RowMajor> y(rows, n), z(rows, n);
      Eigen::Tensor<float, 2, Eigen::RowMajor> yf(rows, n), zf(rows, n);
      normcore::NormStats<float> s, sf, t, tf;
      ln.forward(x, y, s);
      ln.forward(xf, yf, sf);
      rn.forward(x, z, t);
      rn.forward(xf, zf, tf);
      expect_forwards_rounded_once(y, yf, s, sf, z, zf, t, tf);
      // Backward (saved and recomputed statistics), plain and fused.
      for (bool use_saved : {true, false}) {
        Eigen::Tensor<S, 2, Eigen::RowMajor> dx(rows, n), dxa(rows, n), dr(rows, n), dra(rows, n);
        Eigen::Tensor<float, 2, Eigen::RowMajor> dxf(rows, n), drf(rows, n), draf(rows, n);
        Eigen::Tensor<float, 1> dw, db, dwf, dbf, rw, rwf;
        ln.backward(x, dy, &dx, &dw, &db, use_saved ? &s : nullptr);
        ln.backward(xf, dyf, &dxf, &dwf, &dbf, use_saved ? &sf : nullptr);
        ln.backward_add(x, dy, &dh, &dxa, nullptr, nullptr, use_saved ? &s : nullptr);
        rn.backward(x, dy, &dr, &rw, use_saved ? &t : nullptr);
        rn.backward(xf, dyf, &drf, &rwf, use_saved ? &tf : nullptr);
        rn.backward_add(x, dy, &dh, &dra, nullptr, use_saved ? &t : nullptr);
        rn.backward_add(xf, dyf, &dhf, &draf, nullptr, use_saved ? &tf : nullptr);
        for (std::size_t i = 0; i < N; ++i) {
          ASSERT_EQ(static_cast<float>(dx.data()[i]), static_cast<float>(static_cast<S>(dxf.data()[i]))) << i;
          ASSERT_EQ(static_cast<float>(dr.data()[i]), static_cast<float>(static_cast<S>(drf.data()[i]))) << i;
          // The residual gradient joins in float: one rounding, not two
          // (RMSNorm's inside its last multiply-add, so against its float
          // fused backward).
          ASSERT_EQ(static_cast<float>(dxa.data()[i]), static_cast<float>(static_cast<S>(dxf.data()[i] + dhw[i]))) << i;
          ASSERT_EQ(static_cast<float>(dra.data()[i]), static_cast<float>(static_cast<S>(draf.data()[i]))) << i;
        }
        // Parameter gradients: the same sums in the same order (flushed to
        // double every 64 rows however the rows were staged): bit-identical.
        EXPECT_TRUE(bit_equal(dw.data(), dwf.data(), static_cast<std::size_t>(n)));
        EXPECT_TRUE(bit_equal(db.data(), dbf.data(), static_cast<std::size_t>(n)));
        EXPECT_TRUE(bit_equal(rw.data(), rwf.data(), static_cast<std::size_t>(n)));
      }
    }
  }
}

TEST(Mixed, StagedBFloat16RowsEqualTheWholeTensorPath) { check_staged_equals_whole<Eigen::bfloat16>(); }
TEST(Mixed, StagedHalfRowsEqualTheWholeTensorPath) { check_staged_equals_whole<Eigen::half>(); }
// Inputs of at least kStreamingBytes as float (3075 x 1024 values) take
// their long 16-bit rows one at a time in the forward, and short rows (64)
// keep their groups; still the float path rounded once, and on two threads
// too.
template <typename S>
void check_large_rows_equal_float_path(Index n) {
  SCOPED_TRACE(::testing::Message() << "n=" << n);
  const Index rows = normcore::detail::kStreamingBytes / (n * static_cast<Index>(sizeof(float))) + 3;
  const std::size_t N = static_cast<std::size_t>(rows * n);
  ASSERT_GE(static_cast<Index>(N * sizeof(float)), normcore::detail::kStreamingBytes);
  const auto xs = to16<S>(randn<float>(N, 41, 1.0, 2.0));
  const auto xw = to32(xs);
  Eigen::TensorMap<const Eigen::Tensor<S, 2, Eigen::RowMajor>> x(xs.data(), rows, n);
  Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>> xf(xw.data(), rows, n);
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({n}));
  ln.weight().setRandom();
  ln.bias().setRandom();
  normcore::RMSNorm<float> rn(normcore::RMSNormOptions({n}));
  rn.weight().setRandom();
  Eigen::Tensor<float, 2, Eigen::RowMajor> yf(rows, n), zf(rows, n);
  normcore::NormStats<float> sf, tf;
  ln.forward(xf, yf, sf);
  rn.forward(xf, zf, tf);
  Eigen::ThreadPool pool(1);
  Eigen::ThreadPoolDevice dev(&pool, 2);
  for (int threads : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << threads << " thread(s)");
    Eigen::Tensor<S, 2, Eigen::RowMajor> y(rows, n), z(rows, n);
    normcore::NormStats<float> s, t;
    if (threads == 1) {
      ln.forward(x, y, s);
      rn.forward(x, z, t);
    } else {
      ln.forward(dev, x, y, s);
      rn.forward(dev, x, z, t);
    }
    expect_forwards_rounded_once(y, yf, s, sf, z, zf, t, tf);
  }
}
TEST(Mixed, LargeBFloat16RowsEqualTheFloatPath) {
  check_large_rows_equal_float_path<Eigen::bfloat16>(1024);
  check_large_rows_equal_float_path<Eigen::bfloat16>(64);
}
TEST(Mixed, LargeHalfRowsEqualTheFloatPath) {
  check_large_rows_equal_float_path<Eigen::half>(1024);
  check_large_rows_equal_float_path<Eigen::half>(64);
}

TEST(Mixed, BFloat16RowsBeyondFloatSquaresEqualTheWholeTensorPath) {
  check_staged_equals_whole<Eigen::bfloat16>(1e25f);
  check_staged_equals_whole<Eigen::bfloat16>(1e-25f);
}
TEST(Mixed, BFloat16GroupWithOneRowBeyondFloatSquaresEqualsTheWholeTensorPath) {
  check_staged_equals_whole<Eigen::bfloat16>(1e25f, true);
  check_staged_equals_whole<Eigen::bfloat16>(1e-25f, true);
}

TEST(Mixed, ColMajorHalfIsTheFloatPathRoundedOnce) {
  const Index rows = 13, n = 40;
  const std::size_t N = static_cast<std::size_t>(rows * n);
  const auto xs = to16<Eigen::half>(randn<float>(N, 31, -2.0, 3.0));
  const auto dys = to16<Eigen::half>(randn<float>(N, 32));
  const auto dhs = to16<Eigen::half>(randn<float>(N, 33));
  const auto xw = to32(xs), dyw = to32(dys), dhw = to32(dhs);
  Eigen::TensorMap<const Eigen::Tensor<Eigen::half, 2>> x(xs.data(), rows, n), dy(dys.data(), rows, n), dh(dhs.data(), rows, n);
  Eigen::TensorMap<const Eigen::Tensor<float, 2>> xf(xw.data(), rows, n), dyf(dyw.data(), rows, n);
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({n}));
  ln.weight().setRandom();
  Eigen::Tensor<Eigen::half, 2> y = ln(x), dx(rows, n);
  Eigen::Tensor<float, 2> yf = ln(xf), dxf(rows, n);
  ln.backward_add(x, dy, &dh, &dx, nullptr, nullptr);
  ln.backward(xf, dyf, &dxf, nullptr, nullptr);
  for (std::size_t i = 0; i < N; ++i) {
    ASSERT_EQ(static_cast<float>(y.data()[i]), static_cast<float>(static_cast<Eigen::half>(yf.data()[i])));
    ASSERT_EQ(static_cast<float>(dx.data()[i]), static_cast<float>(static_cast<Eigen::half>(dxf.data()[i] + dhw[i])));
  }
}

// detail::convert_n rounds float to 16 bits in packets where the build
// has packet casts, and the last n mod L values apart: each value must get
// the same bits wherever it falls, alone or in a packet. Subnormal floats
// (which AVX512-BF16's packet conversion takes as zero and the scalar one
// rounds) and NaNs of either sign (Eigen's other bfloat16 packet casts give
// them one sign) included.
template <typename S>
void check_conversion_tails_round_as_the_body() {
  std::vector<float> v = randn<float>(40, 71);
  const float sub = std::numeric_limits<float>::min();
  const float tail[] = {sub / 3, -sub / 5, sub * 0.75f, std::numeric_limits<float>::denorm_min(),
                        std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity(), -0.0f, 1e-39f, -3e-39f};
  v.insert(v.begin() + 5, std::begin(tail), std::end(tail));  // in the body
  v.insert(v.end(), std::begin(tail), std::end(tail));        // and in the tail
  const Index n = static_cast<Index>(v.size());
  std::vector<S> whole(v.size()), alone(v.size());
  normcore::detail::convert_n(v.data(), whole.data(), n);
  for (Index i = 0; i < n; ++i) normcore::detail::convert_n(v.data() + i, alone.data() + i, Index(1));
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::uint16_t a = 0, b = 0;
    std::memcpy(&a, &whole[i], 2);
    std::memcpy(&b, &alone[i], 2);
    EXPECT_EQ(a, b) << i << ": " << v[i];
  }
}
TEST(Mixed, BFloat16ConversionTailsRoundAsTheBody) { check_conversion_tails_round_as_the_body<Eigen::bfloat16>(); }
TEST(Mixed, HalfConversionTailsRoundAsTheBody) { check_conversion_tails_round_as_the_body<Eigen::half>(); }

// A 16-bit ColMajor forward widens blocks of rows into float
// (detail::colmajor_in_compute_type, blocks of detail::colmajor_stage_rows):
// every block, the last one short with leftover rows, must give the float
// layer's y on the widened input rounded once, and its statistics, bit for
// bit; so must 3 threads and an in-place call. 1500x64 and 300x1100 take
// several blocks (asserted; with AVX-512, 2 and 5), 16x768 one block of all
// the rows (converted whole). Row 7 holds values of 1e38 in bfloat16, whose
// rstd is not a normal float (RMSNorm's exact path); for half, 6e4. y is
// rounded as the library rounds whole tensors (detail::convert_n).
template <typename S, template <typename> class Layer, typename Options>
void check_colmajor_blocks_equal_float_path() {
  constexpr int CM = Eigen::ColMajor;
  ASSERT_LT(normcore::detail::colmajor_stage_rows<float>(64), Index(1500));
  ASSERT_LT(normcore::detail::colmajor_stage_rows<float>(1100), Index(300));
  for (const auto& [rows, n] : {std::pair<Index, Index>{1500, 64}, {300, 1100}, {16, 768}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << n);
    const std::size_t N = static_cast<std::size_t>(rows * n);
    auto xs = to16<S>(randn<float>(N, 51, 0.5, 2.0));
    for (Index j = 0; j < n; ++j) xs[static_cast<std::size_t>(j * rows + 7)] = static_cast<S>(std::is_same<S, Eigen::half>::value ? 6e4f : 1e38f);
    const auto xw = to32(xs);
    Eigen::TensorMap<const Eigen::Tensor<S, 2, CM>> x(xs.data(), rows, n);
    Eigen::TensorMap<const Eigen::Tensor<float, 2, CM>> xf(xw.data(), rows, n);
    Layer<S> l16(Options({n}));
    Layer<float> l32(Options({n}));
    const auto w = randn<float>(static_cast<std::size_t>(n), 52, 1.0, 0.3);
    for (Index j = 0; j < n; ++j) {
      l16.weight()(j) = static_cast<S>(w[static_cast<std::size_t>(j)]);
      l32.weight()(j) = static_cast<float>(l16.weight()(j));
    }
    normcore::NormStats<float> s16, s32, st;
    Eigen::Tensor<S, 2, CM> y16(rows, n), yt(rows, n), io(rows, n);
    Eigen::Tensor<float, 2, CM> y32(rows, n);
    l16.forward(x, y16, s16);
    l32.forward(xf, y32, s32);
    Eigen::ThreadPool pool(3);
    Eigen::ThreadPoolDevice dev(&pool, 3);
    l16.forward(dev, x, yt, st);
    std::copy(xs.begin(), xs.end(), io.data());
    l16.forward(io, io);
    std::vector<S> rounded(N);
    normcore::detail::convert_n(y32.data(), rounded.data(), rows * n);
    for (std::size_t i = 0; i < N; ++i) {
      const float want = static_cast<float>(rounded[i]);
      ASSERT_EQ(static_cast<float>(y16.data()[i]), want) << i;
      ASSERT_EQ(static_cast<float>(yt.data()[i]), want) << i;
      ASSERT_EQ(static_cast<float>(io.data()[i]), want) << i;
    }
    EXPECT_TRUE(bit_equal(s16.rstd.data(), s32.rstd.data(), static_cast<std::size_t>(rows)));
    EXPECT_TRUE(bit_equal(st.rstd.data(), s32.rstd.data(), static_cast<std::size_t>(rows)));
    ASSERT_EQ(s16.mean.size(), s32.mean.size());
    EXPECT_TRUE(bit_equal(s16.mean.data(), s32.mean.data(), static_cast<std::size_t>(s32.mean.size())));
    EXPECT_TRUE(bit_equal(st.mean.data(), s32.mean.data(), static_cast<std::size_t>(s32.mean.size())));
  }
}
TEST(Mixed, ColMajorBFloat16LayerNormBlocksEqualTheFloatPath) {
  check_colmajor_blocks_equal_float_path<Eigen::bfloat16, normcore::LayerNorm, normcore::LayerNormOptions>();
}
TEST(Mixed, ColMajorHalfRMSNormBlocksEqualTheFloatPath) {
  check_colmajor_blocks_equal_float_path<Eigen::half, normcore::RMSNorm, normcore::RMSNormOptions>();
}
TEST(Mixed, ColMajorBFloat16RMSNormBlocksEqualTheFloatPath) {
  check_colmajor_blocks_equal_float_path<Eigen::bfloat16, normcore::RMSNorm, normcore::RMSNormOptions>();
}

// The 16-bit ColMajor backward widens blocks of rows into float too
// (detail::colmajor_backward_in_compute_type), on whole blocks of its row
// groups' alignment, so its dx, dweight and dbias must be the float layer's
// on the widened x, dy and dh_next, rounded once, bit for bit: with saved
// and recomputed statistics, the fused residual, dx over dy, and 3 threads.
// A float layer fed the 16-bit tensors (the same path) must give the float
// layer's dweight and dbias themselves, bit for bit. Rows 7, 1000 and 2000
// of bfloat16 inputs (1e38) take RMSNorm's exact path (at 3000x64 row 2000
// in a block after the first, row 1000 in a row group that spans two
// blocks, with AVX-512 and AVX2 alike), whose dweight terms come after all
// of its part's blocks, as in the float path.
template <typename S, typename D, typename X, typename DY, typename DX, typename W>
void backward_of(const normcore::LayerNorm<S>& l, const D& dev, const X& x, const DY& dy, const DY* dh, DX* dx, W* dw,
                 W* db, const normcore::NormStats<float>* st) {
  if (dh) {
    l.backward_add(dev, x, dy, dh, dx, dw, db, st);
  } else {
    l.backward(dev, x, dy, dx, dw, db, st);
  }
}
template <typename S, typename D, typename X, typename DY, typename DX, typename W>
void backward_of(const normcore::RMSNorm<S>& l, const D& dev, const X& x, const DY& dy, const DY* dh, DX* dx, W* dw,
                 W* db, const normcore::NormStats<float>* st) {
  if (db) db->setZero();  // (no bias)
  if (dh) {
    l.backward_add(dev, x, dy, dh, dx, dw, st);
  } else {
    l.backward(dev, x, dy, dx, dw, st);
  }
}
template <typename S, template <typename> class Layer, typename Options>
void check_colmajor_backward_blocks_equal_float_path() {
  constexpr int CM = Eigen::ColMajor;
  for (const auto& [rows, n] : {std::pair<Index, Index>{3000, 64}, {300, 1100}, {16, 768}}) {
    const std::size_t N = static_cast<std::size_t>(rows * n);
    auto xs = to16<S>(randn<float>(N, 61, 0.5, 2.0));
    if (std::is_same<S, Eigen::bfloat16>::value)
      for (Index r : {Index(7), Index(1000), Index(2000)})
        for (Index j = 0; r < rows && j < n; ++j) xs[static_cast<std::size_t>(j * rows + r)] = static_cast<S>(1e38f);
    const auto dys = to16<S>(randn<float>(N, 62));
    const auto dhs = to16<S>(randn<float>(N, 63));
    const auto xw = to32(xs), dyw = to32(dys), dhw = to32(dhs);
    Eigen::TensorMap<const Eigen::Tensor<S, 2, CM>> x(xs.data(), rows, n), dy(dys.data(), rows, n),
        dh(dhs.data(), rows, n);
    Eigen::TensorMap<const Eigen::Tensor<float, 2, CM>> xf(xw.data(), rows, n), dyf(dyw.data(), rows, n),
        dhf(dhw.data(), rows, n);
    Layer<S> l16(Options({n}));
    Layer<float> l32(Options({n}));
    const auto w = randn<float>(static_cast<std::size_t>(n), 64, 1.0, 0.3);
    for (Index j = 0; j < n; ++j) {
      l16.weight()(j) = static_cast<S>(w[static_cast<std::size_t>(j)]);
      l32.weight()(j) = static_cast<float>(l16.weight()(j));
    }
    normcore::NormStats<float> s16, s32;
    Eigen::Tensor<S, 2, CM> y16(rows, n);
    Eigen::Tensor<float, 2, CM> y32(rows, n);
    l16.forward(x, y16, s16);
    l32.forward(xf, y32, s32);
    Eigen::ThreadPool pool(3);
    Eigen::ThreadPoolDevice three(&pool, 3);
    for (int threads : {1, 3})
      for (bool saved : {true, false})
        for (bool fused : {false, true})
          for (bool over_dy : {false, true}) {
            SCOPED_TRACE(::testing::Message() << rows << "x" << n << " threads " << threads << " saved " << saved
                                              << " fused " << fused << " dx over dy " << over_dy);
            Eigen::Tensor<S, 2, CM> dx16(rows, n), g(rows, n);
            std::copy(dys.begin(), dys.end(), g.data());
            Eigen::Tensor<float, 2, CM> dx32(rows, n);
            Eigen::Tensor<S, 1> dw16(n), db16(n);
            Eigen::Tensor<float, 1> dw32(n), db32(n);
            Eigen::TensorMap<const Eigen::Tensor<S, 2, CM>> gin(g.data(), rows, n);
            Eigen::Tensor<S, 2, CM>* out = over_dy ? &g : &dx16;
            Eigen::Tensor<S, 2, CM> dxm(rows, n);
            Eigen::Tensor<float, 1> dwm(n), dbm(n);
            if (threads == 3) {
              backward_of(l16, three, x, over_dy ? gin : dy, fused ? &dh : nullptr, out, &dw16, &db16,
                          saved ? &s16 : nullptr);
              backward_of(l32, three, x, dy, fused ? &dh : nullptr, &dxm, &dwm, &dbm, saved ? &s16 : nullptr);
            } else {
              backward_of(l16, normcore::Serial(), x, over_dy ? gin : dy, fused ? &dh : nullptr, out, &dw16,
                          &db16, saved ? &s16 : nullptr);
              backward_of(l32, normcore::Serial(), x, dy, fused ? &dh : nullptr, &dxm, &dwm, &dbm,
                          saved ? &s16 : nullptr);
            }
            backward_of(l32, normcore::Serial(), xf, dyf, fused ? &dhf : nullptr, &dx32, &dw32, &db32,
                        saved ? &s32 : nullptr);
            // dx rounded as the library rounds whole tensors (AVX512-BF16's
            // conversion takes subnormal floats, as row 7's dx, as zero).
            std::vector<S> want(N);
            normcore::detail::convert_n(dx32.data(), want.data(), rows * n);
            for (std::size_t i = 0; i < N; ++i) {
              ASSERT_EQ(static_cast<float>(out->data()[i]), static_cast<float>(want[i])) << i;
              ASSERT_EQ(static_cast<float>(dxm.data()[i]), static_cast<float>(want[i])) << i;
            }
            EXPECT_TRUE(bit_equal(dwm.data(), dw32.data(), static_cast<std::size_t>(n)));
            EXPECT_TRUE(bit_equal(dbm.data(), db32.data(), static_cast<std::size_t>(n)));
            for (Index j = 0; j < n; ++j) {
              ASSERT_EQ(static_cast<float>(dw16(j)), static_cast<float>(static_cast<S>(dw32(j)))) << j;
              ASSERT_EQ(static_cast<float>(db16(j)), static_cast<float>(static_cast<S>(db32(j)))) << j;
            }
          }
  }
}
TEST(Mixed, ColMajorBFloat16LayerNormBackwardBlocksEqualTheFloatPath) {
  check_colmajor_backward_blocks_equal_float_path<Eigen::bfloat16, normcore::LayerNorm, normcore::LayerNormOptions>();
}
TEST(Mixed, ColMajorHalfRMSNormBackwardBlocksEqualTheFloatPath) {
  check_colmajor_backward_blocks_equal_float_path<Eigen::half, normcore::RMSNorm, normcore::RMSNormOptions>();
}
TEST(Mixed, ColMajorBFloat16RMSNormBackwardBlocksEqualTheFloatPath) {
  check_colmajor_backward_blocks_equal_float_path<Eigen::bfloat16, normcore::RMSNorm, normcore::RMSNormOptions>();
}

// ------------------------------------------------------ 16-bit parameters

// A LayerNorm<bfloat16> is a float layer whose weights are the bf16 values:
// same outputs, statistics in float, parameter gradients rounded once to bf16.
TEST(Mixed, SixteenBitLayersAreFloatLayersWithRoundedWeights) {
  using BF = Eigen::bfloat16;
  const Index rows = 33, n = 80;
  const std::size_t N = static_cast<std::size_t>(rows * n);
  const auto xs = to16<BF>(randn<float>(N, 41, 1.0, 2.0));
  const auto dys = to16<BF>(randn<float>(N, 42));
  Eigen::TensorMap<const Eigen::Tensor<BF, 2, Eigen::RowMajor>> x(xs.data(), rows, n), dy(dys.data(), rows, n);
  normcore::LayerNorm<BF> l16(normcore::LayerNormOptions({n}));
  normcore::LayerNorm<float> l32(normcore::LayerNormOptions({n}));
  static_assert(std::is_same<normcore::LayerNorm<BF>::Compute, float>::value, "16-bit layers compute in float");
  const auto w = randn<float>(static_cast<std::size_t>(n), 43, 1.0, 0.3);
  const auto b = randn<float>(static_cast<std::size_t>(n), 44);
  for (Index j = 0; j < n; ++j) {
    l16.weight()(j) = static_cast<BF>(w[static_cast<std::size_t>(j)]);
    l16.bias()(j) = static_cast<BF>(b[static_cast<std::size_t>(j)]);
    l32.weight()(j) = static_cast<float>(l16.weight()(j));
    l32.bias()(j) = static_cast<float>(l16.bias()(j));
  }
  normcore::NormStats<float> s16, s32;
  Eigen::Tensor<BF, 2, Eigen::RowMajor> y16(rows, n), y32(rows, n);
  l16.forward(x, y16, s16);
  l32.forward(x, y32, s32);
  for (std::size_t i = 0; i < N; ++i) ASSERT_EQ(static_cast<float>(y16.data()[i]), static_cast<float>(y32.data()[i]));
  EXPECT_TRUE(bit_equal(s16.rstd.data(), s32.rstd.data(), static_cast<std::size_t>(rows)));
  // Float tensors through the bf16 layer too.
  const auto xw = to32(xs);
  Eigen::TensorMap<const Eigen::Tensor<float, 2, Eigen::RowMajor>> xf(xw.data(), rows, n);
  Eigen::Tensor<float, 2, Eigen::RowMajor> f16 = l16(xf), f32 = l32(xf);
  EXPECT_TRUE(bit_equal(f16.data(), f32.data(), N));
  // Allocating backward: dx in the input's type, dweight/dbias in bf16.
  const auto g16 = l16.backward(x, dy, &s16);
  const auto g32 = l32.backward(x, dy, &s32);
  static_assert(std::is_same<decltype(g16.dx)::Scalar, BF>::value, "dx in the input's type");
  static_assert(std::is_same<decltype(g16.dweight)::Scalar, BF>::value, "dweight in the layer's type");
  static_assert(std::is_same<decltype(g32.dweight)::Scalar, float>::value, "dweight in the layer's type");
  for (std::size_t i = 0; i < N; ++i) ASSERT_EQ(static_cast<float>(g16.dx.data()[i]), static_cast<float>(g32.dx.data()[i]));
  for (Index j = 0; j < n; ++j) {
    ASSERT_EQ(static_cast<float>(g16.dweight(j)), static_cast<float>(static_cast<BF>(g32.dweight(j))));
    ASSERT_EQ(static_cast<float>(g16.dbias(j)), static_cast<float>(static_cast<BF>(g32.dbias(j))));
  }
  // RMSNorm<half> and BatchNorm<bfloat16> the same way.
  normcore::RMSNorm<Eigen::half> r16(normcore::RMSNormOptions({n}));
  normcore::RMSNorm<float> r32(normcore::RMSNormOptions({n}));
  EXPECT_EQ(r16.eps(), r32.eps());  // float's epsilon, as PyTorch's opmath type
  for (Index j = 0; j < n; ++j) {
    r16.weight()(j) = static_cast<Eigen::half>(w[static_cast<std::size_t>(j)]);
    r32.weight()(j) = static_cast<float>(r16.weight()(j));
  }
  const auto hs = to16<Eigen::half>(xw);
  Eigen::TensorMap<const Eigen::Tensor<Eigen::half, 2, Eigen::RowMajor>> xh(hs.data(), rows, n);
  Eigen::Tensor<Eigen::half, 2, Eigen::RowMajor> z16 = r16(xh), z32 = r32(xh);
  for (std::size_t i = 0; i < N; ++i) ASSERT_EQ(static_cast<float>(z16.data()[i]), static_cast<float>(z32.data()[i]));
  Eigen::Tensor<Eigen::half, 1> rw16;
  Eigen::Tensor<float, 1> rw32;
  r16.backward(xh, xh, nullptr, &rw16);
  r32.backward(xh, xh, nullptr, &rw32);
  for (Index j = 0; j < n; ++j)
    ASSERT_EQ(static_cast<float>(rw16(j)), static_cast<float>(static_cast<Eigen::half>(rw32(j))));
  const Index C = 8;
  normcore::BatchNorm<BF> b16{normcore::BatchNormOptions(C)};
  normcore::BatchNorm<float> b32{normcore::BatchNormOptions(C)};
  for (Index c = 0; c < C; ++c) {
    b16.weight()(c) = static_cast<BF>(w[static_cast<std::size_t>(c)]);
    b32.weight()(c) = static_cast<float>(b16.weight()(c));
  }
  Eigen::TensorMap<const Eigen::Tensor<BF, 3, Eigen::RowMajor>> xb(xs.data(), 10, C, 33);
  Eigen::Tensor<BF, 3, Eigen::RowMajor> yb16 = b16(xb), yb32 = b32(xb);
  for (Index i = 0; i < yb16.size(); ++i) ASSERT_EQ(static_cast<float>(yb16.data()[i]), static_cast<float>(yb32.data()[i]));
  static_assert(std::is_same<std::remove_reference_t<decltype(b16.running_var())>::Scalar, float>::value,
                "running statistics stay in float");
  EXPECT_TRUE(bit_equal(b16.running_var().data(), b32.running_var().data(), static_cast<std::size_t>(C)));
  const auto gb16 = b16.backward(xb, xb);
  const auto gb32 = b32.backward(xb, xb);
  for (Index c = 0; c < C; ++c)
    ASSERT_EQ(static_cast<float>(gb16.dweight(c)), static_cast<float>(static_cast<BF>(gb32.dweight(c))));
}

// BatchNorm with 16-bit storage against the double reference rounded once,
// standard-normal and large-mean channels.
TEST(Mixed, BatchNormAgreesWithTheRoundedReference) {
  const Index N = 16, C = 6, HW = 64;
  for (double mean : {0.0, 30.0}) {
    const auto xs = to16<Eigen::bfloat16>(randn<float>(static_cast<std::size_t>(N * C * HW), 51, mean, 1.0));
    const auto xw = to32(xs);
    Eigen::TensorMap<const Eigen::Tensor<Eigen::bfloat16, 3, Eigen::RowMajor>> x(xs.data(), N, C, HW);
    normcore::BatchNorm<float> bn{normcore::BatchNormOptions(C)};
    Eigen::Tensor<Eigen::bfloat16, 3, Eigen::RowMajor> y = bn(x);
    const auto st = normcore::reference::channel_stats(xw.data(), N, C, HW);
    const auto ref = normcore::reference::batch_norm_forward(xw.data(), N, C, HW, st.mean, st.var,
                                                             (const float*)nullptr, (const float*)nullptr, 1e-5);
    const auto a = agreement(y.data(), ref);
    std::printf("  bfloat16 mean %g: BatchNorm %.4f%% equal to the rounded reference\n", mean, 100 * a.equal_share);
    EXPECT_GE(a.equal_share, 0.999);
    EXPECT_LE(a.worst_ulps, 1.0);
  }
}

TEST(Fused, ThreadsGiveTheSerialResult) {
  // 300 rows: split across the threads; 3 rows: fewer values than one
  // thread's share, so the device call takes the calling thread's path.
  for (const Index rows : {Index(300), Index(3)}) {
    SCOPED_TRACE(::testing::Message() << rows << " rows");
    const Index n = 256;
    const std::size_t N = static_cast<std::size_t>(rows * n);
    const auto xs = to16<Eigen::bfloat16>(randn<float>(N, 61));
    const auto rs = to16<Eigen::bfloat16>(randn<float>(N, 62, 0.5, 3.0));
    Eigen::TensorMap<const Eigen::Tensor<Eigen::bfloat16, 2, Eigen::RowMajor>> x(xs.data(), rows, n),
        r(rs.data(), rows, n);
    normcore::LayerNorm<float> ln(normcore::LayerNormOptions({n}));
    Eigen::ThreadPool pool(3);
    Eigen::ThreadPoolDevice dev(&pool, 3);
    Eigen::Tensor<Eigen::bfloat16, 2, Eigen::RowMajor> h1(rows, n), y1(rows, n), h3(rows, n), y3(rows, n);
    normcore::NormStats<float> s1, s3;
    ln.forward_add(x, r, h1, y1, &s1);
    ln.forward_add(dev, x, r, h3, y3, &s3);
    EXPECT_TRUE(bit_equal(h1.data(), h3.data(), N));
    EXPECT_TRUE(bit_equal(y1.data(), y3.data(), N));
    EXPECT_TRUE(bit_equal(s1.mean.data(), s3.mean.data(), static_cast<std::size_t>(rows)));
    Eigen::Tensor<Eigen::bfloat16, 2, Eigen::RowMajor> d1(rows, n), d3(rows, n);
    Eigen::Tensor<float, 1> w1, w3, b1, b3;
    ln.backward_add(h1, y1, &x, &d1, &w1, &b1, &s1);
    ln.backward_add(dev, h1, y1, &x, &d3, &w3, &b3, &s1);
    EXPECT_TRUE(bit_equal(d1.data(), d3.data(), N));
    EXPECT_TRUE(bit_equal(w1.data(), w3.data(), static_cast<std::size_t>(n)));
    EXPECT_TRUE(bit_equal(b1.data(), b3.data(), static_cast<std::size_t>(n)));
  }
}

TEST(Fused, BackwardAddNeedsDx) {
  normcore::LayerNorm<float> ln(normcore::LayerNormOptions({4}));
  Eigen::Tensor<float, 2, Eigen::RowMajor> h(2, 4), dy(2, 4);
  h.setRandom();
  dy.setRandom();
  Eigen::Tensor<float, 2, Eigen::RowMajor>* none = nullptr;
  EXPECT_THROW(ln.backward_add(h, dy, &dy, none, nullptr, nullptr), std::invalid_argument);
  Eigen::Tensor<float, 2, Eigen::RowMajor> bad(2, 5), dx(2, 4);
  EXPECT_THROW(ln.backward_add(h, dy, &bad, &dx, nullptr, nullptr), std::invalid_argument);
}

}  // namespace

namespace {

// forward_add on an input of normcore::detail::kStreamingBytes or more, with
// rows long enough for the row-at-a-time path (mixed.hpp, fused_add_norm):
// h and y must be the bits of h0 = x + r and of the plain forward on h0
// (itself checked against calls below the threshold in test_layer_norm and
// test_rms_norm), with the statistics, whichever stores each output takes:
// streaming (separate aligned tensors), ordinary (an output one element off
// alignment, or h over the residual) or the blocks (h over r and y over x).
// Rows of 1024 values are whole packets on every ISA; rows of 1000 are whole
// packets except for floats with AVX-512, which then take the blocks.
template <typename T, typename Layer>
void check_large_fused(Layer& layer, Index n, bool with_mean) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << (with_mean ? " LayerNorm" : " RMSNorm"));
  using Map = Eigen::TensorMap<Eigen::Tensor<T, 2, Eigen::RowMajor>>;
  using CMap = Eigen::TensorMap<const Eigen::Tensor<T, 2, Eigen::RowMajor>>;
  const Index rows = normcore::detail::kStreamingBytes / (n * static_cast<Index>(sizeof(T))) + 3;
  const auto N = static_cast<std::size_t>(rows * n);
  const auto xv = randn<T>(N, 81, 0.5, 2.0);
  const auto rv = randn<T>(N, 82, -1.0, 3.0);
  CMap x(xv.data(), rows, n), r(rv.data(), rows, n);
  Eigen::Tensor<T, 2, Eigen::RowMajor> h0 = x + r;
  Eigen::Tensor<T, 2, Eigen::RowMajor> y0(rows, n);
  normcore::NormStats<T> s0;
  layer.forward(h0, y0, s0);
  const auto check = [&](const char* what, const T* h, const T* y, const normcore::NormStats<T>& s) {
    SCOPED_TRACE(what);
    EXPECT_TRUE(bit_equal(h, h0.data(), N));
    EXPECT_TRUE(bit_equal(y, y0.data(), N));
    EXPECT_TRUE(bit_equal(s.rstd.data(), s0.rstd.data(), static_cast<std::size_t>(rows)));
    if (with_mean) {
      EXPECT_TRUE(bit_equal(s.mean.data(), s0.mean.data(), static_cast<std::size_t>(rows)));
    }
  };
  // Two buffers with room for an output one element off alignment.
  std::vector<T, Eigen::aligned_allocator<T>> hb(N + 1), yb(N + 1);
  normcore::NormStats<T> s;
  for (int h_off = 0; h_off < 2; ++h_off) {
    for (int y_off = 0; y_off < 2; ++y_off) {
      Map h(hb.data() + h_off, rows, n), y(yb.data() + y_off, rows, n);
      layer.forward_add(x, r, h, y, &s);
      check(h_off ? (y_off ? "both off alignment" : "h off alignment") : (y_off ? "y off alignment" : "aligned"),
            h.data(), y.data(), s);
    }
  }
  Eigen::ThreadPool pool(2);
  Eigen::ThreadPoolDevice dev(&pool, 2);
  Map h(hb.data(), rows, n), y(yb.data(), rows, n);
  layer.forward_add(dev, x, r, h, y, &s);
  check("2 threads", h.data(), y.data(), s);
  // h over the residual (h's stores ordinary, y's streaming), then y over x
  // as well (the blocks).
  auto rw = rv;
  Map rm(rw.data(), rows, n);
  layer.forward_add(x, rm, rm, y, &s);
  check("h over r", rw.data(), y.data(), s);
  auto xw = xv;
  rw = rv;
  Map xm(xw.data(), rows, n);
  rm = Map(rw.data(), rows, n);
  layer.forward_add(xm, rm, rm, xm, &s);
  check("h over r, y over x", rw.data(), xw.data(), s);
}

template <typename T>
class FusedLarge : public ::testing::Test {};
using FusedTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(FusedLarge, FusedTypes, );

TYPED_TEST(FusedLarge, StreamingInputsGiveTheBitsOfAddThenNorm) {
  using T = TypeParam;
  for (const Index n : {Index(1024), Index(1000)}) {
    normcore::LayerNorm<T> ln(normcore::LayerNormOptions({n}));
    const auto gv = randn<T>(static_cast<std::size_t>(n), 83, 1.0, 0.5);
    const auto bv = randn<T>(static_cast<std::size_t>(n), 84, 0.0, 0.5);
    std::copy(gv.begin(), gv.end(), ln.weight().data());
    std::copy(bv.begin(), bv.end(), ln.bias().data());
    check_large_fused<T>(ln, n, true);
    normcore::RMSNorm<T> rn(normcore::RMSNormOptions({n}));
    std::copy(gv.begin(), gv.end(), rn.weight().data());
    check_large_fused<T>(rn, n, false);
  }
}

}  // namespace
