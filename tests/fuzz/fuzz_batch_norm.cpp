// libFuzzer target: normcore::BatchNorm (training and eval, any channel
// axis, with and without running statistics) against normcore::reference.
#include "fuzz_common.hpp"

namespace {

using namespace ncfuzz;

template <typename T, int Layout>
void fuzz(FuzzedDataProvider& p) {
  using Map = Eigen::TensorMap<Eigen::Tensor<T, 3, Layout>>;
  constexpr bool rm = Layout == Eigen::RowMajor;
  Dims3 d;
  d[0] = p.ConsumeIntegralInRange<Index>(0, 9);
  d[1] = p.ConsumeIntegralInRange<Index>(1, 24);
  d[2] = pick_length(p, 2049);
  while (d[0] * d[1] * d[2] > kMaxElements) d[2] = (d[2] + 1) / 2;
  if (p.ConsumeBool()) std::swap(d[1], d[2]);  // channels last, or many channels
  static const int axes[] = {1, -1, 0, 2, -2, -3, 1, -1};
  const int axis_opt = axes[p.ConsumeIntegralInRange<std::size_t>(0, std::size(axes) - 1)];
  const int axis = axis_opt < 0 ? 3 + axis_opt : axis_opt;
  const Index C = d[static_cast<std::size_t>(axis)];
  Index outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= d[static_cast<std::size_t>(i)];
  for (int i = axis + 1; i < 3; ++i) inner *= d[static_cast<std::size_t>(i)];
  const Index total = d[0] * d[1] * d[2];
  const Index count = outer * inner;

  static const double eps_choices[] = {1e-5, 1e-5, 1e-3, 0.0, 1e-12, 1.0};
  const double eps = eps_choices[p.ConsumeIntegralInRange<std::size_t>(0, std::size(eps_choices) - 1)];
  static const double mom_choices[] = {0.1, 0.1, 0.0, 1.0, -1 /* unset */, 0.5};
  const double mom = mom_choices[p.ConsumeIntegralInRange<std::size_t>(0, std::size(mom_choices) - 1)];
  const bool affine = p.ConsumeIntegralInRange<int>(0, 3) != 0;
  const bool track = p.ConsumeIntegralInRange<int>(0, 3) != 0;
  const bool training = p.ConsumeBool();
  const int scenario = p.ConsumeIntegralInRange<int>(0, 19);
  auto opts = [&](Index c) {
    normcore::BatchNormOptions o(c);
    o.eps(eps).affine(affine).track_running_stats(track).channel_axis(axis_opt);
    if (mom >= 0) o.momentum(mom); else o.momentum(std::nullopt);
    return o;
  };
  if (scenario == 13) {
    expect_invalid("BatchNorm: num_features <= 0", [&] { normcore::BatchNorm<T> b(opts(-p.ConsumeIntegralInRange<Index>(0, 2))); });
    expect_invalid("BatchNorm: negative eps", [&] { normcore::BatchNorm<T> b(opts(C > 0 ? C : 1).eps(-1e-5)); });
    expect_invalid("BatchNorm: NaN eps", [&] { normcore::BatchNorm<T> b(opts(C > 0 ? C : 1).eps(std::nan(""))); });
    expect_invalid("BatchNorm: momentum > 1", [&] { normcore::BatchNorm<T> b(opts(C > 0 ? C : 1).momentum(1.5)); });
    expect_invalid("BatchNorm: NaN momentum", [&] { normcore::BatchNorm<T> b(opts(C > 0 ? C : 1).momentum(std::nan(""))); });
    return;
  }
  if (C == 0) {  // a zero-size channel dim: no valid layer has it
    expect_invalid("BatchNorm: num_features 0", [&] { normcore::BatchNorm<T> b(opts(C)); });
    return;
  }
  normcore::BatchNorm<T> bn(opts(C));
  bn.train(training);
  if (affine) {
    fill_params(p, bn.weight().data(), C, 1.0);
    fill_params(p, bn.bias().data(), C, 0.0);
  }
  if (track) {
    for (Index c = 0; c < C; ++c) {
      bn.running_mean()(c) = static_cast<T>(p.ConsumeIntegralInRange<int>(-512, 512) / 128.0);
      bn.running_var()(c) = static_cast<T>(p.ConsumeIntegralInRange<int>(0, 512) / 128.0);
    }
  }
  const T* gamma = affine ? bn.weight().data() : nullptr;
  const T* beta = affine ? bn.bias().data() : nullptr;

  // Logical data viewed as (outer, C, inner); channel c drawn from gens[c].
  std::vector<RowGen<T>> gens(static_cast<std::size_t>(C));
  for (auto& g : gens) g = pick_row_gen<T>(p);
  std::vector<T> xl(static_cast<std::size_t>(total)), dyl(static_cast<std::size_t>(total));
  RowGen<T> gd;
  gd.scale = std::ldexp(1.0, p.ConsumeIntegralInRange<int>(-4, 4));
  const bool wild_dy = p.ConsumeIntegralInRange<int>(0, 7) == 0;
  for (Index o = 0; o < outer; ++o)
    for (Index c = 0; c < C; ++c)
      for (Index i = 0; i < inner; ++i) {
        const std::size_t at = static_cast<std::size_t>((o * C + c) * inner + i);
        xl[at] = draw(p, gens[static_cast<std::size_t>(c)]);
        gd.mode = wild_dy && c == 0 ? Mode::kWild : Mode::kModerate;
        dyl[at] = draw(p, gd);
      }
  Slab<T> xs(total, p.ConsumeIntegralInRange<Index>(0, 15)), ys(total, p.ConsumeIntegralInRange<Index>(0, 15)),
      dys(total, p.ConsumeIntegralInRange<Index>(0, 15)), dxs(total, p.ConsumeIntegralInRange<Index>(0, 15));
  to_memory(rm, d, xl, xs.data());
  to_memory(rm, d, dyl, dys.data());
  Map x(xs.data(), d[0], d[1], d[2]), y(ys.data(), d[0], d[1], d[2]), dy(dys.data(), d[0], d[1], d[2]),
      dx(dxs.data(), d[0], d[1], d[2]);
  const auto rm0 = bn.running_mean(), rv0 = bn.running_var();

  if (scenario >= 14) {
    Eigen::Tensor<T, 3, Layout> other(d[0] + 1, d[1] + 1, d[2] + 1);
    other.setZero();
    normcore::NormStats<T> st;
    Eigen::Tensor<T, 1> dw;
    switch (scenario) {
      case 14: {
        normcore::BatchNorm<T> wrong(opts(C + 1));
        expect_invalid("BatchNorm: channel count differs", [&] { wrong.forward(x, y); });
        normcore::BatchNorm<T> bad_axis(opts(C).channel_axis(p.ConsumeBool() ? 3 : -4));
        expect_invalid("BatchNorm: channel axis out of range", [&] { bad_axis.forward(x, y); });
        Eigen::TensorMap<Eigen::Tensor<T, 1, Layout>> flat(xs.data(), total);
        expect_invalid("BatchNorm: rank-1 input", [&] { bad_axis.forward(flat, flat); });
        break;
      }
      case 15:
        expect_invalid("BatchNorm: output shape differs", [&] { bn.forward(x, other); });
        break;
      case 16:
        expect_invalid("BatchNorm: dy shape differs", [&] { bn.backward(x, other); });
        expect_invalid("BatchNorm: dx shape differs", [&] { bn.backward(x, dy, &other, nullptr, nullptr); });
        break;
      case 17:
        st.mean.resize(C + 1);
        st.rstd.resize(C);
        expect_invalid("BatchNorm: saved mean of the wrong size", [&] { bn.backward(x, dy, &st); });
        break;
      default:
        if (!affine) expect_invalid("BatchNorm: dweight without affine", [&] { bn.backward(x, dy, &dx, &dw, nullptr); });
        break;
    }
    xs.check("x");
    ys.check("y");
    dxs.check("dx");
    return;
  }

  const bool batch = training || !track;
  if (training && count <= 1) {
    normcore::NormStats<T> st;
    expect_invalid("BatchNorm: training on one value per channel", [&] { bn.forward(x, y, st); });
    if (bn.num_batches_tracked() != 0) report("BatchNorm: a failed forward counted a batch", "");
    return;
  }
  normcore::NormStats<T> saved;
  bn.forward(x, y, saved);
  xs.check("x");
  ys.check("y");
  if (count == 0) return;
  const std::string note = shape_note("BatchNorm", std::is_same<T, float>::value, rm, d,
                                      "axis=" + std::to_string(axis_opt) + (training ? " train" : " eval") +
                                          (track ? " track" : "") + " eps=" + std::to_string(eps));
  // Reference statistics: the batch's, or the running ones before the call.
  normcore::reference::ChannelStats st = normcore::reference::channel_stats(xl.data(), outer, C, inner);
  normcore::reference::ChannelStats use = st;
  if (!batch)
    for (Index c = 0; c < C; ++c) {
      use.mean[static_cast<std::size_t>(c)] = static_cast<double>(rm0(c));
      use.var[static_cast<std::size_t>(c)] = static_cast<double>(rv0(c));
    }
  const auto yref = normcore::reference::batch_norm_forward(xl.data(), outer, C, inner, use.mean, use.var, gamma, beta, eps);
  const auto gref = normcore::reference::batch_norm_backward(xl.data(), dyl.data(), outer, C, inner, use.mean, use.var, gamma, eps, batch);
  const std::vector<T> yl = to_logical(rm, d, ys.data());

  Eigen::Tensor<T, 1> dw, db, dw2, db2;
  bn.backward(x, dy, &dx, affine ? &dw : nullptr, affine ? &db : nullptr, &saved);
  xs.check("x");
  dxs.check("dx");
  const std::vector<T> dxl = to_logical(rm, d, dxs.data());

  const double big = std::is_same<T, float>::value ? 0x1p50 : 0x1p400;
  const double small = std::is_same<T, float>::value ? 0x1p-90 : 0x1p-900;
  const double n = static_cast<double>(count);
  const double grow = growth(n) + std::min(n, 256.0);
  bool all_ok = true;
  for (Index c = 0; c < C; ++c) {
    const std::size_t cc = static_cast<std::size_t>(c);
    double xmax = 0, dymax = 0, sdy = 0;
    bool fin = true, dyfin = true;
    for (Index o = 0; o < outer; ++o)
      for (Index i = 0; i < inner; ++i) {
        const std::size_t at = static_cast<std::size_t>((o * C + c) * inner + i);
        fin = fin && std::isfinite(xl[at]);
        dyfin = dyfin && std::isfinite(dyl[at]);
        xmax = std::max(xmax, std::fabs(static_cast<double>(xl[at])));
        dymax = std::max(dymax, std::fabs(static_cast<double>(dyl[at])));
        sdy += std::fabs(static_cast<double>(dyl[at]));
      }
    const double rs = 1.0 / std::sqrt(use.var[cc] + eps);
    const bool ok = fin && xmax <= big && use.var[cc] + eps >= small && std::isfinite(rs) && rs * (xmax + std::fabs(use.mean[cc])) < 1e30;
    all_ok = all_ok && ok && dyfin;
    if (!ok) continue;
    const double quant = std::fabs(use.mean[cc]) * rs;
    double xh = 0;
    for (Index o = 0; o < outer; ++o)
      for (Index i = 0; i < inner; ++i)
        xh = std::max(xh, std::fabs((static_cast<double>(xl[static_cast<std::size_t>((o * C + c) * inner + i)]) - use.mean[cc]) * rs));
    const double G = gamma ? std::fabs(static_cast<double>(gamma[c])) : 1.0, B = beta ? std::fabs(static_cast<double>(beta[c])) : 0.0;
    const double ytol = 8 * ueps<T>() * ((xh + quant + 1) * G + B) * growth(n);
    const double dxtol = batch ? 16 * ueps<T>() * rs * G * dymax * (2 + xh * xh) * (1 + quant) * grow
                               : 4 * ueps<T>() * rs * G * dymax;
    for (Index o = 0; o < outer; ++o)
      for (Index i = 0; i < inner; ++i) {
        const std::size_t at = static_cast<std::size_t>((o * C + c) * inner + i);
        if (!close(static_cast<double>(yl[at]), yref[at], ytol))
          report("BatchNorm forward vs reference", note + "\n  " + describe("y", static_cast<Index>(at), yl[at], yref[at], ytol));
        if (dyfin && !close(static_cast<double>(dxl[at]), gref.dx[at], dxtol))
          report("BatchNorm backward dx vs reference", note + "\n  " + describe("dx", static_cast<Index>(at), dxl[at], gref.dx[at], dxtol));
      }
    if (affine && dyfin) {
      const double wtol = 8 * ueps<T>() * sdy * (xh + 1) * (1 + quant) * grow;
      if (!close(static_cast<double>(dw(c)), gref.dweight[cc], wtol))
        report("BatchNorm backward dweight vs reference", note + "\n  " + describe("dweight", c, dw(c), gref.dweight[cc], wtol));
      if (!close(static_cast<double>(db(c)), gref.dbias[cc], 4 * ueps<T>() * sdy * grow))
        report("BatchNorm backward dbias vs reference", note + "\n  " + describe("dbias", c, db(c), gref.dbias[cc], 4 * ueps<T>() * sdy * grow));
    }
    // Running statistics after a training step.
    if (training && track) {
      const double f = mom >= 0 ? mom : 1.0;
      const double want_m = (1 - f) * static_cast<double>(rm0(c)) + f * st.mean[cc];
      const double want_v = (1 - f) * static_cast<double>(rv0(c)) + f * st.var[cc] * n / (n - 1);
      const double tm = 8 * ueps<T>() * (std::fabs(want_m) + xmax) * growth(n);
      const double tv = 8 * ueps<T>() * (std::fabs(want_v) + xmax * xmax) * growth(n);
      if (!close(static_cast<double>(bn.running_mean()(c)), want_m, tm))
        report("BatchNorm running_mean", note + "\n  " + describe("running_mean", c, bn.running_mean()(c), want_m, tm));
      if (!close(static_cast<double>(bn.running_var()(c)), want_v, tv))
        report("BatchNorm running_var", note + "\n  " + describe("running_var", c, bn.running_var()(c), want_v, tv));
    }
  }
  if (training && track && bn.num_batches_tracked() != 1) report("BatchNorm: num_batches_tracked", note);
  // Backward recomputing the statistics equals backward from the saved ones.
  Eigen::Tensor<T, 3, Layout> dx2(d[0], d[1], d[2]);
  bn.backward(x, dy, &dx2, affine ? &dw2 : nullptr, affine ? &db2 : nullptr, nullptr);
  if (all_ok) {
    if (!bit_equal(dx2.data(), dxs.data(), total)) report("BatchNorm backward: saved vs recomputed statistics differ (dx)", note);
    if (affine && !bit_equal(dw.data(), dw2.data(), C)) report("BatchNorm backward: saved vs recomputed statistics differ (dweight)", note);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider p(data, size);
  switch (p.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: fuzz<float, Eigen::RowMajor>(p); break;
    case 1: fuzz<float, Eigen::ColMajor>(p); break;
    case 2: fuzz<double, Eigen::RowMajor>(p); break;
    default: fuzz<double, Eigen::ColMajor>(p); break;
  }
  return 0;
}
