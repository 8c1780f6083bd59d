/* JPEG windows and restart markers, with libjpeg-turbo.
 *
 * A plain C library (no Python API), loaded with ctypes by shards/jpeg.py; ctypes
 * releases the GIL for each call, so several threads work at once.
 *
 * feeder_jpeg_decode_window decodes one window of a JPEG, optionally at a reduced DCT
 * scale. Only the window's rows and columns go through the IDCT, upsampling and
 * colour conversion: rows above it are skipped (jpeg_skip_scanlines: entropy decoding
 * only), decoding stops after its last row, and columns outside it are cropped away
 * (jpeg_crop_scanline). libjpeg upsamples the edges of a cropped region as if they
 * were the image's edges, so the region keeps one iMCU column of margin on each side
 * of the window: the window's pixels are then exactly those of a full decode.
 *
 * Entropy decoding is sequential, so the rows above a window and the columns beside
 * it still cost their Huffman decoding, most of a decode's time. Not in a JPEG whose
 * restart intervals tile its MCU rows (feeder_jpeg_add_restarts writes them,
 * losslessly): each interval starts byte-aligned with its DC predictions reset, so
 * the intervals around the window, with one MCU of margin, make a smaller JPEG of
 * their own (sub_image) with exactly the same coefficients there, and only that is
 * decoded.
 */

#include <setjmp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

/* What feeder_jpeg_decode_window reports about the region it wrote. */
enum {
  INFO_ROWS,         /* rows written: the window's height at the decode scale */
  INFO_ROW_WIDTH,    /* pixels per written row (the cropped region, margins included) */
  INFO_LEFT,         /* column of the window's first pixel within a row */
  INFO_COLS,         /* the window's width at the decode scale */
  INFO_NEEDED,       /* bytes the region needs (set when the buffer was too small) */
  INFO_LEN
};

enum { OK = 0, FAILED = -1, TOO_SMALL = -2 };

struct error_manager {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  int ended_early;  /* libjpeg hit the end of the data and padded the image */
  int warnings;     /* corrupt-data warnings (bad codes, extraneous bytes, ...) */
  char warning[JMSG_LENGTH_MAX];  /* the first of them */
};

static void on_error(j_common_ptr info) {
  longjmp(((struct error_manager *)info->err)->jump, 1);
}

/* Warnings about corrupt entropy data or extraneous bytes are not errors here (the
 * sharder's decode check screens such files; a full decode accepts them too), but data
 * that ends before the image does is: libjpeg would pad the rest with grey. */
static void on_message(j_common_ptr info, int level) {
  struct error_manager *errors = (struct error_manager *)info->err;
  if (level >= 0) return;  /* trace messages */
  if (info->err->msg_code == JWRN_JPEG_EOF) errors->ended_early = 1;
  if (errors->warnings++ == 0) (*info->err->format_message)(info, errors->warning);
}

static int clamp(int value, int low, int high) {
  return value < low ? low : (value > high ? high : value);
}

static int decode_region(const unsigned char *data, size_t size, int x, int y, int width,
                         int height, int denom, unsigned char *out, size_t out_size, int *info,
                         char *error, int error_size) {
  struct jpeg_decompress_struct cinfo;
  struct error_manager errors;
  JSAMPROW *volatile rows = NULL;

  memset(info, 0, INFO_LEN * sizeof(int));
  cinfo.err = jpeg_std_error(&errors.pub);
  errors.pub.error_exit = on_error;
  errors.pub.emit_message = on_message;
  errors.ended_early = 0;
  errors.warnings = 0;
  if (setjmp(errors.jump)) {
    (*cinfo.err->format_message)((j_common_ptr)&cinfo, error);
    free(rows);
    jpeg_destroy_decompress(&cinfo);
    return FAILED;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, (unsigned long)size);
  jpeg_read_header(&cinfo, TRUE);
  cinfo.out_color_space = JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = (unsigned int)denom;
  jpeg_start_decompress(&cinfo);

  int full_w = (int)cinfo.output_width, full_h = (int)cinfo.output_height;
  int left = clamp(x / denom, 0, full_w - 1), top = clamp(y / denom, 0, full_h - 1);
  int cols = clamp((width + denom / 2) / denom, 1, full_w - left);
  int rows_n = clamp((height + denom / 2) / denom, 1, full_h - top);

  int margin = cinfo.max_h_samp_factor * cinfo.min_DCT_scaled_size;
  JDIMENSION region_x = (JDIMENSION)clamp(left - margin, 0, full_w);
  JDIMENSION region_w = (JDIMENSION)(clamp(left + cols + margin, 0, full_w) - (int)region_x);
  jpeg_crop_scanline(&cinfo, &region_x, &region_w);  /* widens to iMCU boundaries */

  size_t row_bytes = (size_t)region_w * 3;
  info[INFO_ROWS] = rows_n;
  info[INFO_ROW_WIDTH] = (int)region_w;
  info[INFO_LEFT] = left - (int)region_x;
  info[INFO_COLS] = cols;
  if (row_bytes * (size_t)rows_n > out_size) {
    info[INFO_NEEDED] = (int)(row_bytes * (size_t)rows_n);
    jpeg_destroy_decompress(&cinfo);
    return TOO_SMALL;
  }
  rows = malloc((size_t)rows_n * sizeof(JSAMPROW));
  if (rows == NULL) {
    snprintf(error, (size_t)error_size, "out of memory");
    jpeg_destroy_decompress(&cinfo);
    return FAILED;
  }
  for (int r = 0; r < rows_n; r++) rows[r] = out + (size_t)r * row_bytes;
  if (top > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)top) != (JDIMENSION)top) {
    snprintf(error, (size_t)error_size, "image ends above the window");
    free(rows);
    jpeg_destroy_decompress(&cinfo);
    return FAILED;
  }
  int done = 0;
  while (done < rows_n && !errors.ended_early) {
    JDIMENSION got = jpeg_read_scanlines(&cinfo, rows + done, (JDIMENSION)(rows_n - done));
    if (got == 0) break;
    done += (int)got;
  }
  free(rows);
  rows = NULL;
  jpeg_abort_decompress(&cinfo);  /* the rows below the window are never decoded */
  jpeg_destroy_decompress(&cinfo);
  if (done < rows_n || errors.ended_early) {
    snprintf(error, (size_t)error_size, "premature end of JPEG data (window rows %d..%d)", top, top + rows_n);
    return FAILED;
  }
  return OK;
}

/* ---- Restart intervals that tile the MCU rows ---------------------------------- */

static unsigned read16(const unsigned char *p) { return ((unsigned)p[0] << 8) | p[1]; }

/* Where a baseline, single-scan JPEG's parts are, from its markers. */
struct layout {
  size_t sof;        /* offset of the frame header's precision byte (height, width follow) */
  size_t scan;       /* offset of the first byte of entropy-coded data */
  int width, height;
  int mcu_w, mcu_h;  /* MCU size in pixels */
  int restart;       /* restart interval in MCUs (0: none) */
};

/* Fills layout for a sequential Huffman JPEG whose one scan holds every component;
 * returns 0 for anything else (progressive, several scans, no frame). */
static int parse_layout(const unsigned char *data, size_t size, struct layout *out) {
  size_t at = 2;
  int components = 0, h_max = 1, v_max = 1;
  memset(out, 0, sizeof(*out));
  if (size < 4 || data[0] != 0xFF || data[1] != 0xD8) return 0;
  while (at + 4 <= size) {
    if (data[at] != 0xFF) return 0;
    unsigned marker = data[at + 1];
    if (marker == 0xFF) { at++; continue; }  /* fill byte */
    unsigned length = read16(data + at + 2);
    if (length < 2 || at + 2 + length > size) return 0;
    const unsigned char *body = data + at + 4;
    if (marker == 0xC0 || marker == 0xC1) {  /* baseline or extended sequential, Huffman */
      if (length < 8) return 0;
      out->sof = at + 4;
      out->height = (int)read16(body + 1);
      out->width = (int)read16(body + 3);
      components = body[5];
      if (components < 1 || length < 8 + 3u * (unsigned)components) return 0;
      for (int c = 0; c < components; c++) {
        int h = body[6 + 3 * c + 1] >> 4, v = body[6 + 3 * c + 1] & 15;
        if (h > h_max) h_max = h;
        if (v > v_max) v_max = v;
      }
    } else if (marker >= 0xC2 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC) {
      return 0;  /* progressive, lossless, hierarchical or arithmetic: not tiled */
    } else if (marker == 0xDD) {
      if (length < 4) return 0;
      out->restart = (int)read16(body);
    } else if (marker == 0xDA) {
      if (length < 3 || out->sof == 0 || body[0] != components) return 0;  /* not a scan of every component */
      out->scan = at + 2 + length;
      break;
    }
    at += 2 + length;
  }
  if (out->scan == 0 || out->width == 0 || out->height == 0) return 0;
  /* A scan of one component has one block per MCU, whatever its sampling factors. */
  out->mcu_w = components == 1 ? 8 : 8 * h_max;
  out->mcu_h = components == 1 ? 8 : 8 * v_max;
  return 1;
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

/* A JPEG of the restart intervals around the window (x, y, width, height), with the
 * context its upsampling reads, into *sub (malloc'd; the caller frees it), and the offset of its first
 * pixel in the image. Returns 0 where the JPEG is not tiled by its restart intervals
 * or the intervals around the window are the whole image: decode it as it is. */
static int sub_image(const unsigned char *data, size_t size, int x, int y, int width, int height,
                     int denom, unsigned char **sub, size_t *sub_size, int *sub_x, int *sub_y) {
  struct layout l;
  if (!parse_layout(data, size, &l) || l.restart <= 0) return 0;
  int per_row = ceil_div(l.width, l.mcu_w), mcu_rows = ceil_div(l.height, l.mcu_h);
  if (per_row % l.restart != 0) return 0;  /* intervals straddle rows */
  int seg_per_row = per_row / l.restart;

  /* Upsampling reads one chroma sample beyond the window: 2 pixels, 2 * denom at a
   * reduced scale. */
  int context = 2 * denom;
  int c0 = (x - context) / l.mcu_w, c1 = ceil_div(x + width + context, l.mcu_w);
  int r0 = (y - context) / l.mcu_h, r1 = ceil_div(y + height + context, l.mcu_h);
  int s0 = (c0 < 0 ? 0 : c0) / l.restart, s1 = ceil_div(c1 > per_row ? per_row : c1, l.restart);
  if (r0 < 0) r0 = 0;
  if (r1 > mcu_rows) r1 = mcu_rows;
  /* libjpeg upsamples a component of 2 samples or fewer across without smoothing: keep
   * at least 2 MCUs each way, so a narrow last MCU (the image's edge) has company. */
  if ((s1 - s0) * l.restart < 2 && s0 > 0) s0--;
  if (r1 - r0 < 2 && r0 > 0) r0--;
  if (s0 == 0 && s1 == seg_per_row && r0 == 0 && r1 == mcu_rows) return 0;

  /* Interval i spans [starts[i], ends[i]); only those up to the last row used. */
  int needed = r1 * seg_per_row;
  size_t *starts = malloc(2 * (size_t)needed * sizeof(size_t));
  if (starts == NULL) return 0;
  size_t *ends = starts + needed;
  int found = 0;
  size_t at = l.scan;
  starts[0] = at;
  while (found < needed) {
    const unsigned char *ff = memchr(data + at, 0xFF, size - at);
    if (ff == NULL || (size_t)(ff - data) + 1 >= size) break;
    size_t p = (size_t)(ff - data);
    unsigned next = data[p + 1];
    if (next == 0x00 || next == 0xFF) { at = p + 1 + (next == 0x00); continue; }  /* stuffed, fill */
    ends[found++] = p;
    if (next < 0xD0 || next > 0xD7) break;  /* end of the scan */
    if ((int)next - 0xD0 != (found - 1) % 8) break;  /* not the marker due here */
    if (found < needed) starts[found] = p + 2;
    at = p + 2;
  }
  if (found < needed) {
    free(starts);
    return 0;  /* not the intervals the header promised */
  }

  size_t total = l.scan + 2;
  for (int r = r0; r < r1; r++)
    for (int s = s0; s < s1; s++) total += ends[r * seg_per_row + s] - starts[r * seg_per_row + s] + 2;
  unsigned char *out = malloc(total);
  if (out == NULL) {
    free(starts);
    return 0;
  }
  memcpy(out, data, l.scan);
  int left = s0 * l.restart * l.mcu_w, top = r0 * l.mcu_h;
  int right = s1 * l.restart * l.mcu_w, bottom = r1 * l.mcu_h;
  int sub_w = (right > l.width ? l.width : right) - left;
  int sub_h = (bottom > l.height ? l.height : bottom) - top;
  out[l.sof + 1] = (unsigned char)(sub_h >> 8);
  out[l.sof + 2] = (unsigned char)(sub_h & 0xFF);
  out[l.sof + 3] = (unsigned char)(sub_w >> 8);
  out[l.sof + 4] = (unsigned char)(sub_w & 0xFF);
  size_t o = l.scan;
  int written = 0, count = (r1 - r0) * (s1 - s0);
  for (int r = r0; r < r1; r++) {
    for (int s = s0; s < s1; s++) {
      int i = r * seg_per_row + s;
      memcpy(out + o, data + starts[i], ends[i] - starts[i]);
      o += ends[i] - starts[i];
      out[o++] = 0xFF;
      out[o++] = ++written == count ? 0xD9 : (unsigned char)(0xD0 + (written - 1) % 8);
    }
  }
  free(starts);
  *sub = out;
  *sub_size = o;
  *sub_x = left;
  *sub_y = top;
  return 1;
}

/* Decode the window (x, y, width, height), in the image's pixels, at scale 1/denom
 * (1, 2, 4 or 8), as RGB rows of info[INFO_ROW_WIDTH] pixels into out (capacity
 * out_size bytes). Returns OK; TOO_SMALL with info[INFO_NEEDED] set; or FAILED with
 * libjpeg's message in error (error_size bytes). */
int feeder_jpeg_decode_window(const unsigned char *data, size_t size, int x, int y, int width,
                              int height, int denom, unsigned char *out, size_t out_size,
                              int *info, char *error, int error_size) {
  unsigned char *sub = NULL;
  size_t sub_size = 0;
  int sub_x = 0, sub_y = 0;
  if (x >= 0 && y >= 0 && width > 0 && height > 0 &&
      sub_image(data, size, x, y, width, height, denom, &sub, &sub_size, &sub_x, &sub_y)) {
    int code = decode_region(sub, sub_size, x - sub_x, y - sub_y, width, height, denom, out, out_size,
                             info, error, error_size);
    free(sub);
    return code;
  }
  return decode_region(data, size, x, y, width, height, denom, out, out_size, info, error, error_size);
}

/* The restart interval, in MCUs, that tiles rows of per_row MCUs: the largest divisor
 * of per_row up to wanted. Exported for encoders that write restart markers
 * themselves (the sharder's half-scale copies). */
static int tiling_interval(int per_row, int wanted) {
  for (int k = wanted; k > 1; k--)
    if (per_row % k == 0) return k;
  return 1;
}

int feeder_jpeg_tiling_interval(int per_row, int wanted) { return tiling_interval(per_row, wanted); }

static int is_app(jpeg_saved_marker_ptr marker, int n, const char *name, unsigned length) {
  return marker->marker == JPEG_APP0 + n && marker->data_length >= length &&
         memcmp(marker->data, name, length) == 0;
}

/* Rewrite a JPEG, losslessly (the same DCT coefficients, so the same pixels), as a
 * sequential Huffman JPEG with optimised tables and a restart marker every k MCUs,
 * k the largest divisor of an MCU row's length up to wanted_interval, so intervals
 * tile the rows. APPn and COM markers are kept. On OK, *out (size *out_size) is
 * malloc'd by libjpeg: release it with feeder_jpeg_free; *warnings counts the
 * corrupt-data warnings libjpeg gave while reading every coefficient (the entropy
 * decoding of the whole image), the first of them in error. */
int feeder_jpeg_add_restarts(const unsigned char *data, size_t size, int wanted_interval,
                             unsigned char **out, unsigned long *out_size, int *warnings,
                             char *error, int error_size) {
  struct jpeg_decompress_struct src;
  struct jpeg_compress_struct dst;
  struct error_manager errors;
  volatile int compressing = 0;

  *out = NULL;
  *out_size = 0;
  *warnings = 0;
  src.err = jpeg_std_error(&errors.pub);
  dst.err = &errors.pub;
  errors.pub.error_exit = on_error;
  errors.pub.emit_message = on_message;
  errors.ended_early = 0;
  errors.warnings = 0;
  if (setjmp(errors.jump)) {
    (*errors.pub.format_message)((j_common_ptr)&src, error);
    /* Reading fails before the output exists; writing valid coefficients fails only
     * out of memory, and then libjpeg's output buffer may have moved: left alone. */
    if (compressing) jpeg_destroy_compress(&dst);
    jpeg_destroy_decompress(&src);
    *out = NULL;
    return FAILED;
  }
  jpeg_create_decompress(&src);
  jpeg_mem_src(&src, data, (unsigned long)size);
  for (int n = 0; n < 16; n++) jpeg_save_markers(&src, JPEG_APP0 + n, 0xFFFF);
  jpeg_save_markers(&src, JPEG_COM, 0xFFFF);
  jpeg_read_header(&src, TRUE);
  jvirt_barray_ptr *coefficients = jpeg_read_coefficients(&src);
  if (errors.ended_early) {
    snprintf(error, (size_t)error_size, "premature end of JPEG data");
    jpeg_destroy_decompress(&src);
    return FAILED;
  }
  *warnings = errors.warnings;
  if (errors.warnings) snprintf(error, (size_t)error_size, "%s", errors.warning);
  jpeg_create_compress(&dst);
  compressing = 1;
  jpeg_copy_critical_parameters(&src, &dst);
  dst.optimize_coding = TRUE;
  int h_max = 1;
  for (int c = 0; c < dst.num_components; c++)
    if (dst.comp_info[c].h_samp_factor > h_max) h_max = dst.comp_info[c].h_samp_factor;
  int mcu_w = dst.num_components == 1 ? 8 : 8 * h_max;
  dst.restart_interval = (unsigned)tiling_interval(ceil_div((int)dst.image_width, mcu_w), wanted_interval);
  jpeg_mem_dest(&dst, out, out_size);
  jpeg_write_coefficients(&dst, coefficients);
  for (jpeg_saved_marker_ptr m = src.marker_list; m != NULL; m = m->next) {
    if (dst.write_JFIF_header && is_app(m, 0, "JFIF", 5)) continue;  /* written already */
    if (dst.write_Adobe_marker && is_app(m, 14, "Adobe", 5)) continue;
    jpeg_write_marker(&dst, m->marker, m->data, m->data_length);
  }
  jpeg_finish_compress(&dst);
  jpeg_destroy_compress(&dst);
  jpeg_destroy_decompress(&src);  /* whatever follows the scan is not read */
  return OK;
}

void feeder_jpeg_free(void *pointer) { free(pointer); }
