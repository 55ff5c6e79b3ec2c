// specdec's "smallm" linear kernel (specdec/serving/kernels.py): y[M, N] = x[M, K] W[N, K]^T
// (+ bias) for the few rows of a decode or verify pass, on one thread or split between torch's;
// W in float32 (sd_linear) or int8 with a float scale per output column (sd_linear_q8, an int8
// draft's layers: a quarter of the bytes to stream, converted to float in registers).
//
// The weight is packed once into panels of P output columns, wp[p][k][c] = W[p * P + c][k]
// (zero past N), and every call streams it once whatever M is: each weight vector loaded is
// used by all M rows (up to 8 at a time), with the next rows of each panel prefetched. On a
// memory-bound CPU a block of 2-8 rows then costs about what one row does, where SGEMM
// libraries pad small M to their micro-kernel and run compute-bound (measured on an
// AVX-512 Xeon, one thread, the default target's linear layers: 33 / 34 / 34 / 34 / 38 ms at
// 1 / 2 / 3 / 4 / 8 rows against the best of oneMKL and oneDNN's 34 / 40 / 44 / 44 / 51).
// Built at run time with the system's C compiler (no build step in the package).
#include <immintrin.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define SD_GROUP 32  /* grouped codes: weights per (d, m) pair along k (GGUF's block size) */
#define PREFETCH_ROWS 32  /* prefetch distance along k, in panel rows (best of 8..128 measured) */
// int8 panels: a prefetch once per 64-byte line, this many bytes ahead (the int8 variant on
// 8 panels of 16 columns for one row, streaming 40 distinct 3072 x 576 weights on the Xeon:
// 3.6-4.8 ms against 6.4 ms at every row 2 KiB ahead, which ran at 11 GB/s to fp32's 16)
#define PREFETCH_Q8_BYTES 768

// The pieces every block below shares: its accumulators zeroed and stored, input k times the
// J weight vectors wv for each of its MB rows, and (grouped codes) the d and m of group g for
// each of its J panels.
#define ZERO_ACC(ZERO)                                                                     \
  for (int a = 0; a < MB; a++)                                                             \
    for (int j = 0; j < J; j++) acc[a][j] = ZERO;
#define STORE_ACC(STORE, P)                                                                \
  for (int a = 0; a < MB; a++)                                                             \
    for (int j = 0; j < J; j++) STORE(out + (a * 8 + j) * P, acc[a][j]);
#define FMA_ROWS(VEC, SET1, FMA)                                                           \
  for (int a = 0; a < MB; a++) {                                                           \
    VEC xv = SET1(x[(long)a * K + k]);                                                     \
    for (int j = 0; j < J; j++) acc[a][j] = FMA(xv, wv[j], acc[a][j]);                     \
  }
#define LOAD_DM(LOADF, P)                                                                  \
  for (int j = 0; j < J; j++) {                                                            \
    const float *dm = dm0 + ((long)j * groups + g) * 2 * P;                                \
    dv[j] = LOADF(dm);                                                                     \
    mv[j] = LOADF(dm + P);                                                                 \
  }

// PF: prefetch distance in bytes; PFMASK: prefetch when (k & PFMASK) == 0.
#define BLOCK(NAME, TARGET, VEC, WT, P, LOAD, SET1, FMA, ZERO, STORE, PF, PFMASK)          \
__attribute__((target(TARGET), always_inline)) static inline void NAME(                     \
    const float *x, const WT *w0, const float *dm0, float *out, int K, const int MB,       \
    const int J) {                                                                         \
  (void)dm0;                                                                               \
  VEC acc[8][8];                                                                           \
  ZERO_ACC(ZERO)                                                                           \
  for (int k = 0; k < K; k++) {                                                            \
    const WT *w = w0 + (long)k * P;                                                        \
    VEC wv[8];                                                                             \
    for (int j = 0; j < J; j++) {                                                          \
      wv[j] = LOAD(w + (long)j * K * P);                                                   \
      if ((k & (PFMASK)) == 0)                                                             \
        _mm_prefetch((const char *)(w + (long)j * K * P) + (PF), _MM_HINT_T0);             \
    }                                                                                      \
    FMA_ROWS(VEC, SET1, FMA)                                                               \
  }                                                                                        \
  STORE_ACC(STORE, P)                                                                      \
}

#define CASE(BLOCKFN, MB, J) case MB * 16 + J: BLOCKFN(xb, w0, d0, out, K, MB, J); break;
#define CASES(BLOCKFN, MB)                                                                 \
  CASE(BLOCKFN, MB, 1) CASE(BLOCKFN, MB, 2) CASE(BLOCKFN, MB, 4) CASE(BLOCKFN, MB, 8)

// J panels at a time (1, 2, 4 or 8) for a block of mb rows: mb * J accumulators in registers
// (AVX-512: 32 of them, AVX2: 16), as many as fit beside the J weight vectors; a tail of
// fewer panels in the largest of those that fit (7: four, two, one).
#define KERNEL(NAME, BLOCKFN, TARGET, WT, P, JFOR, KDIV, GS)                               \
__attribute__((target(TARGET))) static void NAME(                                          \
    const float *x, const WT *wp, const float *dm, const float *scale, const float *bias,  \
    float *y, int M, int K, int N, int ldy) {                                              \
  int panels = (N + P - 1) / P;                                                            \
  float out[8 * 8 * P];                                                                    \
  for (int m0 = 0; m0 < M; m0 += 8) {                                                      \
    int mb = M - m0 < 8 ? M - m0 : 8;                                                      \
    const float *xb = x + (long)m0 * K;                                                    \
    int J = JFOR(mb);                                                                      \
    for (int p0 = 0, jb = J; p0 < panels; p0 += jb) {                                      \
      while (jb > panels - p0) jb /= 2;                                                    \
      const WT *w0 = wp + (long)p0 * (K / KDIV) * P;                                       \
      const float *d0 = dm ? dm + (long)p0 * (K / (GS)) * 2 * P : 0;                       \
      switch (mb * 16 + jb) { /* constant shapes, so the loops unroll */                   \
        CASES(BLOCKFN, 1) CASES(BLOCKFN, 2) CASES(BLOCKFN, 3) CASES(BLOCKFN, 4)            \
        CASES(BLOCKFN, 5) CASES(BLOCKFN, 6) CASES(BLOCKFN, 7) CASES(BLOCKFN, 8)            \
      }                                                                                    \
      for (int j = 0; j < jb; j++) {                                                       \
        int n0 = (p0 + j) * P, nv = N - n0 < P ? N - n0 : P;                               \
        for (int a = 0; a < mb; a++) {                                                     \
          float *dst = y + (long)(m0 + a) * ldy + n0;                                      \
          const float *src = out + (a * 8 + j) * P;                                        \
          if (scale)                                                                       \
            for (int c = 0; c < nv; c++)                                                   \
              dst[c] = src[c] * scale[n0 + c] + (bias ? bias[n0 + c] : 0.0f);              \
          else if (bias) for (int c = 0; c < nv; c++) dst[c] = src[c] + bias[n0 + c];      \
          else memcpy(dst, src, nv * sizeof(float));                                       \
        }                                                                                  \
      }                                                                                    \
    }                                                                                      \
  }                                                                                        \
}

// Grouped int8 codes (sd_linear_g): each output column's weights in groups of SD_GROUP
// along k, weight = d * q + m with the group's d and m (a GGUF file's Q8_0 / Q4_0 / Q4_1
// blocks: kernels.py re-encodes those exactly). d * q is exact in float32 (an fp16 d times a
// code of at most 8 bits), so one fused multiply-add fma(d, q, m), which rounds d * q + m
// once, forms bit for bit the fp32 weight d * q + m that sd_linear would load (and one FP op
// fewer than a multiply and an add: on a CPU whose FP pipes these kernels fill, forming the
// weights is most of a one-row pass). The products are summed in the same order over k: the
// results are identical to sd_linear's on the dequantized weight, from a quarter of its bytes.
// dm: [panels][K / SD_GROUP][2][P] (d, then m, for the panel's P columns).
#define BLOCKG(NAME, TARGET, VEC, P, LOADQ, LOADF, SET1, FMA, ZERO, STORE, PF, PFMASK, GS) \
__attribute__((target(TARGET), always_inline)) static inline void NAME(                     \
    const float *x, const signed char *w0, const float *dm0, float *out, int K,           \
    const int MB, const int J) {                                                           \
  VEC acc[8][8];                                                                           \
  const long groups = K / (GS);                                                            \
  ZERO_ACC(ZERO)                                                                           \
  for (long g = 0; g < groups; g++) {                                                      \
    VEC dv[8], mv[8];                                                                      \
    LOAD_DM(LOADF, P)                                                                      \
    for (long k = g * (GS); k < (g + 1) * (GS); k++) {                                     \
      const signed char *w = w0 + k * P;                                                   \
      VEC wv[8];                                                                           \
      for (int j = 0; j < J; j++) {                                                        \
        wv[j] = FMA(dv[j], LOADQ(w + (long)j * K * P), mv[j]);                             \
        if ((k & (PFMASK)) == 0)                                                           \
          _mm_prefetch((const char *)(w + (long)j * K * P) + (PF), _MM_HINT_T0);           \
      }                                                                                    \
      FMA_ROWS(VEC, SET1, FMA)                                                             \
    }                                                                                      \
  }                                                                                        \
  STORE_ACC(STORE, P)                                                                      \
}

// 4-bit codes (sd_linear_g4: a GGUF file's Q4_0 / Q4_1 blocks, codes 0..15): two consecutive
// k of a panel's P columns in P bytes, k even in the low nibble and k + 1 in the high one,
// half the 8-bit codes' bytes; each weight formed and summed as in BLOCKG, in the same order.
#define BLOCKG4(NAME, TARGET, VEC, IVEC, P, LOADB, AND, SRLI, SET1I, CVT, LOADF, SET1, FMA,   \
                ZERO, STORE, PFMASK)                                                       \
__attribute__((target(TARGET), always_inline)) static inline void NAME(                     \
    const float *x, const unsigned char *w0, const float *dm0, float *out, int K,         \
    const int MB, const int J) {                                                           \
  VEC acc[8][8];                                                                           \
  const long groups = K / SD_GROUP;                                                        \
  const IVEC low = SET1I(15);                                                              \
  ZERO_ACC(ZERO)                                                                           \
  for (long g = 0; g < groups; g++) {                                                      \
    VEC dv[8], mv[8];                                                                      \
    LOAD_DM(LOADF, P)                                                                      \
    for (long k = g * SD_GROUP; k < (g + 1) * SD_GROUP; k += 2) {                          \
      const unsigned char *w = w0 + (k / 2) * P;                                           \
      VEC lo[8], hi[8];                                                                    \
      for (int j = 0; j < J; j++) {                                                        \
        IVEC b = LOADB(w + (long)j * (K / 2) * P);                                         \
        lo[j] = FMA(dv[j], CVT(AND(b, low)), mv[j]);                                       \
        hi[j] = FMA(dv[j], CVT(SRLI(b, 4)), mv[j]);                                        \
        if (((k / 2) & (PFMASK)) == 0)                                                     \
          _mm_prefetch((const char *)(w + (long)j * (K / 2) * P) + PREFETCH_Q8_BYTES,     \
                       _MM_HINT_T0);                                                       \
      }                                                                                    \
      for (int a = 0; a < MB; a++) {                                                       \
        VEC x0 = SET1(x[(long)a * K + k]), x1 = SET1(x[(long)a * K + k + 1]);              \
        for (int j = 0; j < J; j++) acc[a][j] = FMA(x1, hi[j], FMA(x0, lo[j], acc[a][j])); \
      }                                                                                    \
    }                                                                                      \
  }                                                                                        \
  STORE_ACC(STORE, P)                                                                      \
}

#define J512(mb) ((mb) <= 4 ? 4 : 2)
#define J256(mb) ((mb) <= 2 ? 4 : (mb) <= 4 ? 2 : 1)

// int8 weights: P bytes loaded, widened to P int32, converted to P floats (exact: |q| <= 127)
#define LOADQ512(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define LOADQ256(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))

#define JQ512(mb) ((mb) <= 2 ? 8 : (mb) <= 4 ? 4 : 2)

BLOCK(block512, "avx512f", __m512, float, 16, _mm512_loadu_ps, _mm512_set1_ps, _mm512_fmadd_ps,
      _mm512_setzero_ps(), _mm512_storeu_ps, PREFETCH_ROWS * 16 * 4, 0)
BLOCK(block256, "avx2,fma", __m256, float, 8, _mm256_loadu_ps, _mm256_set1_ps, _mm256_fmadd_ps,
      _mm256_setzero_ps(), _mm256_storeu_ps, PREFETCH_ROWS * 8 * 4, 0)
BLOCK(blockq512, "avx512f", __m512, signed char, 16, LOADQ512, _mm512_set1_ps, _mm512_fmadd_ps,
      _mm512_setzero_ps(), _mm512_storeu_ps, PREFETCH_Q8_BYTES, 3)
BLOCK(blockq256, "avx2,fma", __m256, signed char, 8, LOADQ256, _mm256_set1_ps, _mm256_fmadd_ps,
      _mm256_setzero_ps(), _mm256_storeu_ps, PREFETCH_Q8_BYTES, 7)
BLOCKG(blockg512, "avx512f", __m512, 16, LOADQ512, _mm512_loadu_ps, _mm512_set1_ps,
       _mm512_fmadd_ps, _mm512_setzero_ps(), _mm512_storeu_ps, PREFETCH_Q8_BYTES, 3, SD_GROUP)
BLOCKG(blockg256, "avx2,fma", __m256, 8, LOADQ256, _mm256_loadu_ps, _mm256_set1_ps,
       _mm256_fmadd_ps, _mm256_setzero_ps(), _mm256_storeu_ps, PREFETCH_Q8_BYTES, 7, SD_GROUP)
// groups of 16 (a GGUF file's Q6_K: d = the super-block's d times the group's int8 scale)
BLOCKG(blockg16_512, "avx512f", __m512, 16, LOADQ512, _mm512_loadu_ps, _mm512_set1_ps,
       _mm512_fmadd_ps, _mm512_setzero_ps(), _mm512_storeu_ps, PREFETCH_Q8_BYTES, 3, 16)
BLOCKG(blockg16_256, "avx2,fma", __m256, 8, LOADQ256, _mm256_loadu_ps, _mm256_set1_ps,
       _mm256_fmadd_ps, _mm256_setzero_ps(), _mm256_storeu_ps, PREFETCH_Q8_BYTES, 7, 16)
#define LOADB512(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define LOADB256(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
BLOCKG4(blockg4_512, "avx512f", __m512, __m512i, 16, LOADB512, _mm512_and_si512,
        _mm512_srli_epi32, _mm512_set1_epi32, _mm512_cvtepi32_ps, _mm512_loadu_ps,
        _mm512_set1_ps, _mm512_fmadd_ps, _mm512_setzero_ps(), _mm512_storeu_ps, 3)
BLOCKG4(blockg4_256, "avx2,fma", __m256, __m256i, 8, LOADB256, _mm256_and_si256,
        _mm256_srli_epi32, _mm256_set1_epi32, _mm256_cvtepi32_ps, _mm256_loadu_ps,
        _mm256_set1_ps, _mm256_fmadd_ps, _mm256_setzero_ps(), _mm256_storeu_ps, 7)
KERNEL(linear512, block512, "avx512f", float, 16, J512, 1, SD_GROUP)
KERNEL(linear256, block256, "avx2,fma", float, 8, J256, 1, SD_GROUP)
KERNEL(linearq512, blockq512, "avx512f", signed char, 16, JQ512, 1, SD_GROUP)
KERNEL(linearq256, blockq256, "avx2,fma", signed char, 8, J256, 1, SD_GROUP)
KERNEL(linearg512, blockg512, "avx512f", signed char, 16, JQ512, 1, SD_GROUP)
KERNEL(linearg256, blockg256, "avx2,fma", signed char, 8, J256, 1, SD_GROUP)
KERNEL(linearg16_512, blockg16_512, "avx512f", signed char, 16, JQ512, 1, 16)
KERNEL(linearg16_256, blockg16_256, "avx2,fma", signed char, 8, J256, 1, 16)
KERNEL(linearg4_512, blockg4_512, "avx512f", unsigned char, 16, JQ512, 2, SD_GROUP)
KERNEL(linearg4_256, blockg4_256, "avx2,fma", unsigned char, 8, J256, 2, SD_GROUP)

// The panel width this CPU's kernel reads: 16 (AVX-512), 8 (AVX2 + FMA), 0 (neither).
int sd_panel(void) {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 16;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 8;
  return 0;
}

// dm: grouped codes (bits 4 or 8, groups of ``group``: 32, or 16 for 8-bit codes); else
// scale: int8 weights and their column scales; else float32.
static void linear(const float *x, const void *wp, int bits, int group, const float *dm,
                   const float *scale, const float *bias, float *y, int M, int K, int N,
                   int ldy, int panel) {
  if (dm && bits == 4) {
    if (panel == 16) linearg4_512(x, wp, dm, 0, bias, y, M, K, N, ldy);
    else if (panel == 8) linearg4_256(x, wp, dm, 0, bias, y, M, K, N, ldy);
  } else if (dm && group == 16) {
    if (panel == 16) linearg16_512(x, wp, dm, 0, bias, y, M, K, N, ldy);
    else if (panel == 8) linearg16_256(x, wp, dm, 0, bias, y, M, K, N, ldy);
  } else if (dm) {
    if (panel == 16) linearg512(x, wp, dm, 0, bias, y, M, K, N, ldy);
    else if (panel == 8) linearg256(x, wp, dm, 0, bias, y, M, K, N, ldy);
  } else if (scale) {
    if (panel == 16) linearq512(x, wp, 0, scale, bias, y, M, K, N, ldy);
    else if (panel == 8) linearq256(x, wp, 0, scale, bias, y, M, K, N, ldy);
  } else {
    if (panel == 16) linear512(x, wp, 0, 0, bias, y, M, K, N, ldy);
    else if (panel == 8) linear256(x, wp, 0, 0, bias, y, M, K, N, ldy);
  }
}

// Thread t of n's share of ``panels`` panels, [*p0, *p1) (empty when *p0 >= *p1): runs of 4
// panels, the same split for every kernel of the library (intlinear.c's too).
void sd_panel_share(int panels, int t, int n, int *p0, int *p1) {
  int per = ((panels + n - 1) / n + 3) & ~3;
  *p0 = t * per;
  *p1 = *p0 + per < panels ? *p0 + per : panels;
}

// Panels [p0, p1) of a product (one thread's share): the columns they hold, into y's.
void sd_linear_panels(const float *x, const void *wp, int bits, int group, const float *dm,
                      const float *scale, const float *bias, float *y, int M, int K, int N,
                      int panel, int p0, int p1) {
  if (p0 >= p1) return;
  int c0 = p0 * panel, c1 = p1 * panel < N ? p1 * panel : N;
  linear(x, (const char *)wp + (long)p0 * K * panel * bits / 8, bits, group,
         dm ? dm + (long)p0 * (K / group) * 2 * panel : 0, scale ? scale + c0 : 0,
         bias ? bias + c0 : 0, y + c0, M, K, c1 - c0, N, panel);
}

static void run(const float *x, const void *wp, int bits, int group, const float *dm,
                const float *scale, const float *bias, float *y, int M, int K, int N,
                int panel, int threads) {
#ifdef _OPENMP
  int panels = (N + panel - 1) / panel;
  if (threads > 1 && panels >= 8 * threads) {
#pragma omp parallel num_threads(threads)
    {
      int p0, p1;
      sd_panel_share(panels, omp_get_thread_num(), omp_get_num_threads(), &p0, &p1);
      sd_linear_panels(x, wp, bits, group, dm, scale, bias, y, M, K, N, panel, p0, p1);
    }
    return;
  }
#endif
  (void)threads;
  linear(x, wp, bits, group, dm, scale, bias, y, M, K, N, N, panel);
}

// x: [M, K] and y: [M, N] row-major float32; wp packed for ``panel`` (sd_panel's); bias or NULL.
// ``threads`` > 1 (where built with OpenMP, in the process's OpenMP pool: torch's own): the
// panels are split between the threads in runs of 4, each streaming its share of the weight.
void sd_linear(const float *x, const float *wp, const float *bias, float *y, int M, int K,
               int N, int panel, int threads) {
  run(x, wp, 32, SD_GROUP, 0, 0, bias, y, M, K, N, panel, threads);
}

// The same with int8 weights wq (packed as sd_linear's) and y[:, n] scaled by scale[n].
void sd_linear_q8(const float *x, const signed char *wq, const float *scale, const float *bias,
                  float *y, int M, int K, int N, int panel, int threads) {
  run(x, wq, 8, SD_GROUP, 0, scale, bias, y, M, K, N, panel, threads);
}

// The same with grouped int8 codes wq (packed as sd_linear's) and their groups' d and m (dm,
// see BLOCKG); K a multiple of SD_GROUP. Bit-identical to sd_linear on d * q + m.
void sd_linear_g(const float *x, const signed char *wq, const float *dm, const float *bias,
                 float *y, int M, int K, int N, int panel, int threads) {
  run(x, wq, 8, SD_GROUP, dm, 0, bias, y, M, K, N, panel, threads);
}

// The same with 4-bit codes 0..15, two k per byte (see BLOCKG4).
void sd_linear_g4(const float *x, const unsigned char *wq, const float *dm, const float *bias,
                  float *y, int M, int K, int N, int panel, int threads) {
  run(x, wq, 4, SD_GROUP, dm, 0, bias, y, M, K, N, panel, threads);
}

// The same with 8-bit codes in groups of 16 along k (a GGUF file's Q6_K); K a multiple of 16.
void sd_linear_g16(const float *x, const signed char *wq, const float *dm, const float *bias,
                   float *y, int M, int K, int N, int panel, int threads) {
  run(x, wq, 8, 16, dm, 0, bias, y, M, K, N, panel, threads);
}

// Whether this build splits calls between threads (built with OpenMP).
int sd_threaded(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}
