// The memory access patterns of the logits-level steps, timed alone on this machine: a plain
// `memcpy` (the bench's older floor, `bench/copy_gbps`), a pass that reads every line and writes it
// back (`fused-inplace`'s traffic), a read with streaming stores into a second buffer (`fused`'s),
// and a read alone; two threads, buffers of the N=1024 bf16 logits' size (311 MB), best of eight.
// docs/BENCHMARKS.md, "The floor of each logits-level step, measured as its own traffic".
//   gcc -O2 -mavx512f -mavx512bw -pthread bench/tools/access_patterns.c -o /tmp/access_patterns
//   /tmp/access_patterns [HUGE]   (HUGE 1, the default: the buffers advised onto huge pages; 0: not)
// Prints each pattern's best time and rate, and the process's AnonHugePages.
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static const size_t N = 311164928u;
static char *src, *dst;
static int mode;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *part(void *arg) {
  long i = (long)arg;
  size_t h = N / 2, lo = i * h, hi = lo + h;
  if (mode == 0) {
    memcpy(dst + lo, src + lo, h);
  } else if (mode == 1) {
    __m512i one = _mm512_set1_epi16(1);
    for (size_t k = lo; k < hi; k += 64)
      _mm512_store_si512((void *)(src + k), _mm512_add_epi16(_mm512_load_si512((void *)(src + k)), one));
  } else if (mode == 2) {
    for (size_t k = lo; k < hi; k += 64) _mm512_stream_si512((void *)(dst + k), _mm512_load_si512((void *)(src + k)));
    _mm_sfence();
  } else {
    __m512i acc = _mm512_setzero_si512();
    for (size_t k = lo; k < hi; k += 64) acc = _mm512_add_epi16(acc, _mm512_load_si512((void *)(src + k)));
    volatile int sink = _mm512_reduce_add_epi32(acc);
    (void)sink;
  }
  return 0;
}

static char *buffer(int huge) {
  char *p = mmap(0, N, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (huge) madvise(p, N, MADV_HUGEPAGE);
  return p;
}

int main(int argc, char **argv) {
  int huge = argc > 1 ? atoi(argv[1]) : 1;
  src = buffer(huge);
  dst = buffer(huge);
  memset(src, 1, N);
  memset(dst, 0, N);
  const char *names[] = {"memcpy", "in-place rw", "nt-copy", "read-only"};
  for (mode = 0; mode < 4; mode++) {
    double best = 1e9;
    for (int r = 0; r < 8; r++) {
      double t = now();
      pthread_t th[2];
      for (long i = 0; i < 2; i++) pthread_create(&th[i], 0, part, (void *)i);
      for (int i = 0; i < 2; i++) pthread_join(th[i], 0);
      t = now() - t;
      if (t < best) best = t;
    }
    printf("%-12s %.2f ms  (%.1f GB/s counting %s)\n", names[mode], best * 1e3, (mode == 3 ? 1.0 : 2.0) * N / best / 1e9,
           mode == 3 ? "the read" : "read + write");
  }
  FILE *f = fopen("/proc/self/smaps_rollup", "r");
  char line[256];
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, "AnonHuge", 8)) fputs(line, stdout);
  if (f) fclose(f);
  return 0;
}
