// Shared helpers of the benchmark suite: names, the thread setting.
#include "bench_common.hpp"

#include <cstdio>

namespace nbench {

namespace {
int g_threads = 1;
}

int threads() { return g_threads; }
void set_threads(int n) { g_threads = n < 1 ? 1 : n; }

std::string Case::op_name() const {
  std::string base;
  switch (op) {
    case Op::LN_fwd: base = "LN_fwd"; break;
    case Op::LN_fwd_stats: base = "LN_fwd_stats"; break;
    case Op::LN_bwd: base = "LN_bwd"; break;
    case Op::RMS_fwd: base = "RMS_fwd"; break;
    case Op::RMS_bwd: base = "RMS_bwd"; break;
    case Op::ADD_LN_fwd: base = "ADD_LN_fwd"; break;
    case Op::ADD_RMS_fwd: base = "ADD_RMS_fwd"; break;
    case Op::BN_train: base = "BN_train"; break;
    case Op::BN_eval: base = "BN_eval"; break;
    case Op::BN_bwd: base = "BN_bwd"; break;
  }
  if (is_batch_norm(op)) base += layout == Layout::NHWC ? "_nhwc" : "_nchw";
  if (prec == Prec::BF16) base += "_bf16";
  if (prec == Prec::F16) base += "_f16";
  return base;
}

std::string Case::shape_name() const {
  std::vector<std::int64_t> d = dims;
  if (is_batch_norm(op) && is_2d_bn()) d.resize(2);
  std::string s;
  for (std::size_t i = 0; i < d.size(); ++i) {
    if (i) s += 'x';
    s += std::to_string(d[i]);
  }
  return s;
}

std::vector<float> to_float(const std::vector<double>& v) {
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v[i]);
  return f;
}

std::vector<float> copy_of(const float* p, std::size_t n) { return std::vector<float>(p, p + n); }

}  // namespace nbench
