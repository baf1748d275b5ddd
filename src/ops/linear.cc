#include "ops/linear.h"

#include "mha/linear.h"

#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <vector>

#include "util/check.h"
#include "util/convert.h"
#include "util/parallel.h"

namespace mha::ops {
namespace {

// Output tile sizes. Large enough that packing is a small fraction of each sgemm, small
// enough that two threads share even the seed-sized projections.
constexpr int64_t kTileRows = 256;
constexpr int64_t kTileCols = 256;

// oneDNN (OpenMP runtime) sizes its team by omp_get_max_threads(); pin it to 1 for the call.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SingleThreadedBlas() { omp_set_num_threads(saved_); }

 private:
  int saved_;
};

// f(m0, n0, m, n) for each kTileRows × kTileCols tile of an M × N output, on the pool: the tiles
// depend on the shapes alone, so results have the same bits for any thread count.
template <class F>
void for_each_tile(int64_t M, int64_t N, int num_threads, const F& f) {
  const int64_t tiles_m = (M + kTileRows - 1) / kTileRows;
  const int64_t tiles_n = (N + kTileCols - 1) / kTileCols;
  parallel_for(tiles_m * tiles_n, num_threads, [&](int64_t t) {
    const int64_t m0 = (t / tiles_n) * kTileRows, n0 = (t % tiles_n) * kTileCols;
    f(m0, n0, std::min(kTileRows, M - m0), std::min(kTileCols, N - n0));
  });
}

void check_shapes(const RowMatrix& x, const RowMatrix& w) {
  MHA_CHECK(x.cols == w.cols, "linear: input has {} columns but the weight expects {} (weight ({}, {}))",
            x.cols, w.cols, w.rows, w.cols);
}

}  // namespace

bool bf16_matmul_available() {
  static const bool available = [] {
    using dt = dnnl::memory::data_type;
    try {
      const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
      const dnnl::memory::desc src({2, 32}, dt::bf16, dnnl::memory::dims{32, 1});
      const dnnl::memory::desc wei({32, 2}, dt::bf16, dnnl::memory::dims{1, 32});
      const dnnl::memory::desc dst({2, 2}, dt::f32, dnnl::memory::dims{2, 1});
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), engine);
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return available;
}

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc, int num_threads) {
  if (M == 0 || N == 0) return;
  for_each_tile(M, N, num_threads, [&](int64_t m0, int64_t n0, int64_t m, int64_t n) {
    float* c = C + m0 * ldc + n0;
    if (K == 0) {
      for (int64_t r = 0; r < m; ++r)
        for (int64_t x = 0; x < n; ++x) c[r * ldc + x] = beta == 0.0f ? 0.0f : beta * c[r * ldc + x];
      return;
    }
    // Row m0 of op(A) and column n0 of op(B).
    const float* a = trans_a ? A + m0 : A + m0 * lda;
    const float* b = trans_b ? B + n0 * ldb : B + n0;
    SingleThreadedBlas single;
    const dnnl_status_t status = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, K, 1.0f, a, lda, b, ldb,
                                            beta, c, ldc);
    if (status != dnnl_success) {
      throw Error(fmt::format(
          "linear: dnnl_sgemm failed with status {} for a ({} x {}) · ({} x {}) product{}", static_cast<int>(status), m,
          K, K, n,
          status == dnnl_unimplemented ? "; another copy of oneDNN loaded earlier in this process (libtorch bundles "
                                         "one) may have interposed its symbols: link or load libdnnl before it"
                                       : ""));
    }
  });
}

void linear(RowMatrix x, RowMatrix w, const float* bias, float* y, int64_t ldy, int num_threads) {
  check_shapes(x, w);
  const int64_t M = x.rows, N = w.rows;
  for (int64_t r = 0; r < M; ++r) {
    float* row = y + r * ldy;
    if (bias) {
      std::copy(bias, bias + N, row);
    } else {
      std::fill(row, row + N, 0.0f);
    }
  }
  gemm(false, true, M, N, x.cols, x.data, x.row_stride, w.data, w.row_stride, 1.0f, y, ldy, num_threads);
}

void linear_backward(RowMatrix x, RowMatrix w, const float* dy, int64_t lddy, float* dx, int64_t lddx, float* grad_w,
                     int64_t ldgw, float* grad_b, int num_threads) {
  check_shapes(x, w);
  const int64_t N = x.rows, in = x.cols, out = w.rows;
  // grad_w (out × in) += dyᵀ (out × N) · x (N × in)
  gemm(true, false, out, in, N, dy, lddy, x.data, x.row_stride, 1.0f, grad_w, ldgw, num_threads);
  if (grad_b) {
    // Column sums in a fixed order (rows in sequence), in double.
    parallel_for((out + 63) / 64, num_threads, [&](int64_t t) {
      for (int64_t o = t * 64; o < std::min(out, t * 64 + 64); ++o) {
        double s = 0;
        for (int64_t r = 0; r < N; ++r) s += dy[r * lddy + o];
        grad_b[o] += static_cast<float>(s);
      }
    });
  }
  // dx (N × in) = dy (N × out) · w (out × in)
  if (dx) gemm(false, false, N, in, out, dy, lddy, w.data, w.row_stride, 0.0f, dx, lddx, num_threads);
}

namespace {

// Element size of the types linear_widened reads.
int64_t element_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// The (m × n) tile of y at c (row stride ldy) = rows [m0, m0 + m) of x · rows [n0, n0 + n) of wᵀ,
// K > 0, each operand widened to float32 into this thread's buffers unless it is float32
// already; one single-threaded sgemm per panel of kWidenedPanel columns of K, the first writing
// the tile and the others adding to it. No bias.
void widened_tile(const void* x, DType x_type, int64_t ldx, const void* w, DType w_type, int64_t ldw, int64_t K,
                  int64_t m0, int64_t n0, int64_t m, int64_t n, float* c, int64_t ldy) {
  // Reused across calls (a fresh vector per tile faulted its pages in on every call), and no
  // larger than a panel of each operand's tile: 512 KiB each, whatever K.
  thread_local std::vector<float> xf, wf;
  const auto* xb = static_cast<const unsigned char*>(x);
  const auto* wb = static_cast<const unsigned char*>(w);
  const bool f32 = x_type == DType::kF32;
  for (int64_t k0 = 0; k0 < K; k0 += kWidenedPanel) {
    const int64_t kp = std::min(kWidenedPanel, K - k0);
    if (!f32) {
      xf.resize(static_cast<size_t>(std::max<int64_t>(static_cast<int64_t>(xf.size()), m * kp)));
      for (int64_t r = 0; r < m; ++r)
        widen_to_f32(xb + ((m0 + r) * ldx + k0) * element_bytes(x_type), x_type, xf.data() + r * kp, kp);
    }
    const float* a = f32 ? static_cast<const float*>(x) + m0 * ldx + k0 : xf.data();
    const int64_t lda = f32 ? ldx : kp;
    wf.resize(static_cast<size_t>(std::max<int64_t>(static_cast<int64_t>(wf.size()), n * kp)));
    for (int64_t r = 0; r < n; ++r)
      widen_to_f32(wb + ((n0 + r) * ldw + k0) * element_bytes(w_type), w_type, wf.data() + r * kp, kp);
    gemm(false, true, m, n, kp, a, lda, wf.data(), kp, k0 == 0 ? 0.0f : 1.0f, c, ldy, 1);
  }
}

// Adds bias (or nothing) to the tile, zeroing it first when K = 0 (no product wrote it).
void finish_tile(const float* bias, int64_t K, int64_t n0, int64_t m, int64_t n, float* c, int64_t ldy) {
  for (int64_t r = 0; r < m; ++r) {
    float* row = c + r * ldy;
    for (int64_t o = 0; o < n; ++o) row[o] = (K > 0 ? row[o] : 0.0f) + (bias ? bias[n0 + o] : 0.0f);
  }
}

}  // namespace

void linear_widened(const void* x, DType x_type, int64_t ldx, int64_t M, const void* w, DType w_type, int64_t ldw,
                    int64_t N, int64_t K, const float* bias, float* y, int64_t ldy, int num_threads) {
  check_widening_operands("linear", x_type, w_type);
  if (M == 0 || N == 0) return;
  for_each_tile(M, N, num_threads, [&](int64_t m0, int64_t n0, int64_t m, int64_t n) {
    float* c = y + m0 * ldy + n0;
    if (K > 0) widened_tile(x, x_type, ldx, w, w_type, ldw, K, m0, n0, m, n, c, ldy);
    finish_tile(bias, K, n0, m, n, c, ldy);
  });
}

void linear_bf16(Bf16RowMatrix x, Bf16RowMatrix w, const float* bias, float* y, int64_t ldy, int num_threads) {
  MHA_CHECK(x.cols == w.cols, "linear: input has {} columns but the weight expects {} (weight ({}, {}))", x.cols,
            w.cols, w.rows, w.cols);
  const int64_t M = x.rows, N = w.rows, K = x.cols;
  if (M == 0 || N == 0) return;
  if (!bf16_matmul_available()) {
    // No bf16 matmul here: the tiles' rows widened to float32 (exactly) for sgemm, whose
    // products are those of the bf16 matmul (exact in float32) and its sums float32 as well.
    linear_widened(x.data, DType::kBF16, x.row_stride, M, w.data, DType::kBF16, w.row_stride, N, K, bias, y, ldy,
                   num_threads);
    return;
  }
  using dt = dnnl::memory::data_type;
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  for_each_tile(M, N, num_threads, [&](int64_t m0, int64_t n0, int64_t m, int64_t n) {
    float* c = y + m0 * ldy + n0;
    if (K > 0) {
      SingleThreadedBlas single;  // before the primitive is made: oneDNN sizes its blocking by the threads
      try {
        // y tile (m × n) = x rows (m × K) · wᵀ, the weight read as a (K × n) matrix with strides (1, ldw).
        const dnnl::memory::desc src({m, K}, dt::bf16, dnnl::memory::dims{x.row_stride, 1});
        const dnnl::memory::desc wei({K, n}, dt::bf16, dnnl::memory::dims{1, w.row_stride});
        const dnnl::memory::desc dst({m, n}, dt::f32, dnnl::memory::dims{ldy, 1});
        const dnnl::matmul prim(dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), engine));
        dnnl::stream stream(engine);
        prim.execute(stream, {{DNNL_ARG_SRC, dnnl::memory(src, engine, const_cast<bfloat16*>(x.data + m0 * x.row_stride))},
                              {DNNL_ARG_WEIGHTS, dnnl::memory(wei, engine, const_cast<bfloat16*>(w.data + n0 * w.row_stride))},
                              {DNNL_ARG_DST, dnnl::memory(dst, engine, c)}});
        stream.wait();
      } catch (const dnnl::error& e) {
        throw Error(fmt::format("linear: oneDNN's bf16 matmul failed for a ({} x {}) · ({} x {}) product: {}", m, K, K,
                                n, e.what()));
      }
    }
    finish_tile(bias, K, n0, m, n, c, ldy);
  });
}

void linear_ref(RowMatrix x, RowMatrix w, const float* bias, float* y, int64_t ldy, int num_threads) {
  check_shapes(x, w);
  parallel_for(x.rows, num_threads, [&](int64_t r) {
    const float* xr = x.data + r * x.row_stride;
    for (int64_t o = 0; o < w.rows; ++o) {
      const float* wr = w.data + o * w.row_stride;
      double acc = bias ? bias[o] : 0.0;
      for (int64_t i = 0; i < x.cols; ++i) acc += static_cast<double>(xr[i]) * wr[i];
      y[r * ldy + o] = static_cast<float>(acc);
    }
  });
}

}  // namespace mha::ops

namespace mha {

void linear(const View<const float>& x, const View<const float>& weight, const View<const float>& bias,
            const View<float>& y, int num_threads) {
  MHA_CHECK(x.rank == 2 && weight.rank == 2 && y.rank == 2, "linear: x {}, weight {} and y {} must be 2-D",
            shape_string(x), shape_string(weight), shape_string(y));
  MHA_CHECK(x.shape[1] == weight.shape[1] && y.shape[0] == x.shape[0] && y.shape[1] == weight.shape[0],
            "linear: x {} · weight {}ᵀ does not give y {}", shape_string(x), shape_string(weight), shape_string(y));
  MHA_CHECK(!bias.given() || (bias.rank == 1 && bias.shape[0] == weight.shape[0] && bias.stride[0] == 1),
            "linear: bias must be contiguous ({},); got {}", weight.shape[0], shape_string(bias));
  MHA_CHECK((x.shape[1] <= 1 || x.stride[1] == 1) && (weight.shape[1] <= 1 || weight.stride[1] == 1) &&
                (y.shape[1] <= 1 || y.stride[1] == 1),
            "linear: rows of x, weight and y must be contiguous");
  ops::linear({x.data, x.shape[0], x.shape[1], x.stride[0]}, {weight.data, weight.shape[0], weight.shape[1], weight.stride[0]},
              bias.given() ? bias.data : nullptr, y.data, y.stride[0], num_threads);
}

void linear_backward(const View<const float>& x, const View<const float>& weight, const View<const float>& dy,
                     const View<float>& grad_x, const View<float>& grad_weight, const View<float>& grad_bias,
                     int num_threads) {
  MHA_CHECK(x.rank == 2 && weight.rank == 2 && dy.rank == 2, "linear_backward: x {}, weight {} and dy {} must be 2-D",
            shape_string(x), shape_string(weight), shape_string(dy));
  const int64_t N = x.shape[0], in = x.shape[1], out = weight.shape[0];
  MHA_CHECK(weight.shape[1] == in && dy.shape[0] == N && dy.shape[1] == out,
            "linear_backward: x {} · weight {}ᵀ does not give dy {}", shape_string(x), shape_string(weight),
            shape_string(dy));
  MHA_CHECK(grad_weight.rank == 2 && grad_weight.shape == weight.shape && grad_weight.stride[1] == 1,
            "linear_backward: grad_weight must be {} with contiguous rows; got {}", shape_string(weight),
            shape_string(grad_weight));
  MHA_CHECK(!grad_bias.given() || (grad_bias.rank == 1 && grad_bias.shape[0] == out && grad_bias.stride[0] == 1),
            "linear_backward: grad_bias must be contiguous ({},); got {}", out, shape_string(grad_bias));
  MHA_CHECK(!grad_x.given() || (grad_x.rank == 2 && grad_x.shape == x.shape && (in <= 1 || grad_x.stride[1] == 1)),
            "linear_backward: grad_x must be {} with contiguous rows; got {}", shape_string(x), shape_string(grad_x));
  MHA_CHECK((in <= 1 || (x.stride[1] == 1 && weight.stride[1] == 1)) && (out <= 1 || dy.stride[1] == 1),
            "linear_backward: rows of x, weight and dy must be contiguous");
  ops::linear_backward({x.data, N, in, x.stride[0]}, {weight.data, out, in, weight.stride[0]}, dy.data, dy.stride[0],
                       grad_x.given() ? grad_x.data : nullptr, grad_x.given() ? grad_x.stride[0] : 0, grad_weight.data,
                       grad_weight.stride[0], grad_bias.given() ? grad_bias.data : nullptr, num_threads);
}

}  // namespace mha
