// normcore: 16-bit storage (Eigen::bfloat16, Eigen::half).
//
// Two ways in, both computing in float (nothing is ever accumulated in 16
// bits) and rounding each output once:
//   - a float layer (LayerNorm<float>, ...) accepts bfloat16 or half tensors
//     for its inputs and outputs: float weights, 16-bit activations;
//   - a 16-bit layer (LayerNorm<Eigen::bfloat16>, ...) stores its weights in
//     the storage type as well (as PyTorch's module.to(torch.bfloat16)); it
//     computes in float and saves its statistics in float.
// RowMajor rows are read as stored, each packet widened as it is loaded and
// rounded as it is stored (detail/convert.hpp), where the build converts
// whole packets (detail::packet_io): the row-wise forwards and backwards and
// the fused residual forwards. In other builds rows are widened a block at
// a time into small float buffers (convert_n).
// Either way memory sees one read of each input and one write of each
// output.
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include <unsupported/Eigen/CXX11/Tensor>

#include "normcore/common.hpp"
#include "normcore/detail/convert.hpp"
#include "normcore/detail/scratch.hpp"
#include "normcore/detail/stream.hpp"
#include "normcore/detail/tensor.hpp"
#include "normcore/parallel.hpp"

namespace normcore {
namespace detail {

template <typename X>
constexpr bool is_16bit() {
  return is_storage16<typename tensor_traits<X>::Scalar>::value;
}

template <typename P>
constexpr void check_param_type() {
  static_assert(std::is_same<P, float>::value || std::is_same<P, double>::value ||
                    is_storage16<P>::value,
                "normcore: a layer's type must be float, double, Eigen::bfloat16 or Eigen::half");
}

/// Copies n values from S to D (a no-op conversion when S is D). 16-bit to
/// float and back go through F16C (half) or Eigen's packet casts when this
/// build has them (kEigenPacketCasts) for a 16-bit packet as wide as the
/// float one. Rounding float to bfloat16 with a packet cast, the last
/// n mod L values go through the same cast as a padded packet: AVX512-BF16's
/// conversion (Eigen's cast for 16 floats where the build has it) takes a
/// subnormal float as zero where the scalar conversion rounds it, and
/// Eigen's other bfloat16 casts give every NaN the same sign, so a scalar
/// tail could differ from the body (a value's bits would depend on where it
/// fell). Half: F16C and the scalar conversion both round numbers IEEE's
/// way, but the scalar one (GCC builds: Eigen enables its own F16C path
/// only for clang) turns every NaN into the default one, so where F16C
/// converts the body it converts the tail too, as one padded packet.
template <typename S, typename D>
void convert_n(const S* src, D* dst, Index n) {
  using namespace Eigen::internal;
  if constexpr (std::is_same<S, D>::value) {
    std::copy(src, src + n, dst);
  } else {
    Index i = 0;
#ifdef NORMCORE_F16C
    // Eigen 3.4 enables its F16C conversions only for clang (its test of
    // EIGEN_COMP_CLANG is true for every compiler), so GCC would convert
    // half one lane at a time in software: use F16C directly.
    if constexpr (std::is_same<S, Eigen::half>::value && std::is_same<D, float>::value) {
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    } else if constexpr (std::is_same<S, float>::value && std::is_same<D, Eigen::half>::value) {
      const auto eight = [](const float* f, Eigen::half* h) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(h),
                         _mm256_cvtps_ph(_mm256_loadu_ps(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      };
      for (; i + 8 <= n; i += 8) eight(src + i, dst + i);
      if (i < n) {  // the tail as one padded packet (the scalar conversion drops NaN payloads)
        alignas(32) float f[8] = {};
        alignas(16) Eigen::half h[8];
        std::copy(src + i, src + n, f);
        eight(f, h);
        std::copy(h, h + (n - i), dst + i);
        i = n;
      }
    }
#endif
    if constexpr (std::is_same<D, float>::value && is_storage16<S>::value) {
      using PF = typename simd<float>::Packet;
      using PS = typename packet_traits<S>::type;
      constexpr int L = simd<float>::L;
      if constexpr (kEigenPacketCasts && L > 1 && unpacket_traits<PS>::size == L) {
        for (; i + L <= n; i += L) pstoreu(dst + i, pcast<PS, PF>(ploadu<PS>(src + i)));
      }
    } else if constexpr (std::is_same<S, float>::value && is_storage16<D>::value) {
      using PF = typename simd<float>::Packet;
      using PD = typename packet_traits<D>::type;
      constexpr int L = simd<float>::L;
      if constexpr (kEigenPacketCasts && L > 1 && unpacket_traits<PD>::size == L) {
        for (; i + L <= n; i += L) pstoreu(dst + i, pcast<PF, PD>(ploadu<PF>(src + i)));
        if (i < n) {  // the tail as one padded packet, rounded as the body is
          alignas(64) float f[L] = {};
          alignas(64) D d[L];
          std::copy(src + i, src + n, f);
          pstoreu(d, pcast<PF, PD>(ploadu<PF>(f)));
          std::copy(d, d + (n - i), dst + i);
          i = n;
        }
      }
    }
    for (; i < n; ++i) dst[i] = static_cast<D>(static_cast<float>(src[i]));
  }
}

/// Rows per staging block for rows of n values: about kStageValues floats
/// per buffer, so that a block's buffers stay in L1/L2 between the passes.
constexpr Index kStageValues = 4096;
inline Index stage_rows(Index n) { return std::max<Index>(1, kStageValues / std::max<Index>(n, 1)); }

/// Runs fn(xb, yb, count, r0) over RowMajor rows [b, e) of n values: on the
/// data themselves when they are stored as T, else a block of stage_rows(n)
/// rows at a time through float buffers (widened on the way in, rounded
/// once on the way out). fn writes row r0's statistics onward.
template <typename T, typename S, typename Fn>
void rows_in_compute_type(const S* x, S* y, Index n, Index b, Index e, Fn&& fn) {
  if constexpr (std::is_same<S, T>::value) {
    fn(x + b * n, y + b * n, e - b, b);
  } else {
    const Index blk = stage_rows(n);
    std::vector<T> buf(static_cast<std::size_t>(2 * blk * n));
    for (Index r0 = b; r0 < e; r0 += blk) {
      const Index m = std::min(blk, e - r0);
      convert_n(x + r0 * n, buf.data(), m * n);
      fn(static_cast<const T*>(buf.data()), buf.data() + blk * n, m, r0);
      convert_n(buf.data() + blk * n, y + r0 * n, m * n);
    }
  }
}

/// Rows r0 .. r0 + m - 1 of n ColMajor features at src (leading dimension
/// ld) into dst with leading dimension m, converted; one run when they are
/// all the rows (m == ld).
template <typename S, typename D>
void convert_rows_in(const S* src, Index ld, Index r0, Index m, Index n, D* dst) {
  if (m == ld) {
    convert_n(src, dst, m * n);
  } else {
    for (Index j = 0; j < n; ++j) convert_n(src + j * ld + r0, dst + j * m, m);
  }
}

/// The reverse: a block of m rows (leading dimension m) back into rows
/// r0 .. r0 + m - 1 of dst (leading dimension ld), converted.
template <typename S, typename D>
void convert_rows_out(const S* src, Index m, Index n, D* dst, Index ld, Index r0) {
  if (m == ld) {
    convert_n(src, dst, m * n);
  } else {
    for (Index j = 0; j < n; ++j) convert_n(src + j * m, dst + j * ld + r0, m);
  }
}

/// Runs fn(view, yb, r0) over ColMajor rows [b, e) of n features stored as
/// S (element (r, j) at x[j * ld + r]): blocks of `blk` rows widened into a
/// float buffer from the calling thread's scratch (detail::Scratch), whose
/// leading dimension is the block's row count; view is that block as a
/// ColMajor Matrix2D<T>, fn writes its y into yb (same layout) and row r0's
/// statistics onward; y is rounded once back into S (y null: statistics
/// only, yb null). A row's values are the same wherever it sits, so are its
/// results.
template <typename T, typename S, typename Fn>
void colmajor_in_compute_type(const S* x, S* y, Index ld, Index n, Index b, Index e, Index blk, Fn&& fn) {
  if (e <= b) return;
  blk = std::min(blk, e - b);
  Scratch<T> buf(static_cast<std::size_t>((y ? 2 : 1) * blk * n), false);
  T* const xb = buf.data();
  T* const yb = y ? xb + blk * n : nullptr;
  for (Index r0 = b; r0 < e; r0 += blk) {
    const Index m = std::min(blk, e - r0);
    convert_rows_in(x, ld, r0, m, n, xb);
    fn(colmajor_view(xb, m, n), yb, r0);
    if (y) convert_rows_out(yb, m, n, y, ld, r0);
  }
}

/// The backward's counterpart of colmajor_in_compute_type: runs fn(bx, bdy,
/// bdx, bdh, m, r0) over ColMajor rows [b, e) of n features stored as S, in
/// blocks of `blk` rows starting at b (each block's rows r0 .. r0 + m - 1
/// at bx[j * m + r - r0]), x, dy and dh (when not null) widened into float
/// buffers from the calling thread's scratch; bdx (null when dx is) is
/// rounded once into dx after fn.
template <typename T, typename S, typename Fn>
void colmajor_backward_in_compute_type(const S* x, const S* dy, S* dx, const S* dh, Index ld, Index n, Index b,
                                       Index e, Index blk, Fn&& fn) {
  if (e <= b) return;
  blk = std::min(blk, e - b);
  const Index bn = blk * n;
  Scratch<T> buf(static_cast<std::size_t>((2 + (dx ? 1 : 0) + (dh ? 1 : 0)) * bn), false);
  T* const bx = buf.data();
  T* const bdy = bx + bn;
  T* const bdx = dx ? bdy + bn : nullptr;
  T* const bdh = dh ? bdy + (dx ? 2 : 1) * bn : nullptr;
  for (Index r0 = b; r0 < e; r0 += blk) {
    const Index m = std::min(blk, e - r0);
    convert_rows_in(x, ld, r0, m, n, bx);
    convert_rows_in(dy, ld, r0, m, n, bdy);
    if (dh) convert_rows_in(dh, ld, r0, m, n, bdh);
    fn(static_cast<const T*>(bx), static_cast<const T*>(bdy), bdx, static_cast<const T*>(bdh), m, r0);
    if (dx) convert_rows_out(bdx, m, n, dx, ld, r0);
  }
}

/// Rows per staged sub-block of the 16-bit backward: a whole kRowBlock
/// block when its four buffers (x, dy, dx, dh) are small, else stage_rows(n).
inline Index backward_stage_rows(Index n, Index row_block) {
  return row_block * n <= 4 * kStageValues ? row_block : stage_rows(n);
}

/// A layer's weight and bias as its arithmetic type T needs them: the
/// parameters themselves when they are stored as T, float copies otherwise.
template <typename T>
struct ParamPtrs {
  const T* gamma = nullptr;
  const T* beta = nullptr;
  std::vector<T> storage;
};

template <typename T, typename P>
ParamPtrs<T> param_ptrs(const Eigen::Tensor<P, 1>& w, const Eigen::Tensor<P, 1>& b) {
  ParamPtrs<T> p;
  if constexpr (std::is_same<T, P>::value) {
    p.gamma = w.size() ? w.data() : nullptr;
    p.beta = b.size() ? b.data() : nullptr;
  } else {
    p.storage.resize(static_cast<std::size_t>(w.size() + b.size()));
    convert_n(w.data(), p.storage.data(), w.size());
    convert_n(b.data(), p.storage.data() + w.size(), b.size());
    p.gamma = w.size() ? p.storage.data() : nullptr;
    p.beta = b.size() ? p.storage.data() + w.size() : nullptr;
  }
  return p;
}

/// Checks at compile time that X's scalar type is T (the layer's arithmetic
/// type), or a 16-bit storage type when T is float.
template <typename T, typename X>
constexpr void check_storage() {
  using S = typename tensor_traits<X>::Scalar;
  static_assert(std::is_same<S, T>::value || (std::is_same<T, float>::value && is_storage16<S>::value),
                "normcore: the tensor's scalar type must be the layer's arithmetic type "
                "(float for 16-bit layers), or Eigen::bfloat16 / Eigen::half with a float or 16-bit layer");
}

template <typename X, typename Y>
constexpr void check_same_scalar() {
  static_assert(std::is_same<typename tensor_traits<X>::Scalar, typename tensor_traits<Y>::Scalar>::value,
                "normcore: these tensors must have the same scalar type (input, output and gradients)");
}

/// h = x + residual, summed in float and rounded once to S, for n values;
/// with hf, also the stored (rounded) h widened back to float. One pass of
/// packets (16-bit loads widened, sums narrowed, then widened again: exact).
template <typename S>
void add_rows(const S* x, const S* r, S* h, float* hf, Index n) {
  if constexpr (!is_storage16<S>::value) {
    for (Index i = 0; i < n; ++i) h[i] = x[i] + r[i];
    if (hf && static_cast<const void*>(hf) != static_cast<const void*>(h)) {
      for (Index i = 0; i < n; ++i) hf[i] = static_cast<float>(h[i]);
    }
  } else {
    using namespace Eigen::internal;
    using PF = typename simd<float>::Packet;
    constexpr int L = simd<float>::L;
    Index i = 0;
    // Only where the build converts whole packets (packet_io: F16C for half,
    // else Eigen's casts). NEON has 16-bit packets of 4 values, as wide as
    // float's, but no casts for them.
    if constexpr (packet_io<S, L>()) {
      for (; i + L <= n; i += L) {
        store_narrowed(h + i, padd(load_widened<PF>(x + i), load_widened<PF>(r + i)));
        if (hf) pstoreu(hf + i, load_widened<PF>(h + i));
      }
    }
    for (; i < n; ++i) {
      h[i] = static_cast<S>(static_cast<float>(x[i]) + static_cast<float>(r[i]));
      if (hf) hf[i] = static_cast<float>(h[i]);
    }
  }
}

/// A float tensor (map) of x's dims and layout, x's values widened into it
/// when `copy`: BatchNorm's whole copies of 16-bit tensors. In the calling
/// thread's scratch (detail::Scratch, kept between calls) when `in_arena`
/// (the caller's copies together fit in kScratchKeepBytes), else in an
/// Eigen tensor of its own for the call. As Eigen tensors every copy came from
/// glibc's heap, which, depending on what else the process held, gave the
/// pages back at each return and faulted them in again at the next call:
/// on the Zen 5 guest BatchNorm's bfloat16 forward at 8x256x196 took 10 ms
/// a call, about 40 times its time with the copies kept.
template <typename X>
class FloatCopy {
  using Tr = tensor_traits<X>;
  using Map = Eigen::TensorMap<Eigen::Tensor<float, Tr::rank, Tr::layout>>;
  using Dims = Eigen::DSizes<Eigen::Index, Tr::rank>;

 public:
  FloatCopy(const X& x, bool copy, bool in_arena)
      : arena_(in_arena ? static_cast<std::size_t>(x.size()) : 0, false),
        heap_(in_arena ? Dims() : Dims(x.dimensions())),
        map_(in_arena ? arena_.data() : heap_.data(), x.dimensions()) {
    if (copy) convert_n(x.data(), map_.data(), x.size());
  }
  Map& map() { return map_; }
  const Map& map() const { return map_; }

 private:
  Scratch<float> arena_;
  Eigen::Tensor<float, Tr::rank, Tr::layout> heap_;
  Map map_;
};

/// Whether `count` float copies of x fit in a thread's kept scratch.
template <typename X>
bool copies_fit_scratch(const X& x, int count) {
  return static_cast<std::size_t>(x.size()) * sizeof(float) * static_cast<std::size_t>(count) <= kScratchKeepBytes;
}

}  // namespace detail
}  // namespace normcore

namespace normcore {
namespace detail {

/// The shared front of LayerNorm's and RMSNorm's backward: checks x, dy,
/// dx (a pointer or nullptr) and dh_next (a pointer, possibly null) against
/// each other and the normalized shape, takes the views, and calls
/// impl(view, dy, dx, dh) with raw pointers (dx, dh null when absent).
/// 16-bit data arrive as they are stored (ColMajor ones are widened a block
/// of rows at a time in the layers' backward_impl).
template <typename T, typename X, typename DY, typename DX, typename DH, typename Impl>
void row_backward_entry(const char* who, const std::vector<Index>& shape, const X& x, const DY& dy, DX dx,
                        const DH* dh, Impl&& impl) {
  using S = typename tensor_traits<X>::Scalar;
  check_storage<T, X>();
  check_same_scalar<X, DY>();
  check_layouts<X, DY>();
  check_same_scalar<X, DH>();
  check_layouts<X, DH>();
  const auto xv = split_view<S>(who, "input", x, shape);
  check_same_shape(who, "dy", x, dy);
  if (dh) check_same_shape(who, "dh_next", x, *dh);
  S* dxp = nullptr;
  if constexpr (!std::is_null_pointer<DX>::value) {
    using D = std::remove_pointer_t<DX>;
    static_assert(std::is_pointer<DX>::value, "normcore: pass dx as a pointer (or nullptr)");
    check_same_scalar<X, D>();
    check_layouts<X, D>();
    static_assert(tensor_traits<D>::writable, "normcore: dx must be writable");
    if (dx) {
      check_same_shape(who, "dx", x, *dx);
      dxp = dx->data();
    }
  }
  impl(xv, static_cast<const S*>(dy.data()), dxp, dh ? static_cast<const S*>(dh->data()) : static_cast<const S*>(nullptr));
}

/// The fused residual add as a statistics source (statistics.hpp,
/// RowValues): packet i is x + r, stored into h as it is read (streaming
/// stores when StreamH). value(j) does not store: the caller writes h's
/// last n mod L values after the statistics, which may still read r there
/// when h is r.
template <typename T, bool StreamH>
struct AddStoreValues {
  const T* x;
  const T* r;
  T* h;
  template <typename Packet>
  EIGEN_ALWAYS_INLINE Packet packet(Index i) const {
    using namespace Eigen::internal;
    const Packet s = padd(ploadu<Packet>(x + i), ploadu<Packet>(r + i));
    store_packet<StreamH>(h + i, s);
    return s;
  }
  EIGEN_ALWAYS_INLINE T value(Index j) const { return x[j] + r[j]; }
};

/// fn(i, x, r, h, y) with row i's pointers, for each of `count` rows of n
/// values: the loop of the fused forward's row-by-row path.
template <typename T, typename Fn>
void each_add_row(const T* x, const T* r, T* h, T* y, Index n, Index count, Fn&& fn) {
  for (Index i = 0; i < count; ++i) fn(i, x + i * n, r + i * n, h + i * n, y + i * n);
}

/// h = x + r for a row's last n mod L values (those AddStoreValues does not
/// store).
template <typename T>
void add_tail(const T* x, const T* r, T* h, Index n) {
  for (Index j = n / simd<T>::L * simd<T>::L; j < n; ++j) h[j] = x[j] + r[j];
}

/// x + r made again, not stored: the normalize pass when h took streaming
/// stores (and so is no longer in cache, while x and r are).
template <typename T>
struct SumValues {
  const T* x;
  const T* r;
  template <typename Packet>
  EIGEN_ALWAYS_INLINE Packet packet(Index i) const {
    using namespace Eigen::internal;
    return padd(ploadu<Packet>(x + i), ploadu<Packet>(r + i));
  }
  template <typename Packet, typename Mask>
  EIGEN_ALWAYS_INLINE Packet packet(Index i, Mask m) const {
    using namespace Eigen::internal;
    return padd(ploadu<Packet>(x + i, m), ploadu<Packet>(r + i, m));
  }
  EIGEN_ALWAYS_INLINE T value(Index j) const { return x[j] + r[j]; }
};

/// Fused residual add and norm: h = x + residual (summed in float for
/// 16-bit storage and rounded once; h may alias residual for an in-place
/// update), then y = norm(h). Two paths for RowMajor rows, split across the
/// device's threads; both give the same bits:
/// * Streaming inputs (detail::streaming_input) of rows of at least
///   `long_row` values, stored in the compute type, whose four tensors are
///   each either the same as or disjoint from each other, and h or y can
///   take streaming stores: row by row, direct_fn's statistics pass reads x
///   and residual and stores h as it goes, and the row is normalized
///   straight after. h takes streaming stores when it is apart from the
///   other three and aligned (detail::can_stream_rows; the normalize pass
///   then adds x and residual again, from L1), y when it is apart from the
///   other three and aligned. (Either makes rows whole packets, so today
///   this path's rows have no tail; add_tail keeps it right if they did.) With both, memory sees x and residual read and h
///   and y written once, with no read-for-ownership of h or y. (Without
///   either, as in an update in place, this path measured slower than the
///   blocks: 1.10x the time for LayerNorm at 4096x1024.)
/// * Otherwise, blocks of about kStageValues values: each block's h is
///   added, then normalized while it is still in cache (16-bit: from h
///   itself where the build converts whole packets, else from a float
///   buffer holding the rounded h).
/// ColMajor: the add, then `whole`.
///   rows_fn(hb, yb, count, r0, saved, prm): normalizes count rows of T, or
///   of 16-bit S (see above), from hb into yb and saves row r0's
///   statistics onward.
///   direct_fn(x, r, h, y, count, r0, saved, prm, stream_h, stream_y): the
///   first path for count rows (stream_h, stream_y: std::integral_constant).
template <typename T, typename Device, typename X, typename R, typename H, typename Y, typename Whole,
          typename Rows, typename Direct>
void fused_add_norm(const Device& device, const char* who, const std::vector<Index>& shape, const X& x,
                    const R& residual, H& h, Y& y, NormStats<T>* saved, Whole&& whole, Rows&& rows_fn,
                    Index long_row, Direct&& direct_fn, const ParamPtrs<T>& prm, bool with_mean) {
  using S = typename tensor_traits<X>::Scalar;
  check_storage<T, X>();
  check_same_scalar<X, R>();
  check_same_scalar<X, H>();
  check_same_scalar<X, Y>();
  check_layouts<X, R>();
  check_layouts<X, H>();
  check_layouts<X, Y>();
  static_assert(tensor_traits<H>::writable && tensor_traits<Y>::writable,
                "normcore: h and the output must be writable");
  check_same_shape(who, "residual", x, residual);
  check_same_shape(who, "h", x, h);
  check_same_shape(who, "output", x, y);
  const auto v = split_view<S>(who, "input", x, shape);
  const S* xp = x.data();
  const S* rp = residual.data();
  S* hp = h.data();
  S* yp = y.data();
  if (!v.row_major) {
    add_rows(xp, rp, hp, static_cast<float*>(nullptr), v.rows * v.cols);
    whole(h, y, saved);
    return;
  }
  const Index rows = v.rows, n = v.cols;
  if (saved) {
    if (with_mean) {
      resize_vector(saved->mean, rows);
    } else {
      saved->mean.resize(0);
    }
    resize_vector(saved->rstd, rows);
  }
  if (rows == 0) return;
  const Index parts = row_parts_for(device, rows * n, rows);
  const Split split{rows, parts, 1};
  if constexpr (std::is_same<S, T>::value) {
    const Index total = rows * n;
    const auto apart = [total](const S* a, const S* b) { return disjoint(a, total, b, total); };
    const auto same_or_apart = [&](const S* a, const S* b) { return a == b || apart(a, b); };
    const bool stream_h = apart(hp, xp) && apart(hp, rp) && apart(hp, yp) && can_stream_rows(hp, n);
    const bool stream_y = apart(yp, xp) && apart(yp, rp) && apart(yp, hp) && can_stream_rows(yp, n);
    if (streaming_input<S, T>(rows, n) && n >= long_row && (stream_h || stream_y) && same_or_apart(xp, rp) &&
        same_or_apart(xp, hp) && same_or_apart(xp, yp) && same_or_apart(rp, hp) && same_or_apart(rp, yp) &&
        same_or_apart(hp, yp)) {
      run_parts(device, parts, [&](Index p) {
        const Index b = split.begin(p), e = split.begin(p + 1);
        const auto go = [&](auto sh, auto sy) {
          direct_fn(xp + b * n, rp + b * n, hp + b * n, yp + b * n, e - b, b, saved, prm, sh, sy);
        };
        using Yes = std::true_type;
        using No = std::false_type;
        if (stream_h) {
          stream_y ? go(Yes(), Yes()) : go(Yes(), No());
        } else {
          stream_y ? go(No(), Yes()) : go(No(), No());
        }
        if (stream_h || stream_y) stream_fence();
      });
      return;
    }
  }
  run_parts(device, parts, [&split, &n, &long_row, &rows, &xp, &rp, &hp, &rows_fn, &yp, &saved, &prm](Index p) {
    const Index b = split.begin(p), e = split.begin(p + 1);
    constexpr bool direct16 = !std::is_same<S, T>::value && packet_io<S, simd<T>::L>();
    // Long 16-bit rows of an input of kStreamingBytes or more as T: one row
    // per block (add, then normalize from h in L1), as the float path's rows.
    const bool one_row = direct16 && n >= long_row && rows * n * static_cast<Index>(sizeof(T)) >= kStreamingBytes;
    const Index blk = one_row ? 1 : stage_rows(n);
    std::vector<T> buf(std::is_same<S, T>::value || direct16 ? 0 : static_cast<std::size_t>(2 * blk * n));
    for (Index r0 = b; r0 < e; r0 += blk) {
      const Index m = std::min(blk, e - r0);
      if constexpr (std::is_same<S, T>::value) {
        add_rows(xp + r0 * n, rp + r0 * n, hp + r0 * n, static_cast<float*>(nullptr), m * n);
        rows_fn(hp + r0 * n, yp + r0 * n, m, r0, saved, prm);
      } else {
        if constexpr (direct16) {  // 16-bit rows: normalized from h itself
          add_rows(xp + r0 * n, rp + r0 * n, hp + r0 * n, static_cast<float*>(nullptr), m * n);
          rows_fn(static_cast<const S*>(hp + r0 * n), yp + r0 * n, m, r0, saved, prm);
        } else {
          add_rows(xp + r0 * n, rp + r0 * n, hp + r0 * n, buf.data(), m * n);
          rows_fn(buf.data(), buf.data() + blk * n, m, r0, saved, prm);
          convert_n(buf.data() + blk * n, yp + r0 * n, m * n);
        }
      }
    }
  });
}

}  // namespace detail
}  // namespace normcore
