/* Bilinear resizes of many RGB windows in one call, with the GIL released throughout.
 *
 * A plain C library (no Python API), loaded with ctypes by decode/resize.py. OpenCV's
 * resize releases the GIL too, but only for one image: each call takes it back, and
 * with several threads taking turns a worker spends about a third of its time in that
 * call waiting for it (docs/performance.md, Decoded cache). Here a batch's windows are
 * resized, and mirrored where asked, by one call on each thread, the calls taking the
 * next window from a shared counter until none is left.
 *
 * The filter is OpenCV's INTER_LINEAR (tf.data's resize(bilinear), torch's
 * interpolate(antialias=False)): half-pixel centres, source coordinates clamped to
 * the window. It is separable: each source row the output needs is resized across
 * once (kept while consecutive output rows use it), then pairs of such rows are
 * blended down. Fixed point: horizontal weights of 11 bits, the across pass kept at
 * 7 fractional bits in int16, vertical weights of 14 bits with rounding products
 * (SSSE3's pmulhrsw); within 1 level of an exact float resize. A mirrored output is
 * the same resize with its column table reversed, so it costs nothing more.
 *
 * The SSSE3 path and the portable one compute the same integers: a window resized
 * either way is byte-for-byte the same (tests/feeder/test_resize.py).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

/* One window to resize: its first pixel, its rows' stride and its size; the output, a
 * contiguous dst_height x dst_width x 3 array; and whether to mirror it left-right. */
struct feeder_resize_item {
  const uint8_t *src;
  int64_t src_stride;
  int32_t width, height;
  uint8_t *dst;
  int32_t dst_width, dst_height;
  int32_t flip;
  int32_t pad_;
};

enum { H_BITS = 11, H_SHIFT = 4, V_BITS = 14, OUT_SHIFT = 6 };
enum { OK = 0, FAILED = -1 };

/* Where output column or row i reads from: index of the first source pixel, and the
 * weights of it and the next (summing to 1 << bits). */
static void coordinates(int src_size, int dst_size, int bits, int32_t *first, int16_t *w0, int16_t *w1) {
  double scale = (double)src_size / dst_size;
  int one = 1 << bits;
  for (int i = 0; i < dst_size; i++) {
    double at = (i + 0.5) * scale - 0.5;
    if (at < 0) at = 0;
    int s = (int)floor(at);
    double f = at - s;
    if (s >= src_size - 1) {
      s = src_size - 1;
      f = 0;
    }
    int weight = (int)lrint(f * one);
    first[i] = s;
    w1[i] = (int16_t)weight;
    w0[i] = (int16_t)(one - weight);
  }
}

/* Rounding product of pmulhrsw: (a * b + 2^14) >> 15. */
static inline int mulhrs(int a, int b) { return (a * b + (1 << 14)) >> 15; }

static void across_portable(const uint8_t *row, int width, const int32_t *xs, const int16_t *w0,
                            const int16_t *w1, int n, int16_t *out) {
  for (int i = 0; i < n; i++) {
    const uint8_t *p = row + 3 * xs[i];
    const uint8_t *q = xs[i] + 1 < width ? p + 3 : p;
    for (int c = 0; c < 3; c++)
      out[3 * i + c] = (int16_t)((p[c] * w0[i] + q[c] * w1[i] + (1 << (H_SHIFT - 1))) >> H_SHIFT);
  }
}

static void down_portable(const int16_t *a, const int16_t *b, int b0, int b1, int n, uint8_t *out) {
  for (int i = 0; i < n; i++) {
    int v = (mulhrs(a[i], b0) + mulhrs(b[i], b1) + (1 << (OUT_SHIFT - 1))) >> OUT_SHIFT;
    out[i] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
  }
}

#if HAVE_X86
/* Per output pixel: its two source pixels' 6 bytes as [R0 R1 G0 G1 B0 B1 0 0] in int16
 * (one pshufb), times [w0 w1 w0 w1 w0 w1 0 0] summed in pairs (pmaddwd): R, G, B. */
__attribute__((target("ssse3"))) static void across_ssse3(const uint8_t *row, int width, const int32_t *xs,
                                                         const __m128i *weights, const int16_t *w0,
                                                         const int16_t *w1, int n, int16_t *out) {
  const __m128i pairs = _mm_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
  const __m128i half = _mm_set1_epi32(1 << (H_SHIFT - 1));
  int readable = 3 * width - 8; /* the last byte offset an 8-byte load may start at */
  int i = 0;
  for (; i + 1 < n; i += 2) {
    int at0 = 3 * xs[i], at1 = 3 * xs[i + 1];
    if (at0 > readable || at1 > readable) {
      across_portable(row, width, xs + i, w0 + i, w1 + i, 2, out + 3 * i);
      continue;
    }
    __m128i p0 = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(row + at0)), pairs);
    __m128i p1 = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(row + at1)), pairs);
    __m128i s0 = _mm_srai_epi32(_mm_add_epi32(_mm_madd_epi16(p0, weights[i]), half), H_SHIFT);
    __m128i s1 = _mm_srai_epi32(_mm_add_epi32(_mm_madd_epi16(p1, weights[i + 1]), half), H_SHIFT);
    __m128i both = _mm_packs_epi32(s0, s1); /* [R G B 0 | R G B 0] */
    _mm_storel_epi64((__m128i *)(out + 3 * i), both);
    _mm_storeh_pd((double *)(out + 3 * i + 3), _mm_castsi128_pd(both));
  }
  if (i < n) across_portable(row, width, xs + i, w0 + i, w1 + i, n - i, out + 3 * i);
}

__attribute__((target("ssse3"))) static void down_ssse3(const int16_t *a, const int16_t *b, int b0, int b1, int n,
                                                       uint8_t *out) {
  const __m128i wa = _mm_set1_epi16((int16_t)b0), wb = _mm_set1_epi16((int16_t)b1);
  const __m128i half = _mm_set1_epi16(1 << (OUT_SHIFT - 1));
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i lo = _mm_add_epi16(_mm_mulhrs_epi16(_mm_loadu_si128((const __m128i *)(a + i)), wa),
                               _mm_mulhrs_epi16(_mm_loadu_si128((const __m128i *)(b + i)), wb));
    __m128i hi = _mm_add_epi16(_mm_mulhrs_epi16(_mm_loadu_si128((const __m128i *)(a + i + 8)), wa),
                               _mm_mulhrs_epi16(_mm_loadu_si128((const __m128i *)(b + i + 8)), wb));
    lo = _mm_srai_epi16(_mm_add_epi16(lo, half), OUT_SHIFT);
    hi = _mm_srai_epi16(_mm_add_epi16(hi, half), OUT_SHIFT);
    _mm_storeu_si128((__m128i *)(out + i), _mm_packus_epi16(lo, hi));
  }
  if (i < n) down_portable(a + i, b + i, b0, b1, n - i, out + i);
}

static int have_ssse3(void) {
  static int known = -1;
  if (known < 0) known = __builtin_cpu_supports("ssse3") ? 1 : 0;
  return known;
}
#endif

int feeder_resize_simd(void) {
#if HAVE_X86
  return have_ssse3();
#else
  return 0;
#endif
}

/* Source row y of item resized across into out. */
static void across(const struct feeder_resize_item *item, const int32_t *xs, const int16_t *packed,
                   const int16_t *w0, const int16_t *w1, int y, int16_t *out, int simd) {
  const uint8_t *row = item->src + (int64_t)y * item->src_stride;
#if HAVE_X86
  if (simd) {
    across_ssse3(row, item->width, xs, (const __m128i *)packed, w0, w1, item->dst_width, out);
    return;
  }
#else
  (void)packed;
  (void)simd;
#endif
  across_portable(row, item->width, xs, w0, w1, item->dst_width, out);
}

static int resize_one(const struct feeder_resize_item *item, int simd) {
  int w = item->width, h = item->height, dw = item->dst_width, dh = item->dst_height;
  if (w < 1 || h < 1 || dw < 1 || dh < 1) return FAILED;
  int lanes = 3 * dw;
  /* One allocation: column table (and its pmaddwd weights), row table, two rows. */
  size_t bytes = 16 * (size_t)dw + 16 + 4 * (size_t)dw + 4 * (size_t)dw + 8 * (size_t)dh + 2 * (2 * (size_t)lanes + 16);
  uint8_t *memory = malloc(bytes);
  if (memory == NULL) return FAILED;
  uintptr_t aligned = ((uintptr_t)memory + 15) & ~(uintptr_t)15;
  int16_t *packed = (int16_t *)aligned;      /* dw x 8 int16 */
  int32_t *xs = (int32_t *)(packed + 8 * (size_t)dw);
  int16_t *xw0 = (int16_t *)(xs + dw), *xw1 = xw0 + dw;
  int32_t *ys = (int32_t *)(xw1 + dw);
  int16_t *yw0 = (int16_t *)(ys + dh), *yw1 = yw0 + dh;
  int16_t *rows[2] = {yw1 + dh, yw1 + dh + lanes + 8};
  int tags[2] = {-1, -1};

  coordinates(w, dw, H_BITS, xs, xw0, xw1);
  coordinates(h, dh, V_BITS, ys, yw0, yw1);
  if (item->flip) {
    for (int i = 0, j = dw - 1; i < j; i++, j--) {
      int32_t x = xs[i]; xs[i] = xs[j]; xs[j] = x;
      int16_t a = xw0[i]; xw0[i] = xw0[j]; xw0[j] = a;
      int16_t b = xw1[i]; xw1[i] = xw1[j]; xw1[j] = b;
    }
  }
  for (int i = 0; i < dw; i++) {
    int16_t *p = packed + 8 * (size_t)i;
    p[0] = p[2] = p[4] = xw0[i];
    p[1] = p[3] = p[5] = xw1[i];
    p[6] = p[7] = 0;
  }

  for (int y = 0; y < dh; y++) {
    int a = ys[y], b = a + 1 < h ? a + 1 : a;
    int sa = tags[0] == a ? 0 : (tags[1] == a ? 1 : -1);
    if (sa < 0) {
      sa = tags[0] == b ? 1 : 0; /* not the slot holding the other row */
      across(item, xs, packed, xw0, xw1, a, rows[sa], simd);
      tags[sa] = a;
    }
    int sb = tags[sa] == b ? sa : (tags[1 - sa] == b ? 1 - sa : -1);
    if (sb < 0) {
      sb = 1 - sa;
      across(item, xs, packed, xw0, xw1, b, rows[sb], simd);
      tags[sb] = b;
    }
    int16_t *got[2] = {rows[sa], rows[sb]};
    uint8_t *out = item->dst + (size_t)y * lanes;
#if HAVE_X86
    if (simd)
      down_ssse3(got[0], got[1], yw0[y], yw1[y], lanes, out);
    else
#endif
      down_portable(got[0], got[1], yw0[y], yw1[y], lanes, out);
  }
  free(memory);
  return OK;
}

/* Resize items of items[0 .. count-1] until none is left, each call claiming the next
 * one from *next (shared by the calls working on the list at once, each on a thread of
 * its own); SIMD where allow_simd and the CPU has it. An item that cannot be resized (a
 * size below 1, out of memory) is left unwritten, and the first to fail sets *failed
 * (-1 before) to its index. Returns how many this call resized. */
int feeder_resize_linear(const struct feeder_resize_item *items, int count, int *next, int *failed,
                         int allow_simd) {
  int simd = allow_simd && feeder_resize_simd();
  int done = 0;
  for (;;) {
    int i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
    if (i >= count) break;
    if (resize_one(&items[i], simd) != OK) {
      int none = -1;
      __atomic_compare_exchange_n(failed, &none, i, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
      continue;
    }
    done++;
  }
  return done;
}
