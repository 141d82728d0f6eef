// Lesson 5: where the LayerNorm goes. Pre-LN against Post-LN.
//
// A residual block adds a sublayer F (here a two-layer MLP) to its input.
// The original Transformer normalizes after the addition (Post-LN):
//
//     h <- LN(h + F(h))
//
// and most later models normalize the sublayer's input instead (Pre-LN), with
// one last LayerNorm before the output head:
//
//     h <- h + F(LN(h))
//
// Xiong et al. (2020, "On Layer Normalization in the Transformer
// Architecture") showed that at initialization the Post-LN gradients of the
// blocks near the output are large, which is why Post-LN needs a learning-
// rate warmup, while in Pre-LN the gradient is about the same in every block
// and training works without warmup.
//
// This lesson builds both networks with 12 blocks of width 32 from Eigen
// matrices and normcore's LayerNorm forward and backward, checks the
// backward pass against finite differences, prints the per-block gradient
// norms at initialization, and trains both with Adam at a constant learning
// rate (no warmup) on a toy regression task, and Post-LN once more with a
// warmup. It runs in about two seconds. The curves go to CSV files in the
// directory given as argv[1] (default: the current directory);
// examples/plot_pre_post_ln.py draws them (examples/pre_post_ln.png).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <Eigen/Dense>
#include <normcore/normcore.hpp>

#include "lesson.hpp"

using lesson::claim;
using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vec = Eigen::RowVectorXd;
using Map = Eigen::TensorMap<Eigen::Tensor<double, 2, Eigen::RowMajor>>;
using ConstMap = Eigen::TensorMap<const Eigen::Tensor<double, 2, Eigen::RowMajor>>;

constexpr int kBlocks = 12, kWidth = 32, kHidden = 64, kIn = 16, kOut = 4, kBatch = 32;

// A Gaussian sampler (Box-Muller) that draws the same numbers with every
// standard library, unlike std::normal_distribution.
struct Rng {
  std::mt19937_64 gen;
  explicit Rng(std::uint64_t seed) : gen(seed) {}
  double uniform() { return (static_cast<double>(gen() >> 11) + 0.5) * 0x1.0p-53; }
  double normal() {
    const double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  Mat matrix(int rows, int cols, double stddev) {
    Mat m(rows, cols);
    for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = stddev * normal();
    return m;
  }
};

// LayerNorm on an Eigen matrix (rows = examples), through TensorMaps.
struct Norm {
  normcore::LayerNorm<double> ln{normcore::LayerNormOptions({kWidth})};
  normcore::NormStats<double> stats;
  Eigen::Tensor<double, 1> dweight, dbias;
  Mat forward(const Mat& x) {
    Mat y(x.rows(), x.cols());
    Map ym(y.data(), y.rows(), y.cols());
    ln.forward(ConstMap(x.data(), x.rows(), x.cols()), ym, stats);
    return y;
  }
  Mat backward(const Mat& x, const Mat& dy) {  // returns dx, stores dweight, dbias
    Mat dx(x.rows(), x.cols());
    Map dxm(dx.data(), dx.rows(), dx.cols());
    ln.backward(ConstMap(x.data(), x.rows(), x.cols()), ConstMap(dy.data(), dy.rows(), dy.cols()),
                &dxm, &dweight, &dbias, &stats);
    return dx;
  }
};

// One residual block: F(v) = relu(v W1 + b1) W2 + b2, with its LayerNorm.
struct Block {
  Mat W1, W2, dW1, dW2;
  Vec b1, b2, db1, db2;
  Norm norm;
  Mat in, ln_in, a, z;  // saved by forward for backward

  Block(Rng& rng)
      : W1(rng.matrix(kWidth, kHidden, std::sqrt(2.0 / (kWidth + kHidden)))),  // Xavier
        W2(rng.matrix(kHidden, kWidth, std::sqrt(2.0 / (kWidth + kHidden)))),
        b1(Vec::Zero(kHidden)),
        b2(Vec::Zero(kWidth)) {}

  Mat mlp(const Mat& v) {
    a = (v * W1).rowwise() + b1;
    z = a.cwiseMax(0.0);
    return (z * W2).rowwise() + b2;
  }
  Mat mlp_backward(const Mat& v, const Mat& dm) {  // returns d/dv
    dW2 = z.transpose() * dm;
    db2 = dm.colwise().sum();
    const Mat da = (dm * W2.transpose()).cwiseProduct((a.array() > 0).cast<double>().matrix());
    dW1 = v.transpose() * da;
    db1 = da.colwise().sum();
    return da * W1.transpose();
  }
  Mat forward(const Mat& h, bool pre_ln) {
    in = h;
    if (pre_ln) {  // h + F(LN(h))
      ln_in = norm.forward(h);
      return h + mlp(ln_in);
    }
    ln_in = h + mlp(h);  // LN(h + F(h))
    return norm.forward(ln_in);
  }
  Mat backward(const Mat& dout, bool pre_ln) {
    if (pre_ln) return dout + norm.backward(in, mlp_backward(ln_in, dout));
    const Mat ds = norm.backward(ln_in, dout);
    return ds + mlp_backward(in, ds);
  }
  double grad_norm() const { return std::sqrt(dW1.squaredNorm() + dW2.squaredNorm()); }
};

struct Net {
  bool pre_ln;
  Mat W_in, W_out, dW_in, dW_out;
  std::vector<Block> blocks;
  Norm final_norm;  // Pre-LN only
  Mat x_saved, h_last, head_in;

  Net(bool pre, std::uint64_t seed) : pre_ln(pre) {
    Rng rng(seed);  // the same seed gives both networks the same weights
    W_in = rng.matrix(kIn, kWidth, std::sqrt(2.0 / (kIn + kWidth)));
    for (int l = 0; l < kBlocks; ++l) blocks.emplace_back(rng);
    W_out = rng.matrix(kWidth, kOut, std::sqrt(2.0 / (kWidth + kOut)));
  }
  Mat forward(const Mat& x) {
    x_saved = x;
    Mat h = x * W_in;
    for (Block& b : blocks) h = b.forward(h, pre_ln);
    h_last = h;
    head_in = pre_ln ? final_norm.forward(h) : h;
    return head_in * W_out;
  }
  double loss(const Mat& x, const Mat& y) {  // mean over examples of |f(x) - y|^2 / 2
    return 0.5 * (forward(x) - y).squaredNorm() / static_cast<double>(x.rows());
  }
  double loss_and_grad(const Mat& x, const Mat& y) {
    const Mat diff = forward(x) - y;
    const Mat dout = diff / static_cast<double>(x.rows());
    dW_out = head_in.transpose() * dout;
    Mat dh = dout * W_out.transpose();
    if (pre_ln) dh = final_norm.backward(h_last, dh);
    for (int l = kBlocks - 1; l >= 0; --l) dh = blocks[l].backward(dh, pre_ln);
    dW_in = x_saved.transpose() * dh;
    return 0.5 * diff.squaredNorm() / static_cast<double>(x.rows());
  }

  // Every parameter with its gradient, for the optimizer.
  struct Param {
    double* w;
    const double* g;
    Eigen::Index n;
  };
  std::vector<Param> params() {
    std::vector<Param> p{{W_in.data(), dW_in.data(), W_in.size()},
                         {W_out.data(), dW_out.data(), W_out.size()}};
    auto add_norm = [&](Norm& nm) {
      p.push_back({nm.ln.weight().data(), nm.dweight.data(), nm.ln.weight().size()});
      p.push_back({nm.ln.bias().data(), nm.dbias.data(), nm.ln.bias().size()});
    };
    for (Block& b : blocks) {
      p.push_back({b.W1.data(), b.dW1.data(), b.W1.size()});
      p.push_back({b.W2.data(), b.dW2.data(), b.W2.size()});
      p.push_back({b.b1.data(), b.db1.data(), b.b1.size()});
      p.push_back({b.b2.data(), b.db2.data(), b.b2.size()});
      add_norm(b.norm);
    }
    if (pre_ln) add_norm(final_norm);
    return p;
  }
};

// Adam (Kingma and Ba), constant learning rate: no warmup.
struct Adam {
  explicit Adam(double learning_rate) : lr(learning_rate) {}
  double lr, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  int t = 0;
  std::vector<std::vector<double>> m, v;
  void step(const std::vector<Net::Param>& ps) {
    if (m.empty()) {
      for (const auto& p : ps) {
        m.emplace_back(static_cast<std::size_t>(p.n), 0.0);
        v.emplace_back(static_cast<std::size_t>(p.n), 0.0);
      }
    }
    ++t;
    const double c1 = 1 - std::pow(b1, t), c2 = 1 - std::pow(b2, t);
    for (std::size_t k = 0; k < ps.size(); ++k) {
      for (Eigen::Index i = 0; i < ps[k].n; ++i) {
        const double g = ps[k].g[i];
        double& mi = m[k][static_cast<std::size_t>(i)];
        double& vi = v[k][static_cast<std::size_t>(i)];
        mi = b1 * mi + (1 - b1) * g;
        vi = b2 * vi + (1 - b2) * g * g;
        ps[k].w[i] -= lr * (mi / c1) / (std::sqrt(vi / c2) + eps);
      }
    }
  }
};

// The toy task: regress the 4 outputs of a fixed random two-layer tanh
// network of the 16 inputs.
struct Task {
  Mat A, B;
  explicit Task(Rng& rng)
      : A(rng.matrix(kIn, 32, 1.0 / std::sqrt(kIn))), B(rng.matrix(32, kOut, 1.0 / std::sqrt(32))) {}
  void sample(Rng& rng, int n, Mat& x, Mat& y) const {
    x = rng.matrix(n, kIn, 1.0);
    y = (x * A).array().tanh().matrix() * B;
  }
};

// Central finite difference of the loss in weight w, against the gradient
// `analytic` that backward computed for it.
double fd_check(Net& net, double& w, double analytic, const Mat& x, const Mat& y) {
  const double h = 1e-5, w0 = w;
  w = w0 + h;
  const double up = net.loss(x, y);
  w = w0 - h;
  const double down = net.loss(x, y);
  w = w0;
  const double numeric = (up - down) / (2 * h);
  return std::fabs(analytic - numeric) / std::max(std::fabs(analytic), std::fabs(numeric));
}

// Adam on fresh batches of 32 for kSteps steps at learning rate kLr, the
// rate ramped up linearly over the first `warmup` steps (0: no warmup).
// Returns the held-out loss every 10 steps.
constexpr int kSteps = 400;
constexpr double kLr = 1e-2;
std::vector<double> train(Net& net, const Task& task, int warmup, const Mat& x_eval,
                          const Mat& y_eval) {
  Adam opt(kLr);
  Rng batch_rng(11);  // every run sees the same batches
  std::vector<double> curve;
  for (int step = 0; step <= kSteps; ++step) {
    if (step % 10 == 0) curve.push_back(net.loss(x_eval, y_eval));
    if (step == kSteps) break;
    Mat x, y;
    task.sample(batch_rng, kBatch, x, y);
    net.loss_and_grad(x, y);
    opt.lr = warmup > 0 ? kLr * std::min(1.0, (step + 1.0) / warmup) : kLr;
    opt.step(net.params());
  }
  return curve;
}

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  Rng data_rng(7);
  const Task task(data_rng);
  Mat x_eval, y_eval;
  task.sample(data_rng, 256, x_eval, y_eval);  // held out: the loss curves use it

  // --- 1. The backward pass, checked. ----------------------------------------
  // One weight deep inside each network: the first block's W1 in Post-LN (its
  // gradient passes back through all 12 LayerNorms) and the first block's
  // LayerNorm gain in Pre-LN (normcore's dweight). Central differences in
  // double agree with backward to better than 1e-6.
  {
    Net post(false, 1), pre(true, 1);
    post.loss_and_grad(x_eval, y_eval);
    pre.loss_and_grad(x_eval, y_eval);
    const double e1 = fd_check(post, post.blocks[0].W1(3, 5), post.blocks[0].dW1(3, 5), x_eval, y_eval);
    const double e2 = fd_check(pre, pre.blocks[0].norm.ln.weight()(7), pre.blocks[0].norm.dweight(7),
                               x_eval, y_eval);
    std::printf("1. finite difference check: relative error %.1e (%s)  [Post-LN, block 1, W1]\n", e1,
                e1 < 1e-6 ? "ok" : "WRONG");
    std::printf("   finite difference check: relative error %.1e (%s)  [Pre-LN, block 1, LN gain]\n", e2,
                e2 < 1e-6 ? "ok" : "WRONG");
    claim(e1 < 1e-6, "Post-LN W1 gradient matches finite differences");
    claim(e2 < 1e-6, "Pre-LN LayerNorm gain gradient matches finite differences");
  }

  // --- 2. Gradient norms at initialization. ----------------------------------
  // Same weights, same 256 held-out examples; the norm of the gradient of
  // each block's MLP weights (W1 and W2). Post-LN's grow toward the output
  // and its last block's is several times Pre-LN's; Pre-LN's stay within a
  // factor of about two of each other (here they shrink toward the output).
  Net pre(true, 1), post(false, 1), post_warm(false, 1);
  pre.loss_and_grad(x_eval, y_eval);
  post.loss_and_grad(x_eval, y_eval);
  std::FILE* gcsv = std::fopen((dir + "/pre_post_ln_grad.csv").c_str(), "w");
  claim(gcsv != nullptr, "the gradient CSV file can be written");
  if (gcsv) std::fprintf(gcsv, "block,pre_ln,post_ln\n");
  std::printf("2. gradient norm of each block's MLP weights at initialization\n");
  std::printf("   block   Pre-LN   Post-LN\n");
  for (int l = 0; l < kBlocks; ++l) {
    const double gp = pre.blocks[l].grad_norm(), gq = post.blocks[l].grad_norm();
    std::printf("   %5d  %7.3f  %8.3f\n", l + 1, gp, gq);
    if (gcsv) std::fprintf(gcsv, "%d,%.6g,%.6g\n", l + 1, gp, gq);
  }
  if (gcsv) std::fclose(gcsv);
  const double pre_spread = pre.blocks[kBlocks - 1].grad_norm() / pre.blocks[0].grad_norm();
  const double post_spread = post.blocks[kBlocks - 1].grad_norm() / post.blocks[0].grad_norm();
  const double last_ratio = post.blocks[kBlocks - 1].grad_norm() / pre.blocks[kBlocks - 1].grad_norm();
  std::printf("   block 12 / block 1: Pre-LN %.2f, Post-LN %.2f; at block 12, Post-LN / Pre-LN = %.1f\n",
              pre_spread, post_spread, last_ratio);
  claim(post_spread > 1.5, "Post-LN gradients grow toward the output");
  claim(last_ratio > 2.0, "Post-LN's last-block gradient is more than twice Pre-LN's");
  claim(pre_spread > 0.4 && pre_spread < 2.5, "Pre-LN's first and last block gradients are within ~2x");

  // --- 3. Training without warmup. -------------------------------------------
  // Adam at learning rate 1e-2 from the first step. Pre-LN trains. Post-LN
  // does not: within a few dozen steps it settles at the loss of predicting
  // the mean of y, and stays there. The same Post-LN network with the rate
  // ramped up over 100 steps (warmup) trains like Pre-LN.
  const double mean_loss = 0.5 * (y_eval.rowwise() - y_eval.colwise().mean()).squaredNorm() / 256.0;
  const std::vector<double> c_pre = train(pre, task, 0, x_eval, y_eval);
  const std::vector<double> c_post = train(post, task, 0, x_eval, y_eval);
  const std::vector<double> c_warm = train(post_warm, task, 100, x_eval, y_eval);
  std::printf("3. held-out loss, Adam at lr %.0e (predicting the mean of y scores %.4f)\n", kLr,
              mean_loss);
  std::printf("   step   Pre-LN   Post-LN   Post-LN + warmup\n");
  std::FILE* lcsv = std::fopen((dir + "/pre_post_ln_loss.csv").c_str(), "w");
  claim(lcsv != nullptr, "the loss CSV file can be written");
  if (lcsv) std::fprintf(lcsv, "step,pre_ln,post_ln,post_ln_warmup\n");
  for (std::size_t i = 0; i < c_pre.size(); ++i) {
    if (lcsv) std::fprintf(lcsv, "%zu,%.6g,%.6g,%.6g\n", 10 * i, c_pre[i], c_post[i], c_warm[i]);
    if (i % 5 == 0) {
      std::printf("   %4zu  %7.4f  %8.4f  %8.4f\n", 10 * i, c_pre[i], c_post[i], c_warm[i]);
    }
  }
  if (lcsv) std::fclose(lcsv);
  std::printf("   wrote %s/pre_post_ln_grad.csv and %s/pre_post_ln_loss.csv\n", dir.c_str(), dir.c_str());
  claim(c_pre.back() < 0.2 * mean_loss, "Pre-LN without warmup ends below 1/5 of the mean's loss");
  claim(c_post.back() > 0.5 * mean_loss, "Post-LN without warmup stays near the mean's loss");
  claim(c_warm.back() < 0.2 * mean_loss, "Post-LN with warmup ends below 1/5 of the mean's loss");
  return lesson::finish("05_pre_ln_vs_post_ln");
}
