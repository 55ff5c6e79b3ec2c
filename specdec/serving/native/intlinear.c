// specdec's integer linear kernel (the "integer" numerics, specdec/serving/kernels.py):
// y[M, N] = x[M, K] W[N, K]^T (+ bias) for W held as grouped codes (a GGUF file's Q4_0 / Q4_1 /
// Q8_0 blocks, a draft's int8 rows): weight = d * q + m per group of 32 along k.
//
// As llama.cpp's Q8_0 / Q8_1 dot products: each row of x is quantized per block of 32 to int8
// with one float scale (dx = max |x| / 127, xq = round(x / dx)), s = dx * sum(xq) kept per row
// and block; then for one column and block
//     sum_k x_k (d q_k + m)  ~  (d dx) * sum_k q_k xq_k + m * s
// A Q6_K weight's 8-bit codes come in groups of 16 (one d each): for those the activations are
// quantized per block of 16 too, so every block of the product is one group of the weight's
// (``group``, 32 or 16, below; 4-bit codes are always in 32s).
// with the integer sum exact in int32 (vpdpbusd: 64 byte products per instruction where the
// float path does 16 FMAs, after forming each weight from its code). Per row, column and block
// the float step is the same two fused multiply-adds in the same order whichever kernel runs,
// however many rows share the pass and whichever thread computes the column:
//     acc = fma(d * dx, (float)isum, acc); acc = fma(m, s, acc);   y = acc (+ bias)
// so a row's output is bit-identical across row counts, batch compositions, threads and the
// kernel paths (AVX512-VNNI, AVX512BW, AVX-VNNI, AVX2, scalar), which tests check.
//
// Codes are repacked once at load (kernels.pack_groups_int) so that 4 consecutive k of one
// column share a 32-bit lane (vpdpbusd's unit), panels of P columns as smallm.c's:
//   4 bits: [panel][group][h = 0..3][P columns][4 bytes], byte b of column c holds
//           k = 8h + b (low nibble) and k = 8h + 4 + b (high nibble) of the group
//   8 bits: [panel][group][h = 0..group/4-1][P columns][4 bytes], k = 4h + b, stored q + 128
// (unsigned, vpdpbusd's first operand; the + 128 is taken off exactly as 128 * sum(xq)).
// dm: the groups' d and m as smallm.c's sd_linear_g reads them, [panel][group][2][P].
// Each ISA body below is this file included once more under its target; the path is chosen
// at run time (sd_int_path), the scalar body is the reference tests compare against.
#ifndef INTLINEAR_BODY
#define INTLINEAR_BODY
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

void sd_panel_share(int panels, int t, int n, int *p0, int *p1);  /* smallm.c's split */
void sd_linear_int_panels(const signed char *xq, const float *dxs, const int *xsum,
                          const unsigned char *wq, const float *dm, const float *bias, float *y,
                          int M, int K, int N, int bits, int group, int panel, int p0, int p1);

#define IGROUP 32  /* k per block of 4-bit codes (GGUF's), as smallm.c's SD_GROUP */
#define IPREFETCH 768  /* bytes ahead along a panel's stream (smallm.c's PREFETCH_Q8_BYTES) */
#define MAXROWS 16  /* rows of x per streaming of the weight, at most (ROWS per ISA below) */

static inline int load_i32(const signed char *p) {
  int v;
  memcpy(&v, p, 4);
  return v;
}

// x[M, K] -> xq[M, K] int8, and per row and block of ``gs`` (32 or 16)
// dxs[(r * groups + g) * 2] = (dx, s) and xsum[r * groups + g] = sum(xq). Every step is exact
// or one IEEE rounding (max, one product, round to nearest even, integer sums), so any build
// of it, vectorised or not, gives the same codes.
static void quantize_rows(const float *x, int M, int K, int gs, signed char *xq, float *dxs,
                          int *xsum) {
  int groups = K / gs;
  for (long r = 0; r < M; r++)
    for (int g = 0; g < groups; g++) {
      const float *xr = x + r * K + (long)g * gs;
      signed char *q = xq + r * K + (long)g * gs;
      float amax = 0.0f;
      for (int k = 0; k < gs; k++) {
        float a = fabsf(xr[k]);
        amax = a > amax ? a : amax;
      }
      float dx = amax / 127.0f, id = dx != 0.0f ? 1.0f / dx : 0.0f;
      int sum = 0;
      for (int k = 0; k < gs; k++) {
        int c = (int)lrintf(xr[k] * id);  // (cvtss2si: to nearest, ties to even)
        c = c > 127 ? 127 : c < -127 ? -127 : c;
        q[k] = (signed char)c;
        sum += c;
      }
      dxs[(r * groups + g) * 2] = dx;
      dxs[(r * groups + g) * 2 + 1] = dx * (float)sum;
      xsum[r * groups + g] = sum;
    }
}

// The scalar reference (and the fallback of a CPU with none of the paths below): the same
// integer sums and the same float steps, column by column.
static void linear_int_ref(const signed char *xq, const float *dxs, const unsigned char *w,
                           const float *dm, const float *bias, float *y, int M, int K, int N,
                           int ldy, int bits, int gs, int P) {
  int groups = K / gs;
  long panel_bytes = (long)K * P * bits / 8;
  for (int n = 0; n < N; n++) {
    int p = n / P, c = n % P;
    const unsigned char *wp = w + p * panel_bytes;
    for (int r = 0; r < M; r++) {
      float acc = 0.0f;
      for (int g = 0; g < groups; g++) {
        const signed char *x = xq + (long)r * K + (long)g * gs;
        int isum = 0;
        if (bits == 4)
          for (int h = 0; h < 4; h++)
            for (int b = 0; b < 4; b++) {
              int byte = wp[(((long)g * 4 + h) * P + c) * 4 + b];
              isum += (byte & 15) * x[8 * h + b] + (byte >> 4) * x[8 * h + 4 + b];
            }
        else
          for (int h = 0; h < gs / 4; h++)
            for (int b = 0; b < 4; b++)
              isum += (wp[(((long)g * (gs / 4) + h) * P + c) * 4 + b] - 128) * x[4 * h + b];
        const float *dmg = dm + ((long)p * groups + g) * 2 * P;
        const float *ds = dxs + ((long)r * groups + g) * 2;
        float t = dmg[c] * ds[0];
        acc = fmaf(t, (float)isum, acc);
        acc = fmaf(dmg[P + c], ds[1], acc);
      }
      y[(long)r * ldy + n] = bias ? acc + bias[n] : acc;
    }
  }
}

// The ISA bodies: P, the rows per streaming and the integer dot products (what differs
// between paths of one width), then the body, which derives its vector operations from P.

// AVX512-VNNI (panel 16)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,fma")
#define SFX(name) name##_vnni512
#define P_WIDTH 16
#define ROWS 16  /* rows per streaming: 16 integer sums and the weights fit in 32 registers */
#define DOT4(acc, u, x) _mm512_dpbusd_epi32(acc, u, x)
#define PREP8(u) (u)
#define DOT8(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define OFFSET8 128
#include __FILE__
#pragma GCC pop_options

// AVX512BW without VNNI (panel 16): u8 x s8 pairs to int16 (4-bit codes: at most
// 2 * 15 * 127, no saturation), pairs of those to int32; 8-bit codes as |q| times x with q's
// sign (llama.cpp's trick: at most 2 * 128 * 127 < 2^15).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,fma")
#define SFX(name) name##_bw512
#define P_WIDTH 16
#define ROWS 16
#define DOT4(acc, u, x) \
  _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)))
#define PREP8(u) _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80))
#define DOT8(acc, q, x)                                                                    \
  DOT4(acc, _mm512_abs_epi8(q),                                                            \
       _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(q), _mm512_setzero_si512(), x))
#define OFFSET8 0
#include __FILE__
#pragma GCC pop_options

// AVX-VNNI (panel 8: 256-bit vpdpbusd)
#pragma GCC push_options
#pragma GCC target("avx2,avxvnni,fma")
#define SFX(name) name##_vnni256
#define P_WIDTH 8
#define ROWS 8  /* (16 registers) */
#define DOT4(acc, u, x) _mm256_dpbusd_avx_epi32(acc, u, x)
#define PREP8(u) (u)
#define DOT8(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#define OFFSET8 128
#include __FILE__
#pragma GCC pop_options

// AVX2 (panel 8): as the AVX512BW body, with vpsignb for q's sign
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SFX(name) name##_avx2
#define P_WIDTH 8
#define ROWS 8
#define DOT4(acc, u, x) \
  _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)))
#define PREP8(u) _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80))
#define DOT8(acc, q, x) DOT4(acc, _mm256_abs_epi8(q), _mm256_sign_epi8(x, q))
#define OFFSET8 0
#include __FILE__
#pragma GCC pop_options

// Which path a panel width runs here: 2 VNNI, 1 the byte-pair path, 0 the scalar reference;
// at most ``cap`` (tests lower it to run each path on the same CPU).
static int int_cap = 2;

void sd_int_cap(int cap) { int_cap = cap; }

int sd_int_path(int panel) {
  __builtin_cpu_init();
  int level = 0;
  if (panel == 16 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma"))
    level = __builtin_cpu_supports("avx512vnni") ? 2 : 1;
  else if (panel == 8 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    level = __builtin_cpu_supports("avxvnni") ? 2 : 1;
  return level < int_cap ? level : int_cap;
}

static void linear_int(const signed char *xq, const float *dxs, const int *xsum,
                       const unsigned char *w, const float *dm, const float *bias, float *y,
                       int M, int K, int N, int ldy, int bits, int gs, int panel, int path) {
  if (panel == 16 && path == 2)
    linear_int_vnni512(xq, dxs, xsum, w, dm, bias, y, M, K, N, ldy, bits, gs);
  else if (panel == 16 && path == 1)
    linear_int_bw512(xq, dxs, xsum, w, dm, bias, y, M, K, N, ldy, bits, gs);
  else if (panel == 8 && path == 2)
    linear_int_vnni256(xq, dxs, xsum, w, dm, bias, y, M, K, N, ldy, bits, gs);
  else if (panel == 8 && path == 1)
    linear_int_avx2(xq, dxs, xsum, w, dm, bias, y, M, K, N, ldy, bits, gs);
  else
    linear_int_ref(xq, dxs, w, dm, bias, y, M, K, N, ldy, bits, gs, panel);
}

// x: [M, K], y: [M, N] row-major float32; wq: codes of ``bits`` 4 or 8 packed as above for
// ``panel`` (16 or 8), in groups of ``group`` along k (32; 16 for 8-bit codes from Q6_K); dm:
// the groups' d and m; bias or NULL; K a multiple of the group. With
// ``threads`` > 1 (built with OpenMP) the panels are split between the threads in runs of 4,
// as smallm.c's. Returns 0, or -1 when the quantized rows' memory could not be allocated.
int sd_linear_int(const float *x, const unsigned char *wq, const float *dm, const float *bias,
                  float *y, int M, int K, int N, int bits, int group, int panel,
                  int threads) {
  int groups = K / group, path = sd_int_path(panel);
  char *scratch = malloc((size_t)M * K + sizeof(float) * 3 * M * groups + 64);
  if (!scratch) return -1;
  float *dxs = (float *)(((size_t)scratch + 63) & ~(size_t)63);
  int *xsum = (int *)(dxs + 2 * M * groups);
  signed char *xq = (signed char *)(xsum + M * groups);
  quantize_rows(x, M, K, group, xq, dxs, xsum);
#ifdef _OPENMP
  int panels = (N + panel - 1) / panel;
  if (threads > 1 && panels >= 8 * threads) {
#pragma omp parallel num_threads(threads)
    {
      int p0, p1;
      sd_panel_share(panels, omp_get_thread_num(), omp_get_num_threads(), &p0, &p1);
      sd_linear_int_panels(xq, dxs, xsum, wq, dm, bias, y, M, K, N, bits, group, panel, p0,
                           p1);
    }
    free(scratch);
    return 0;
  }
#endif
  (void)threads;
  linear_int(xq, dxs, xsum, wq, dm, bias, y, M, K, N, N, bits, group, panel, path);
  free(scratch);
  return 0;
}

// Panels [p0, p1) of the product on rows already quantized (sd_quantize_rows): one thread's
// share, the columns they hold into y's.
void sd_linear_int_panels(const signed char *xq, const float *dxs, const int *xsum,
                          const unsigned char *wq, const float *dm, const float *bias, float *y,
                          int M, int K, int N, int bits, int group, int panel, int p0,
                          int p1) {
  if (p0 >= p1) return;
  int groups = K / group, c0 = p0 * panel, c1 = p1 * panel < N ? p1 * panel : N;
  linear_int(xq, dxs, xsum, wq + p0 * ((long)K * panel * bits / 8),
             dm + (long)p0 * groups * 2 * panel, bias ? bias + c0 : 0, y + c0, M, K, c1 - c0, N,
             bits, group, panel, sd_int_path(panel));
}

// The activation quantization alone (tests compare it with their own): xq [M, K], dxs
// [M, K / group, 2] (dx, s), xsum [M, K / group].
void sd_quantize_rows(const float *x, int M, int K, int group, signed char *xq, float *dxs,
                      int *xsum) {
  quantize_rows(x, M, K, group, xq, dxs, xsum);
}

#else  // the body, once per ISA (SFX, P_WIDTH, ROWS and the dot products defined above)

// The vector operations of the width P_WIDTH (512 or 256 bits).
#if P_WIDTH == 16
#define IVEC __m512i
#define FVEC __m512
#define LOADW(p) _mm512_loadu_si512((const void *)(p))
#define BCAST4(p) _mm512_set1_epi32(load_i32(p))
#define NIBBLE(b, s) _mm512_and_si512(_mm512_srli_epi16(b, s), _mm512_set1_epi8(15))
#define ZEROI _mm512_setzero_si512()
#define SUBI(a, b) _mm512_sub_epi32(a, b)
#define SET1I _mm512_set1_epi32
#define CVT _mm512_cvtepi32_ps
#define LOADF _mm512_loadu_ps
#define STOREF _mm512_storeu_ps
#define SET1F _mm512_set1_ps
#define MULF _mm512_mul_ps
#define FMAF _mm512_fmadd_ps
#else
#define IVEC __m256i
#define FVEC __m256
#define LOADW(p) _mm256_loadu_si256((const __m256i *)(p))
#define BCAST4(p) _mm256_set1_epi32(load_i32(p))
#define NIBBLE(b, s) _mm256_and_si256(_mm256_srli_epi16(b, s), _mm256_set1_epi8(15))
#define ZEROI _mm256_setzero_si256()
#define SUBI(a, b) _mm256_sub_epi32(a, b)
#define SET1I _mm256_set1_epi32
#define CVT _mm256_cvtepi32_ps
#define LOADF _mm256_loadu_ps
#define STOREF _mm256_storeu_ps
#define SET1F _mm256_set1_ps
#define MULF _mm256_mul_ps
#define FMAF _mm256_fmadd_ps
#endif

// MB rows against J panels: the integer sums of a block in MB * J registers, the float
// accumulators in MB * J more (the compiler keeps what fits in registers: up to 8 of each on
// AVX-512), the groups' d and m loaded once a block for every row; ``out`` written at the end.
__attribute__((always_inline)) static inline void SFX(block)(
    const signed char *xq, const float *dxs, const int *xsum, const unsigned char *w0,
    const float *dm0, float *out, int K, const int MB, const int J, const int bits,
    const int gs) {
  const int P = P_WIDTH;
  const long groups = K / gs, panel_bytes = (long)K * P * bits / 8;
  FVEC acc[MAXROWS][8];
  for (int a = 0; a < MB; a++)
    for (int j = 0; j < J; j++) acc[a][j] = SET1F(0.0f);
  for (long g = 0; g < groups; g++) {
    IVEC isum[MAXROWS][8];
    for (int a = 0; a < MB; a++)
      for (int j = 0; j < J; j++) isum[a][j] = ZEROI;
    if (bits == 4) {
      for (int h = 0; h < 4; h++) {
        IVEC lo[8], hi[8];
        for (int j = 0; j < J; j++) {
          const unsigned char *w = w0 + j * panel_bytes + (g * 4 + h) * P * 4;
          IVEC b = LOADW(w);
          lo[j] = NIBBLE(b, 0);
          hi[j] = NIBBLE(b, 4);
          _mm_prefetch((const char *)w + IPREFETCH, _MM_HINT_T0);
        }
        for (int a = 0; a < MB; a++) {
          const signed char *x = xq + (long)a * K + g * IGROUP + 8 * h;
          IVEC x0 = BCAST4(x), x1 = BCAST4(x + 4);
          for (int j = 0; j < J; j++) isum[a][j] = DOT4(DOT4(isum[a][j], lo[j], x0), hi[j], x1);
        }
      }
    } else {
      for (int h = 0; h < gs / 4; h++) {
        IVEC wv[8];
        for (int j = 0; j < J; j++) {
          const unsigned char *w = w0 + j * panel_bytes + (g * (gs / 4) + h) * P * 4;
          wv[j] = PREP8(LOADW(w));
          _mm_prefetch((const char *)w + IPREFETCH, _MM_HINT_T0);
        }
        for (int a = 0; a < MB; a++) {
          IVEC x = BCAST4(xq + (long)a * K + g * gs + 4 * h);
          for (int j = 0; j < J; j++) isum[a][j] = DOT8(isum[a][j], wv[j], x);
        }
      }
    }
    FVEC dv[8], mv[8];
    for (int j = 0; j < J; j++) {
      const float *dm = dm0 + ((long)j * groups + g) * 2 * P;
      dv[j] = LOADF(dm);
      mv[j] = LOADF(dm + P);
    }
    for (int a = 0; a < MB; a++) {
      const float *ds = dxs + ((long)a * groups + g) * 2;
      FVEC dxv = SET1F(ds[0]), sv = SET1F(ds[1]);
      IVEC off = SET1I(OFFSET8 * xsum[a * groups + g]);
      for (int j = 0; j < J; j++) {
        IVEC s = bits == 8 && OFFSET8 ? SUBI(isum[a][j], off) : isum[a][j];
        acc[a][j] = FMAF(mv[j], sv, FMAF(MULF(dv[j], dxv), CVT(s), acc[a][j]));
      }
    }
  }
  for (int a = 0; a < MB; a++)
    for (int j = 0; j < J; j++) STOREF(out + (a * 8 + j) * P, acc[a][j]);
}

#define ICASE(MB, J)                                                                       \
  case MB * 16 + J:                                                                        \
    if (bits == 4) SFX(block)(xb, db, sb, w0, d0, out, K, MB, J, 4, IGROUP);               \
    else if (gs == 16) SFX(block)(xb, db, sb, w0, d0, out, K, MB, J, 8, 16);               \
    else SFX(block)(xb, db, sb, w0, d0, out, K, MB, J, 8, IGROUP);                         \
    break;

// Panels J at a time (4 for one or two rows, 2 for three or four, else 1: the integer sums of
// MB * J vectors and J (or 2 J) weight vectors in registers), a tail of fewer one at a time,
// rows ROWS at a time (a verify block of 9-16 rows streams the weight once on AVX-512). (Only those shapes are compiled: each is a copy of the block per bits and
// ISA, and the compiler's time grows with them.)
static void SFX(linear_int)(const signed char *xq, const float *dxs, const int *xsum,
                            const unsigned char *wp, const float *dm, const float *bias,
                            float *y, int M, int K, int N, int ldy, int bits, int gs) {
  const int P = P_WIDTH;
  int panels = (N + P - 1) / P, groups = K / gs;
  long panel_bytes = (long)K * P * bits / 8;
  float out[MAXROWS * 8 * P_WIDTH];
  for (int m0 = 0; m0 < M; m0 += ROWS) {
    int mb = M - m0 < ROWS ? M - m0 : ROWS;
    const signed char *xb = xq + (long)m0 * K;
    const float *db = dxs + (long)m0 * groups * 2;
    const int *sb = xsum + (long)m0 * groups;
    int J = mb <= 2 ? 4 : mb <= 4 ? 2 : 1;
    for (int p0 = 0, jb = J; p0 < panels; p0 += jb) {
      if (jb > panels - p0) jb = 1;
      const unsigned char *w0 = wp + p0 * panel_bytes;
      const float *d0 = dm + (long)p0 * groups * 2 * P;
      switch (mb * 16 + jb) {  // constant shapes, so the loops unroll
        ICASE(1, 4) ICASE(2, 4) ICASE(3, 2) ICASE(4, 2)
        ICASE(1, 1) ICASE(2, 1) ICASE(3, 1) ICASE(4, 1)
        ICASE(5, 1) ICASE(6, 1) ICASE(7, 1) ICASE(8, 1)
#if ROWS > 8
        ICASE(9, 1) ICASE(10, 1) ICASE(11, 1) ICASE(12, 1)
        ICASE(13, 1) ICASE(14, 1) ICASE(15, 1) ICASE(16, 1)
#endif
      }
      for (int j = 0; j < jb; j++) {
        int n0 = (p0 + j) * P, nv = N - n0 < P ? N - n0 : P;
        for (int a = 0; a < mb; a++) {
          float *dst = y + (long)(m0 + a) * ldy + n0;
          const float *src = out + (a * 8 + j) * P;
          if (bias) for (int c = 0; c < nv; c++) dst[c] = src[c] + bias[n0 + c];
          else memcpy(dst, src, nv * sizeof(float));
        }
      }
    }
  }
}
#undef ICASE

#undef SFX
#undef P_WIDTH
#undef ROWS
#undef IVEC
#undef FVEC
#undef LOADW
#undef BCAST4
#undef NIBBLE
#undef ZEROI
#undef DOT4
#undef PREP8
#undef DOT8
#undef OFFSET8
#undef SUBI
#undef SET1I
#undef CVT
#undef LOADF
#undef STOREF
#undef SET1F
#undef MULF
#undef FMAF
#endif
