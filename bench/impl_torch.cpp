// libtorch (ATen) peers. LayerNorm and BatchNorm are ATen's fused CPU
// kernels (native_layer_norm, native_batch_norm and their backwards); RMSNorm
// is composed from ATen ops, as a user of libtorch 1.13 writes it (no fused
// RMSNorm exists there). libtorch 1.13 has no CPU out= kernels for these ops
// (the out= overloads allocate and copy), so the functional ops are timed:
// each call allocates its outputs, which main() keeps cheap by tuning malloc.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/csrc/api/include/torch/version.h>

#include <string>
#include <tuple>
#include <vector>

#include "bench_common.hpp"

namespace nbench {
namespace {

at::Tensor wrap(const float* p, at::IntArrayRef sizes) {
  return at::from_blob(const_cast<float*>(p), sizes, at::TensorOptions().dtype(at::kFloat));
}
at::Tensor wrap(const float* p, at::IntArrayRef sizes, at::IntArrayRef strides) {
  return at::from_blob(const_cast<float*>(p), sizes, strides, at::TensorOptions().dtype(at::kFloat));
}
std::vector<float> to_vector(const at::Tensor& t, at::MemoryFormat fmt = at::MemoryFormat::Contiguous) {
  const at::Tensor c = t.contiguous(fmt);
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

// Whether runner R runs the case's op on a tiny input of the given dims
// (params: its parameter count): libtorch lacks some 16-bit CPU kernels in
// some releases, and says so by throwing.
template <typename R>
bool runs_tiny(const Case& c, std::vector<std::int64_t> dims, std::size_t params) {
  try {
    Case t = c;
    t.dims = std::move(dims);
    std::vector<float> v(static_cast<std::size_t>(t.elements()), 0.5f), p(params, 1.0f);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] += 0.25f * static_cast<float>(i % 5);
    Inputs in{v.data(), v.data(), p.data(), p.data(), p.data(), p.data()};
    R r(t, in);
    r.run();
    Result res;
    r.collect(res);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

class TorchRows : public Runner {
 public:
  TorchRows(const Case& c, const Inputs& in) : c_(c) {
    const std::int64_t rows = c.rows(), n = c.hidden();
    x_ = wrap(in.x, {rows, n});
    dy_ = wrap(in.dy, {rows, n});
    w_ = wrap(in.gamma, {n});
    b_ = wrap(in.beta, {n});
    if (c.op == Op::LN_bwd) {
      std::tie(y_, mean_, rstd_) = at::native_layer_norm(x_, {n}, w_, b_, kLnEps);
    } else if (c.op == Op::RMS_bwd) {
      rstd_ = at::rsqrt(x_.pow(2).mean({-1}, true) + kRmsEps);
    }
  }
  void run() override {
    const std::int64_t n = c_.hidden();
    switch (c_.op) {
      case Op::LN_fwd:
      case Op::LN_fwd_stats:
        std::tie(y_, mean_, rstd_) = at::native_layer_norm(x_, {n}, w_, b_, kLnEps);
        break;
      case Op::LN_bwd:
        std::tie(y_, dw_, db_) =
            at::native_layer_norm_backward(dy_, x_, {n}, mean_, rstd_, w_, b_, {true, true, true});
        break;
      case Op::RMS_fwd: {
        const at::Tensor var = x_.pow(2).mean({-1}, true);
        y_ = w_ * (x_ * at::rsqrt(var + kRmsEps));
        break;
      }
      default: {  // RMS_bwd, with the forward's saved rstd
        const at::Tensor xhat = x_ * rstd_;
        const at::Tensor g = dy_ * w_;
        y_ = rstd_ * (g - xhat * (g * xhat).mean({-1}, true));
        dw_ = (dy_ * xhat).sum(0);
      }
    }
  }
  void collect(Result& r) override {
    r.out = to_vector(y_);
    if (c_.op == Op::LN_bwd || c_.op == Op::RMS_bwd) r.dweight = to_vector(dw_);
    if (c_.op == Op::LN_bwd) r.dbias = to_vector(db_);
    if (c_.op == Op::LN_fwd_stats) {
      r.mean = to_vector(mean_);
      r.rstd = to_vector(rstd_);
    }
  }

 private:
  Case c_;
  at::Tensor x_, dy_, w_, b_, y_, mean_, rstd_, dw_, db_;
};

class TorchBatchNorm : public Runner {
 public:
  TorchBatchNorm(const Case& c, const Inputs& in) : c_(c) {
    const std::int64_t N = c.N(), C = c.C(), H = c.dims[2], W = c.dims[3];
    if (c.is_2d_bn()) {
      x_ = wrap(in.x, {N, C});
      dy_ = wrap(in.dy, {N, C});
    } else if (c.layout == Layout::NCHW) {
      x_ = wrap(in.x, {N, C, H, W});
      dy_ = wrap(in.dy, {N, C, H, W});
    } else {  // channels-last: logical NCHW, memory NHWC
      x_ = wrap(in.x, {N, C, H, W}, {H * W * C, 1, W * C, C});
      dy_ = wrap(in.dy, {N, C, H, W}, {H * W * C, 1, W * C, C});
    }
    fmt_ = c.layout == Layout::NHWC && !c.is_2d_bn() ? at::MemoryFormat::ChannelsLast
                                                     : at::MemoryFormat::Contiguous;
    w_ = wrap(in.gamma, {C});
    b_ = wrap(in.beta, {C});
    rm_ = wrap(in.running_mean, {C}).clone();
    rv_ = wrap(in.running_var, {C}).clone();
    if (c.prec != Prec::F32) {  // as module.to(dtype): every tensor in the dtype (.to keeps the strides)
      const at::ScalarType dt = c.prec == Prec::BF16 ? at::kBFloat16 : at::kHalf;
      for (at::Tensor* t : {&x_, &dy_, &w_, &b_, &rm_, &rv_}) *t = t->to(dt);
    }
    if (c.op == Op::BN_bwd) {
      std::tie(y_, mean_, invstd_) =
          at::native_batch_norm(x_, w_, b_, rm_, rv_, true, kBnMomentum, kBnEps);
    }
  }
  void run() override {
    switch (c_.op) {
      case Op::BN_train:
        std::tie(y_, mean_, invstd_) =
            at::native_batch_norm(x_, w_, b_, rm_, rv_, true, kBnMomentum, kBnEps);
        break;
      case Op::BN_eval:
        std::tie(y_, mean_, invstd_) =
            at::native_batch_norm(x_, w_, b_, rm_, rv_, false, kBnMomentum, kBnEps);
        break;
      default:
        std::tie(y_, dw_, db_) = at::native_batch_norm_backward(
            dy_, x_, w_, rm_, rv_, mean_, invstd_, true, kBnEps, {true, true, true});
    }
  }
  void collect(Result& r) override {
    r.out = to_vector(y_.to(at::kFloat), fmt_);
    if (c_.op == Op::BN_bwd) {
      r.dweight = to_vector(dw_.to(at::kFloat));
      r.dbias = to_vector(db_.to(at::kFloat));
    } else if (c_.op == Op::BN_train) {
      r.mean = to_vector(mean_.to(at::kFloat));
      r.rstd = to_vector(invstd_.to(at::kFloat));
    }
  }

  /// Whether this libtorch has the 16-bit kernels for the case.
  static bool available(const Case& c) { return runs_tiny<TorchBatchNorm>(c, {4, 2, 2, 2}, 2); }

 private:
  Case c_;
  at::MemoryFormat fmt_;
  at::Tensor x_, dy_, w_, b_, rm_, rv_, y_, mean_, invstd_, dw_, db_;
};

// Rows in bfloat16 / half (and the fused ops in float too), with the
// parameters in the same dtype, as module.to(dtype) runs them: LayerNorm is
// ATen's fused kernel on the 16-bit tensors; RMSNorm is written as
// Hugging Face's LlamaRMSNorm writes it (statistics in float, then back to
// the dtype); the residual add is at::add.
class TorchRows16 : public Runner {
 public:
  TorchRows16(const Case& c, const Inputs& in) : c_(c) {
    const std::int64_t rows = c.rows(), n = c.hidden();
    dt_ = c.prec == Prec::BF16 ? at::kBFloat16 : c.prec == Prec::F16 ? at::kHalf : at::kFloat;
    x_ = wrap(in.x, {rows, n}).to(dt_);
    dy_ = wrap(in.dy, {rows, n}).to(dt_);
    w_ = wrap(in.gamma, {n}).to(dt_);
    b_ = wrap(in.beta, {n}).to(dt_);
    if (c.op == Op::LN_bwd) {
      std::tie(y_, mean_, rstd_) = at::native_layer_norm(x_, {n}, w_, b_, kLnEps);
    } else if (c.op == Op::RMS_bwd) {
      rstd_ = at::rsqrt(x_.to(at::kFloat).pow(2).mean({-1}, true) + kRmsEps);
    }
  }
  void run() override {
    const std::int64_t n = c_.hidden();
    switch (c_.op) {
      case Op::LN_fwd: y_ = std::get<0>(at::native_layer_norm(x_, {n}, w_, b_, kLnEps)); break;
      case Op::LN_bwd:
        std::tie(y_, dw_, db_) =
            at::native_layer_norm_backward(dy_, x_, {n}, mean_, rstd_, w_, b_, {true, true, true});
        break;
      case Op::RMS_fwd: y_ = rms(x_); break;
      case Op::RMS_bwd: {
        const at::Tensor xf = x_.to(at::kFloat), dyf = dy_.to(at::kFloat);
        const at::Tensor xhat = xf * rstd_;
        const at::Tensor g = dyf * w_.to(at::kFloat);
        y_ = (rstd_ * (g - xhat * (g * xhat).mean({-1}, true))).to(dt_);
        dw_ = (dyf * xhat).sum(0).to(dt_);
        break;
      }
      case Op::ADD_LN_fwd:
        h_ = at::add(x_, dy_);
        y_ = std::get<0>(at::native_layer_norm(h_, {n}, w_, b_, kLnEps));
        break;
      default:  // ADD_RMS_fwd
        h_ = at::add(x_, dy_);
        y_ = rms(h_);
    }
  }
  void collect(Result& r) override {
    r.out = to_vector(y_.to(at::kFloat));
    if (h_.defined()) r.h = to_vector(h_.to(at::kFloat));
    if (c_.op == Op::LN_bwd || c_.op == Op::RMS_bwd) r.dweight = to_vector(dw_.to(at::kFloat));
    if (c_.op == Op::LN_bwd) r.dbias = to_vector(db_.to(at::kFloat));
  }

  /// Whether this libtorch has the kernels for the case (half LayerNorm on
  /// the CPU, for one, is missing from some releases).
  static bool available(const Case& c) { return runs_tiny<TorchRows16>(c, {2, 8}, 8); }

 private:
  at::Tensor rms(const at::Tensor& x) const {
    const at::Tensor xf = x.to(at::kFloat);
    const at::Tensor var = xf.pow(2).mean({-1}, true);
    return w_ * (xf * at::rsqrt(var + kRmsEps)).to(dt_);
  }
  Case c_;
  at::ScalarType dt_;
  at::Tensor x_, dy_, w_, b_, y_, h_, mean_, rstd_, dw_, db_;
};

}  // namespace

std::string torch_info() {
  // show_config() has a line "CPU capability usage: AVX2" (the kernels used).
  std::string cap = "unknown";
  const std::string cfg = at::show_config();
  const std::string key = "CPU capability usage: ";
  const auto at_key = cfg.find(key);
  if (at_key != std::string::npos) {
    const auto from = at_key + key.size();
    cap = cfg.substr(from, cfg.find('\n', from) - from);
  }
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH) + " (ATen CPU capability " + cap +
         ", intra-op threads " + std::to_string(at::get_num_threads()) + ")";
}

void add_torch_impls(std::vector<Impl>& out) {
  at::set_num_threads(threads());
  out.push_back({"torch",
                 [](const Case& c) {
                   if (c.prec == Prec::F32 && !is_add(c.op)) return true;
                   if (is_batch_norm(c.op)) return TorchBatchNorm::available(c);
                   return TorchRows16::available(c);
                 },
                 [](const Case& c, const Inputs& in) -> RunnerPtr {
                   if (is_batch_norm(c.op)) return std::make_unique<TorchBatchNorm>(c, in);
                   if (c.prec != Prec::F32 || is_add(c.op)) return std::make_unique<TorchRows16>(c, in);
                   return std::make_unique<TorchRows>(c, in);
                 }});
}

}  // namespace nbench
