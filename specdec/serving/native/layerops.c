// specdec's fused decoder-layer ops (specdec/serving/engine.py, the native path): everything a
// Llama-family layer does between its linear layers, for the few rows of a decode or verify
// pass, in three calls instead of ~30 torch ops. Each torch op costs 3-45 us to dispatch
// however small its tensors (measured on an AVX-512 EPYC, one core: an RMSNorm of one row 20-28
// us, rotate_half 13 us, scaled_dot_product_attention over 150 keys 45 us), which came to
// 8.5 ms of the int8 draft's 19.7 ms forward and ~9 ms of the fp32 target's ~35 ms.
//
//   sd_add_rms_norm  x += delta (the residual), then out = weight * RMSNorm(x)
//   sd_attend        RoPE on one session's new queries and keys, its keys and values into its
//                    KV cache, then causal (optionally sliding-window) softmax attention
//   sd_silu_mul      silu(gate) * up over the gate_up projection's two halves
//
// All in float32, in transformers' order of operations; sums and exponentials round
// differently from torch's (~1e-7 relative), as any two kernels do. Each body is compiled for
// AVX-512, AVX2 + FMA and the baseline (this file includes itself once per target) and chosen
// at run time. Built at run time with the system's C compiler, beside smallm.c.
#ifndef LAYEROPS_BODY
#define LAYEROPS_BODY
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16  // independent partial sums: vectorised without reassociating float adds
// 16 floats (one AVX-512 register, two AVX2, four SSE), loaded unaligned
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

#define SFX(name) name##_512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")
#include __FILE__
#pragma GCC pop_options
#undef SFX
#define SFX(name) name##_256
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include __FILE__
#pragma GCC pop_options
#undef SFX
#define SFX(name) name##_base
#include __FILE__
#undef SFX

static int level(void) {
  static int cached = -1;
  if (cached < 0) {
    __builtin_cpu_init();
    cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") ? 2
             : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
  }
  return cached;
}

#define DISPATCH(name, ...)                                   \
  switch (level()) {                                         \
    case 2: name##_512(__VA_ARGS__); break;                  \
    case 1: name##_256(__VA_ARGS__); break;                  \
    default: name##_base(__VA_ARGS__);                       \
  }

// x, delta, out: [n, hidden] row-major; delta NULL: no residual to add first.
void sd_add_rms_norm(float *x, const float *delta, const float *weight, float *out, int n,
                     int hidden, float eps) {
  DISPATCH(add_rms_norm, x, delta, weight, out, n, hidden, eps)
}

// One session's t new rows. qkv: [t, ld] with each row's (hq + 2 hkv) heads of d (queries, keys,
// values); cos, sin: [t, d / 2] of each row's position n0 + r (transformers' RoPE angles); kc, vc:
// this layer's cache, head h at position s at kc[h * head_stride + s * d], positions 0..n0
// already filled; window: keys within the last ``window`` positions (0: all); out: [t, hq * d].
void sd_attend(const float *qkv, int ld, int t, const float *cos, const float *sin, float *kc,
               float *vc, long head_stride, int n0, int window, float scale, int hq, int hkv,
               int d, float *out) {
  DISPATCH(attend, qkv, ld, t, cos, sin, kc, vc, head_stride, n0, window, scale, hq, hkv, d, out)
}

// gate_up: [n, 2 * inter] (gate, then up); out: [n, inter].
void sd_silu_mul(const float *gate_up, float *out, int n, int inter) {
  DISPATCH(silu_mul, gate_up, out, n, inter)
}

// smallm's products (smallm.c, built into the same library)
void sd_linear(const float *x, const float *wp, const float *bias, float *y, int M, int K,
               int N, int panel, int threads);
void sd_linear_q8(const float *x, const signed char *wq, const float *scale, const float *bias,
                  float *y, int M, int K, int N, int panel, int threads);
void sd_linear_g(const float *x, const signed char *wq, const float *dm, const float *bias,
                 float *y, int M, int K, int N, int panel, int threads);
void sd_linear_g4(const float *x, const unsigned char *wq, const float *dm, const float *bias,
                  float *y, int M, int K, int N, int panel, int threads);
int sd_linear_int(const float *x, const unsigned char *wq, const float *dm, const float *bias,
                  float *y, int M, int K, int N, int bits, int group, int panel, int threads);
// their pieces, for a team of threads already running (team_layers below)
void sd_panel_share(int panels, int t, int n, int *p0, int *p1);
void sd_linear_panels(const float *x, const void *wp, int bits, int group, const float *dm,
                      const float *scale, const float *bias, float *y, int M, int K, int N,
                      int panel, int p0, int p1);
void sd_linear_g16(const float *x, const signed char *wq, const float *dm, const float *bias,
                   float *y, int M, int K, int N, int panel, int threads);
void sd_quantize_rows(const float *x, int M, int K, int group, signed char *xq, float *dxs,
                      int *xsum);
void sd_linear_int_panels(const signed char *xq, const float *dxs, const int *xsum,
                          const unsigned char *wq, const float *dm, const float *bias, float *y,
                          int M, int K, int N, int bits, int group, int panel, int p0, int p1);

// One linear layer on smallm, its weight format's one descriptor (kernels.py's LinDesc builds
// it once per layer, for Linear's calls and for sd_layers alike): its packed panels, column
// scales (int8 weights) or groups' d and m (grouped codes; both NULL: float32), bias (or NULL),
// input and output widths, ``bits`` per stored weight (codes 4 or 8, int8 8, float32 32);
// ``integer``: the codes packed for intlinear.c's integer product (sd_linear_int); ``group``:
// 32, or 16 (Q6_K's codes).
typedef struct {
  const void *w;
  const float *scale, *bias;
  long k, n;
  const float *dm;
  long bits, integer;
  long group;  // weights per (d, m) along k: 32, or 16 (8-bit codes from Q6_K)
} sd_lin;

// One decoder layer: its norms' weights, its four linear layers, its attention window (0: all).
typedef struct {
  const float *attn_norm, *mlp_norm;
  sd_lin qkv, o, gate_up, down;
  long window;
} sd_layer;

// y = x W^T (+ bias) for the n rows of x: the one place a weight format picks its kernel.
// Returns 0, or -1 when the integer product's quantized rows could not be allocated.
int sd_lin_run(const sd_lin *l, const float *x, float *y, int n, int panel, int threads) {
  if (l->integer)
    return sd_linear_int(x, l->w, l->dm, l->bias, y, n, (int)l->k, (int)l->n, (int)l->bits,
                         (int)l->group, panel, threads);
  if (l->dm && l->bits == 4)
    sd_linear_g4(x, l->w, l->dm, l->bias, y, n, (int)l->k, (int)l->n, panel, threads);
  else if (l->dm && l->group == 16)
    sd_linear_g16(x, l->w, l->dm, l->bias, y, n, (int)l->k, (int)l->n, panel, threads);
  else if (l->dm)
    sd_linear_g(x, l->w, l->dm, l->bias, y, n, (int)l->k, (int)l->n, panel, threads);
  else if (l->scale)
    sd_linear_q8(x, l->w, l->scale, l->bias, y, n, (int)l->k, (int)l->n, panel, threads);
  else
    sd_linear(x, l->w, l->bias, y, n, (int)l->k, (int)l->n, panel, threads);
  return 0;
}

#ifdef _OPENMP
// A team's integer products share one quantization of each layer input.
typedef struct {
  signed char *xq;
  float *dxs;
  int *xsum;
} qrows;

// One linear layer by a running team: thread t of nt computes its share of the panels, the
// split of smallm.c's run() (all on thread 0 below 8 panels a thread), after one thread has
// quantized the rows for the integer product. Every thread returns once y is complete.
static void team_lin(const sd_lin *l, const float *x, float *y, int n, int panel, int t, int nt,
                     const qrows *q) {
  int panels = (int)((l->n + panel - 1) / panel), share = panels >= 8 * nt ? nt : 1;
  int p0 = 0, p1 = 0;
  if (t < share) sd_panel_share(panels, t, share, &p0, &p1);
  if (l->integer) {
#pragma omp single
    sd_quantize_rows(x, n, (int)l->k, (int)l->group, q->xq, q->dxs, q->xsum);
    sd_linear_int_panels(q->xq, q->dxs, q->xsum, l->w, l->dm, l->bias, y, n, (int)l->k,
                         (int)l->n, (int)l->bits, (int)l->group, panel, p0, p1);
  } else {
    sd_linear_panels(x, l->w, (int)l->bits, (int)l->group, l->dm, l->scale, l->bias, y, n,
                     (int)l->k, (int)l->n, panel, p0, p1);
  }
#pragma omp barrier
}

// sd_layers with its threads started once for the whole pass, not once per linear layer
// (~120 starts and joins a forward), and attention split between them by query head: the
// same functions on the same numbers, so every output is the same bits as sd_layers' one
// thread's (a column or a head is computed whole by whichever thread has it).
static int team_layers(float *x, int n, int hidden, const sd_layer *layers, int num_layers,
                       float eps, int sessions, const int *offsets, const int *lengths,
                       float *const *kcs, float *const *vcs, const long *layer_strides,
                       const long *head_strides, const float *cos, const float *sin,
                       float scale, int hq, int hkv, int d, int panel, int threads) {
  long ld = layers[0].qkv.n, inter = layers[0].down.k, half = d / 2;
  long kmax = hidden > inter ? hidden : inter;
  kmax = kmax > (long)hq * d ? kmax : (long)hq * d;
  float *h = malloc(sizeof(float) * n * (2 * hidden + ld + (long)hq * d + 3 * inter));
  long qblocks = kmax / 16;  // activation blocks a row, at most (blocks of 16 for Q6_K codes)
  char *qmem = malloc((size_t)n * kmax + (sizeof(float) * 2 + sizeof(int)) * n * qblocks);
  if (!h || !qmem) {
    free(h);
    free(qmem);
    return -1;
  }
  qrows q = {(signed char *)qmem + (sizeof(float) * 2 + sizeof(int)) * n * qblocks,
             (float *)qmem, (int *)(qmem + sizeof(float) * 2 * n * qblocks)};
  float *delta = h + (long)n * hidden, *qkv = delta + (long)n * hidden, *attn = qkv + n * ld;
  float *gate_up = attn + (long)n * hq * d, *act = gate_up + 2 * n * inter;
  int items = sessions * hq;  // (session, query head) pairs, split between the threads
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int first = (int)((long)items * t / nt), last = (int)((long)items * (t + 1) / nt);
    for (int li = 0; li < num_layers; li++) {
      const sd_layer *L = layers + li;
#pragma omp single
      sd_add_rms_norm(x, li ? delta : 0, L->attn_norm, h, n, hidden, eps);
      team_lin(&L->qkv, h, qkv, n, panel, t, nt, &q);
#pragma omp single
      for (int i = 0; i < sessions; i++) {
        int s = offsets[i];
        DISPATCH(attend_store, qkv + s * ld, (int)ld, offsets[i + 1] - s, cos + s * half,
                 sin + s * half, kcs[i] + li * layer_strides[i], vcs[i] + li * layer_strides[i],
                 head_strides[i], lengths[i], hq, hkv, d)
      }
      for (int i = 0; i < sessions; i++) {
        int h0 = first > i * hq ? first - i * hq : 0;
        int h1 = last < (i + 1) * hq ? last - i * hq : hq;
        if (h0 >= h1) continue;
        int s = offsets[i];
        DISPATCH(attend_heads, qkv + s * ld, (int)ld, offsets[i + 1] - s, cos + s * half,
                 sin + s * half, kcs[i] + li * layer_strides[i], vcs[i] + li * layer_strides[i],
                 head_strides[i], lengths[i], (int)L->window, scale, hq, hkv, d,
                 attn + (long)s * hq * d, h0, h1)
      }
#pragma omp barrier
      team_lin(&L->o, attn, delta, n, panel, t, nt, &q);
#pragma omp single
      sd_add_rms_norm(x, delta, L->mlp_norm, h, n, hidden, eps);
      team_lin(&L->gate_up, h, gate_up, n, panel, t, nt, &q);
#pragma omp single
      sd_silu_mul(gate_up, act, n, (int)inter);
      team_lin(&L->down, act, delta, n, panel, t, nt, &q);
    }
  }
  if (num_layers)
    for (long j = 0; j < (long)n * hidden; j++) x[j] += delta[j];
  free(h);
  free(qmem);
  return 0;
}
#endif

// Every decoder layer of a pass in one call: the engine's native path when all of a plain
// Llama block's linear layers run on smallm, the same ops in the same order as its per-layer
// Python loop (_native_block) without its ~45 us per layer of dispatch (1.4 ms of the int8
// draft's ~12.6 ms one-token forward on one EPYC core). x: [n, hidden], the embedded rows, in
// place to the last layer's output. Session i holds rows offsets[i]..offsets[i + 1], lengths[i]
// cached positions, its cache kcs[i] / vcs[i] with layer and head strides (in floats); cos,
// sin: [n, d / 2]. Returns 0, or -1 when scratch memory could not be allocated.
int sd_layers(float *x, int n, int hidden, const sd_layer *layers, int num_layers, float eps,
              int sessions, const int *offsets, const int *lengths, float *const *kcs,
              float *const *vcs, const long *layer_strides, const long *head_strides,
              const float *cos, const float *sin, float scale, int hq, int hkv, int d,
              int panel, int threads) {
#ifdef _OPENMP
  if (threads > 1)
    return team_layers(x, n, hidden, layers, num_layers, eps, sessions, offsets, lengths, kcs,
                       vcs, layer_strides, head_strides, cos, sin, scale, hq, hkv, d, panel,
                       threads);
#endif
  long ld = layers[0].qkv.n, inter = layers[0].down.k, half = d / 2;
  float *h = malloc(sizeof(float) * n * (2 * hidden + ld + (long)hq * d + 3 * inter));
  if (!h) return -1;
  float *delta = h + (long)n * hidden, *qkv = delta + (long)n * hidden, *attn = qkv + n * ld;
  float *gate_up = attn + (long)n * hq * d, *act = gate_up + 2 * n * inter;
  int status = 0;
  for (int li = 0; li < num_layers && !status; li++) {
    const sd_layer *L = layers + li;
    sd_add_rms_norm(x, li ? delta : 0, L->attn_norm, h, n, hidden, eps);
    status |= sd_lin_run(&L->qkv, h, qkv, n, panel, threads);
    for (int i = 0; i < sessions; i++) {
      int s = offsets[i];
      sd_attend(qkv + s * ld, (int)ld, offsets[i + 1] - s, cos + s * half, sin + s * half,
                kcs[i] + li * layer_strides[i], vcs[i] + li * layer_strides[i],
                head_strides[i], lengths[i], (int)L->window, scale, hq, hkv, d,
                attn + (long)s * hq * d);
    }
    status |= sd_lin_run(&L->o, attn, delta, n, panel, threads);
    sd_add_rms_norm(x, delta, L->mlp_norm, h, n, hidden, eps);
    status |= sd_lin_run(&L->gate_up, h, gate_up, n, panel, threads);
    sd_silu_mul(gate_up, act, n, (int)inter);
    status |= sd_lin_run(&L->down, act, delta, n, panel, threads);
  }
  if (num_layers && !status)
    for (long j = 0; j < (long)n * hidden; j++) x[j] += delta[j];
  free(h);
  return status ? -1 : 0;
}

#else  // the bodies, once per target

static inline float SFX(dot)(const float *a, const float *b, int n) {
  float acc[LANES] = {0};
  int j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += a[j + l] * b[j + l];
  float s = 0.0f;
  for (int l = 0; l < LANES; l++) s += acc[l];
  for (; j < n; j++) s += a[j] * b[j];
  return s;
}

// The dot product of rows of d = 16 j floats (a head's query and key): one vector of partial
// sums, halved down to one float; per key the generic dot's 16 scalar adds cost ~4x this.
static inline float SFX(dot16)(const float *a, const float *b, int d) {
  v16 acc = *(const v16 *)a * *(const v16 *)b;
  for (int j = 16; j < d; j += 16) acc += *(const v16 *)(a + j) * *(const v16 *)(b + j);
  v8 lo, hi;
  memcpy(&lo, &acc, 32);
  memcpy(&hi, (const char *)&acc + 32, 32);
  lo += hi;
  v4 a4, b4;
  memcpy(&a4, &lo, 16);
  memcpy(&b4, (const char *)&lo + 16, 16);
  a4 += b4;
  return (a4[0] + a4[2]) + (a4[1] + a4[3]);
}

// e^x, Cephes' expf (relative error < 2e-7 over its range), branch-free so that loops of it
// vectorise: x = m ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^m
// (x clamped to [-87, 88], where 2^m stays a normal float).
static inline float SFX(fexp)(float x) {
  x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
  // m = x / ln2 rounded to the nearest integer: adding and subtracting 1.5 * 2^23 rounds
  // (the default rounding mode) without a call that would stop the loop's vectorisation
  float m = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - m * 0.693359375f + m * 2.12194440e-4f;
  float z = r * r;
  float p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r +
              4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f;
  float y = p * z + r + 1.0f;
  union { int i; float f; } two_m = {((int)m + 127) << 23};
  return y * two_m.f;
}

static void SFX(add_rms_norm)(float *x, const float *delta, const float *weight, float *out,
                              int n, int hidden, float eps) {
  for (int r = 0; r < n; r++) {
    float *xr = x + (long)r * hidden;
    float *o = out + (long)r * hidden;
    if (delta) {
      const float *dr = delta + (long)r * hidden;
      for (int j = 0; j < hidden; j++) xr[j] += dr[j];
    }
    float inv = 1.0f / sqrtf(SFX(dot)(xr, xr, hidden) / (float)hidden + eps);
    for (int j = 0; j < hidden; j++) o[j] = weight[j] * (xr[j] * inv);
  }
}

// transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, halves (x1, x2).
static inline void SFX(rope)(const float *x, const float *cos, const float *sin, float *y,
                             int half) {
  for (int j = 0; j < half; j++) {
    float x1 = x[j], x2 = x[j + half];
    y[j] = x1 * cos[j] - x2 * sin[j];
    y[j + half] = x2 * cos[j] + x1 * sin[j];
  }
}

// The new keys (rotated) and values into the cache.
static void SFX(attend_store)(const float *qkv, int ld, int t, const float *cos,
                              const float *sin, float *kc, float *vc, long head_stride, int n0,
                              int hq, int hkv, int d) {
  int half = d / 2;
  for (int r = 0; r < t; r++) {
    const float *row = qkv + (long)r * ld;
    for (int h = 0; h < hkv; h++) {
      long at = h * head_stride + (long)(n0 + r) * d;
      SFX(rope)(row + (long)(hq + h) * d, cos + (long)r * half, sin + (long)r * half, kc + at,
                half);
      memcpy(vc + at, row + (long)(hq + hkv + h) * d, d * sizeof(float));
    }
  }
}

// Query heads [h0, h1) of every new row against the cache (its new keys already stored).
static void SFX(attend_heads)(const float *qkv, int ld, int t, const float *cos,
                              const float *sin, const float *kc, const float *vc,
                              long head_stride, int n0, int window, float scale, int hq,
                              int hkv, int d, float *out, int h0, int h1) {
  int half = d / 2, group = hq / hkv;
  float *scores = malloc(sizeof(float) * (n0 + t) + sizeof(float) * d);
  float *q = scores + n0 + t;
  for (int r = 0; r < t; r++) {
    int pos = n0 + r;
    int lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
    int len = pos + 1 - lo;
    for (int h = h0; h < h1; h++) {
      const float *kh = kc + (h / group) * head_stride + (long)lo * d;
      const float *vh = vc + (h / group) * head_stride + (long)lo * d;
      SFX(rope)(qkv + (long)r * ld + (long)h * d, cos + (long)r * half, sin + (long)r * half,
                q, half);
      float top = -INFINITY;
      if (d % 16 == 0)
        for (int s = 0; s < len; s++) scores[s] = SFX(dot16)(q, kh + (long)s * d, d) * scale;
      else
        for (int s = 0; s < len; s++) scores[s] = SFX(dot)(q, kh + (long)s * d, d) * scale;
      for (int s = 0; s < len; s++) top = scores[s] > top ? scores[s] : top;
      for (int s = 0; s < len; s++) scores[s] = SFX(fexp)(scores[s] - top);
      float acc[LANES] = {0};
      int s = 0;
      for (; s + LANES <= len; s += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += scores[s + l];
      float sum = 0.0f;
      for (int l = 0; l < LANES; l++) sum += acc[l];
      for (; s < len; s++) sum += scores[s];
      float inv = 1.0f / sum;
      float *o = out + (long)r * hq * d + (long)h * d;
      if (d % 16 == 0) {  // 16 output dims at a time, their sums held in a register
        for (int j = 0; j < d; j += 16) {
          v16 acc = {0};
          for (s = 0; s < len; s++) acc += scores[s] * *(const v16 *)(vh + (long)s * d + j);
          *(v16 *)(o + j) = acc * inv;
        }
        continue;
      }
      for (int j = 0; j < d; j++) o[j] = 0.0f;
      for (s = 0; s < len; s++) {
        float w = scores[s];
        const float *v = vh + (long)s * d;
        for (int j = 0; j < d; j++) o[j] += w * v[j];
      }
      for (int j = 0; j < d; j++) o[j] *= inv;
    }
  }
  free(scores);
}

static void SFX(attend)(const float *qkv, int ld, int t, const float *cos, const float *sin,
                        float *kc, float *vc, long head_stride, int n0, int window, float scale,
                        int hq, int hkv, int d, float *out) {
  SFX(attend_store)(qkv, ld, t, cos, sin, kc, vc, head_stride, n0, hq, hkv, d);
  SFX(attend_heads)(qkv, ld, t, cos, sin, kc, vc, head_stride, n0, window, scale, hq, hkv, d,
                    out, 0, hq);
}

static void SFX(silu_mul)(const float *gate_up, float *out, int n, int inter) {
  for (int r = 0; r < n; r++) {
    const float *g = gate_up + (long)r * 2 * inter, *u = g + inter;
    float *o = out + (long)r * inter;
    for (int j = 0; j < inter; j++) o[j] = g[j] / (1.0f + SFX(fexp)(-g[j])) * u[j];
  }
}

#endif
