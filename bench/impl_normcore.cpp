// The in-tree implementations: normcore itself, normcore's reference path
// (plain double loops), and the Eigen Tensor expression a user would write by
// hand for each operation.

// The Eigen baseline runs on a ThreadPoolDevice when the suite uses more than
// one thread. (Only this file includes Eigen's Tensor module.)
#define EIGEN_USE_THREADS
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <normcore/normcore.hpp>
#include <normcore/reference/reference.hpp>

#if __has_include(<normcore/rms_norm.hpp>)
#include <normcore/rms_norm.hpp>
#define NBENCH_HAVE_RMS 1
#else
#define NBENCH_HAVE_RMS 0
#endif
#if __has_include(<normcore/batch_norm.hpp>)
#include <normcore/batch_norm.hpp>
#define NBENCH_HAVE_BN 1
#else
#define NBENCH_HAVE_BN 0
#endif
#if __has_include(<normcore/reference/rms_norm.hpp>)
#include <normcore/reference/rms_norm.hpp>
#define NBENCH_HAVE_RMS_REF 1
#else
#define NBENCH_HAVE_RMS_REF 0
#endif
#if __has_include(<normcore/reference/batch_norm.hpp>)
#include <normcore/reference/batch_norm.hpp>
#define NBENCH_HAVE_BN_REF 1
#else
#define NBENCH_HAVE_BN_REF 0
#endif

#include <unsupported/Eigen/CXX11/Tensor>

#include "bench_common.hpp"

namespace nbench {
namespace {

using Idx = Eigen::Index;
template <int R>
using CMap = Eigen::TensorMap<Eigen::Tensor<const float, R, Eigen::RowMajor>>;
template <int R>
using Map = Eigen::TensorMap<Eigen::Tensor<float, R, Eigen::RowMajor>>;
using Vec = Eigen::Tensor<float, 1, Eigen::RowMajor>;

bool is_row_op(Op op) {
  return op == Op::LN_fwd || op == Op::LN_fwd_stats || op == Op::LN_bwd || op == Op::RMS_fwd ||
         op == Op::RMS_bwd;
}
bool is_rms(Op op) { return op == Op::RMS_fwd || op == Op::RMS_bwd; }

void to_vec(const float* p, Idx n, Vec& v) {
  v.resize(n);
  for (Idx i = 0; i < n; ++i) v(i) = p[i];
}
std::vector<float> from_tensor(const Eigen::Tensor<float, 1>& t) {
  return std::vector<float>(t.data(), t.data() + t.size());
}

// ---------------------------------------------------------------- normcore

// normcore runs on a ThreadPoolDevice of the suite's thread count N when
// that is more than one (normcore::Serial, the calling thread, otherwise).
// normcore's calling thread takes a share of the work, as OpenMP's master
// thread does in the peers, so N threads in all are a pool of N - 1 and the
// caller (see README, Threads). The Eigen baseline has its own pool of N:
// Eigen's executor leaves the calling thread waiting.
const Eigen::ThreadPoolDevice* nc_device() {
  static std::unique_ptr<Eigen::ThreadPool> pool;
  static std::unique_ptr<Eigen::ThreadPoolDevice> dev;
  if (threads() <= 1) return nullptr;
  if (!dev || dev->numThreads() != threads()) {
    dev.reset();
    pool = std::make_unique<Eigen::ThreadPool>(threads() - 1);
    dev = std::make_unique<Eigen::ThreadPoolDevice>(pool.get(), threads());
  }
  return dev.get();
}
// serial: the calling thread whatever the suite's thread count (the
// normcore_1thread implementation below).
template <typename F>
void on_device(bool serial, F&& f) {
  const auto* d = serial ? nullptr : nc_device();
  if (d) {
    f(*d);
  } else {
    f(normcore::Serial());
  }
}

class NcLayerNorm : public Runner {
 public:
  NcLayerNorm(const Case& c, const Inputs& in, bool serial = false)
      : c_(c), in_(in), serial_(serial), ln_(normcore::LayerNormOptions({c.hidden()}).eps(kLnEps)),
        out_(static_cast<std::size_t>(c.elements())) {
    for (Idx j = 0; j < c.hidden(); ++j) {
      ln_.weight()(j) = in.gamma[j];
      ln_.bias()(j) = in.beta[j];
    }
    if (c.op == Op::LN_bwd) {  // statistics from an untimed forward
      std::vector<float> y(out_.size());
      Map<2> ym(y.data(), c.rows(), c.hidden());
      ln_.forward(x(), ym, stats_);
    }
  }
  void run() override {
    Map<2> o(out_.data(), c_.rows(), c_.hidden());
    switch (c_.op) {
      case Op::LN_fwd: on_device(serial_, [&](const auto& d) { ln_.forward(d, x(), o); }); break;
      case Op::LN_fwd_stats: on_device(serial_, [&](const auto& d) { ln_.forward(d, x(), o, stats_); }); break;
      default: {
        CMap<2> dy(in_.dy, c_.rows(), c_.hidden());
        on_device(serial_, [&](const auto& d) { ln_.backward(d, x(), dy, &o, &dw_, &db_, &stats_); });
      }
    }
  }
  void collect(Result& r) override {
    r.out.assign(out_.begin(), out_.end());
    if (c_.op == Op::LN_bwd) {
      r.dweight = from_tensor(dw_);
      r.dbias = from_tensor(db_);
    } else if (c_.op == Op::LN_fwd_stats) {
      r.mean = from_tensor(stats_.mean);
      r.rstd = from_tensor(stats_.rstd);
    }
  }

 private:
  CMap<2> x() const { return CMap<2>(in_.x, c_.rows(), c_.hidden()); }
  Case c_;
  Inputs in_;
  bool serial_;
  normcore::LayerNorm<float> ln_;
  normcore::NormStats<float> stats_;
  Eigen::Tensor<float, 1> dw_, db_;
  Buffer out_;
};

#if NBENCH_HAVE_RMS
class NcRmsNorm : public Runner {
 public:
  NcRmsNorm(const Case& c, const Inputs& in, bool serial = false)
      : c_(c), in_(in), serial_(serial), rn_(normcore::RMSNormOptions({c.hidden()}).eps(kRmsEps)),
        out_(static_cast<std::size_t>(c.elements())) {
    for (Idx j = 0; j < c.hidden(); ++j) rn_.weight()(j) = in.gamma[j];
    if (c.op == Op::RMS_bwd) {
      std::vector<float> y(out_.size());
      Map<2> ym(y.data(), c.rows(), c.hidden());
      rn_.forward(x(), ym, stats_);
    }
  }
  void run() override {
    Map<2> o(out_.data(), c_.rows(), c_.hidden());
    if (c_.op == Op::RMS_fwd) {
      on_device(serial_, [&](const auto& d) { rn_.forward(d, x(), o); });
    } else {
      CMap<2> dy(in_.dy, c_.rows(), c_.hidden());
      on_device(serial_, [&](const auto& d) { rn_.backward(d, x(), dy, &o, &dw_, &stats_); });
    }
  }
  void collect(Result& r) override {
    r.out.assign(out_.begin(), out_.end());
    if (c_.op == Op::RMS_bwd) r.dweight = from_tensor(dw_);
  }

 private:
  CMap<2> x() const { return CMap<2>(in_.x, c_.rows(), c_.hidden()); }
  Case c_;
  Inputs in_;
  bool serial_;
  normcore::RMSNorm<float> rn_;
  normcore::NormStats<float> stats_;
  Eigen::Tensor<float, 1> dw_;
  Buffer out_;
};
#endif

#if NBENCH_HAVE_BN
// NCHW: a rank-4 map (N, C, H, W) with channel axis 1. NHWC: (N, H, W, C)
// with the channel axis last. The (N, C) shape: a rank-2 map, axis 1.
template <typename S>
class NcBatchNorm : public Runner {
 public:
  NcBatchNorm(const Case& c, const Inputs& in, bool serial = false)
      : c_(c), in_(in), serial_(serial), bn_(make_bn(c)), out_(static_cast<std::size_t>(c.elements())) {
    if constexpr (!std::is_same<S, float>::value) {  // the inputs in the storage type (values exact in it)
      x16_.resize(out_.size());
      dy16_.resize(out_.size());
      for (std::size_t i = 0; i < out_.size(); ++i) {
        x16_[i] = static_cast<S>(in.x[i]);
        dy16_[i] = static_cast<S>(in.dy[i]);
      }
    }
    for (Idx j = 0; j < c.C(); ++j) {
      bn_.weight()(j) = static_cast<S>(in.gamma[j]);
      bn_.bias()(j) = static_cast<S>(in.beta[j]);
      bn_.running_mean()(j) = in.running_mean[j];
      bn_.running_var()(j) = in.running_var[j];
    }
    if (c.op == Op::BN_eval) {
      bn_.eval();
    } else {
      bn_.train();
    }
    if (c.op == Op::BN_bwd) {
      std::vector<S> y(out_.size());
      dispatch(xp(), y.data(), [&](auto x, auto yv) { bn_.forward(x, yv, stats_); });
    }
  }
  void run() override {
    switch (c_.op) {
      case Op::BN_train:
        dispatch(xp(), out_.data(), [&](auto x, auto y) {
          on_device(serial_, [&](const auto& d) { bn_.forward(d, x, y, stats_); });
        });
        break;
      case Op::BN_eval:
        dispatch(xp(), out_.data(), [&](auto x, auto y) {
          on_device(serial_, [&](const auto& d) { bn_.forward(d, x, y); });
        });
        break;
      default:
        dispatch(xp(), out_.data(), [&](auto x, auto dx) {
          decltype(x) dy(dyp(), x.dimensions());
          on_device(serial_, [&](const auto& d) { bn_.backward(d, x, dy, &dx, &dw_, &db_, &stats_); });
        });
    }
  }
  void collect(Result& r) override {
    r.out.resize(out_.size());
    for (std::size_t i = 0; i < out_.size(); ++i) r.out[i] = static_cast<float>(out_[i]);
    if (c_.op == Op::BN_bwd) {
      r.dweight = widened(dw_);
      r.dbias = widened(db_);
    } else if (c_.op == Op::BN_train) {
      r.mean = from_tensor(stats_.mean);
      r.rstd = from_tensor(stats_.rstd);
    }
  }

 private:
  template <int R>
  using In = Eigen::TensorMap<Eigen::Tensor<const S, R, Eigen::RowMajor>>;
  template <int R>
  using Out = Eigen::TensorMap<Eigen::Tensor<S, R, Eigen::RowMajor>>;
  const S* xp() const {
    if constexpr (std::is_same<S, float>::value) {
      return in_.x;
    } else {
      return x16_.data();
    }
  }
  const S* dyp() const {
    if constexpr (std::is_same<S, float>::value) {
      return in_.dy;
    } else {
      return dy16_.data();
    }
  }
  static std::vector<float> widened(const Eigen::Tensor<S, 1>& t) {
    std::vector<float> v(static_cast<std::size_t>(t.size()));
    for (Idx i = 0; i < t.size(); ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(t(i));
    return v;
  }
  static normcore::BatchNorm<S> make_bn(const Case& c) {
    const bool last = c.layout == Layout::NHWC && !c.is_2d_bn();
    return normcore::BatchNorm<S>(
        normcore::BatchNormOptions(c.C()).eps(kBnEps).momentum(kBnMomentum).channel_axis(last ? -1 : 1));
  }
  template <typename F>
  void dispatch(const S* x, S* y, F&& f) {
    if (c_.is_2d_bn()) {
      f(In<2>(x, c_.N(), c_.C()), Out<2>(y, c_.N(), c_.C()));
    } else if (c_.layout == Layout::NCHW) {
      f(In<4>(x, c_.N(), c_.C(), c_.dims[2], c_.dims[3]), Out<4>(y, c_.N(), c_.C(), c_.dims[2], c_.dims[3]));
    } else {
      f(In<4>(x, c_.N(), c_.dims[2], c_.dims[3], c_.C()), Out<4>(y, c_.N(), c_.dims[2], c_.dims[3], c_.C()));
    }
  }
  Case c_;
  Inputs in_;
  bool serial_;
  normcore::BatchNorm<S> bn_;
  normcore::NormStats<float> stats_;
  Eigen::Tensor<S, 1> dw_, db_;
  std::vector<S, CacheAligned<S>> out_, x16_, dy16_;
};

RunnerPtr make_batch_norm(const Case& c, const Inputs& in, bool serial) {
  if (c.prec == Prec::BF16) return std::make_unique<NcBatchNorm<Eigen::bfloat16>>(c, in, serial);
  if (c.prec == Prec::F16) return std::make_unique<NcBatchNorm<Eigen::half>>(c, in, serial);
  return std::make_unique<NcBatchNorm<float>>(c, in, serial);
}
#endif

// ------------------------------------------- 16-bit storage and fused ops

float widen(float v) { return v; }
float widen(Eigen::bfloat16 v) { return static_cast<float>(v); }
float widen(Eigen::half v) { return static_cast<float>(v); }

// Row cases in storage type S (float only for the fused ops): a layer whose
// parameters are stored in S too (LayerNorm<S>, RMSNorm<S>), as
// module.to(dtype) in PyTorch. `fused` false: the unfused pair, an Eigen
// expression h = x + residual on the same device, then the layer.
template <typename S>
class NcRows16 : public Runner {
 public:
  NcRows16(const Case& c, const Inputs& in, bool fused)
      : c_(c), fused_(fused), ln_(normcore::LayerNormOptions({c.hidden()}).eps(kLnEps)),
        rn_(normcore::RMSNormOptions({c.hidden()}).eps(kRmsEps)) {
    const std::size_t N = static_cast<std::size_t>(c.elements());
    x_.resize(N);
    dy_.resize(N);
    out_.resize(N);
    h_.resize(is_add(c.op) ? N : 0);
    for (std::size_t i = 0; i < N; ++i) {
      x_[i] = static_cast<S>(in.x[i]);
      dy_[i] = static_cast<S>(in.dy[i]);
    }
    for (Idx j = 0; j < c.hidden(); ++j) {
      ln_.weight()(j) = static_cast<S>(in.gamma[j]);
      ln_.bias()(j) = static_cast<S>(in.beta[j]);
      rn_.weight()(j) = static_cast<S>(in.gamma[j]);
    }
    if (c.op == Op::LN_bwd) ln_.forward(X(), Out(), stats_);
    if (c.op == Op::RMS_bwd) rn_.forward(X(), Out(), stats_);
  }
  void run() override {
    switch (c_.op) {
      case Op::LN_fwd: on_device(false, [&](const auto& d) { ln_.forward(d, X(), Out()); }); break;
      case Op::RMS_fwd: on_device(false, [&](const auto& d) { rn_.forward(d, X(), Out()); }); break;
      case Op::LN_bwd: {
        auto o = Out();
        on_device(false, [&](const auto& d) { ln_.backward(d, X(), DY(), &o, &dw_, &db_, &stats_); });
        break;
      }
      case Op::RMS_bwd: {
        auto o = Out();
        on_device(false, [&](const auto& d) { rn_.backward(d, X(), DY(), &o, &dw_, &stats_); });
        break;
      }
      default: {  // ADD_LN_fwd, ADD_RMS_fwd
        M h(h_.data(), c_.rows(), c_.hidden());
        on_device(false, [&](const auto& d) {
          if (fused_) {
            if (c_.op == Op::ADD_LN_fwd) {
              ln_.forward_add(d, X(), DY(), h, Out());
            } else {
              rn_.forward_add(d, X(), DY(), h, Out());
            }
            return;
          }
          add_pass(d, h_.data());
          if (c_.op == Op::ADD_LN_fwd) {
            ln_.forward(d, h, Out());
          } else {
            rn_.forward(d, h, Out());
          }
        });
      }
    }
  }
  void collect(Result& r) override {
    r.out = floats(out_);
    r.h = floats(h_);
    if (c_.op == Op::LN_bwd || c_.op == Op::RMS_bwd) r.dweight = floats(dw_);
    if (c_.op == Op::LN_bwd) r.dbias = floats(db_);
  }

 private:
  using CM = Eigen::TensorMap<const Eigen::Tensor<S, 2, Eigen::RowMajor>>;
  using M = Eigen::TensorMap<Eigen::Tensor<S, 2, Eigen::RowMajor>>;
  CM X() const { return CM(x_.data(), c_.rows(), c_.hidden()); }
  CM DY() const { return CM(dy_.data(), c_.rows(), c_.hidden()); }
  M Out() { return M(out_.data(), c_.rows(), c_.hidden()); }
  // The unfused add: one vectorized pass (normcore's own add, so that half
  // gets F16C conversions rather than Eigen's per-lane software ones), split
  // in equal contiguous chunks across the device's threads.
  template <typename D>
  void add_pass(const D& d, S* h) {
    const Idx total = c_.elements();
    auto chunk = [&](Idx b, Idx e) { normcore::detail::add_rows(x_.data() + b, dy_.data() + b, h + b, nullptr, e - b); };
    if constexpr (std::is_same<D, normcore::Serial>::value) {
      chunk(0, total);
    } else {
      const Idx t = d.numThreads(), per = (total + t - 1) / t;
      Eigen::Barrier done(static_cast<unsigned>(t));
      for (Idx i = 0; i < t; ++i) {
        d.enqueue_with_barrier(&done, [&, i] { chunk(std::min(total, i * per), std::min(total, (i + 1) * per)); });
      }
      done.Wait();
    }
  }
  template <typename V>
  static std::vector<float> floats(const V& v) {
    std::vector<float> f(static_cast<std::size_t>(v.size()));
    for (std::size_t i = 0; i < f.size(); ++i) f[i] = widen(v.data()[i]);
    return f;
  }
  Case c_;
  bool fused_;
  normcore::LayerNorm<S> ln_;
  normcore::RMSNorm<S> rn_;
  normcore::NormStats<float> stats_;
  Eigen::Tensor<S, 1> dw_, db_;
  std::vector<S, CacheAligned<S>> x_, dy_, out_, h_;
};

RunnerPtr make_rows16(const Case& c, const Inputs& in, bool fused) {
  switch (c.prec) {
    case Prec::BF16: return std::make_unique<NcRows16<Eigen::bfloat16>>(c, in, fused);
    case Prec::F16: return std::make_unique<NcRows16<Eigen::half>>(c, in, fused);
    default: return std::make_unique<NcRows16<float>>(c, in, fused);
  }
}

// ----------------------------------------------------------- reference path

class RefRunner : public Runner {
 public:
  RefRunner(const Case& c, const Inputs& in) : c_(c), in_(in) {}
  void run() override {
    const std::ptrdiff_t rows = c_.rows(), n = c_.hidden();
    if (is_add(c_.op)) {  // h = x + residual, rounded to the storage type
      h_.resize(static_cast<std::size_t>(rows * n));
      for (std::size_t i = 0; i < h_.size(); ++i) {
        const float v = in_.x[i] + in_.dy[i];
        h_[i] = c_.prec == Prec::BF16 ? widen(Eigen::bfloat16(v)) : c_.prec == Prec::F16 ? widen(Eigen::half(v)) : v;
      }
    }
    switch (c_.op) {
      case Op::ADD_LN_fwd:
        y_ = normcore::reference::layer_norm_forward(h_.data(), rows, n, in_.gamma, in_.beta, kLnEps);
        break;
#if NBENCH_HAVE_RMS_REF
      case Op::ADD_RMS_fwd:
        y_ = normcore::reference::rms_norm_forward(h_.data(), rows, n, in_.gamma, kRmsEps);
        break;
#endif
      case Op::LN_fwd:
        y_ = normcore::reference::layer_norm_forward(in_.x, rows, n, in_.gamma, in_.beta, kLnEps);
        break;
      case Op::LN_fwd_stats:
        y_ = normcore::reference::layer_norm_forward(in_.x, rows, n, in_.gamma, in_.beta, kLnEps,
                                                     &stats_);
        break;
      case Op::LN_bwd:
        g_ = normcore::reference::layer_norm_backward(in_.x, in_.dy, rows, n, in_.gamma, kLnEps);
        break;
#if NBENCH_HAVE_RMS_REF
      case Op::RMS_fwd:
        y_ = normcore::reference::rms_norm_forward(in_.x, rows, n, in_.gamma, kRmsEps);
        break;
      case Op::RMS_bwd:
        g_ = normcore::reference::rms_norm_backward(in_.x, in_.dy, rows, n, in_.gamma, kRmsEps);
        break;
#endif
      default: run_bn(); break;
    }
  }
  void collect(Result& r) override {
    if (is_backward(c_.op)) {
      r.out = to_float(g_.dx);
      r.dweight = to_float(g_.dweight);
      if (c_.op != Op::RMS_bwd) r.dbias = to_float(g_.dbias);
    } else {
      r.out = to_float(y_);
      r.h = h_;
      if (c_.op == Op::LN_fwd_stats || c_.op == Op::BN_train) {
        r.mean = to_float(stats_.mean);
        r.rstd = to_float(stats_.rstd);
      }
    }
  }

 private:
  void run_bn();
  Case c_;
  Inputs in_;
  std::vector<double> y_;
  std::vector<float> h_;
  normcore::reference::RowStats stats_;
  normcore::reference::Grads g_;
};

void RefRunner::run_bn() {
#if NBENCH_HAVE_BN_REF
  // Reference BatchNorm works on (outer, C, inner) data: NCHW is (N, C, HW),
  // NHWC is (N*HW, C, 1).
  const bool nhwc = c_.layout == Layout::NHWC || c_.is_2d_bn();
  const std::ptrdiff_t outer = nhwc ? c_.N() * c_.HW() : c_.N();
  const std::ptrdiff_t inner = nhwc ? 1 : c_.HW();
  const std::ptrdiff_t C = c_.C();
  namespace ref = normcore::reference;
  switch (c_.op) {
    case Op::BN_train: {  // batch statistics, then normalize
      const ref::ChannelStats st = ref::channel_stats(in_.x, outer, C, inner);
      y_ = ref::batch_norm_forward(in_.x, outer, C, inner, st.mean, st.var, in_.gamma, in_.beta, kBnEps);
      stats_.mean = st.mean;
      stats_.rstd.resize(st.var.size());
      for (std::size_t c = 0; c < st.var.size(); ++c) stats_.rstd[c] = 1.0 / std::sqrt(st.var[c] + kBnEps);
      break;
    }
    case Op::BN_eval: {
      const std::vector<double> rm(in_.running_mean, in_.running_mean + C);
      const std::vector<double> rv(in_.running_var, in_.running_var + C);
      y_ = ref::batch_norm_forward(in_.x, outer, C, inner, rm, rv, in_.gamma, in_.beta, kBnEps);
      break;
    }
    default: {
      const ref::ChannelStats st = ref::channel_stats(in_.x, outer, C, inner);
      g_ = ref::batch_norm_backward(in_.x, in_.dy, outer, C, inner, st.mean, st.var, in_.gamma,
                                    kBnEps, true);
    }
  }
#endif
}

bool ref_supports(const Case& c) {
  if (is_rms(c.op) || c.op == Op::ADD_RMS_fwd) return NBENCH_HAVE_RMS_REF;
  if (is_batch_norm(c.op)) return NBENCH_HAVE_BN_REF;
  return true;
}

// ------------------------------------------- Eigen Tensor expressions by hand
//
// What a user writes without normcore: reductions and broadcasts, several
// passes, evaluated on Eigen's default device (one thread) or on a
// ThreadPoolDevice with the suite's thread count.

class EigenRunner : public Runner {
 public:
  EigenRunner(const Case& c, const Inputs& in)
      : c_(c), in_(in), out_(static_cast<std::size_t>(c.elements())) {
    if (threads() > 1) {
      pool_ = std::make_unique<Eigen::ThreadPool>(threads());
      dev_ = std::make_unique<Eigen::ThreadPoolDevice>(pool_.get(), threads());
    }
    if (is_row_op(c.op)) {
      rows_ = c.rows();
      n_ = c.hidden();
      to_vec(in.gamma, n_, gamma_);
      to_vec(in.beta, n_, beta_);
    } else {
      // (outer, C, inner): NCHW -> (N, C, HW); NHWC and (N, C) -> (N*HW, C, 1).
      const bool nhwc = c.layout == Layout::NHWC || c.is_2d_bn();
      a_ = nhwc ? c.N() * c.HW() : c.N();
      ch_ = c.C();
      b_ = nhwc ? 1 : c.HW();
      to_vec(in.gamma, ch_, gamma_);
      to_vec(in.beta, ch_, beta_);
      to_vec(in.running_mean, ch_, rmean_);
      to_vec(in.running_var, ch_, rvar_);
    }
    if (is_backward(c.op)) {  // saved statistics from the untimed forward
      const Op fwd = c.op == Op::LN_bwd ? Op::LN_fwd_stats : c.op == Op::RMS_bwd ? Op::RMS_fwd : Op::BN_train;
      const Op saved = c_.op;
      c_.op = fwd;
      run();
      c_.op = saved;
    }
  }

  void run() override {
    if (dev_) {
      body(*dev_);
    } else {
      body(Eigen::DefaultDevice());
    }
  }

  void collect(Result& r) override {
    r.out.assign(out_.begin(), out_.end());
    auto v = [](const Vec& t) { return std::vector<float>(t.data(), t.data() + t.size()); };
    switch (c_.op) {
      case Op::LN_fwd_stats:
      case Op::BN_train:
        r.mean = v(mean_);
        r.rstd = v(rstd_);
        break;
      case Op::LN_bwd:
      case Op::BN_bwd:
        r.dweight = v(dw_);
        r.dbias = v(db_);
        break;
      case Op::RMS_bwd: r.dweight = v(dw_); break;
      default: break;
    }
  }

 private:
  template <typename Device>
  void body(const Device& d) {
    if (is_row_op(c_.op)) {
      rows_body(d);
    } else {
      bn_body(d);
    }
  }

  template <typename Device>
  void rows_body(const Device& d) {
    const Idx rows = rows_, n = n_;
    CMap<2> X(in_.x, rows, n);
    Map<2> Y(out_.data(), rows, n);
    const Eigen::array<Idx, 1> along_row{{1}}, along_col{{0}};
    const Eigen::array<Idx, 2> as_col{{rows, 1}}, over_row{{1, n}};
    const Eigen::array<Idx, 2> as_row{{1, n}}, over_col{{rows, 1}};
    auto per_row = [&](const Vec& v) { return v.reshape(as_col).broadcast(over_row); };
    auto per_col = [&](const Vec& v) { return v.reshape(as_row).broadcast(over_col); };
    mean_.resize(rows);
    rstd_.resize(rows);
    switch (c_.op) {
      case Op::LN_fwd:
      case Op::LN_fwd_stats: {
        mean_.device(d) = X.mean(along_row);
        auto centered = X - per_row(mean_);
        rstd_.device(d) = (centered.square().mean(along_row) + static_cast<float>(kLnEps)).rsqrt();
        Y.device(d) = centered * per_row(rstd_) * per_col(gamma_) + per_col(beta_);
        break;
      }
      case Op::LN_bwd: {
        CMap<2> DY(in_.dy, rows, n);
        auto xhat = (X - per_row(mean_)) * per_row(rstd_);
        auto g = DY * per_col(gamma_);
        Vec mg(rows), mgx(rows);
        mg.device(d) = g.mean(along_row);
        mgx.device(d) = (g * xhat).mean(along_row);
        Y.device(d) = per_row(rstd_) * (g - per_row(mg) - xhat * per_row(mgx));
        dw_.resize(n);
        db_.resize(n);
        dw_.device(d) = (DY * xhat).sum(along_col);
        db_.device(d) = DY.sum(along_col);
        break;
      }
      case Op::RMS_fwd: {
        rstd_.device(d) = (X.square().mean(along_row) + static_cast<float>(kRmsEps)).rsqrt();
        Y.device(d) = X * per_row(rstd_) * per_col(gamma_);
        break;
      }
      default: {  // RMS_bwd
        CMap<2> DY(in_.dy, rows, n);
        auto xhat = X * per_row(rstd_);
        auto g = DY * per_col(gamma_);
        Vec mgx(rows);
        mgx.device(d) = (g * xhat).mean(along_row);
        Y.device(d) = per_row(rstd_) * (g - xhat * per_row(mgx));
        dw_.resize(n);
        dw_.device(d) = (DY * xhat).sum(along_col);
      }
    }
  }

  template <typename Device>
  void bn_body(const Device& d) {
    const Idx A = a_, C = ch_, B = b_;
    CMap<3> X(in_.x, A, C, B);
    Map<3> Y(out_.data(), A, C, B);
    const Eigen::array<Idx, 2> red{{0, 2}};
    const Eigen::array<Idx, 3> as_ch{{1, C, 1}}, over{{A, 1, B}};
    auto per_ch = [&](const Vec& v) { return v.reshape(as_ch).broadcast(over); };
    const float m = static_cast<float>(A * B);
    switch (c_.op) {
      case Op::BN_train: {
        mean_.resize(C);
        rstd_.resize(C);
        mean_.device(d) = X.mean(red);
        auto centered = X - per_ch(mean_);
        Vec var(C);
        var.device(d) = centered.square().mean(red);
        rstd_.device(d) = (var + static_cast<float>(kBnEps)).rsqrt();
        Vec scale(C);
        scale.device(d) = rstd_ * gamma_;
        Y.device(d) = centered * per_ch(scale) + per_ch(beta_);
        // Running statistics, with the unbiased variance as PyTorch keeps it.
        const float mom = static_cast<float>(kBnMomentum);
        rmean_.device(d) = rmean_ * (1 - mom) + mean_ * mom;
        rvar_.device(d) = rvar_ * (1 - mom) + var * (mom * m / (m > 1 ? m - 1 : 1));
        break;
      }
      case Op::BN_eval: {
        Vec scale(C), shift(C);
        scale.device(d) = gamma_ * (rvar_ + static_cast<float>(kBnEps)).rsqrt();
        shift.device(d) = beta_ - rmean_ * scale;
        Y.device(d) = X * per_ch(scale) + per_ch(shift);
        break;
      }
      default: {  // BN_bwd, from the saved batch statistics
        CMap<3> DY(in_.dy, A, C, B);
        auto xhat = (X - per_ch(mean_)) * per_ch(rstd_);
        dw_.resize(C);
        db_.resize(C);
        db_.device(d) = DY.sum(red);
        dw_.device(d) = (DY * xhat).sum(red);
        Vec k(C), mdb(C), mdw(C);
        k.device(d) = gamma_ * rstd_;
        mdb.device(d) = db_ / m;
        mdw.device(d) = dw_ / m;
        Y.device(d) = per_ch(k) * (DY - per_ch(mdb) - xhat * per_ch(mdw));
      }
    }
  }

  Case c_;
  Inputs in_;
  Buffer out_;
  std::unique_ptr<Eigen::ThreadPool> pool_;
  std::unique_ptr<Eigen::ThreadPoolDevice> dev_;
  Idx rows_ = 0, n_ = 0, a_ = 0, ch_ = 0, b_ = 0;
  Vec gamma_, beta_, rmean_, rvar_, mean_, rstd_, dw_, db_;
};

}  // namespace

std::string normcore_cache_info() {
  namespace d = normcore::detail;
  const auto kib = [](normcore::Index b) { return b > 0 ? std::to_string(b >> 10) + " KiB" : std::string("not reported"); };
  const int set = d::path_choices();
  return "L2 " + kib(d::l2_cache_bytes()) + ", L3 " + kib(d::l3_cache_bytes()) +
         " (sysconf); forward streaming stores from " + std::to_string(normcore::forward_stream_threshold() >> 20) +
         " MiB; path choices: " + (set == 1 ? "Intel" : set == 2 ? "AMD Zen 5" : set == 3 ? "AMD Zen 3" : "other CPUs (Zen 4)");
}

void add_normcore_impls(std::vector<Impl>& out) {
  out.push_back({"normcore",
                 [](const Case& c) {
                   if (is_rms(c.op)) return bool(NBENCH_HAVE_RMS);
                   if (is_batch_norm(c.op)) return bool(NBENCH_HAVE_BN);
                   return true;
                 },
                 [](const Case& c, const Inputs& in) -> RunnerPtr {
#if NBENCH_HAVE_BN
                   if (is_batch_norm(c.op)) return make_batch_norm(c, in, false);
#endif
                   if (c.prec != Prec::F32 || is_add(c.op)) return make_rows16(c, in, true);
#if NBENCH_HAVE_RMS
                   if (is_rms(c.op)) return std::make_unique<NcRmsNorm>(c, in);
#endif
                   if (is_rms(c.op) || is_batch_norm(c.op)) return nullptr;
                   return std::make_unique<NcLayerNorm>(c, in);
                 }});
  // Runs with more than one thread: normcore on the calling thread alone, on
  // every float shape of the row-wise layers and BatchNorm, so that the
  // N-thread speedup is measured inside one process. Tiny shapes (under
  // kMinElementsPerThread) run on the calling thread with or without a
  // device: there it measures "2 threads never slower than 1". Across the
  // 1- and 2-thread processes instead, the Zen 5 guest's runs timed
  // LayerNorm's 1x768 forward, the same code, 1.57x apart (session 39), and
  // put 2 threads at 1.01-1.13x 1 thread at 2048x50, where one process
  // measured 1.54-1.85x (session 42).
  out.push_back({"normcore_1thread",
                 [](const Case& c) {
                   return threads() > 1 && c.prec == Prec::F32 && !is_add(c.op) &&
                          (!is_rms(c.op) || NBENCH_HAVE_RMS) && (!is_batch_norm(c.op) || NBENCH_HAVE_BN);
                 },
                 [](const Case& c, const Inputs& in) -> RunnerPtr {
#if NBENCH_HAVE_RMS
                   if (is_rms(c.op)) return std::make_unique<NcRmsNorm>(c, in, true);
#endif
#if NBENCH_HAVE_BN
                   if (is_batch_norm(c.op)) return make_batch_norm(c, in, true);
#endif
                   if (is_rms(c.op) || is_batch_norm(c.op)) return nullptr;
                   return std::make_unique<NcLayerNorm>(c, in, true);
                 }});
  out.push_back({"reference", ref_supports,
                 [](const Case& c, const Inputs& in) -> RunnerPtr {
                   if (!ref_supports(c)) return nullptr;
                   return std::make_unique<RefRunner>(c, in);
                 }});
  out.push_back({"normcore_unfused", [](const Case& c) { return is_add(c.op); },
                 [](const Case& c, const Inputs& in) -> RunnerPtr { return make_rows16(c, in, false); }});
  out.push_back({"eigen", [](const Case& c) { return c.prec == Prec::F32 && !is_add(c.op); },
                 [](const Case& c, const Inputs& in) -> RunnerPtr {
                   return std::make_unique<EigenRunner>(c, in);
                 }});
}

}  // namespace nbench
