// normcore::BatchNorm: PyTorch's nn.BatchNorm1d/2d/3d over Eigen tensors.
//
//   normcore::BatchNorm<float> bn(normcore::BatchNormOptions(64).momentum(0.1));
//   Eigen::Tensor<float, 4, Eigen::RowMajor> y = bn(x);   // (N, C, H, W), training
//   bn.eval();  y = bn(x);                                 // running statistics
//   normcore::BatchNorm<float> nhwc(normcore::BatchNormOptions(64).channel_axis(-1));
//
// Statistics per channel over every other dim. Training normalizes with the
// batch mean and biased variance and updates the running statistics with the
// unbiased variance: running = (1 - m) * running + m * batch (m = 1 /
// num_batches_tracked when momentum is unset). Not thread-safe in training
// mode (the running statistics change); eval mode is const in effect.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "normcore/common.hpp"
#include "normcore/detail/normalize.hpp"
#include "normcore/detail/scratch.hpp"
#include "normcore/mixed.hpp"
#include "normcore/parallel.hpp"
#include "normcore/statistics.hpp"
#include "normcore/welford.hpp"

namespace normcore {

namespace detail {

/// Channels per group of BatchNorm's fused channels-first passes (the
/// backward's, and on Intel CPUs the training forward's), for segments of
/// `inner` values and `channel_bytes` bytes a channel of what the pass reads
/// twice (x and dy; the forward: x): enough channels that each run of
/// contiguous values is at least `run` long (what the hardware prefetcher
/// needs). On Intel CPUs (intel_tuned), no more of them than half of the L2
/// (backward_l2_bytes) holds, at least one channel: the second pass (dx, y)
/// then reads them back from the L2. Measured, for the backward on an Intel
/// Xeon guest (2 MB of L2, float, two builds of one driver alternating, the
/// same bits): one channel a group instead of two took 0.92x the time at
/// 32x64x56x56 (0.8 MB of x and dy a channel), 0.83x at 64x64x56x56 and 0.94x
/// at 32x64x48x48; on 2 threads 0.92x and 0.84x. At 128x64x56x56 (3.2 MB a
/// channel, so no longer two channels under the fused size limit: two passes
/// before) 0.96x. With groups that small, shorter segments fuse too when a
/// group's run is long enough (BatchNorm::backward_impl): against two passes,
/// 0.72-0.86x the time at 16x512x14x14, 32x64x28x28, 64x128x28x28, 32x256x7x7
/// and 64x512x7x7 (2 threads: 0.74-0.86x), 0.98-1.00x at 4x32x7x7, 8x64x14x14
/// and 16x256x7x7; 256x256x14x14 (groups of 2 channels, runs of 392 values)
/// took 1.10x fused and keeps two passes.
inline Index fused_channel_group(Index inner, Index channel_bytes, Index run) {
  const Index runs = std::max<Index>(1, (run + inner - 1) / std::max<Index>(1, inner));
  if (!intel_tuned()) return runs;
  const Index fit = backward_l2_bytes() / 2 / std::max<Index>(1, channel_bytes);
  return std::max<Index>(1, std::min<Index>(runs, fit));
}

}  // namespace detail

/// Options of BatchNorm, named as in the libtorch C++ frontend.
class BatchNormOptions {
 public:
  /* implicit */ BatchNormOptions(Index num_features) : num_features_(num_features) {}
  BatchNormOptions& num_features(Index v) {
    num_features_ = v;
    return *this;
  }
  Index num_features() const { return num_features_; }
  /// Added to the variance. Default 1e-5.
  BatchNormOptions& eps(double v) {
    eps_ = v;
    return *this;
  }
  double eps() const { return eps_; }
  /// Weight of the new batch in the running statistics. Default 0.1;
  /// std::nullopt means the cumulative average (1 / num_batches_tracked).
  BatchNormOptions& momentum(std::optional<double> v) {
    momentum_ = v;
    return *this;
  }
  const std::optional<double>& momentum() const { return momentum_; }
  /// Learnable per-channel weight and bias. Default true.
  BatchNormOptions& affine(bool v) {
    affine_ = v;
    return *this;
  }
  bool affine() const { return affine_; }
  /// Keep running statistics (used in eval mode). Default true. Without
  /// them, batch statistics are used in both modes.
  BatchNormOptions& track_running_stats(bool v) {
    track_running_stats_ = v;
    return *this;
  }
  bool track_running_stats() const { return track_running_stats_; }
  /// The logical dim holding the channels. Default 1, as PyTorch (N, C, ...);
  /// negative counts from the end, so -1 serves channels-last data (N, H, W, C).
  BatchNormOptions& channel_axis(int v) {
    channel_axis_ = v;
    return *this;
  }
  int channel_axis() const { return channel_axis_; }

 private:
  Index num_features_;
  double eps_ = 1e-5;
  std::optional<double> momentum_ = 0.1;
  bool affine_ = true;
  bool track_running_stats_ = true;
  int channel_axis_ = 1;
};

/// The communicator seam of BatchNorm's training path (SyncBatchNorm): set
/// one with BatchNorm::set_reducer and every training forward hands its
/// per-channel Welford states to allreduce_moments, and every training
/// backward its per-channel sums to allreduce_sums, before using them. An
/// implementation combines them across processes (normcore/mpi.hpp has one
/// for MPI). Without a reducer nothing changes and no MPI header is needed.
class BatchNormReducer {
 public:
  virtual ~BatchNormReducer() = default;
  /// states[c] (count, mean, M2 of channel c on this process; count may be 0)
  /// becomes the Chan merge of that channel's states over all processes.
  virtual void allreduce_moments(Welford<double>* states, Index channels) = 0;
  /// values[i] becomes the sum of values[i] over all processes.
  virtual void allreduce_sums(double* values, Index n) = 0;
};

/// Batch normalization. P, the type of weight and bias, is float or double,
/// or Eigen::bfloat16 / Eigen::half: the 16-bit layers compute in float and
/// keep their running statistics in float (a 16-bit running variance would
/// lose most momentum updates to rounding). Tensors: as for LayerNorm.
template <typename P>
class BatchNorm {
  static_assert(std::is_same<P, float>::value || std::is_same<P, double>::value ||
                    detail::is_storage16<P>::value,
                "normcore::BatchNorm<P>: P must be float, double, Eigen::bfloat16 or Eigen::half");

 public:
  using Scalar = P;
  using Compute = detail::compute_t<P>;

 private:
  using T = Compute;

 public:

  explicit BatchNorm(const BatchNormOptions& options) : options_(options) {
    const Index C = options_.num_features();
    if (C <= 0) detail::fail(std::string(kWho) + ": expected num_features > 0, got " + std::to_string(C));
    if (!(options_.eps() >= 0.0) || !std::isfinite(options_.eps()))
      detail::fail(std::string(kWho) + ": expected eps >= 0 and finite, got " + std::to_string(options_.eps()));
    if (options_.momentum() && !(*options_.momentum() >= 0.0 && *options_.momentum() <= 1.0))
      detail::fail(std::string(kWho) + ": expected momentum in [0, 1] or unset, got " +
                   std::to_string(*options_.momentum()));
    if (options_.affine()) {
      weight_.resize(C);
      weight_.setConstant(P(1));
      bias_.resize(C);
      bias_.setConstant(P(0));
    }
    if (options_.track_running_stats()) {
      running_mean_.resize(C);
      running_mean_.setZero();
      running_var_.resize(C);
      running_var_.setConstant(T(1));
    }
  }

  const BatchNormOptions& options() const { return options_; }
  /// Training mode (the default) or eval mode.
  void train(bool on = true) { training_ = on; }
  void eval() { training_ = false; }
  bool is_training() const { return training_; }

  Eigen::Tensor<P, 1>& weight() { return weight_; }
  const Eigen::Tensor<P, 1>& weight() const { return weight_; }
  Eigen::Tensor<P, 1>& bias() { return bias_; }
  const Eigen::Tensor<P, 1>& bias() const { return bias_; }
  /// Running statistics; empty with track_running_stats(false).
  Eigen::Tensor<T, 1>& running_mean() { return running_mean_; }
  const Eigen::Tensor<T, 1>& running_mean() const { return running_mean_; }
  Eigen::Tensor<T, 1>& running_var() { return running_var_; }
  const Eigen::Tensor<T, 1>& running_var() const { return running_var_; }
  std::int64_t num_batches_tracked() const { return num_batches_tracked_; }

  /// Combines the training statistics across processes (not owned; nullptr,
  /// the default, keeps everything local). dweight and dbias stay local, as in
  /// PyTorch's SyncBatchNorm: sum them across processes as for any parameter.
  void set_reducer(BatchNormReducer* reducer) { reducer_ = reducer; }
  BatchNormReducer* reducer() const { return reducer_; }

  /// Allocating forward (updates the running statistics in training mode).
  template <typename X>
  auto operator()(const X& x) {
    auto y = detail::make_like(x);
    forward(x, y);
    return y;
  }

  template <typename X, typename Y>
  void forward(const X& x, Y&& y) {
    forward_impl(Serial(), x, y, nullptr);
  }

  /// Also saves the per-channel mean and invstd used (batch statistics when
  /// they are used, else the running ones) for backward.
  template <typename X, typename Y>
  void forward(const X& x, Y&& y, NormStats<T>& saved) {
    forward_impl(Serial(), x, y, &saved);
  }

  /// The same on a device's threads (e.g. an Eigen::ThreadPoolDevice):
  /// statistics split by channel, normalization by rows; bit-identical for
  /// any thread count.
  template <typename Device, typename X, typename Y, typename = std::enable_if_t<detail::is_device<Device>::value>>
  void forward(const Device& device, const X& x, Y&& y) {
    if (detail::to_serial(device, x.size())) return forward_impl(Serial(), x, y, nullptr);
    forward_impl(device, x, y, nullptr);
  }
  template <typename Device, typename X, typename Y, typename = std::enable_if_t<detail::is_device<Device>::value>>
  void forward(const Device& device, const X& x, Y&& y, NormStats<T>& saved) {
    if (detail::to_serial(device, x.size())) return forward_impl(Serial(), x, y, &saved);
    forward_impl(device, x, y, &saved);
  }

  /// Any subset of dx, dweight, dbias (pointers; nullptr for the ones not
  /// wanted). In training mode (or without running statistics) the gradient
  /// flows through the batch mean and variance (saved, or recomputed from
  /// x); in eval mode through fixed running statistics.
  template <typename X, typename DY, typename DX>
  void backward(const X& x, const DY& dy, DX dx, Eigen::Tensor<P, 1>* dweight,
                Eigen::Tensor<P, 1>* dbias, const NormStats<T>* saved = nullptr) const {
    backward(Serial(), x, dy, dx, dweight, dbias, saved);
  }

  template <typename Device, typename X, typename DY, typename DX,
            typename = std::enable_if_t<detail::is_device<Device>::value>>
  void backward(const Device& device, const X& x, const DY& dy, DX dx, Eigen::Tensor<P, 1>* dweight,
                Eigen::Tensor<P, 1>* dbias, const NormStats<T>* saved = nullptr) const {
    if (detail::to_serial(device, x.size())) return backward(Serial(), x, dy, dx, dweight, dbias, saved);
    detail::check_storage<T, X>();
    detail::check_same_scalar<X, DY>();
    // 16-bit x, dy and dx are read and written as stored (no float copies):
    // see backward_impl.
    using S = typename detail::tensor_traits<X>::Scalar;
    S* dxp = nullptr;
    if constexpr (!std::is_null_pointer<DX>::value) {
      using D = std::remove_pointer_t<DX>;
      static_assert(std::is_pointer<DX>::value, "normcore: pass dx as a pointer (or nullptr)");
      detail::check_same_scalar<X, D>();
      detail::check_layouts<X, D>();
      static_assert(detail::tensor_traits<D>::writable, "normcore: dx must be writable");
      if (dx) {
        detail::check_same_shape(kWho, "dx", x, *dx);
        dxp = dx->data();
      }
    }
    backward_impl(device, x, dy, dxp, dweight, dbias, saved);
  }

  template <typename X, typename DY>
  auto backward(const X& x, const DY& dy, const NormStats<T>* saved = nullptr) const {
    using Tr = detail::tensor_traits<X>;
    Gradients<P, Tr::rank, Tr::layout, typename Tr::Scalar> g;
    g.dx = detail::make_like(x);
    backward(x, dy, &g.dx, weight_.size() ? &g.dweight : nullptr,
             bias_.size() ? &g.dbias : nullptr, saved);
    return g;
  }

 private:
  static constexpr const char* kWho = "normcore::BatchNorm";
  // Fused channels-first backward: channels go in groups whose segments make
  // runs of at least kFusedRun contiguous elements, long enough for the
  // hardware prefetcher, and only if a group's x and dy fit in kFusedBytes
  // (so that the second read comes from cache). Measured on Zen 3: 0.85x
  // the time at 32x64x56x56 (1 thread); shorter segments (14x14, 7x7) got
  // slower fused, from the jumps between segments. On Intel CPUs a group
  // also keeps its x and dy within half the L2 (detail::fused_channel_group),
  // and what must be long is a group's run, not each segment.
  static constexpr Index kFusedRun = 4096;
  static constexpr Index kFusedBytes = Index(4) << 20;
  // Channels last on several threads: a window of chunks holds this many
  // bytes of per-chunk results before they are merged, or kPartsPerThread
  // chunks per thread if that is more (24 bytes per channel and chunk of up
  // to 256 rows: under 5% of a float input's size, 2.3% for full chunks; a
  // window is about 10 MB of float input or more).
  static constexpr Index kRowChunkBytes = Index(256) << 10;

  // Memory view: element (o, c, i) at data[(o * C + c) * inner + i].
  struct View {
    Index outer, C, inner;
    std::vector<Index> dims;
  };

  template <typename X>
  View view_of(const X& x) const {
    using Tr = detail::tensor_traits<X>;
    View v;
    v.dims = detail::dims_of(x);
    const int rank = Tr::rank;
    const int axis = options_.channel_axis() < 0 ? rank + options_.channel_axis() : options_.channel_axis();
    if (rank < 2 || axis < 0 || axis >= rank) {
      detail::fail(std::string(kWho) + ": expected input of rank >= 2 with channel axis " +
                   std::to_string(options_.channel_axis()) + ", got input of shape " +
                   detail::shape_string(v.dims));
    }
    if (v.dims[static_cast<std::size_t>(axis)] != options_.num_features()) {
      detail::fail(std::string(kWho) + ": expected " + std::to_string(options_.num_features()) +
                   " channels in dim " + std::to_string(axis) + ", got input of shape " +
                   detail::shape_string(v.dims));
    }
    const Index before = detail::product(v.dims, 0, static_cast<std::size_t>(axis));
    const Index after = detail::product(v.dims, static_cast<std::size_t>(axis) + 1, v.dims.size());
    const bool rm = Tr::layout == Eigen::RowMajor;
    v.outer = rm ? before : after;  // ColMajor: the leading logical dims vary fastest
    v.inner = rm ? after : before;
    v.C = options_.num_features();
    return v;
  }

  bool uses_batch_stats() const { return training_ || !options_.track_running_stats(); }

  // Channel ranges for threads: boundaries on packets (channels-last) so each
  // channel's arithmetic is the same for any split. kPartsPerThread parts a
  // thread, as the row splits: with one part a thread, a pool thread that
  // woke late held up half the call. Measured on a Zen 5 guest (2 threads,
  // float, both in one process, each in both orders): channels-first
  // backward at 64x512x7x7 0.81-0.82x the time in one order and 0.94-0.97x
  // in the other; training forward 0.91x at 64x512x7x7 and 32x64x56x56,
  // 0.93x at 256x256x14x14; 1.01x for the backward at 256x256x14x14; 1
  // thread: one part, as before.
  template <typename Device>
  detail::Split channel_split(const Device& device, const View& v) const {
    constexpr int L = detail::simd<T>::L;
    const Index align = v.inner == 1 ? L : 1;
    const Index parts =
        detail::parts_for(device, v.outer * v.C * v.inner, v.inner == 1 ? (v.C + L - 1) / L : v.C, detail::kPartsPerThread);
    return detail::Split{v.C, parts, align};
  }
  template <typename Device>
  detail::Split segment_split(const Device& device, const View& v) const {
    const Index segs = v.inner == 1 ? v.outer : v.outer * v.C;  // rows (NHWC) or (o, c) segments
    const Index parts = detail::parts_for(device, v.outer * v.C * v.inner, segs, detail::kPartsPerThread);
    return detail::Split{segs, parts, 1};
  }

  // Channels-last (inner == 1) statistics on several threads split the rows,
  // not the channels: threads that each own a slice of every row walk the
  // whole tensor side by side and share its prefetch streams (measured: two
  // threads barely faster than one). Only with two chunks of rows or more.
  template <typename Device>
  static bool rows_split(const Device& device, const View& v) {
    return v.inner == 1 && device.numThreads() > 1 && v.outer > detail::kChunk;
  }

  // The rows of a channels-last tensor in whole chunks of kChunk rows, a
  // window of chunks at a time: run(k0, k1, out) computes chunks [k0, k1) on
  // some thread, chunk k's `per` results at out + (k - k0) * per; then
  // merge(chunk) takes the window's chunks in order. A chunk is never split
  // and the merge order is fixed, so the result does not depend on the
  // number of threads.
  template <typename S, typename Device, typename Run, typename Merge>
  static void row_chunks(const Device& device, const View& v, Index per, Run&& run, Merge&& merge) {
    const Index chunks = (v.outer + detail::kChunk - 1) / detail::kChunk;
    const Index window = std::max<Index>(static_cast<Index>(device.numThreads()) * detail::kPartsPerThread,
                                         kRowChunkBytes / std::max<Index>(1, per * Index(sizeof(S))));
    std::vector<S> buf(static_cast<std::size_t>(std::min(window, chunks) * per));
    for (Index w0 = 0; w0 < chunks; w0 += window) {
      const Index w1 = std::min(chunks, w0 + window);
      const Index parts =
          detail::parts_for(device, (w1 - w0) * detail::kChunk * v.C, w1 - w0, detail::kPartsPerThread);
      const detail::Split split{w1 - w0, parts, 1};
      detail::run_parts(device, parts, [&](Index p) {
        const Index k0 = split.begin(p), k1 = split.begin(p + 1);
        run(w0 + k0, w0 + k1, buf.data() + k0 * per);
      });
      for (Index k = 0; k < w1 - w0; ++k) merge(buf.data() + k * per);
    }
  }

  // Values of x stored as S, as T, for the statistics: x itself where S is
  // T; 16-bit values widened into buf (widen_count(n) values, none where S
  // is T). span_as: the n values from p. rows_as: m rows of wd values,
  // `stride` apart, from p; *out_stride receives the returned rows' stride
  // (stride, or wd: widened rows are packed).
  template <typename S>
  static std::size_t widen_count(Index n) {
    return std::is_same<S, T>::value ? 0 : static_cast<std::size_t>(n);
  }
  template <typename S>
  static const T* span_as(const S* p, Index n, T* buf) {
    if constexpr (std::is_same<S, T>::value) {
      (void)n;
      (void)buf;
      return p;
    } else {
      detail::convert_n(p, buf, n);
      return buf;
    }
  }
  template <typename S>
  static const T* rows_as(const S* p, Index m, Index wd, Index stride, T* buf, Index* out_stride) {
    if constexpr (std::is_same<S, T>::value) {
      (void)m;
      (void)wd;
      (void)buf;
      *out_stride = stride;
      return p;
    } else {
      *out_stride = wd;
      if (stride == wd) return span_as(p, m * wd, buf);
      for (Index i = 0; i < m; ++i) detail::convert_n(p + i * stride, buf + i * wd, wd);
      return buf;
    }
  }
  // The rows past a chunk that detail::lane_chunks may request ahead (its
  // ahead_rows: `left`), on channels-last inputs of T read in place of at
  // least detail::kStreamingBytes (detail::streaming_input); else none (-1). Measured on a Zen 4 guest
  // (AVX-512, float, 1 thread, the training forward, two builds
  // alternating, 5-7 rounds, medians): 0.75-0.77x the time at 50176x256
  // (49 MB, the suite's 256x256x14x14 channels-last) and 0.72-0.79x at
  // 16384x512 (32 MB). With the requests on inputs the L3 holds, 1.04-1.06x
  // at 4096x512 and 3136x512 (8 and 6.1 MB), hence the gate.
  template <typename S>
  static Index lane_rows_ahead(const View& v, Index left) {
    return detail::streaming_input<S, T>(v.outer, v.C) ? left : -1;
  }
  // Lane c of a chunk's lane states (lane_chunks' flush) as a Welford state.
  static Welford<double> lane_state(Index rows, const T* mean, const T* m2, Index c) {
    return Welford<double>(static_cast<double>(rows), static_cast<double>(mean[c]), static_cast<double>(m2[c]));
  }

  // Per-channel Welford states (pivot-shifted by the channel's first
  // value) of x stored as T, or as a 16-bit S (T float). 16-bit values are
  // read a block at a time and widened into float (span_as, rows_as), never
  // as a float copy of x: every kernel gets the same values, in the same
  // groups and order, as from a float copy, so the same bits. Channels last,
  // a chunk of kChunk rows at a time (lane_chunks' chunks; on several
  // threads row_chunks' chunks); channels first, see channels_first_moments.
  // With normalize_blocks, the 16-bit training forward makes no float copy.
  // Measured on the Zen 4 guest (bfloat16, NCHW, 1 thread, glibc's default
  // malloc settings), against float copies of x and y: 2.3 ms instead of
  // 33.8 ms at 32x64x56x56 (the float forward 3.0 ms), 6.7 ms instead of 66
  // ms at 256x256x14x14 (float 10.7 ms), 0.89 ms instead of 1.99 ms at
  // 64x512x7x7 (float 0.79 ms), 0.43 ms instead of 1.45 ms at 8x64x56x56
  // (float 0.47 ms).
  template <typename Device, typename S>
  void channel_moments(const Device& device, const S* x, const View& v, std::vector<T>& pivot,
                       std::vector<Welford<double>>& w) const {
    const Index C = v.C;
    pivot.resize(static_cast<std::size_t>(C));
    w.assign(static_cast<std::size_t>(C), Welford<double>());
    if (v.outer * v.inner == 0) {  // no values here (possible on one rank of many)
      std::fill(pivot.begin(), pivot.end(), T(0));
      return;
    }
    for (Index c = 0; c < C; ++c) pivot[static_cast<std::size_t>(c)] = static_cast<T>(x[c * v.inner]);
    if (rows_split(device, v)) {
      // Channels last on several threads: whole chunks of rows per thread,
      // each chunk's states kept and merged in chunk order, as on one thread
      // (so the same bits).
      row_chunks<Welford<double>>(device, v, C, [&](Index k0, Index k1, Welford<double>* out) {
        detail::Scratch<T> buf(widen_count<S>(detail::kChunk * C), false);
        for (Index k = k0; k < k1; ++k) {
          const Index r0 = k * detail::kChunk, m = std::min<Index>(detail::kChunk, v.outer - r0);
          Index stride = 0;
          const T* rows = rows_as(x + r0 * C, m, C, C, buf.data(), &stride);
          Welford<double>* o = out + (k - k0) * C;
          detail::lane_chunks(rows, stride, m, C, pivot.data(), [&](Index, Index n, const T* mean, const T* m2) {
            for (Index c = 0; c < C; ++c) o[c] = lane_state(n, mean, m2, c);
          }, lane_rows_ahead<S>(v, std::min(v.outer, k1 * detail::kChunk) - r0 - m));
        }
      }, [&](const Welford<double>* chunk) {
        for (Index c = 0; c < C; ++c) w[static_cast<std::size_t>(c)].merge(chunk[c]);
      });
    } else {
      const detail::Split split = channel_split(device, v);
      detail::run_parts(device, split.parts, [&](Index p) {
        const Index c0 = split.begin(p), c1 = split.begin(p + 1), wd = c1 - c0;
        if (v.inner == 1) {  // channels-last: rows of C values, one lane per channel
          detail::Scratch<T> buf(widen_count<S>(detail::kChunk * wd), false);
          for (Index r0 = 0; r0 < v.outer; r0 += detail::kChunk) {
            const Index m = std::min<Index>(detail::kChunk, v.outer - r0);
            Index stride = 0;
            const T* rows = rows_as(x + r0 * C + c0, m, wd, C, buf.data(), &stride);
            detail::lane_chunks(rows, stride, m, wd, pivot.data() + c0,
                                [&](Index, Index n, const T* mean, const T* m2) {
                                  for (Index c = 0; c < wd; ++c)
                                    w[static_cast<std::size_t>(c0 + c)].merge(lane_state(n, mean, m2, c));
                                }, lane_rows_ahead<S>(v, v.outer - r0 - m));
          }
          return;
        }
        channels_first_moments(x, v, pivot.data(), w.data(), c0, c1);
      });
    }
    for (Index c = 0; c < C; ++c) exact_if_needed(x, v, pivot.data(), w.data(), c);
  }

  // Channels [c0, c1) of a channels-first tensor (inner > 1) stored as S:
  // each channel's segments merged into w[c] in order of o, shifted by
  // pivot[c]. 16-bit values are widened a sample's segments at a time
  // (short segments), a segment at a time (long ones) or a chunk of samples
  // of a tile of channels at a time (small_map_moments).
  template <typename S>
  static void channels_first_moments(const S* x, const View& v, const T* pivot, Welford<double>* w, Index c0,
                                     Index c1) {
    const Index C = v.C, inner = v.inner;
    if (inner > 1 && inner < detail::simd<T>::L) {
      small_map_moments(x, v, pivot, w, c0, c1);
      return;
    }
    if (inner < detail::kShortRowPackets * detail::simd<T>::L) {
      // Short segments (e.g. 7x7): the segments (o, c0..c1) lie side by
      // side and go through the grouped short-row kernel as rows, each
      // shifted by its own first value; each is then moved to its
      // channel's pivot (in double) and merged in order of o.
      detail::Scratch<T> buf(widen_count<S>((c1 - c0) * inner), false);
      std::vector<Welford<double>> seg(static_cast<std::size_t>(c1 - c0));
      for (Index o = 0; o < v.outer; ++o) {
        const T* first = span_as(x + (o * C + c0) * inner, (c1 - c0) * inner, buf.data());
        rows_moments(first, inner, inner, c1 - c0, seg.data());
        for (Index c = c0; c < c1; ++c) {
          const auto& sc = seg[static_cast<std::size_t>(c - c0)];
          const double shift = static_cast<double>(first[(c - c0) * inner]) - static_cast<double>(pivot[c]);
          w[c].merge(Welford<double>(sc.count(), sc.mean() + shift, sc.m2()));
        }
      }
      return;
    }
    detail::Scratch<T> buf(widen_count<S>(inner), false);
    for (Index o = 0; o < v.outer; ++o)
      for (Index c = c0; c < c1; ++c)
        w[c].merge(row_moments(span_as(x + (o * C + c) * inner, inner, buf.data()), inner, pivot[c]));
  }

  // channels_first_moments for maps smaller than a packet (1 < inner < L;
  // with AVX-512, 2x2 to 3x5 floats): too short for the short-row kernel's
  // packets, each segment's moments then cost a merge in double of their
  // own. Instead each position (c, i) of a tile of channels is a lane:
  // lane_chunks steps the tile's ct * inner lanes down the batch (stride
  // C * inner; 16-bit values widened a chunk of samples at a time into a
  // packed buffer), a chunk of samples at a time, every lane shifted by its
  // channel's pivot, and a channel's state is the merge of its inner lanes,
  // in order of i. Each channel's arithmetic depends only on its own values
  // and the batch size, so the same bits for any thread count (the threads
  // split channels).
  template <typename S>
  static void small_map_moments(const S* x, const View& v, const T* pivot, Welford<double>* w, Index c0,
                                Index c1) {
    const Index inner = v.inner;
    const Index ct = std::max<Index>(1, kSmallMapTile / inner);
    std::vector<T> piv(static_cast<std::size_t>(ct * inner));
    std::vector<Welford<double>> lane(static_cast<std::size_t>(ct * inner));
    detail::Scratch<T> buf(widen_count<S>(detail::kChunk * ct * inner), false);
    for (Index t0 = c0; t0 < c1; t0 += ct) {
      const Index t1 = std::min(c1, t0 + ct), tw = (t1 - t0) * inner;
      for (Index c = t0; c < t1; ++c) std::fill_n(piv.begin() + (c - t0) * inner, inner, pivot[c]);
      std::fill(lane.begin(), lane.end(), Welford<double>());
      for (Index o0 = 0; o0 < v.outer; o0 += detail::kChunk) {
        const Index m = std::min<Index>(detail::kChunk, v.outer - o0);
        Index stride = 0;
        const T* rows = rows_as(x + (o0 * v.C + t0) * inner, m, tw, v.C * inner, buf.data(), &stride);
        detail::lane_chunks(rows, stride, m, tw, piv.data(), [&](Index, Index n, const T* mean, const T* m2) {
          for (Index j = 0; j < tw; ++j) lane[static_cast<std::size_t>(j)].merge(lane_state(n, mean, m2, j));
        });
      }
      for (Index c = t0; c < t1; ++c) {
        Welford<double> s;
        for (Index i = 0; i < inner; ++i) s.merge(lane[static_cast<std::size_t>((c - t0) * inner + i)]);
        w[c].merge(s);
      }
    }
  }

  // Channel c, if its squares left T's range: exact two-pass in long double.
  template <typename S>
  void exact_if_needed(const S* x, const View& v, const T* pivot, Welford<double>* w, Index c) const {
    const Index C = v.C;
    const double n = static_cast<double>(v.outer * v.inner);
    auto& wc = w[c];
    const bool bad = !(std::isfinite(wc.m2()) && std::isfinite(wc.mean())) ||
                     detail::m2_underflowed<T>(wc.m2(), n, options_.eps());
    if (!bad) return;
    const long double p = pivot[c];
    long double sum = 0;
    bool finite = true;
    for (Index o = 0; o < v.outer; ++o)
      for (Index i = 0; i < v.inner; ++i) {
        const T xv = static_cast<T>(x[(o * C + c) * v.inner + i]);
        finite = finite && std::isfinite(xv);
        sum += static_cast<long double>(xv) - p;
      }
    if (!finite) return;  // NaN or Inf in the channel: NaN is the answer
    const long double mean = sum / static_cast<long double>(n);
    long double m2 = 0;
    for (Index o = 0; o < v.outer; ++o)
      for (Index i = 0; i < v.inner; ++i) {
        const long double d = static_cast<long double>(static_cast<T>(x[(o * C + c) * v.inner + i])) - p - mean;
        m2 += d * d;
      }
    wc = Welford<double>(n, static_cast<double>(mean), static_cast<double>(m2));
  }

  // The batch statistics of the training path: this process's channel
  // moments, combined across processes when a reducer is set (absolute means
  // are exchanged, then brought back to this process's pivots).
  template <typename Device, typename S>
  void batch_moments(const Device& device, const S* x, const View& v, std::vector<T>& pivot,
                     std::vector<Welford<double>>& w) const {
    channel_moments(device, x, v, pivot, w);
    if (!reducer_) return;
    const Index C = v.C;
    for (Index c = 0; c < C; ++c) {
      auto& wc = w[static_cast<std::size_t>(c)];
      wc = Welford<double>(wc.count(), static_cast<double>(pivot[static_cast<std::size_t>(c)]) + wc.mean(), wc.m2());
    }
    reducer_->allreduce_moments(w.data(), C);
    for (Index c = 0; c < C; ++c) {
      auto& wc = w[static_cast<std::size_t>(c)];
      wc = Welford<double>(wc.count(), wc.mean() - static_cast<double>(pivot[static_cast<std::size_t>(c)]), wc.m2());
    }
  }

  template <typename Device, typename X, typename Y>
  void forward_impl(const Device& device, const X& x, Y& y, NormStats<T>* saved) {
    detail::check_storage<T, X>();
    detail::check_same_scalar<X, Y>();
    if constexpr (detail::is_16bit<X>()) {
      detail::check_layouts<X, Y>();
      static_assert(detail::tensor_traits<Y>::writable, "normcore: the output must be writable");
      const View v = view_of(x);
      detail::check_same_shape(kWho, "output", x, y);
      if (uses_batch_stats() && !reducer_ && fused_forward_group(device, v) > 0) {  // (Intel CPUs) through whole float copies
        const bool in_arena = detail::copies_fit_scratch(x, 2);
        const detail::FloatCopy<X> xf(x, true, in_arena);
        detail::FloatCopy<X> yf(x, false, in_arena);
        forward_float(device, xf.map(), yf.map(), saved);
        detail::convert_n(yf.map().data(), y.data(), x.size());
        return;
      }
      // The batch statistics (channel_moments) and the normalize read x as
      // it is stored, a block at a time.
      std::vector<detail::NormCoeffs<T>> k;
      if (forward_coeffs(device, x.data(), v, saved, k)) normalize_blocks(device, x.data(), y.data(), v, k);
    } else {
      forward_float(device, x, y, saved);
    }
  }

  template <typename Device, typename X, typename Y>
  void forward_float(const Device& device, const X& x, Y& y, NormStats<T>* saved) {
    detail::check_scalar<T, X>();
    detail::check_scalar<T, Y>();
    detail::check_layouts<X, Y>();
    static_assert(detail::tensor_traits<Y>::writable, "normcore: the output must be writable");
    const View v = view_of(x);
    detail::check_same_shape(kWho, "output", x, y);
    const Index group = uses_batch_stats() && !reducer_ ? fused_forward_group(device, v) : 0;
    if (group > 0) {
      forward_fused(device, x.data(), y.data(), v, group, saved);
      return;
    }
    std::vector<detail::NormCoeffs<T>> k;
    if (forward_coeffs(device, x.data(), v, saved, k)) normalize(device, x.data(), y.data(), v, k);
  }

  // A forward's per-channel coefficients k: from the batch statistics of x
  // (which also step the running statistics) or from the running ones (x
  // is not read); and saved's mean and rstd. False when there is nothing
  // to normalize (no values on this process).
  template <typename Device, typename S>
  bool forward_coeffs(const Device& device, const S* x, const View& v, NormStats<T>* saved,
                      std::vector<detail::NormCoeffs<T>>& k) {
    const Index C = v.C;
    k.resize(static_cast<std::size_t>(C));
    if (uses_batch_stats()) {
      std::vector<T> pivot;
      std::vector<Welford<double>> w;
      batch_moments(device, x, v, pivot, w);
      const double count = w.empty() ? 0.0 : w[0].count();
      if (training_ && count <= 1) {
        detail::fail(std::string(kWho) + ": expected more than 1 value per channel when training, "
                                         "got input of shape " + detail::shape_string(v.dims) +
                     (reducer_ ? " (" + std::to_string(static_cast<long long>(count)) + " values over all processes)" : std::string()));
      }
      if (count == 0) {
        if (saved) {
          detail::resize_vector(saved->mean, C);
          detail::resize_vector(saved->rstd, C);
        }
        return false;
      }
      const double f = momentum_step();
      const std::vector<double> r = batch_rstd(w);
      for (Index c = 0; c < C; ++c)
        k[static_cast<std::size_t>(c)] = batch_coeffs(c, pivot.data(), w.data(), f, r[static_cast<std::size_t>(c)]);
    } else {
      const std::vector<double> r = running_rstd();
      for (Index c = 0; c < C; ++c)
        k[static_cast<std::size_t>(c)] = detail::norm_coeffs_r<T>(running_mean_(c), 0.0, static_cast<double>(running_var_(c)),
                                                                  r[static_cast<std::size_t>(c)]);
    }
    if (saved) {
      detail::resize_vector(saved->mean, C);
      detail::resize_vector(saved->rstd, C);
      for (Index c = 0; c < C; ++c) {
        saved->mean(c) = k[static_cast<std::size_t>(c)].mean;
        saved->rstd(c) = k[static_cast<std::size_t>(c)].rstd;
      }
    }
    return true;
  }

  // A training step of the running statistics: counts the batch and
  // returns the weight of its statistics (momentum, or 1 / batches when
  // momentum is unset); 0 when the running statistics are not updated.
  double momentum_step() {
    if (!(training_ && options_.track_running_stats())) return 0.0;
    ++num_batches_tracked_;
    return options_.momentum() ? *options_.momentum() : 1.0 / static_cast<double>(num_batches_tracked_);
  }

  // Channel c's coefficients from its batch moments (w[c], shifted by
  // pivot[c]); when f (momentum_step) is not 0, it also updates channel c's
  // running statistics. (This and channel_constants run in the fused
  // forward and in the two passes; their products that meet a sum are
  // explicit fma, so that the bits do not depend on where GCC's default
  // -ffp-contract=fast fuses them, which in double differed between the
  // two.)
  // r: 1 / sqrt(variance + eps) (channel_rstd), or computed here.
  detail::NormCoeffs<T> batch_coeffs(Index c, const T* pivot, const Welford<double>* w, double f) {
    return batch_coeffs(c, pivot, w, f, 1.0 / std::sqrt(w[c].variance() + options_.eps()));
  }
  detail::NormCoeffs<T> batch_coeffs(Index c, const T* pivot, const Welford<double>* w, double f, double r) {
    const auto& wc = w[c];
    const auto k = detail::norm_coeffs_r<T>(pivot[c], wc.mean(), wc.variance(), r);
    if (f == 0.0) return k;
    const double mean = static_cast<double>(pivot[c]) + wc.mean();
    running_mean_(c) = static_cast<T>(std::fma(f, mean, (1 - f) * static_cast<double>(running_mean_(c))));
    const double var = wc.sample_variance();
    running_var_(c) = static_cast<T>(std::fma(f, var, (1 - f) * static_cast<double>(running_var_(c))));
    return k;
  }

  // 1 / sqrt(var(c) + eps) for channels [0, C), in double packets
  // (detail::inv_sqrt_eps): the same bits as the scalar expression. On a
  // Zen 5 guest an eval forward of one sample of 4096 channels took
  // 24-27 us with a scalar sqrt and division per channel, 19 us with these.
  // (In place: inv_sqrt_eps reads each packet before it writes it.)
  template <typename Var>
  std::vector<double> channel_rstd(Index C, Var&& var) const {
    std::vector<double> r(static_cast<std::size_t>(C));
    for (Index c = 0; c < C; ++c) r[static_cast<std::size_t>(c)] = var(c);
    detail::inv_sqrt_eps(r.data(), options_.eps(), C, r.data());
    return r;
  }
  // channel_rstd of the batch variances (w: a state per channel) and of the
  // running variances.
  std::vector<double> batch_rstd(const std::vector<Welford<double>>& w) const {
    return channel_rstd(static_cast<Index>(w.size()), [&](Index c) { return w[static_cast<std::size_t>(c)].variance(); });
  }
  std::vector<double> running_rstd() const {
    return channel_rstd(running_var_.size(), [&](Index c) { return static_cast<double>(running_var_(c)); });
  }

  // y = fma(x - pivot, rstd * gamma, beta - shift * gamma): the affine
  // transform folded into two per-channel constants, from a channel's
  // coefficients kc, gamma g and beta b.
  static void affine_constants(const detail::NormCoeffs<T>& kc, double g, double b, T& piv, T& sc, T& bs) {
    piv = kc.pivot;
    sc = static_cast<T>(static_cast<double>(kc.rstd) * g);
    bs = static_cast<T>(std::fma(-static_cast<double>(kc.shift), g, b));
  }
  // Channel c's constants.
  void channel_constants(Index c, const detail::NormCoeffs<T>& kc, T* piv, T* sc, T* bs) const {
    affine_constants(kc, weight_.size() ? static_cast<double>(weight_(c)) : 1.0,
                     bias_.size() ? static_cast<double>(bias_(c)) : 0.0, piv[c], sc[c], bs[c]);
  }
  // Channels [0, C) of k, with the tests for weight and bias outside the
  // loop (0.5 ns a channel less than channel_constants per channel, in the
  // eval forward of channel_rstd's comment).
  void channels_constants(const detail::NormCoeffs<T>* k, Index C, T* piv, T* sc, T* bs) const {
    const P* g = weight_.size() ? weight_.data() : nullptr;
    const P* b = bias_.size() ? bias_.data() : nullptr;
    for (Index c = 0; c < C; ++c)
      affine_constants(k[c], g ? static_cast<double>(g[c]) : 1.0, b ? static_cast<double>(b[c]) : 0.0, piv[c],
                       sc[c], bs[c]);
  }

  // Streaming stores for y on inputs of detail::kStreamingBytes or more
  // when every packet store lands on a packet boundary: y aligned, and
  // rows (channels-last) or segments (channels-first) of whole packets;
  // short segments align their stores on y themselves.
  static bool streams_y(const T* x, const T* y, const View& v) {
    constexpr int L = detail::simd<T>::L;
    const Index total = v.outer * v.C * v.inner;
    const Index run = v.inner == 1 ? v.C : (v.inner >= L && v.inner < detail::kShortRowPackets * L) ? L : v.inner;
    return total * static_cast<Index>(sizeof(T)) >= detail::kStreamingBytes && detail::disjoint(x, total, y, total) &&
           detail::can_stream_rows(y, run);
  }

  // Channels per group of the fused channels-first training forward
  // (forward_fused), or 0 for two passes (statistics, then normalize). On
  // Intel CPUs only, as the fused backward's groups: a group's x within
  // half the L2 (detail::fused_channel_group), its runs of contiguous
  // values at least half of kFusedRun, an x the L2 does not hold (else the
  // normalize reads it from there anyway), enough channels to keep every
  // thread busy, and more than one value per channel (else the two-pass
  // path reports the error). Measured on an Intel Xeon guest (2 MB of L2,
  // float, two builds of one driver alternating, the same bits), against
  // two passes: 0.73-0.85x the time at 4x256x28x28, 16x64x56x56,
  // 32x64x56x56, 8x64x112x112, 32x128x28x28, 64x128x28x28,
  // 16x512x14x14, 32x256x14x14 and 32x512x7x7; 0.92x at 64x512x7x7 and
  // 0.94x at 64x64x56x56 (runs of 3136 values: 1.02-1.08x in other
  // runs). On 2 threads 0.77-0.95x. Shorter runs lost: 1.09-1.13x at
  // 128x128x28x28 (1568), 1.80x at 256x256x14x14 (980); and inputs the L2
  // holds: 1.13x at 8x64x14x14.
  template <typename Device>
  Index fused_forward_group(const Device& device, const View& v) const {
    const Index count = v.outer * v.inner;
    if (!detail::intel_tuned() || v.inner <= 1 || count <= 1 || v.C < 8 * static_cast<Index>(device.numThreads()) ||
        v.C * count * Index(sizeof(T)) <= detail::backward_l2_bytes())
      return 0;
    const Index group = detail::fused_channel_group(v.inner, count * Index(sizeof(T)), kFusedRun);
    return group * v.inner >= kFusedRun / 2 ? group : 0;
  }

  // The channels-first training forward a group of channels at a time: the
  // group's moments, coefficients and running statistics, then its
  // normalize, which reads x back from the L2 rather than memory. Each
  // channel gets the arithmetic of the two passes (the same moments, merged
  // in order of o; the same per-value normalize), so the same bits.
  template <typename Device>
  void forward_fused(const Device& device, const T* x, T* y, const View& v, Index group, NormStats<T>* saved) {
    const Index C = v.C;
    const std::size_t nc = static_cast<std::size_t>(C);
    std::vector<T> pivot(nc), piv(nc), sc(nc), bs(nc);
    for (Index c = 0; c < C; ++c) pivot[static_cast<std::size_t>(c)] = x[c * v.inner];
    std::vector<Welford<double>> w(nc);
    const double f = momentum_step();
    if (saved) {
      detail::resize_vector(saved->mean, C);
      detail::resize_vector(saved->rstd, C);
    }
    const bool stream = streams_y(x, y, v);
    const detail::Split split = channel_split(device, v);
    detail::run_parts(device, split.parts, [&](Index p) {
      const auto body = [&](auto stream_y) {
        constexpr bool Stream = decltype(stream_y)::value;
        const Index c1 = split.begin(p + 1);
        for (Index g0 = split.begin(p); g0 < c1; g0 += group) {
          const Index g1 = std::min(c1, g0 + group);
          channels_first_moments(x, v, pivot.data(), w.data(), g0, g1);
          for (Index c = g0; c < g1; ++c) {
            exact_if_needed(x, v, pivot.data(), w.data(), c);
            const auto kc = batch_coeffs(c, pivot.data(), w.data(), f);
            channel_constants(c, kc, piv.data(), sc.data(), bs.data());
            if (saved) {
              saved->mean(c) = kc.mean;
              saved->rstd(c) = kc.rstd;
            }
          }
          for (Index o = 0; o < v.outer; ++o)
            normalize_part<Stream>(x, y, v, o * C + g0, o * C + g1, piv.data(), sc.data(), bs.data(), true);
        }
      };
      if (stream) {
        body(std::true_type());
        detail::stream_fence();
      } else {
        body(std::false_type());
      }
    });
  }

  template <typename Device>
  void normalize(const Device& device, const T* x, T* y, const View& v,
                 const std::vector<detail::NormCoeffs<T>>& k) const {
    const Index C = v.C;
    std::vector<T> piv(static_cast<std::size_t>(C)), sc(static_cast<std::size_t>(C)), bs(static_cast<std::size_t>(C));
    channels_constants(k.data(), C, piv.data(), sc.data(), bs.data());
    const detail::Split split = segment_split(device, v);
    const bool pivots = any_pivot(piv);
    const bool stream = streams_y(x, y, v);
    detail::run_parts(device, split.parts, [&split, &stream, &x, &y, &v, &piv, &sc, &bs, &pivots](Index p) {
      const Index s0 = split.begin(p), s1 = split.begin(p + 1);
      if (stream) {
        normalize_part<true>(x, y, v, s0, s1, piv.data(), sc.data(), bs.data(), pivots);
        detail::stream_fence();
      } else {
        normalize_part<false>(x, y, v, s0, s1, piv.data(), sc.data(), bs.data(), pivots);
      }
    });
  }

  // Whether any pivot is other than +0 (see normalize_channels_last).
  static bool any_pivot(const std::vector<T>& piv) {
    return std::any_of(piv.begin(), piv.end(), [](T p) { return p != T(0) || std::signbit(p); });
  }

  // normalize into 16-bit y (D) from 16-bit x (S). No float copy of x or
  // y is made. Channels-last rows, and channels-first segments that
  // one_pass_segments takes, go through normalize16_rows and
  // normalize16_segments in builds that convert whole packets; the rest a
  // block of about kNormalizeBlock values at a time through float buffers
  // (whole rows; a run of one sample's segments; or a piece of one long
  // segment), with normalize_part on each block and convert_n into y.
  // Every value gets normalize's arithmetic, fma(x - pivot, scale, shift),
  // rounded once, so the same bits as normalizing a whole float copy and
  // rounding it (the path before, which made float copies of x and y).
  // Measured on the Zen 4 guest (AVX-512, bfloat16, NCHW, 1 thread,
  // glibc's default malloc settings), eval, against that path: 0.98 ms
  // instead of 33.9 ms at 32x64x56x56 (which went mostly to page faults:
  // copies of 25.7 MB each, over detail::kScratchKeepBytes, allocated
  // every call; the float forward 1.9 ms), 2.6 ms instead of 61 ms at
  // 256x256x14x14 (float 4.4 ms), 0.19 ms instead of 1.34 ms at
  // 8x64x56x56 (float 0.36 ms). Per segment, the padded packet of a
  // segment's tail (the kernel's tail when y is over x) costs about as
  // much as the packets of a short one: at 64x256x9x9 and 64x256x10x10 the
  // per-segment kernel took 1.7x and 1.8x the time of the blocks, at
  // 256x256x14x14 0.44x; blocks of 2048 values took 0.77-0.95x the time of
  // blocks of 4096 at 64x512x7x7, 256x256x14x14 and 32x64x56x56.
  static constexpr Index kNormalizeBlock = 2048;
  static constexpr Index kFusedSegmentPackets = 8;
  template <typename Device, typename S, typename D>
  void normalize_blocks(const Device& device, const S* x, D* y, const View& v,
                        const std::vector<detail::NormCoeffs<T>>& k) const {
    const Index C = v.C;
    if (v.outer * C * v.inner == 0) return;  // (an empty dim: with running statistics, no error)
    std::vector<T> piv(static_cast<std::size_t>(C)), sc(static_cast<std::size_t>(C)), bs(static_cast<std::size_t>(C));
    channels_constants(k.data(), C, piv.data(), sc.data(), bs.data());
    const bool pivots = any_pivot(piv);
    const detail::Split split = segment_split(device, v);
    // Values a block holds: at least one whole row, channels last.
    const Index block = std::max(kNormalizeBlock, v.inner == 1 ? C : Index(0));
    const Index total = v.outer * C * v.inner;
    const bool apart = detail::disjoint(x, total, y, total);  // (see normalize16_rows)
    detail::run_parts(device, split.parts, [&split, &v, &pivots, &x, &y, &C, &piv, &sc, &bs, &apart, &block](Index p) {
      static_cast<void>(C);  // (C and apart: read where the build converts whole packets only)
      static_cast<void>(apart);
      const Index s0 = split.begin(p), s1 = split.begin(p + 1);
      if constexpr (detail::packet_io<S, detail::simd<T>::L>() && detail::packet_io<D, detail::simd<T>::L>()) {
        if (v.inner == 1) {
          if (pivots)
            normalize16_rows<true>(x, y, C, s0, s1, piv.data(), sc.data(), bs.data(), apart);
          else
            normalize16_rows<false>(x, y, C, s0, s1, piv.data(), sc.data(), bs.data(), apart);
          return;
        }
        if (one_pass_segments(v.inner, apart)) {
          normalize16_segments(x, y, v.inner, C, s0, s1, piv.data(), sc.data(), bs.data(), apart);
          return;
        }
      }
      detail::Scratch<T> buf(static_cast<std::size_t>(2 * block), false);
      T* const yb = buf.data();
      T* const xb = yb + block;
      for_blocks(v, s0, s1, block, [&](Index first, Index count, const View& bv, Index c) {
        detail::convert_n(x + first, xb, count);
        const Index segs = bv.inner == 1 ? bv.outer : bv.C;
        normalize_part<false>(xb, yb, bv, 0, segs, piv.data() + c, sc.data() + c, bs.data() + c, pivots);
        detail::convert_n(static_cast<const T*>(yb), y + first, count);
      });
    });
  }

  // Whether the 16-bit one-pass kernels (normalize16_segments,
  // dx16_segments) take channels-first segments of `inner` values: at least
  // one packet when the output is apart from the inputs (a segment's tail is
  // then its last packet, overlapping), else at least kFusedSegmentPackets
  // packets or whole packets (a padded tail costs about as much as a short
  // segment's packets).
  static bool one_pass_segments(Index inner, bool apart) {
    constexpr Index L = detail::simd<T>::L;
    return inner >= kFusedSegmentPackets * L || (inner >= L && (inner % L == 0 || apart));
  }

  // Segments [s0, s1) of v (channels last: rows) in blocks of about `block`
  // values (block >= C channels last: whole rows), for the 16-bit paths'
  // float buffers: f(first, count, bv, c) for values [first, first + count)
  // of the tensor, bv the block as a view of its own and c its first
  // channel: m rows of C values; a piece of one segment longer than a block
  // (one segment of the piece's length); or a run of one sample's
  // segments.
  template <typename F>
  static void for_blocks(const View& v, Index s0, Index s1, Index block, F&& f) {
    const Index C = v.C, inner = v.inner;
    if (inner == 1) {
      const Index rows = std::max<Index>(1, block / C);
      for (Index r = s0; r < s1; r += rows) {
        const Index m = std::min(rows, s1 - r);
        f(r * C, m * C, View{m, C, 1, {}}, Index(0));
      }
      return;
    }
    for (Index sg = s0; sg < s1;) {
      const Index c = sg % C;
      if (inner > block) {
        for (Index i = 0; i < inner; i += block) {
          const Index len = std::min(block, inner - i);
          f(sg * inner + i, len, View{1, 1, len, {}}, c);
        }
        ++sg;
        continue;
      }
      const Index segs = std::min({s1 - sg, C - c, block / inner});  // within one sample
      f(sg * inner, segs * inner, View{1, segs, inner, {}}, c);
      sg += segs;
    }
  }

  // normalize_blocks' kernels for channels-last rows and channels-first
  // segments (see there), in builds that convert whole packets
  // (detail::packet_io): one pass, each packet of x widened as it is
  // loaded and rounded once into y (D) as it is
  // stored. A row's or segment's last C mod L (inner mod L) values go
  // through one more packet, so that they are computed and rounded as the
  // body is (detail::convert_n's tail does the same): the same bits as
  // normalize, then convert_n. With y apart from x (`apart`), that packet
  // is the row's or segment's last L values, overlapping the body's last
  // packet, whose values it computes and stores again, the same bits; else
  // (y over x, where those values of x are already overwritten) a padded
  // copy of the tail (normalize16_tail). Measured on the Zen 4 guest
  // (bfloat16, 1 thread), overlapping tails against padded ones, eval: NCHW
  // 0.85x the time at 256x256x14x14 and, with the segments under 8 packets
  // opened to the kernel (they went through the float blocks), 0.59x at
  // 64x512x7x7 and 0.62x at 64x256x9x9; channels-last 0.32x at 8192x100
  // and 0.82x at 2048x1000. Training: 0.99x, 0.83x and 0.83x NCHW.
  template <bool Pivot, typename S, typename D>
  static void normalize16_rows(const S* x, D* y, Index C, Index o0, Index o1, const T* piv, const T* sc,
                               const T* bs, bool apart) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const Index full = C / L * L;
    for (Index o = o0; o < o1; ++o) {
      const S* xr = x + o * C;
      D* yr = y + o * C;
      const auto packet = [&](Index c) {
        const Packet v = detail::load_widened<Packet>(xr + c);
        detail::store_narrowed(yr + c, pmadd(Pivot ? psub(v, ploadu<Packet>(piv + c)) : v, ploadu<Packet>(sc + c),
                                             ploadu<Packet>(bs + c)));
      };
      for (Index c = 0; c < full; c += L) packet(c);
      if (full == C) continue;
      if (apart && C >= L)
        packet(C - L);  // the row's last L values
      else
        normalize16_tail(xr + full, yr + full, C - full, piv + full, sc + full, bs + full, 1);
    }
  }
  template <typename S, typename D>
  static void normalize16_segments(const S* x, D* y, Index inner, Index C, Index s0, Index s1, const T* piv,
                                   const T* sc, const T* bs, bool apart) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const Index full = inner / L * L;
    Index cc = s0 % C;
    for (Index sg = s0; sg < s1; ++sg) {
      const S* xs = x + sg * inner;
      D* ys = y + sg * inner;
      const Packet pp = pset1<Packet>(piv[cc]), ps = pset1<Packet>(sc[cc]), pb = pset1<Packet>(bs[cc]);
      const auto packet = [&](Index i) {
        detail::store_narrowed(ys + i, pmadd(psub(detail::load_widened<Packet>(xs + i), pp), ps, pb));
      };
      for (Index i = 0; i < full; i += L) packet(i);
      if (full < inner) {
        if (apart)
          packet(inner - L);  // the segment's last L values (inner >= L here)
        else
          normalize16_tail(xs + full, ys + full, inner - full, piv + cc, sc + cc, bs + cc, 0);
      }
      if (++cc == C) cc = 0;
    }
  }
  // n < L values: constants k[j * step] (step 1: one a lane; 0: one for all).
  template <typename S, typename D>
  static void normalize16_tail(const S* x, D* y, Index n, const T* piv, const T* sc, const T* bs, Index step) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    alignas(64) T xv[L] = {}, pv[L] = {}, sv[L] = {}, bv[L] = {};
    alignas(64) D out[L];
    for (Index j = 0; j < n; ++j) {
      xv[j] = static_cast<T>(x[j]);
      pv[j] = piv[j * step];
      sv[j] = sc[j * step];
      bv[j] = bs[j * step];
    }
    detail::store_narrowed(out, pmadd(psub(ploadu<Packet>(xv), ploadu<Packet>(pv)), ploadu<Packet>(sv),
                                      ploadu<Packet>(bv)));
    std::copy(out, out + n, y);
  }

  // Segments [s0, s1) of normalize (channels-last: rows).
  template <bool Stream>
  static void normalize_part(const T* x, T* y, const View& v, Index s0, Index s1, const T* piv, const T* sc,
                             const T* bs, bool pivots) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const Index C = v.C;
    if (v.inner == 1) {
      if (pivots)
        normalize_channels_last<true, Stream>(x, y, C, s0, s1, piv, sc, bs);
      else
        normalize_channels_last<false, Stream>(x, y, C, s0, s1, piv, sc, bs);
      return;
    }
    if (v.inner > 1 && v.inner < L) {  // (streams_y never streams these: segments shorter than a packet)
      normalize_small_maps(x, y, v.inner, C, s0, s1, piv, sc, bs);
      return;
    }
    if (v.inner >= L && v.inner < detail::kShortRowPackets * L) {
      normalize_short_segments<Stream>(x, y, v.inner, C, s0, s1, piv, sc, bs);
      return;
    }
    Index cc = s0 % C;  // channel of segment sg
    for (Index sg = s0; sg < s1; ++sg) {
      const T* xs = x + sg * v.inner;
      T* ys = y + sg * v.inner;
      const Packet pp = pset1<Packet>(piv[cc]), ps = pset1<Packet>(sc[cc]), pb = pset1<Packet>(bs[cc]);
      Index i = 0;
      for (; i + L <= v.inner; i += L)
        detail::store_packet<Stream>(ys + i, pmadd(psub(ploadu<Packet>(xs + i), pp), ps, pb));
      for (; i < v.inner; ++i) ys[i] = detail::madd(xs[i] - piv[cc], sc[cc], bs[cc]);
      if (++cc == C) cc = 0;  // no division per segment
    }
  }

  // One packet of y = fma(x - pp, ps, pb); without Pivot, fma(x, ps, pb).
  // Stream: a streaming store (y aligned).
  template <bool Pivot, bool Stream, typename Packet>
  static EIGEN_ALWAYS_INLINE void normalize_packet(const T* x, T* y, const Packet& pp, const Packet& ps,
                                                   const Packet& pb) {
    using namespace Eigen::internal;
    const Packet v = ploadu<Packet>(x);
    detail::store_packet<Stream>(y, pmadd(Pivot ? psub(v, pp) : v, ps, pb));
  }
  template <bool Pivot, bool Stream, int NP>
  static void normalize_lane_block(const T* x, T* y, Index C, Index o0, Index o1, const T* piv, const T* sc,
                                   const T* bs) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    Packet pp[NP], ps[NP], pb[NP];
    NORMCORE_UNROLL
    for (int k = 0; k < NP; ++k) {
      pp[k] = Pivot ? ploadu<Packet>(piv + k * L) : pset1<Packet>(T(0));
      ps[k] = ploadu<Packet>(sc + k * L);
      pb[k] = ploadu<Packet>(bs + k * L);
    }
    for (Index o = o0; o < o1; ++o)
      NORMCORE_UNROLL
      for (int k = 0; k < NP; ++k)
        normalize_packet<Pivot, Stream>(x + o * C + k * L, y + o * C + k * L, pp[k], ps[k], pb[k]);
  }
  template <bool Pivot, bool Stream>
  static void normalize_lane_rows(const T* x, T* y, Index C, Index o0, Index o1, const T* piv, const T* sc,
                                  const T* bs) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const Index full = C / L * L;
    for (Index o = o0; o < o1; ++o)
      for (Index c = 0; c < full; c += L) {
        const Packet pp = Pivot ? ploadu<Packet>(piv + c) : pset1<Packet>(T(0));
        normalize_packet<Pivot, Stream>(x + o * C + c, y + o * C + c, pp, ploadu<Packet>(sc + c),
                                        ploadu<Packet>(bs + c));
      }
  }
  // Channels-last rows [o0, o1) of C values: y = fma(x - piv, sc, bs) per
  // channel, the same arithmetic per value as every other normalize loop, so
  // the same bits. (With Pivot false every piv is +0, and in the default
  // floating-point environment, round to nearest without flush-to-zero,
  // x - (+0) is x for every x, -0 too: the subtraction and its load are left
  // out.)
  // * Channels that fill at most kRegisterLanePackets whole packets keep
  //   their constants in registers for all the rows.
  // * More channels: a row at a time, the constants loaded with each
  //   packet. (Four rows per load of a packet's constants, on inputs under
  //   12 MB, measured 0.78x the time in an earlier round; in the tenth round
  //   a row at a time took 0.60-0.89x the time of the four rows at 2 to 16
  //   MB, for any offset of y from x.)
  // Leftover channels (C mod L) in scalars.
  template <bool Pivot, bool Stream>
  static void normalize_channels_last(const T* x, T* y, Index C, Index o0, Index o1, const T* piv, const T* sc,
                                      const T* bs) {
    constexpr int L = detail::simd<T>::L;
    const Index full = C / L * L;
    if (full > detail::kRegisterLanePackets * L) {
      normalize_lane_rows<Pivot, Stream>(x, y, C, o0, o1, piv, sc, bs);
    } else if (full > 0) {
      detail::with_register_packets(static_cast<int>(full / L), [&](auto k) {
        normalize_lane_block<Pivot, Stream, decltype(k)::value>(x, y, C, o0, o1, piv, sc, bs);
      });
    }
    if (full < C)
      for (Index o = o0; o < o1; ++o)
        for (Index c = full; c < C; ++c) {
          const std::size_t cc = static_cast<std::size_t>(c);
          y[o * C + c] = detail::madd(x[o * C + c] - piv[cc], sc[cc], bs[cc]);
        }
  }

  // Values (lanes) per tile of channels on maps smaller than a packet:
  // normalize_small_maps' expanded constants (three arrays of 8 KB),
  // dx_small_maps' (half as many values: six arrays of 4 KB), and the lanes
  // of small_map_moments and small_map_sums.
  static constexpr Index kSmallMapTile = 8192 / static_cast<Index>(sizeof(T));

  // Channels-first segments [s0, s1) of 1 < inner < L values (AVX-512
  // floats: maps of 2x2 to 3x5; AVX2 floats and AVX-512 doubles: 2x2, 1x7):
  // no segment holds a packet, and a packet spans up to L / inner + 1
  // channels. The channels go in tiles of ct = kSmallMapTile / inner, whose
  // constants are expanded to one per value (small_map_tiles); then each
  // sample's run of the tile's ct * inner values is one loop of packets,
  // y = fma(x - pe, se, be), the arithmetic of the segment loop on every value,
  // so the same bits. A value at a time, the segment loop took 0.6-1.5 ns
  // a value at 64x512x3x3 and 64x512x2x2 on a Zen 5 guest (AVX-512 float,
  // eval), 6-13x its time on 7x7 maps; now 0.10-0.15 ns.
  static void normalize_small_maps(const T* x, T* y, Index inner, Index C, Index s0, Index s1, const T* piv,
                                   const T* sc, const T* bs) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const T* const constants[3] = {piv, sc, bs};
    small_map_tiles(inner, C, s0, s1, kSmallMapTile / inner, constants,
                    [&](Index first, Index len, const T* pe, Index tile) {
                      const T* const se = pe + tile;
                      const T* const be = se + tile;
                      const T* const xs = x + first;
                      T* const ys = y + first;
                      Index i = 0;
                      for (; i + L <= len; i += L)
                        pstoreu(ys + i, pmadd(psub(ploadu<Packet>(xs + i), ploadu<Packet>(pe + i)),
                                              ploadu<Packet>(se + i), ploadu<Packet>(be + i)));
                      for (; i < len; ++i) ys[i] = detail::madd(xs[i] - pe[i], se[i], be[i]);
                    });
  }

  // The runs of channels-first segments [s0, s1) of 1 < inner < L values,
  // a tile of channels at a time, for normalize_small_maps and
  // dx_small_maps: tiles of ct channels (at least one), whose K per-channel
  // constants (k[0..K), indexed by channel) are expanded to one per value,
  // K arrays of ct * inner values; then run(first, length, e, tile) for
  // each sample's run of the tile within [s0, s1): the run's values start
  // at index `first` of the tensor, constant j of its first value at
  // e + j * tile.
  template <int K, typename Run>
  static void small_map_tiles(Index inner, Index C, Index s0, Index s1, Index ct, const T* const (&k)[K],
                              Run&& run) {
    ct = std::max<Index>(1, ct);
    const Index tile = ct * inner;
    detail::Scratch<T> buf(static_cast<std::size_t>(K * tile), false);
    T* const e = buf.data();
    for (Index c0 = 0; c0 < C; c0 += ct) {
      const Index c1 = std::min(C, c0 + ct);
      bool expanded = false;
      for (Index o = s0 / C; o * C < s1; ++o) {  // the samples [s0, s1) reaches
        const Index a = std::max(s0, o * C + c0), b = std::min(s1, o * C + c1);
        if (a >= b) continue;
        if (!expanded) {
          for (int j = 0; j < K; ++j)
            for (Index c = c0; c < c1; ++c) std::fill_n(e + j * tile + (c - c0) * inner, inner, k[j][c]);
          expanded = true;
        }
        run(a * inner, (b - a) * inner, static_cast<const T*>(e + (a - o * C - c0) * inner), tile);
      }
    }
  }

  // Channels-first segments [s0, s1) of `inner` values, L <= inner < 16 L
  // (with AVX2, float maps of 3x3 to 11x11): walked as one run of values in
  // packets aligned on y, not segment by segment, so that no load or store
  // is split across cache lines and no segment ends in a scalar loop. A
  // packet that straddles two segments (at most two: inner >= L) takes each
  // lane's constants by a select on the lane index. Every value gets the same arithmetic as in the
  // segment loop, so the same bits.
  template <bool Stream>
  static void normalize_short_segments(const T* x, T* y, Index inner, Index C, Index s0, Index s1,
                                       const T* piv, const T* sc, const T* bs) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    Index c = s0 % C;            // channel of the current segment
    Index end = (s0 + 1) * inner;  // where the current segment ends
    const Index f1 = s1 * inner;
    Index f = s0 * inner;
    auto one = [&](Index i) {  // a value outside the aligned packets
      while (i >= end) {
        end += inner;
        if (++c == C) c = 0;
      }
      y[i] = detail::madd(x[i] - piv[c], sc[c], bs[c]);
    };
    // Up to the first packet boundary of y (fewer than L values: one
    // segment). The stores after it land on packet boundaries.
    const std::size_t bytes = sizeof(Packet);
    const std::size_t to_boundary = (bytes - reinterpret_cast<std::uintptr_t>(y + f) % bytes) % bytes;
    for (const Index h = std::min(f1, f + static_cast<Index>(to_boundary / sizeof(T))); f < h; ++f) one(f);
    Packet pp = pset1<Packet>(piv[c]), ps = pset1<Packet>(sc[c]), pb = pset1<Packet>(bs[c]);
    const Packet lane = plset<Packet>(T(0));
    while (f + L <= f1) {
      if (f + L <= end) {  // whole packets inside the segment
        const Index stop = std::min(end, f1);
        for (; f + L <= stop; f += L) detail::store_packet<Stream>(y + f, pmadd(psub(ploadu<Packet>(x + f), pp), ps, pb));
        continue;
      }
      const Index cn = c + 1 == C ? 0 : c + 1;
      const Packet np = pset1<Packet>(piv[cn]), ns = pset1<Packet>(sc[cn]), nb = pset1<Packet>(bs[cn]);
      if (f < end) {  // lanes [0, end - f) in channel c, the rest in cn
        const Packet first = pcmp_lt(lane, pset1<Packet>(static_cast<T>(end - f)));
        detail::store_packet<Stream>(y + f, pmadd(psub(ploadu<Packet>(x + f), pselect(first, pp, np)),
                                                   pselect(first, ps, ns), pselect(first, pb, nb)));
        f += L;
      }
      c = cn;
      end += inner;
      pp = np;
      ps = ns;
      pb = nb;
    }
    for (; f < f1; ++f) one(f);
  }

  // What the dx passes read and write: x, dy, dx and the per-channel
  // coefficients, dx = fma(dy, a, -fma(x_hat, k3, k4)) with x_hat =
  // fma(x - piv, rs, xs). The loops copy it into a local first: through
  // captured references, GCC at -O2 reloaded every pointer after each store,
  // since Eigen's packet stores may alias anything.
  struct DxArgs {
    const T* x;
    const T* dy;
    T* dx;
    const T* piv;
    const T* rs;
    const T* xs;
    const T* k3;
    const T* k4;
    const T* a;
  };

  // dx of one channels-first segment: `inner` values from `base`, channel c;
  // streaming stores when Stream. Always inlined (as a lambda, GCC at -O2
  // called it out of line once per segment: the backward took 1.2-1.4x its
  // -O3 time on short segments and channels last).
  template <bool Stream>
  static EIGEN_ALWAYS_INLINE void dx_values(const DxArgs& q, Index base, Index inner, Index c) {
    using namespace Eigen::internal;
    using Packet = typename detail::narrow_simd<T>::Packet;
    constexpr int L = detail::narrow_simd<T>::L;
    const T* xp = q.x + base;
    const T* gp = q.dy + base;
    T* out = q.dx + base;
    const T piv = q.piv[c], rs = q.rs[c], xs = q.xs[c], k3 = q.k3[c], k4 = q.k4[c], a = q.a[c];
    const Packet pp = pset1<Packet>(piv), pa = pset1<Packet>(a), p3 = pset1<Packet>(k3), p4 = pset1<Packet>(k4),
                 pr = pset1<Packet>(rs), pxs = pset1<Packet>(xs);
    Index i = 0;
    for (; i + L <= inner; i += L) {
      const Packet xh = pmadd(psub(ploadu<Packet>(xp + i), pp), pr, pxs);
      detail::store_packet<Stream>(out + i, pmadd(ploadu<Packet>(gp + i), pa, pnegate(pmadd(xh, p3, p4))));
    }
    for (; i < inner; ++i) {
      const T xh = detail::madd(xp[i] - piv, rs, xs);
      out[i] = detail::madd(gp[i], a, -detail::madd(xh, k3, k4));
    }
  }

  // dx of channels-first segments [s0, s1) of 1 < inner < L values, as
  // normalize_small_maps: a tile of channels at a time, its six constants
  // expanded to one per value (kSmallMapTile / 2 values a tile: 24 KB of
  // floats), then each sample's run of the tile in packets, the arithmetic
  // of dx_values on every value, so the same bits.
  static void dx_small_maps(const DxArgs& q, Index inner, Index C, Index s0, Index s1) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const T* const constants[6] = {q.piv, q.rs, q.xs, q.k3, q.k4, q.a};
    small_map_tiles(inner, C, s0, s1, kSmallMapTile / 2 / inner, constants,
                    [&](Index first, Index len, const T* pv, Index tile) {
                      const T* const rs = pv + tile;
                      const T* const xs = rs + tile;
                      const T* const k3 = xs + tile;
                      const T* const k4 = k3 + tile;
                      const T* const ga = k4 + tile;
                      const T* const xp = q.x + first;
                      const T* const gp = q.dy + first;
                      T* const out = q.dx + first;
                      Index i = 0;
                      for (; i + L <= len; i += L) {
                        const Packet xh = pmadd(psub(ploadu<Packet>(xp + i), ploadu<Packet>(pv + i)),
                                                ploadu<Packet>(rs + i), ploadu<Packet>(xs + i));
                        pstoreu(out + i, pmadd(ploadu<Packet>(gp + i), ploadu<Packet>(ga + i),
                                               pnegate(pmadd(xh, ploadu<Packet>(k3 + i), ploadu<Packet>(k4 + i)))));
                      }
                      for (; i < len; ++i) {
                        const T xh = detail::madd(xp[i] - pv[i], rs[i], xs[i]);
                        out[i] = detail::madd(gp[i], ga[i], -detail::madd(xh, k3[i], k4[i]));
                      }
                    });
  }

  // One segment (o, c) of a channels-first tensor: adds its sums (as in
  // channel_sums) to the channel's. S: T, or 16 bits widened as loaded
  // (builds with detail::packet_io).
  template <typename S>
  static void segment_sums(const S* xs, const S* gs, Index inner, T mean, double& sg, double& sgd, double& sd) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const Packet pm = pset1<Packet>(mean);
    Packet a0 = pset1<Packet>(T(0)), a1 = a0, a2 = a0;
    Index i = 0;
    for (; i + L <= inner; i += L) {
      const Packet g = detail::load_widened<Packet>(gs + i);
      const Packet d = psub(detail::load_widened<Packet>(xs + i), pm);
      a0 = padd(a0, g);
      a1 = pmadd(g, d, a1);
      a2 = padd(a2, d);
    }
    double s0 = static_cast<double>(predux(a0)), s1 = static_cast<double>(predux(a1)),
           s2 = static_cast<double>(predux(a2));
    for (; i < inner; ++i) {
      const double d = static_cast<double>(static_cast<T>(xs[i]) - mean);
      const double g = static_cast<double>(static_cast<T>(gs[i]));
      s0 += g;
      s1 += g * d;
      s2 += d;
    }
    sg += s0;
    sgd += s1;
    sd += s2;
  }

  // Channels [c0, c1) of a channels-first tensor: adds their sums over every
  // segment, in order of o (memory order).
  // 16-bit x and dy (S) in builds without packet conversions: a segment
  // at a time widened into a float buffer.
  template <typename S>
  static void range_sums(const S* x, const S* dy, const View& v, const T* mean, Index c0, Index c1, double* sg,
                         double* sgd, double* sd) {
    if (v.inner > 1 && v.inner < detail::simd<T>::L) {
      small_map_sums(x, dy, v, mean, c0, c1, sg, sgd, sd);
      return;
    }
    const Index inner = v.inner;
    if constexpr (detail::packet_io<S, detail::simd<T>::L>()) {
      for (Index o = 0; o < v.outer; ++o) {
        for (Index c = c0; c < c1; ++c) {
          const Index base = (o * v.C + c) * inner;
          segment_sums(x + base, dy + base, inner, mean[c], sg[c], sgd[c], sd[c]);
        }
      }
    } else {
      detail::Scratch<T> buf(static_cast<std::size_t>(2 * inner), false);
      T* const xb = buf.data();
      T* const gb = xb + inner;
      for (Index o = 0; o < v.outer; ++o) {
        for (Index c = c0; c < c1; ++c) {
          const Index base = (o * v.C + c) * inner;
          detail::convert_n(x + base, xb, inner);
          detail::convert_n(dy + base, gb, inner);
          segment_sums(static_cast<const T*>(xb), static_cast<const T*>(gb), inner, mean[c], sg[c], sgd[c], sd[c]);
        }
      }
    }
  }

  // range_sums for maps smaller than a packet (1 < inner < L), as
  // small_map_moments: each position (c, i) of a tile of channels is a
  // lane, and chunk_sums (the channels-last kernel) steps the tile's lanes
  // down the batch (stride C * inner) with each lane's channel mean, in T
  // over chunks of kChunk samples; a channel adds its lanes' chunk sums in
  // double, in order of i, chunk after chunk. A lane's arithmetic does not
  // depend on its place in the tile, so neither does a channel's on how
  // the channels are split.
  template <typename S>
  static void small_map_sums(const S* x, const S* dy, const View& v, const T* mean, Index c0, Index c1,
                             double* sg, double* sgd, double* sd) {
    const Index inner = v.inner, stride = v.C * inner;
    const Index ct = std::max<Index>(1, kSmallMapTile / inner);
    const bool cached = sum_rows_cached(v.outer * inner, v.C);
    std::vector<T> m(static_cast<std::size_t>(ct * inner)), a(static_cast<std::size_t>(3 * ct * inner));
    for (Index t0 = c0; t0 < c1; t0 += ct) {
      const Index t1 = std::min(c1, t0 + ct), w = (t1 - t0) * inner;
      for (Index c = t0; c < t1; ++c) std::fill_n(m.begin() + (c - t0) * inner, inner, mean[c]);
      for (Index o0 = 0; o0 < v.outer; o0 += detail::kChunk) {
        std::fill(a.begin(), a.end(), T(0));
        strided_sums(x + t0 * inner, dy + t0 * inner, stride, m.data(), w, o0,
                     std::min<Index>(v.outer, o0 + detail::kChunk), a.data(), cached);
        for (Index c = t0; c < t1; ++c)
          for (Index j = (c - t0) * inner; j < (c - t0 + 1) * inner; ++j) {
            sg[c] += static_cast<double>(a[static_cast<std::size_t>(j)]);
            sgd[c] += static_cast<double>(a[static_cast<std::size_t>(w + j)]);
            sd[c] += static_cast<double>(a[static_cast<std::size_t>(2 * w + j)]);
          }
      }
    }
  }

  // Channels-last rows [r0, r1), channels [c0, c0 + w): adds each channel's
  // sums of dy, dy * d and d (d = x - mean) in T to a[c], a[w + c], a[2w + c],
  // row after row. On inputs the caches hold (`cached`), kSumRows rows at a
  // time: a column's three sums are loaded and stored once for the four,
  // which add their terms in row order (the same bits). Measured on Zen 4
  // (float, 1 thread, the whole backward): 0.78-0.98x the time on inputs of
  // 2-8 MB (64x512x7x7 0.88x, (N,C) 4096x512 0.91-0.93x, 32x32x32x32
  // 0.78x; -O2 0.88x and 0.95x); on inputs from memory it lost
  // (32x64x56x56 1.10x, 256x256x14x14 1.23x; 64x64x28x28, 12.8 MB, 1.00x),
  // hence the gate (x under kStreamingBytes). Two rows at a time: 0.95x at
  // 64x512x7x7, 1.05x at 4096x512. On Zen 3 (AVX2, the same 256-bit
  // packets) four rows lost from 6 MB (0.87x the time with one row at
  // 64x512x7x7, 0.91x at (N,C) 4096x512, 0.82x at 12544x128) and won or tied
  // below (1.15x with one row at 32768x32, 0.99x at 2048x512), so builds
  // without AVX-512 gate them as the row-wise backwards (x under
  // kStreamingBytes / 2, detail::streaming_backward): the instruction set
  // stands in for the machine, the only hint a header has.
  static constexpr int kSumRows = 4;
  // Whether the channels-last dx pass takes streaming stores (with the
  // conditions on dx in backward_impl): on the row-wise backwards' gate (x
  // of at least kStreamingBytes / 2, detail::streaming_backward), on every
  // CPU. Streaming stores, against ordinary ones, the whole backward, float,
  // 1 thread, the same bits: on Zen 3 (AVX2, two builds of one driver
  // alternating, 7 rounds) 0.80x the time at (N,C) 4096x512, 0.82-0.87x at
  // 3136x512, 50176x256 and 100352x64, 0.85x at 2560x512 (5 MB), 0.90x at
  // 2048x512 (4 MB) and 1.05x at 1024x512 (2 MB), which the caches hold
  // between calls; on an Intel Xeon (AVX-512, two builds) 0.81x at
  // 256x256x14x14 channels-last and 0.89x at 32x64x56x56 (1.00x at
  // 3136x512 and (N,C) 4096x512); on AMD Zen 5 0.85x at (N,C) 4096x512 and
  // 0.88-0.97x channels-last at 32x64x56x56, 256x256x14x14 and 64x512x7x7
  // (2 threads 0.86-0.96x);
  // on Zen 4 (both choices alternating in one process, 9 shuffled rounds,
  // session 53) 0.77-0.81x at (N,C) 4096x512, 0.79x at 64x512x7x7,
  // 0.93x at 256x256x14x14, 0.97x at 32x64x56x56, 0.76x at 16x512x14x14,
  // 0.82-0.83x at 1600x1024 and 12544x128, 0.89x at 100352x64; 2 threads
  // 0.78x, 0.84x, 0.88x, 0.87x and 0.84x at the first five. (An earlier
  // round's 1.10-1.14x at 32x64x56x56 and 256x256x14x14 on Zen 4, with
  // the backward's code of then, had kept AVX-512 builds off it but on
  // Intel CPUs and Zen 5.)
  static bool dx_streams_channels_last(Index rows, Index C) { return detail::streaming_backward<T, T>(rows, C); }
  // Whether the four-row sums apply (chunk_sums, kSumRows). With streaming
  // dx on Zen 4, one row at a time on inputs of kStreamingBytes / 2 to
  // kStreamingBytes (the gate of builds without AVX-512) took 1.14-1.31x the
  // time at 64x512x7x7, 16x512x14x14, 1600x1024 and 12544x128, 1.01x at
  // (N,C) 4096x512.
  static bool sum_rows_cached(Index rows, Index C) {
#if defined(EIGEN_VECTORIZE_AVX512)
    return !detail::streaming_input<T, T>(rows, C);
#else
    return !detail::streaming_backward<T, T>(rows, C);
#endif
  }
  // S: T, or 16 bits widened as loaded (builds with detail::packet_io).
  template <typename S>
  static void chunk_sums(const S* x, const S* dy, Index C, const T* mean, Index c0, Index w, Index r0, Index r1,
                         T* a, bool cached) {
    const Index o = cached ? chunk_sums_rows<kSumRows>(x, dy, C, mean, c0, w, r0, r1, a) : r0;
    chunk_sums_rows<1>(x, dy, C, mean, c0, w, o, r1, a);
  }
  // chunk_sums over whole groups of R rows from r0; returns the first row
  // it left.
  template <int R, typename S>
  static Index chunk_sums_rows(const S* x, const S* dy, Index C, const T* mean, Index c0, Index w, Index r0,
                               Index r1, T* a) {
    using namespace Eigen::internal;
    // At most 256-bit packets: the sums go through memory row after row, and
    // with AVX-512 the 512-bit store-to-load chains took about twice as long.
    using Packet = typename detail::narrow_simd<T>::Packet;
    constexpr int L = detail::narrow_simd<T>::L;
    Index o = r0;
    for (; o + R <= r1; o += R) {
      const S* xr = x + o * C + c0;
      const S* gr = dy + o * C + c0;
      const T* mr = mean + c0;
      Index c = 0;
      for (; c + L <= w; c += L) {
        const Packet m = ploadu<Packet>(mr + c);
        Packet s0 = ploadu<Packet>(a + c), s1 = ploadu<Packet>(a + w + c), s2 = ploadu<Packet>(a + 2 * w + c);
        NORMCORE_UNROLL
        for (int i = 0; i < R; ++i) {
          const Packet g = detail::load_widened<Packet>(gr + i * C + c);
          const Packet d = psub(detail::load_widened<Packet>(xr + i * C + c), m);
          s0 = padd(s0, g);
          s1 = pmadd(g, d, s1);
          s2 = padd(s2, d);
        }
        pstoreu(a + c, s0);
        pstoreu(a + w + c, s1);
        pstoreu(a + 2 * w + c, s2);
      }
      for (; c < w; ++c) {
        NORMCORE_UNROLL
        for (int i = 0; i < R; ++i) {
          const T d = static_cast<T>(xr[i * C + c]) - mr[c];
          const T g = static_cast<T>(gr[i * C + c]);
          a[c] += g;
          a[w + c] = detail::madd(g, d, a[w + c]);
          a[2 * w + c] += d;
        }
      }
    }
    return o;
  }

  // chunk_sums of rows [r0, r1) of w values each, row o at x + o * stride
  // (and dy + o * stride), their means at mean[0, w). 16-bit x and dy (S)
  // are widened as loaded, or, in builds without packet conversions, go a
  // few rows at a time (about kNormalizeBlock values, at least kSumRows
  // rows) through float buffers: chunk_sums adds every row's terms in row order however many
  // rows it is given at once, so the same bits as on float copies.
  template <typename S>
  static void strided_sums(const S* x, const S* dy, Index stride, const T* mean, Index w, Index r0, Index r1,
                           T* a, bool cached) {
    if constexpr (detail::packet_io<S, detail::narrow_simd<T>::L>()) {
      chunk_sums(x, dy, stride, mean, 0, w, r0, r1, a, cached);
    } else {
      const Index rows = std::max<Index>(kSumRows, kNormalizeBlock / std::max<Index>(1, w) / kSumRows * kSumRows);
      detail::Scratch<T> buf(static_cast<std::size_t>(2 * rows * w), false);
      T* const xb = buf.data();
      T* const gb = xb + rows * w;
      for (Index o = r0; o < r1; o += rows) {
        const Index m = std::min(rows, r1 - o);
        for (Index i = 0; i < m; ++i) {
          detail::convert_n(x + (o + i) * stride, xb + i * w, w);
          detail::convert_n(dy + (o + i) * stride, gb + i * w, w);
        }
        chunk_sums(xb, gb, w, mean, 0, w, 0, m, a, true);  // (the buffers are in cache)
      }
    }
  }

  // Per channel: sg = sum dy, sgd = sum dy * d, sd = sum d with d = x - mean.
  // Channels last: sums in T over chunks of kChunk rows, added in double in
  // chunk order (on several threads, whole chunks per thread). S: T, or
  // 16-bit x and dy, widened as they are read (strided_sums, range_sums).
  template <typename Device, typename S>
  void channel_sums(const Device& device, const S* x, const S* dy, const View& v, const T* mean,
                    double* sg, double* sgd, double* sd) const {
    const Index C = v.C;
    for (Index c = 0; c < C; ++c) sg[c] = sgd[c] = sd[c] = 0;
    const bool cached = sum_rows_cached(v.outer * v.inner, C);  // chunk_sums
    if (rows_split(device, v)) {
      row_chunks<double>(device, v, 3 * C, [&](Index k0, Index k1, double* out) {
        std::vector<T> a(static_cast<std::size_t>(3 * C));
        for (Index k = k0; k < k1; ++k, out += 3 * C) {
          std::fill(a.begin(), a.end(), T(0));
          strided_sums(x, dy, C, mean, C, k * detail::kChunk, std::min(v.outer, (k + 1) * detail::kChunk), a.data(),
                       cached);
          for (Index j = 0; j < 3 * C; ++j) out[j] = static_cast<double>(a[static_cast<std::size_t>(j)]);
        }
      }, [&](const double* chunk) {
        for (Index c = 0; c < C; ++c) {
          sg[c] += chunk[c];
          sgd[c] += chunk[C + c];
          sd[c] += chunk[2 * C + c];
        }
      });
      return;
    }
    const detail::Split split = channel_split(device, v);
    detail::run_parts(device, split.parts, [&](Index p) {
      const Index c0 = split.begin(p), c1 = split.begin(p + 1), w = c1 - c0;
      if (v.inner == 1) {
        std::vector<T> a(static_cast<std::size_t>(3 * w));
        for (Index o0 = 0; o0 < v.outer; o0 += detail::kChunk) {
          std::fill(a.begin(), a.end(), T(0));
          strided_sums(x + c0, dy + c0, C, mean + c0, w, o0, std::min<Index>(v.outer, o0 + detail::kChunk), a.data(),
                       cached);
          for (Index c = 0; c < w; ++c) {
            sg[c0 + c] += static_cast<double>(a[static_cast<std::size_t>(c)]);
            sgd[c0 + c] += static_cast<double>(a[static_cast<std::size_t>(w + c)]);
            sd[c0 + c] += static_cast<double>(a[static_cast<std::size_t>(2 * w + c)]);
          }
        }
        return;
      }
      range_sums(x, dy, v, mean, c0, c1, sg, sgd, sd);
    });
  }

  // S: T, or the 16-bit type x, dy and dx are stored in (then read and
  // written as stored: the statistics by batch_moments, the sums by
  // channel_sums, dx by dx16_part; see there).
  template <typename Device, typename X, typename DY, typename S>
  void backward_impl(const Device& device, const X& x, const DY& dy, S* dx, Eigen::Tensor<P, 1>* dweight,
                     Eigen::Tensor<P, 1>* dbias, const NormStats<T>* saved) const {
    constexpr bool widen = !std::is_same<S, T>::value;
    detail::check_layouts<X, DY>();
    const View v = view_of(x);
    detail::check_same_shape(kWho, "dy", x, dy);
    if ((dweight || dbias) && !weight_.size())
      detail::fail(std::string(kWho) + ": dweight/dbias requested but the layer is not affine");
    const Index C = v.C;
    if (saved) {
      detail::check_stats(kWho, saved->mean, "mean", C);
      detail::check_stats(kWho, saved->rstd, "rstd", C);
    }
    std::vector<T> mean(static_cast<std::size_t>(C)), rstd(static_cast<std::size_t>(C));
    const bool batch = uses_batch_stats();
    if (saved) {
      for (Index c = 0; c < C; ++c) {
        mean[static_cast<std::size_t>(c)] = saved->mean(c);
        rstd[static_cast<std::size_t>(c)] = saved->rstd(c);
      }
    } else if (batch) {
      std::vector<T> pivot;
      std::vector<Welford<double>> w;
      batch_moments(device, x.data(), v, pivot, w);
      const std::vector<double> r = batch_rstd(w);
      for (Index c = 0; c < C; ++c) {
        const auto& wc = w[static_cast<std::size_t>(c)];
        const auto k = detail::norm_coeffs_r<T>(pivot[static_cast<std::size_t>(c)], wc.mean(), wc.variance(),
                                                r[static_cast<std::size_t>(c)]);
        mean[static_cast<std::size_t>(c)] = k.mean;
        rstd[static_cast<std::size_t>(c)] = k.rstd;
      }
    } else {
      const std::vector<double> r = running_rstd();
      for (Index c = 0; c < C; ++c) {
        mean[static_cast<std::size_t>(c)] = running_mean_(c);
        rstd[static_cast<std::size_t>(c)] = static_cast<T>(r[static_cast<std::size_t>(c)]);
      }
    }
    const Index local_count = v.outer * v.inner;
    std::vector<double> sums(static_cast<std::size_t>(3 * C + 1));
    double* sg = sums.data();
    double* sgd = sg + C;
    double* sd = sgd + C;
    sums[static_cast<std::size_t>(3 * C)] = static_cast<double>(local_count);
    // Per channel: dx = fma(dy, a, -fma(x_hat, k3, k4)), x_hat = fma(x - mean, rs, xs).
    std::vector<T> a(static_cast<std::size_t>(C)), k3(static_cast<std::size_t>(C)), k4(static_cast<std::size_t>(C)),
        xs(static_cast<std::size_t>(C));
    const std::vector<T>& piv = mean;
    const std::vector<T>& rs = rstd;
    auto coeffs = [&](Index c, double count) {
      const std::size_t cc = static_cast<std::size_t>(c);
      const double g = weight_.size() ? static_cast<double>(weight_(c)) : 1.0;
      const double r = static_cast<double>(rstd[cc]);
      a[cc] = static_cast<T>(g * r);
      // x_hat = fma(d, rstd, xs) and no rstd^2 anywhere, which would leave
      // T's range at extreme magnitudes.
      if (batch && count > 0) {
        const double inv_n = 1.0 / count;
        const double delta = sd[c] * inv_n;
        const double mean_g = sg[c] * inv_n;
        const double mean_gx = r * (sgd[c] - delta * sg[c]) * inv_n;
        k3[cc] = static_cast<T>(g * r * mean_gx);
        k4[cc] = static_cast<T>(g * r * mean_g);
        xs[cc] = static_cast<T>(-delta * r);
      } else {
        k3[cc] = k4[cc] = xs[cc] = T(0);
      }
    };
    // Streaming stores for dx when dx is apart from x and dy, aligned, and
    // its segments (channels-first) or rows (channels-last) are whole
    // packets: channels-first on inputs of detail::kStreamingBytes or more,
    // channels-last on the row-wise backwards' gate
    // (dx_streams_channels_last).
    // (16-bit dx: ordinary stores.)
    const Index total = v.outer * C * v.inner;
    bool stream = false;
    if constexpr (!widen) {
      stream = dx &&
               (v.inner > 1 ? total * static_cast<Index>(sizeof(T)) >= detail::kStreamingBytes &&
                                  detail::can_stream_rows(dx, v.inner)
                            : dx_streams_channels_last(v.outer, C) && detail::can_stream_rows(dx, C)) &&
               detail::disjoint(x.data(), total, static_cast<const T*>(dx), total) &&
               detail::disjoint(dy.data(), total, static_cast<const T*>(dx), total);
    }
    const auto streaming = [&](auto&& body) {
      if (stream) {
        body(std::true_type());
        detail::stream_fence();
      } else {
        body(std::false_type());
      }
    };
    DxArgs dx_args{nullptr, nullptr, nullptr, piv.data(), rs.data(), xs.data(), k3.data(), k4.data(), a.data()};
    if constexpr (!widen) {
      dx_args.x = x.data();
      dx_args.dy = dy.data();
      dx_args.dx = dx;
    }
    // Channels first with no cross-process reduction: each channel's sums,
    // coefficients and dx in one go, so dx reads x and dy back from cache
    // rather than memory. Same arithmetic, same bits as the two passes.
    // Only with enough channels to keep every thread busy (the dx pass alone
    // splits finer, by segments).
    // (inner may be 0: an empty spatial dim, or N = 0 for ColMajor.) Not
    // for 16-bit tensors, whose passes widen them again.
    const Index group = detail::fused_channel_group(v.inner, local_count * Index(2 * sizeof(T)), kFusedRun);
    // On Intel CPUs, where a group stays within half the L2, a group's run
    // of contiguous values must be a quarter of kFusedRun long; elsewhere
    // each segment (see kFusedRun). Channels first only (inner > 1):
    // channels-last sums go by chunks of rows, other bits.
    const Index run = v.inner <= 1 ? 0 : detail::intel_tuned() ? group * v.inner : v.inner;
    const bool fused = !widen && dx && run >= kFusedRun / 4 && local_count > 0 && !(reducer_ && batch) &&
                       C >= 8 * static_cast<Index>(device.numThreads()) &&
                       group * local_count * Index(2 * sizeof(T)) <= kFusedBytes;
    if (fused) {  // (sums starts at zero)
      const detail::Split split = channel_split(device, v);
      detail::run_parts(device, split.parts, [&](Index p) {
        streaming([&](auto stream_dx) {
          constexpr bool Stream = decltype(stream_dx)::value;
          const DxArgs q = dx_args;
          const Index c1 = split.begin(p + 1), inner = v.inner, outer = v.outer, nc = C;
          for (Index g0 = split.begin(p); g0 < c1; g0 += group) {
            const Index g1 = std::min(c1, g0 + group);
            range_sums(q.x, q.dy, v, mean.data(), g0, g1, sg, sgd, sd);
            for (Index c = g0; c < g1; ++c) coeffs(c, static_cast<double>(local_count));
            for (Index o = 0; o < outer; ++o)
              for (Index c = g0; c < g1; ++c) dx_values<Stream>(q, (o * nc + c) * inner, inner, c);
          }
        });
      });
    } else if (local_count > 0) {
      channel_sums(device, x.data(), dy.data(), v, mean.data(), sg, sgd, sd);
    }
    // Parameter gradients are local (as PyTorch's SyncBatchNorm): keep this
    // process's sums; the mean correction delta below is global.
    const std::vector<double> local(sums.begin(), sums.begin() + 2 * C);
    if (reducer_ && batch) reducer_->allreduce_sums(sums.data(), 3 * C + 1);
    const double count = sums[static_cast<std::size_t>(3 * C)];
    if (dweight) {
      detail::resize_vector(*dweight, C);
      for (Index c = 0; c < C; ++c) {
        const double r = static_cast<double>(rstd[static_cast<std::size_t>(c)]);
        const double delta = batch && count > 0 ? sd[c] / count : 0.0;
        (*dweight)(c) = static_cast<P>(r * (local[static_cast<std::size_t>(C + c)] - delta * local[static_cast<std::size_t>(c)]));
      }
    }
    if (dbias) {
      detail::resize_vector(*dbias, C);
      for (Index c = 0; c < C; ++c) (*dbias)(c) = static_cast<P>(local[static_cast<std::size_t>(c)]);
    }
    if (!dx || fused || total == 0) return;  // (an empty dim: nothing to write)
    for (Index c = 0; c < C; ++c) coeffs(c, count);
    const detail::Split split = segment_split(device, v);
    if constexpr (widen) {
      detail::run_parts(device, split.parts, [&split, &x, &dy, &dx, &dx_args, &v](Index p) {
        dx16_part(x.data(), dy.data(), dx, dx_args, v, split.begin(p), split.begin(p + 1));
      });
    } else {
      detail::run_parts(device, split.parts, [&split, &v, &streaming, &dx_args, &C](Index p) {
        const Index s0 = split.begin(p), s1 = split.begin(p + 1);
        if (v.inner == 1) {
          streaming([&](auto stream_dx) {
            constexpr bool Stream = decltype(stream_dx)::value;
            dx_rows<Stream>(dx_args, C, s0, s1);
          });
          return;
        }
        if (v.inner > 1 && v.inner < detail::simd<T>::L) {  // (never streams: segments shorter than a packet)
          dx_small_maps(dx_args, v.inner, C, s0, s1);
          return;
        }
        streaming([&](auto stream_dx) {
          constexpr bool Stream = decltype(stream_dx)::value;
          const DxArgs q = dx_args;
          const Index inner = v.inner, nc = C;
          Index c = s0 % nc;  // channel of segment s
          for (Index s = s0; s < s1; ++s) {
            dx_values<Stream>(q, s * inner, inner, c);
            if (++c == nc) c = 0;  // no division per segment
          }
        });
      });
    }
  }

  // dx of channels-last rows [o0, o1) of C values. In packets of at most
  // 256 bits: with AVX-512, 512-bit ones took 1.3-1.7x the time (three
  // streams and six per-channel constants a packet).
  template <bool Stream>
  static void dx_rows(const DxArgs& args, Index C, Index o0, Index o1) {
    using namespace Eigen::internal;
    using Packet = typename detail::narrow_simd<T>::Packet;
    constexpr int L = detail::narrow_simd<T>::L;
    const DxArgs q = args;  // (in a local: see DxArgs)
    for (Index o = o0; o < o1; ++o) {
      const T* xr = q.x + o * C;
      const T* gr = q.dy + o * C;
      T* dr = q.dx + o * C;
      Index c = 0;
      for (; c + L <= C; c += L) {
        const Packet d = psub(ploadu<Packet>(xr + c), ploadu<Packet>(q.piv + c));
        const Packet xh = pmadd(d, ploadu<Packet>(q.rs + c), ploadu<Packet>(q.xs + c));
        const Packet t = pmadd(xh, ploadu<Packet>(q.k3 + c), ploadu<Packet>(q.k4 + c));
        detail::store_packet<Stream>(dr + c, pmadd(ploadu<Packet>(gr + c), ploadu<Packet>(q.a + c), pnegate(t)));
      }
      for (; c < C; ++c) {
        const T xh = detail::madd(xr[c] - q.piv[c], q.rs[c], q.xs[c]);
        dr[c] = detail::madd(gr[c], q.a[c], -detail::madd(xh, q.k3[c], q.k4[c]));
      }
    }
  }

  // dx of segments [s0, s1) (channels last: rows) into 16-bit dx from
  // 16-bit x and dy (S), with the per-channel constants of k (its x, dy and
  // dx unused): no float copy. Channels-last rows, and channels-first
  // segments that one_pass_segments takes, in one
  // pass (dx16_rows, dx16_segments) in builds that convert whole
  // packets; the rest a block of about kNormalizeBlock values at a time
  // through float buffers, with the float kernels on each block (whole
  // rows; a run of one sample's segments; or a piece of one long segment)
  // and convert_n into dx. Every value gets the arithmetic of dx_values,
  // rounded once: the same bits as the float backward on widened copies of
  // x and dy, rounded (the path before, which made those copies).
  template <typename S>
  static void dx16_part(const S* x, const S* dy, S* dx, const DxArgs& k, const View& v, Index s0, Index s1) {
    constexpr int L = detail::simd<T>::L;
    const Index C = v.C, inner = v.inner, total = v.outer * C * inner;
    if constexpr (detail::packet_io<S, L>()) {
      // Overlapping tails (as normalize16_rows) when dx is apart from x and dy.
      const bool apart = detail::disjoint(x, total, dx, total) && detail::disjoint(dy, total, dx, total);
      if (inner == 1) {
        dx16_rows(x, dy, dx, k, C, s0, s1, apart);
        return;
      }
      if (one_pass_segments(inner, apart)) {
        dx16_segments(x, dy, dx, k, inner, C, s0, s1, apart);
        return;
      }
    }
    const Index block = std::max(kNormalizeBlock, inner == 1 ? C : Index(0));  // at least a row
    detail::Scratch<T> buf(static_cast<std::size_t>(2 * block), false);
    T* const xb = buf.data();
    T* const gb = xb + block;
    // Each block's dx over dy's buffer (in place, as the kernels allow).
    for_blocks(v, s0, s1, block, [&](Index first, Index count, const View& bv, Index c) {
      detail::convert_n(x + first, xb, count);
      detail::convert_n(dy + first, gb, count);
      const DxArgs q{xb, gb, gb, k.piv + c, k.rs + c, k.xs + c, k.k3 + c, k.k4 + c, k.a + c};
      if (bv.inner == 1) {
        dx_rows<false>(q, bv.C, 0, bv.outer);
      } else if (bv.inner < L) {
        dx_small_maps(q, bv.inner, bv.C, 0, bv.C);
      } else {
        for (Index j = 0; j < bv.C; ++j) dx_values<false>(q, j * bv.inner, bv.inner, j);
      }
      detail::convert_n(static_cast<const T*>(gb), dx + first, count);
    });
  }

  // dx16_part's one-pass kernels: each packet of x and dy widened as it is
  // loaded, dx rounded once as it is stored; a row's or segment's last
  // values through one more packet, computed and rounded as the body is
  // (detail::convert_n's tail does the same): the last L values, overlapping
  // the body, when dx is apart from x and dy (`apart`), else one padded
  // packet (dx16_tail), as normalize16_rows. Overlapping tails, against
  // padded ones, on the Zen 4 guest (bfloat16, 1 thread, saved statistics):
  // 0.87x the time at NCHW 256x256x14x14 and, with the segments under 8
  // packets opened to the kernel, 0.81x at 64x512x7x7 and 0.72x at
  // 64x256x9x9; channels-last 0.61x at 8192x100 and 0.90x at 2048x1000.
  template <typename Packet>
  static EIGEN_ALWAYS_INLINE Packet dx_of(const Packet& xv, const Packet& g, const Packet& piv, const Packet& rs,
                                          const Packet& xs, const Packet& k3, const Packet& k4, const Packet& a) {
    using namespace Eigen::internal;
    return pmadd(g, a, pnegate(pmadd(pmadd(psub(xv, piv), rs, xs), k3, k4)));
  }
  // Channels-last rows in full packets, unlike the float dx_rows: with
  // AVX-512 (bfloat16, 1 thread, the whole backward with saved statistics)
  // 512-bit packets took 0.79-0.93x the time of 256-bit ones at 4096x512,
  // 64x512x7x7, 32x64x56x56 and 256x256x14x14 channels last.
  template <typename S>
  static void dx16_rows(const S* x, const S* dy, S* dx, const DxArgs& k, Index C, Index o0, Index o1, bool apart) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const DxArgs q = k;  // (in a local: see DxArgs)
    const Index full = C / L * L;
    for (Index o = o0; o < o1; ++o) {
      const S* xr = x + o * C;
      const S* gr = dy + o * C;
      S* dr = dx + o * C;
      const auto packet = [&](Index c) {
        detail::store_narrowed(dr + c, dx_of(detail::load_widened<Packet>(xr + c), detail::load_widened<Packet>(gr + c),
                                             ploadu<Packet>(q.piv + c), ploadu<Packet>(q.rs + c),
                                             ploadu<Packet>(q.xs + c), ploadu<Packet>(q.k3 + c),
                                             ploadu<Packet>(q.k4 + c), ploadu<Packet>(q.a + c)));
      };
      for (Index c = 0; c < full; c += L) packet(c);
      if (full == C) continue;
      if (apart && C >= L)
        packet(C - L);  // the row's last L values
      else
        dx16_tail(xr + full, gr + full, dr + full, C - full, q, full, 1);
    }
  }
  template <typename S>
  static void dx16_segments(const S* x, const S* dy, S* dx, const DxArgs& k, Index inner, Index C, Index s0,
                            Index s1, bool apart) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    const DxArgs q = k;
    const Index full = inner / L * L;
    Index c = s0 % C;
    for (Index sg = s0; sg < s1; ++sg) {
      const S* xs = x + sg * inner;
      const S* gs = dy + sg * inner;
      S* ds = dx + sg * inner;
      const Packet pp = pset1<Packet>(q.piv[c]), pr = pset1<Packet>(q.rs[c]), px = pset1<Packet>(q.xs[c]),
                   p3 = pset1<Packet>(q.k3[c]), p4 = pset1<Packet>(q.k4[c]), pa = pset1<Packet>(q.a[c]);
      const auto packet = [&](Index i) {
        detail::store_narrowed(ds + i, dx_of(detail::load_widened<Packet>(xs + i), detail::load_widened<Packet>(gs + i),
                                             pp, pr, px, p3, p4, pa));
      };
      for (Index i = 0; i < full; i += L) packet(i);
      if (full < inner) {
        if (apart)
          packet(inner - L);  // the segment's last L values (inner >= L here)
        else
          dx16_tail(xs + full, gs + full, ds + full, inner - full, q, c, 0);
      }
      if (++c == C) c = 0;
    }
  }
  // n < L values; the constants of value j at k.<constant>[c + j * step].
  template <typename S>
  static void dx16_tail(const S* x, const S* dy, S* dx, Index n, const DxArgs& k, Index c, Index step) {
    using namespace Eigen::internal;
    using Packet = typename detail::simd<T>::Packet;
    constexpr int L = detail::simd<T>::L;
    alignas(64) T in[8][L] = {};  // x, dy, then the constants in dx_of's order
    alignas(64) S out[L];
    const T* const constants[6] = {k.piv, k.rs, k.xs, k.k3, k.k4, k.a};
    for (Index j = 0; j < n; ++j) {
      in[0][j] = static_cast<T>(x[j]);
      in[1][j] = static_cast<T>(dy[j]);
      for (int i = 0; i < 6; ++i) in[2 + i][j] = constants[i][c + j * step];
    }
    detail::store_narrowed(out, dx_of(ploadu<Packet>(in[0]), ploadu<Packet>(in[1]), ploadu<Packet>(in[2]),
                                      ploadu<Packet>(in[3]), ploadu<Packet>(in[4]), ploadu<Packet>(in[5]),
                                      ploadu<Packet>(in[6]), ploadu<Packet>(in[7])));
    std::copy(out, out + n, dx);
  }

  BatchNormOptions options_;
  bool training_ = true;
  Eigen::Tensor<P, 1> weight_;
  Eigen::Tensor<P, 1> bias_;
  Eigen::Tensor<T, 1> running_mean_;
  Eigen::Tensor<T, 1> running_var_;
  std::int64_t num_batches_tracked_ = 0;
  BatchNormReducer* reducer_ = nullptr;
};

}  // namespace normcore
