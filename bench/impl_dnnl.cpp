// oneDNN peers: the layer_normalization and batch_normalization primitives
// (forward training, forward inference, backward), on the caller's buffers.
// oneDNN 2.x has no RMSNorm, so it sits out the RMS cases. Primitives are
// created when the runner is made; run() only executes them. Debian's build
// uses the OpenMP runtime, so its thread count follows omp_set_num_threads.
#include <dnnl.hpp>

#include <cmath>
#include <string>
#include <unordered_map>
#include <vector>

#include "bench_common.hpp"

namespace nbench {
namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;
using flags = dnnl::normalization_flags;

dnnl::engine& cpu_engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

memory user_mem(const memory::desc& md, const float* p) {
  return memory(md, cpu_engine(), const_cast<float*>(p));
}

std::vector<float> rstd_of(const std::vector<float>& var, double eps) {
  std::vector<float> r(var.size());
  for (std::size_t i = 0; i < var.size(); ++i) r[i] = static_cast<float>(1.0 / std::sqrt(var[i] + eps));
  return r;
}

class DnnlRunner : public Runner {
 public:
  DnnlRunner(const Case& c, const Inputs& in)
      : c_(c), strm_(cpu_engine()), out_(static_cast<std::size_t>(c.elements())) {
    const bool rows = !is_batch_norm(c.op);
    memory::desc data_md, stat_md, param_md;
    std::int64_t nstat, nparam;
    if (rows) {
      data_md = memory::desc({c.rows(), c.hidden()}, dt::f32, tag::ab);
      nstat = c.rows();
      nparam = c.hidden();
      eps_ = kLnEps;
    } else {
      if (c.is_2d_bn()) {
        data_md = memory::desc({c.N(), c.C()}, dt::f32, tag::nc);
      } else {
        data_md = memory::desc({c.N(), c.C(), c.dims[2], c.dims[3]}, dt::f32,
                               c.layout == Layout::NHWC ? tag::nhwc : tag::nchw);
      }
      nstat = c.C();
      nparam = c.C();
      eps_ = kBnEps;
    }
    stat_md = memory::desc({nstat}, dt::f32, tag::a);
    param_md = memory::desc({nparam}, dt::f32, tag::a);
    mean_.assign(static_cast<std::size_t>(nstat), 0.f);
    var_.assign(static_cast<std::size_t>(nstat), 0.f);
    if (c.op == Op::BN_eval) {
      mean_.assign(in.running_mean, in.running_mean + nstat);
      var_.assign(in.running_var, in.running_var + nstat);
    }
    dw_.assign(static_cast<std::size_t>(nparam), 0.f);
    db_.assign(static_cast<std::size_t>(nparam), 0.f);

    const memory src = user_mem(data_md, in.x);
    const memory dst = user_mem(data_md, out_.data());
    const memory scale = user_mem(param_md, in.gamma), shift = user_mem(param_md, in.beta);
    const memory mean = user_mem(stat_md, mean_.data()), var = user_mem(stat_md, var_.data());
    const flags f = flags::use_scale | flags::use_shift;
    const auto eps = static_cast<float>(eps_);
    std::unordered_map<int, memory> fwd_args = {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst},
                                                {DNNL_ARG_SCALE, scale}, {DNNL_ARG_SHIFT, shift},
                                                {DNNL_ARG_MEAN, mean}, {DNNL_ARG_VARIANCE, var}};
    const bool training = c.op != Op::LN_fwd && c.op != Op::BN_eval;
    const auto prop = training ? dnnl::prop_kind::forward_training : dnnl::prop_kind::forward_inference;
    if (rows) {
      dnnl::layer_normalization_forward::primitive_desc fpd(
          dnnl::layer_normalization_forward::desc(prop, data_md, stat_md, eps, f), cpu_engine());
      fwd_ = dnnl::layer_normalization_forward(fpd);
      if (c.op == Op::LN_bwd) {
        dnnl::layer_normalization_backward::primitive_desc bpd(
            dnnl::layer_normalization_backward::desc(dnnl::prop_kind::backward, data_md, data_md,
                                                     stat_md, eps, f),
            cpu_engine(), fpd);
        bwd_ = dnnl::layer_normalization_backward(bpd);
      }
    } else {
      const flags bf = c.op == Op::BN_eval ? f | flags::use_global_stats : f;
      dnnl::batch_normalization_forward::primitive_desc fpd(
          dnnl::batch_normalization_forward::desc(prop, data_md, eps, bf), cpu_engine());
      fwd_ = dnnl::batch_normalization_forward(fpd);
      if (c.op == Op::BN_bwd) {
        dnnl::batch_normalization_backward::primitive_desc bpd(
            dnnl::batch_normalization_backward::desc(dnnl::prop_kind::backward, data_md, data_md,
                                                     eps, f),
            cpu_engine(), fpd);
        bwd_ = dnnl::batch_normalization_backward(bpd);
      }
    }
    if (is_backward(c.op)) {
      // Statistics from an untimed training forward into a scratch output.
      scratch_.resize(out_.size());
      fwd_args[DNNL_ARG_DST] = user_mem(data_md, scratch_.data());
      fwd_.execute(strm_, fwd_args);
      strm_.wait();
      args_ = {{DNNL_ARG_SRC, src},
               {DNNL_ARG_DIFF_DST, user_mem(data_md, in.dy)},
               {DNNL_ARG_MEAN, mean},
               {DNNL_ARG_VARIANCE, var},
               {DNNL_ARG_SCALE, scale},
               {DNNL_ARG_SHIFT, shift},
               {DNNL_ARG_DIFF_SRC, dst},
               {DNNL_ARG_DIFF_SCALE, user_mem(param_md, dw_.data())},
               {DNNL_ARG_DIFF_SHIFT, user_mem(param_md, db_.data())}};
    } else {
      args_ = fwd_args;
    }
  }
  void run() override {
    if (is_backward(c_.op)) {
      bwd_.execute(strm_, args_);
    } else {
      fwd_.execute(strm_, args_);
    }
    strm_.wait();
  }
  void collect(Result& r) override {
    r.out.assign(out_.begin(), out_.end());
    if (is_backward(c_.op)) {
      r.dweight = dw_;
      r.dbias = db_;
    } else if (c_.op == Op::LN_fwd_stats || c_.op == Op::BN_train) {
      r.mean = mean_;
      r.rstd = rstd_of(var_, eps_);
    }
  }

 private:
  Case c_;
  dnnl::stream strm_;
  double eps_ = 0;
  Buffer out_, scratch_;
  std::vector<float> mean_, var_, dw_, db_;
  dnnl::primitive fwd_, bwd_;
  std::unordered_map<int, memory> args_;
};

}  // namespace

std::string dnnl_info() {
  const dnnl_version_t* v = dnnl_version();
  std::string isa;
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx2: isa = "avx2"; break;
    case dnnl::cpu_isa::avx2_vnni: isa = "avx2_vnni"; break;
    case dnnl::cpu_isa::avx512_core: isa = "avx512_core"; break;
    case dnnl::cpu_isa::avx512_core_vnni: isa = "avx512_core_vnni"; break;
    case dnnl::cpu_isa::avx512_core_bf16: isa = "avx512_core_bf16"; break;
    case dnnl::cpu_isa::avx512_core_amx: isa = "avx512_core_amx"; break;
    default: isa = "other"; break;
  }
  return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
         " (effective ISA " + isa + ", OpenMP runtime)";
}

void add_dnnl_impls(std::vector<Impl>& out) {
  out.push_back({"onednn",
                 [](const Case& c) {
                   return c.op != Op::RMS_fwd && c.op != Op::RMS_bwd && !is_add(c.op) && c.prec == Prec::F32;
                 },
                 [](const Case& c, const Inputs& in) -> RunnerPtr {
                   if (c.op == Op::RMS_fwd || c.op == Op::RMS_bwd) return nullptr;
                   return std::make_unique<DnnlRunner>(c, in);
                 }});
}

}  // namespace nbench
