// Linear layers on x86 CPUs with AVX2 and FMA: y[M, N] = x[M, K] . W[N, K]^T, made for decode
// batches (M = 1..64 rows), where the product is a stream over the weight.
//
//   gemm_f32(x fp32 [M, K], w fp32 [N, K], bias fp32 [N]?) -> fp32 [M, N]
//   gemm_q8(x fp32 [M, K], q int8 [N, K], scale fp32 [N, K / 32], bias?) -> fp32 [M, N]
//     q8: one scale per 32 consecutive weights of a row (w ~= q * scale). x is rounded to
//     int16 with one scale per 32 values (~3e-5 of the block's largest magnitude), so each
//     block's products are summed exactly in int32 (vpmaddwd), then scaled into fp32.
//   gemm_q4(...): 4-bit weights with a scale and a min per 32 (cpu_gemm_q4.inc, included).
//
// Why our own (2-core AMD EPYC, LFM2-350M's weights, bench/RESULTS.md): torch's fp32 paths
// read the weights at one row near the copy bandwidth (oneDNN) but at half of it by 4-8 rows,
// and no int8 weight path of torch's or torchao's on AVX2 beat fp32 at one row (torch's
// _weight_int8pack_mm 2.9x slower, torchao's int8 weight-only 2x slower; fbgemm's W8A8 needs
// 7-bit activations on AVX2). These loops read each weight once per call, for every x row.
//
// Work is split over output rows in chunks that torch's threads take in turn (at::parallel_for,
// torch's pool and thread count; see for_tiles). A tile holds 4 weight rows against up to 3 x
// rows: 12 accumulators, 3 x vectors and a weight vector fill AVX2's 16 registers. Every
// output is its own row's sums in one fixed order, so a row's result does not depend on the
// batch or the thread count. Compiled with -mavx2 -mfma (no -march=native), one build for every
// AVX2 machine; the fp32 and q8 tiles' AVX-512 twins (and q8's VNNI ones) are compiled per
// function (target attribute) and taken at load where the CPU has AVX-512F and BW (and VNNI). Python checks the CPU before loading it and holds
// the float64 references (shortconv/kernels/cpu_gemm.py).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

namespace {

constexpr int kRows = 4;      // weight rows per tile
constexpr int kMaxMR = 3;     // x rows per tile
constexpr int64_t kBlock = 32;  // q8: weights per scale

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct F32Row {
  const float* w;
};

// y[m * ldy + r] = sum_k x[m * ldx + k] * w[r][k], for r < R, m < MR.
template <int R, int MR>
inline void tile_f32(const F32Row* rows, int64_t K, const float* x, int64_t ldx, float* y,
                     int64_t ldy) {
  __m256 acc[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      // Every other step, the same line of the next tile's row: memory streams one tile ahead
      // of the FMAs (LFM2-350M, 2 threads, AVX2 pinned on the Xeon: a decode step 60.7 ->
      // 53.7 ms, a verify step of 5 positions 1.57x -> 1.44x of it).
      if ((k & 15) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(rows[r].w + R * K + k), _MM_HINT_T0);
      const __m256 wv = _mm256_loadu_ps(rows[r].w + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * ldx + kk] * rows[r].w[kk];
      y[m * ldy + r] = s;
    }
}

#include "cpu_gemm_f32_512.inc"  // the fp32 tiles' AVX-512 twins, and the choice of ISA
#include "cpu_norm.inc"          // the fused fp32 RMSNorm (its AVX-512 row where chosen)

struct Q8Row {
  const int8_t* q;
  const float* scale;
};

// x rows as int16 with one scale per 32 values (xq * xs ~= x; the largest magnitude of a block
// maps to 32767, so the rounding is ~3e-5 of it): q8 tiles then take their products in
// integers, 16 at a time (vpmaddwd), three times denser than widening every weight to fp32.
// Sums stay exact in int32: 32 products of |q| <= 127 and |xq| <= 32767 are < 2^27. The q4
// tiles on VNNI CPUs take x as int8 instead (XQ<int8_t>, largest magnitude 127: Q8_0's
// rounding), which their quality bounds allow and q8's do not (cpu_gemm_q4_vnni.inc).
template <typename T>
struct XQ {
  std::vector<T> q;
  std::vector<float> scale;
};
using X16 = XQ<int16_t>;

// The largest |v[j]| of a 32-value block, 8 lanes at a time. The compiler kept the scalar loop
// (32 dependent maxss a block: a verify step's 5 rows spent ~20 us a call here on a 4608-wide
// x, on one thread while the others waited); max is exact, so the lanes' order cannot change
// it. NOTE: a NaN is skipped (max_ps returns its second operand), as std::max(amax, |v|) did.
inline float block_amax(const float* v) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < kBlock; j += 8)
    m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + j), magnitude), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

template <typename T>
XQ<T> quantize_x(const float* x, int64_t M, int64_t K) {
  constexpr float qmax = std::numeric_limits<T>::max();
  XQ<T> out{std::vector<T>(M * K), std::vector<float>(M * (K / kBlock))};
  for (int64_t i = 0; i < M * (K / kBlock); ++i) {
    const float* v = x + i * kBlock;
    const float sc = block_amax(v) / qmax;
    out.scale[i] = sc;
    for (int j = 0; j < kBlock; ++j)
      out.q[i * kBlock + j] = sc > 0.f ? static_cast<T>(std::nearbyint(v[j] / sc)) : 0;
  }
  return out;
}

// The q8 twin of tile_f32 for the few-row case: per 32-weight block, the int8 weights widen
// to int16 and meet the int16 x rows in vpmaddwd; the block's int32 sum then takes both
// scales into the fp32 accumulator. K is a multiple of kBlock.
// NOTE: in this and every quantized tile, each loop over `acc` carries `#pragma GCC unroll`:
// where one stayed rolled (the final reduce, or a tile inlined into its caller), GCC 12 kept
// the accumulators in registers but also stored them to the stack on every K step (the fp32
// AVX-512 tile's story, cpu_gemm_f32_512.inc; q4 VNNI at 2-32 rows ~1.1x without the stores).
// Unrolling moves no addition: the outputs are the same bits.
template <int R, int MR>
inline void tile_q8(const Q8Row* rows, int64_t K, const int16_t* xq, const float* xs,
                    float* y, int64_t ldy) {
  const int64_t nb = K / kBlock;
  __m256 acc[R][MR];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t k = b * kBlock;
    // A tile's R rows are R * K contiguous bytes read R * kBlock (two lines) a block: fetch
    // the same share of the next tile's bytes, so memory streams one tile ahead.
    const char* next = reinterpret_cast<const char*>(rows[0].q + R * K + b * R * kBlock);
    for (int line = 0; line < R * kBlock; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m128i* src = reinterpret_cast<const __m128i*>(rows[r].q + k);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(src));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(src + 1));
      const __m256 ws = _mm256_broadcast_ss(rows[r].scale + b);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xq + m * K + k);
        const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xv)),
                                             _mm256_madd_epi16(w1, _mm256_loadu_si256(xv + 1)));
        const __m256 sc = _mm256_mul_ps(ws, _mm256_broadcast_ss(xs + m * nb + b));
        acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), sc, acc[r][m]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) y[m * ldy + r] = hsum(acc[r][m]);
}

#include "cpu_gemm_q8_512.inc"   // the q8 tiles' AVX-512 twins
#include "cpu_gemm_q8_vnni.inc"  // and their VNNI twins (4 blocks a register)

// R weight rows against every row of x, kMaxMR x rows at a time.
template <int R>
inline void f32_rows(const F32Row* rows, int64_t K, const float* x, int64_t M, float* y,
                     int64_t N) {
  int64_t m = 0;
  for (; m + kMaxMR <= M; m += kMaxMR) tile_f32<R, kMaxMR>(rows, K, x + m * K, K, y + m * N, N);
  if (M - m == 2) tile_f32<R, 2>(rows, K, x + m * K, K, y + m * N, N);
  if (M - m == 1) tile_f32<R, 1>(rows, K, x + m * K, K, y + m * N, N);
}

// R q8 weight rows against every int16 row of x, kMaxMR x rows at a time. Each output is its
// own row's sums in one fixed order, whatever M: a row's result does not depend on its batch.
template <int R>
inline void q8_rows(const Q8Row* rows, int64_t K, const X16& x, int64_t M, float* y, int64_t N) {
  const int64_t nb = K / kBlock;
  int64_t m = 0;
  for (; m + kMaxMR <= M; m += kMaxMR)
    tile_q8<R, kMaxMR>(rows, K, x.q.data() + m * K, x.scale.data() + m * nb, y + m * N, N);
  if (M - m == 2) tile_q8<R, 2>(rows, K, x.q.data() + m * K, x.scale.data() + m * nb, y + m * N, N);
  if (M - m == 1) tile_q8<R, 1>(rows, K, x.q.data() + m * K, x.scale.data() + m * nb, y + m * N, N);
}

// body(n0, nr) for the tiles of kRows weight rows (nr < kRows only for the last), on torch's
// threads. A chunk is about 64 KB of weights at the least, below which a thread's start costs
// more than it saves. NOTE: chunks are taken from a shared counter, about 8 per thread, not
// split into one fixed share per thread: a server's own processes (its HTTP proxy, Ray) run on
// the same cores, and a thread that loses its core for a while then delays only its current
// chunk, where with fixed shares the other threads wait at the join for all of its share. A
// tile's sums do not depend on which thread takes it.
template <typename Body>
void for_tiles(int64_t N, int64_t K, int64_t weight_bytes, const Body& body) {
  const int64_t tiles = (N + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (kRows * K * weight_bytes));
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max(grain, (tiles + 8 * threads - 1) / (8 * threads));
  const int64_t chunks = (tiles + chunk - 1) / chunk;
  const auto run = [&](int64_t c) {
    for (int64_t t = c * chunk; t < std::min(tiles, (c + 1) * chunk); ++t)
      body(t * kRows, std::min<int64_t>(kRows, N - t * kRows));
  };
  if (threads == 1 || chunks == 1) {
    for (int64_t c = 0; c < chunks; ++c) run(c);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) run(c);
  });
}

// Calls fn(rows_count, rows, n0) with rows_count an std::integral_constant: kRows for a whole
// tile, 1 per row for the last, short one (so fn instantiates its row templates for both).
template <typename Row, typename Fn>
inline void run_tile(const Row* rows, int64_t nr, int64_t n0, const Fn& fn) {
  if (nr == kRows) {
    fn(std::integral_constant<int, kRows>{}, rows, n0);
  } else {
    for (int64_t r = 0; r < nr; ++r) fn(std::integral_constant<int, 1>{}, rows + r, n0 + r);
  }
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a 2-D fp32 CPU tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
}

at::Tensor finish(at::Tensor y, const std::optional<at::Tensor>& bias) {
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

at::Tensor gemm_f32(const at::Tensor& x_in, const at::Tensor& w_in,
                    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat && w_in.device().is_cpu(),
              "w must be a 2-D fp32 CPU tensor");
  const int64_t N = w_in.size(0), K = w_in.size(1);
  check_x(x_in, K);
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float *wp = w.data_ptr<float>(), *xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_tiles(N, K, 4, [&](int64_t n0, int64_t nr) {
    F32Row rows[kRows];
    for (int64_t r = 0; r < nr; ++r) rows[r] = F32Row{wp + (n0 + r) * K};
    run_tile(rows, nr, n0, [&](auto R, const F32Row* rs, int64_t n) {
      if (wide_tiles()) {
        f32_rows_512<R>(rs, K, xp, M, yp + n, N);
      } else {
        f32_rows<R>(rs, K, xp, M, yp + n, N);
      }
    });
  });
  return finish(y, bias);
}

// "avx2", "avx512" or "avx512vnni" pins the tiles (refused where the CPU lacks it; each level
// includes the ones before); "" keeps the choice. Returns the level in use.
std::string set_isa(const std::string& want) {
  static const char* const names[] = {"avx2", "avx512", "avx512vnni"};
  if (!want.empty()) {
    const auto* it = std::find(std::begin(names), std::end(names), want);
    TORCH_CHECK(it != std::end(names), "isa must be 'avx2', 'avx512', 'avx512vnni' or '', got '",
                want, "'");
    const Isa level = static_cast<Isa>(it - std::begin(names));
    TORCH_CHECK(level <= detect_isa(), "this CPU lacks ", want, " (AVX-512 needs F and BW)");
    g_isa = level;
  }
  return names[static_cast<int>(g_isa)];
}

at::Tensor gemm_q8(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& s_in,
                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(q_in.dim() == 2 && q_in.scalar_type() == at::kChar && q_in.device().is_cpu(),
              "q must be a 2-D int8 CPU tensor");
  const int64_t N = q_in.size(0), K = q_in.size(1);
  TORCH_CHECK(K % kBlock == 0, "q8 needs in_features divisible by ", kBlock, ", got ", K);
  TORCH_CHECK(s_in.scalar_type() == at::kFloat && s_in.dim() == 2 && s_in.size(0) == N &&
                  s_in.size(1) == K / kBlock,
              "scale must be fp32 [", N, ", ", K / kBlock, "]");
  check_x(x_in, K);
  const at::Tensor x = x_in.contiguous(), q = q_in.contiguous(), s = s_in.contiguous();
  const int64_t M = x.size(0), nb = K / kBlock;
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float *sp = s.data_ptr<float>(), *xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const X16 x16 = quantize_x<int16_t>(xp, M, K);
  // The tile set is read once per call: x is laid out for the one that runs.
  const bool vnni = g_isa == Isa::kAvx512Vnni, wide = wide_tiles() && !vnni;
  const X16Quads x16q = vnni ? quad_blocks(x16, M, K) : X16Quads{};
  const X16Pairs x16p = wide ? pair_blocks(x16, M, K, 8) : X16Pairs{};
  for_tiles(N, K, 1, [&](int64_t n0, int64_t nr) {
    Q8Row rows[kRows];
    for (int64_t r = 0; r < nr; ++r) rows[r] = Q8Row{qp + (n0 + r) * K, sp + (n0 + r) * nb};
    run_tile(rows, nr, n0, [&](auto R, const Q8Row* rs, int64_t n) {
      if (vnni) {
        q8_rows_vnni<R>(rs, K, x16q, M, yp + n, N);
      } else if (wide) {
        q8_rows_512<R>(rs, K, x16p, M, yp + n, N);
      } else {
        q8_rows<R>(rs, K, x16, M, yp + n, N);
      }
    });
  });
  return finish(y, bias);
}

#include "cpu_gemm_q4.inc"
#include "cpu_gemm_q6.inc"

}  // namespace

TORCH_LIBRARY(shortconv_cpu, m) {
  m.def("gemm_f32(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("gemm_q8(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor");
  m.def("gemm_q4(Tensor x, Tensor q, Tensor scale, Tensor min, Tensor? bias) -> Tensor");
  m.def("gemm_q6(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor");
  m.def("set_isa(str want) -> str", TORCH_FN(set_isa));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(shortconv_cpu, CPU, m) {
  m.impl("gemm_f32", TORCH_FN(gemm_f32));
  m.impl("gemm_q8", TORCH_FN(gemm_q8));
  m.impl("gemm_q4", TORCH_FN(gemm_q4));
  m.impl("gemm_q6", TORCH_FN(gemm_q6));
  m.impl("rms_norm", TORCH_FN(rms_norm));
}
