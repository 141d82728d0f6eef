// SyncBatchNorm: BatchNorm over a batch that is spread across MPI ranks.
//
// Data parallel training gives every process a share of each batch. A plain
// BatchNorm would then normalize each share with that share's own mean and
// variance: a different function on every rank, and a noisier one the
// smaller the shares. With a reducer (normcore/mpi.hpp), every training
// forward merges the ranks' per-channel (count, mean, M2) and every backward
// sums the ranks' per-channel gradient sums, so the ranks together compute
// exactly the function one process computes on the whole batch: the same
// output, the same dx, the same running statistics. dweight and dbias stay
// per rank (as in PyTorch's SyncBatchNorm): they are summed across ranks
// like the gradient of any other parameter.
//
// Below: a batch of 12 images (N, C, H, W) = (12, 3, 4, 4), shared unevenly
// (rank r's share grows with r; with more ranks than that, some ranks get
// none, which works too). A few SGD steps fit BatchNorm's weight and bias to
// a target (1.5 and 0.25). Each rank also runs one process's BatchNorm on the whole batch,
// to compare with: rank 0 prints every rank's largest difference.
//
//   mpirun -np 2 ./sync_batch_norm
//   mpirun -np 5 --oversubscribe ./sync_batch_norm
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <normcore/batch_norm.hpp>
#include <normcore/mpi.hpp>

using normcore::Index;
using Images = Eigen::Tensor<float, 4, Eigen::RowMajor>;
using ImagesMap = Eigen::TensorMap<Eigen::Tensor<float, 4, Eigen::RowMajor>>;

namespace {

int claims = 0, failed = 0;
void claim(bool ok, const char* what) {  // evaluated alike on every rank
  ++claims;
  if (!ok) {
    ++failed;
    std::printf("CLAIM FAILED: %s\n", what);
  }
}

double max_abs_diff(const float* a, const float* b, Index n) {
  double m = 0;
  for (Index i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  {  // the reducer must be destroyed before MPI_Finalize: give it this scope
    const Index N = 12, C = 3, H = 4, W = 4, block = C * H * W;

    // Rank r's share of the batch: about N (r + 1) / (1 + 2 + ... + size).
    std::vector<Index> first(static_cast<std::size_t>(size) + 1, 0);
    const double total = static_cast<double>(size) * (size + 1) / 2;
    for (int r = 1; r <= size; ++r)
      first[static_cast<std::size_t>(r)] = static_cast<Index>(std::floor(N * (r * (r + 1) / 2) / total + 0.5));
    const Index n0 = first[static_cast<std::size_t>(rank)], n = first[static_cast<std::size_t>(rank) + 1] - n0;

    normcore::MpiBatchNormReducer reducer;  // MPI_COMM_WORLD
    normcore::BatchNorm<float> bn{normcore::BatchNormOptions(C)};
    bn.set_reducer(&reducer);
    normcore::BatchNorm<float> whole{normcore::BatchNormOptions(C)};  // to compare with

    if (rank == 0)
      std::printf("%d rank%s, batch of %ld images of %ld channels, shares:", size, size == 1 ? "" : "s", long(N), long(C));
    for (int r = 0; r < size && rank == 0; ++r)
      std::printf(" %ld", long(first[static_cast<std::size_t>(r) + 1] - first[static_cast<std::size_t>(r)]));
    if (rank == 0) std::printf("\n");

    std::mt19937 gen(7);  // the same stream on every rank: every rank knows the whole batch
    std::normal_distribution<float> noise(0.0f, 1.0f);
    const float lr = 0.5f / float(N * H * W);  // 0.5 on the mean loss per value
    double worst = 0;  // largest difference on this rank over all steps
    for (int step = 0; step < 5; ++step) {
      // Images with channel means 5, -2, 0.5 and scales 2, 0.5, 1; target:
      // the standardized image times 1.5, plus 0.25.
      Images x(N, C, H, W), target(N, C, H, W);
      const float mean[3] = {5.0f, -2.0f, 0.5f}, scale[3] = {2.0f, 0.5f, 1.0f};
      for (Index i = 0; i < N; ++i)
        for (Index c = 0; c < C; ++c)
          for (Index h = 0; h < H; ++h)
            for (Index w = 0; w < W; ++w) {
              const float z = noise(gen);
              x(i, c, h, w) = mean[c] + scale[c] * z;
              target(i, c, h, w) = 1.5f * z + 0.25f;
            }

      // This rank: its share only.
      ImagesMap xr(x.data() + n0 * block, n, C, H, W);
      Images yr(n, C, H, W);
      normcore::NormStats<float> saved;
      bn.forward(xr, yr, saved);
      Images dyr = yr - ImagesMap(target.data() + n0 * block, n, C, H, W);  // loss 0.5 |y - target|^2
      const auto g = bn.backward(xr, dyr, &saved);
      // Parameter gradients are per rank: sum them, as for any parameter.
      std::vector<float> grads(static_cast<std::size_t>(2 * C));
      std::copy(g.dweight.data(), g.dweight.data() + C, grads.begin());
      std::copy(g.dbias.data(), g.dbias.data() + C, grads.begin() + C);
      MPI_Allreduce(MPI_IN_PLACE, grads.data(), static_cast<int>(2 * C), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double loss = 0;
      for (Index i = 0; i < n * block; ++i) loss += 0.5 * double(dyr.data()[i]) * double(dyr.data()[i]);
      MPI_Allreduce(MPI_IN_PLACE, &loss, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);

      // One process, the whole batch.
      Images y(N, C, H, W);
      normcore::NormStats<float> whole_saved;
      whole.forward(x, y, whole_saved);
      Images dy = y - target;
      const auto gw = whole.backward(x, dy, &whole_saved);

      // Compare this rank's rows of y and dx with the whole batch's.
      worst = std::max(worst, max_abs_diff(yr.data(), y.data() + n0 * block, n * block));
      worst = std::max(worst, max_abs_diff(g.dx.data(), gw.dx.data() + n0 * block, n * block));
      // The gradient sums relative to their size (sums of 192 values per channel).
      for (Index c = 0; c < C; ++c) {
        const auto rel = [](double a, double b) { return std::fabs(a - b) / std::max(1.0, std::fabs(b)); };
        worst = std::max(worst, rel(grads[static_cast<std::size_t>(c)], gw.dweight(c)));
        worst = std::max(worst, rel(grads[static_cast<std::size_t>(C + c)], gw.dbias(c)));
      }
      if (rank == 0) std::printf("step %d: loss %.4f\n", step, loss);

      // SGD, the same update everywhere.
      for (Index c = 0; c < C; ++c) {
        bn.weight()(c) -= lr * grads[static_cast<std::size_t>(c)];
        bn.bias()(c) -= lr * grads[static_cast<std::size_t>(C + c)];
        whole.weight()(c) -= lr * gw.dweight(c);
        whole.bias()(c) -= lr * gw.dbias(c);
      }
    }
    for (Index c = 0; c < C; ++c) {
      worst = std::max(worst, std::fabs(double(bn.running_mean()(c)) - double(whole.running_mean()(c))));
      worst = std::max(worst, std::fabs(double(bn.running_var()(c)) - double(whole.running_var()(c))));
      worst = std::max(worst, std::fabs(double(bn.weight()(c)) - double(whole.weight()(c))));
    }

    // Every rank's largest difference, printed by rank 0 in rank order.
    std::vector<double> per_rank(static_cast<std::size_t>(size));
    MPI_Allgather(&worst, 1, MPI_DOUBLE, per_rank.data(), 1, MPI_DOUBLE, MPI_COMM_WORLD);
    const double all = *std::max_element(per_rank.begin(), per_rank.end());
    // float values of size ~4 (standardized images), rounded differently on
    // a share than on the whole batch: a few float epsilons.
    const double bound = 1e-5;
    if (rank == 0) {
      for (int r = 0; r < size; ++r)
        std::printf("rank %d (%ld images): max |difference| from one process on the whole batch %.3g\n", r,
                    long(first[static_cast<std::size_t>(r) + 1] - first[static_cast<std::size_t>(r)]),
                    per_rank[static_cast<std::size_t>(r)]);
      std::printf("after 5 steps, channel by channel: weight");
      for (Index c = 0; c < C; ++c) std::printf(" %.3f", double(bn.weight()(c)));
      std::printf(", bias");
      for (Index c = 0; c < C; ++c) std::printf(" %.3f", double(bn.bias()(c)));
      std::printf(", running_mean");
      for (Index c = 0; c < C; ++c) std::printf(" %.3f", double(bn.running_mean()(c)));
      std::printf("\n");
      std::printf("ranks together vs one process: max |difference| %.3g (%s)\n", all, all <= bound ? "ok" : "too large");
    }
    claim(all <= bound, "the ranks together compute what one process computes on the whole batch");
    double off = 0;
    for (Index c = 0; c < C; ++c)
      off = std::max({off, std::fabs(double(bn.weight()(c)) - 1.5), std::fabs(double(bn.bias()(c)) - 0.25)});
    claim(off < 0.1, "SGD brought weight and bias near the target's 1.5 and 0.25");
    // Every rank evaluated the same claims on the same gathered numbers.
  }
  int bad = failed;
  MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) {
    if (bad) std::printf("sync_batch_norm: %d of %d claims FAILED\n", bad, claims);
    else std::printf("sync_batch_norm: all %d claims hold\n", claims);
  }
  MPI_Finalize();
  return bad ? 1 : 0;
}
