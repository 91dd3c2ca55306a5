/* Exercises libtms_hook.so (preloaded) on the simulator, through either vendor API and in any of
 * the three loading styles (see vendor.h). The tms_* API is found at run time in the preloaded
 * library. Usage: hook_consumer MODE API [ARGS]   (API: cuda | acl) */
#define _GNU_SOURCE
#include "vendor.h"
#include "tms.h"
#include <dlfcn.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MiB (1024ULL * 1024ULL)
#define EXPECT(expr, want)                                                                      \
  do {                                                                                          \
    long long _r = (long long)(expr), _w = (long long)(want);                                   \
    if (_r != _w) {                                                                             \
      fprintf(stderr, "%s:%d: %s = %lld, want %lld\n", __FILE__, __LINE__, #expr, _r, _w);      \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

static void *tms_sym(const char *name) {
  void *f = dlsym(RTLD_DEFAULT, name);
  if (!f) {
    fprintf(stderr, "%s not found: is libtms_hook.so preloaded?\n", name);
    exit(92);
  }
  return f;
}
#define TMS(f) ((__typeof__(&f))tms_sym(#f))

struct sim_stats {
  uint32_t device_count, pad;
  uint64_t capacity, device_used[16], process_used[16];
  uint64_t host_resident_bytes, live_handles, live_mappings, reservations, plain_allocations,
      pinned_host_bytes;
};

/* Whether the program runs on tms-sim (its introspection answers); on a real device (the hardware
 * kit) the checks that need it are left out and everything else runs the same. */
static int on_simulator(void) {
  void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (!h) h = dlopen("libascendcl.so", RTLD_LAZY | RTLD_NOLOAD);
  return h && dlsym(h, "tms_sim_stats") != NULL;
}

/* A device's free-memory figure against the bytes a pause or resume moved: exact on the
 * simulator; on a real device the driver's own bookkeeping (page tables, its pools) moves the
 * figure by up to DRIVER_SLACK as well, so a difference that small is reported, not failed. */
#define DRIVER_SLACK (4 * MiB)
#define EXPECT_FREE(expr, want)                                                                 \
  do {                                                                                          \
    long long _r = (long long)(expr), _w = (long long)(want), _d = _r - _w;                     \
    if (_d != 0 && (on_simulator() || _d > (long long)DRIVER_SLACK || -_d > (long long)DRIVER_SLACK)) { \
      fprintf(stderr, "%s:%d: %s = %lld, want %lld\n", __FILE__, __LINE__, #expr, _r, _w);      \
      exit(1);                                                                                  \
    }                                                                                           \
    if (_d != 0)                                                                                \
      fprintf(stderr, "%s:%d: %s = %lld, want %lld (off by %lld: the driver's own bookkeeping)\n", \
              __FILE__, __LINE__, #expr, _r, _w, _d);                                           \
  } while (0)

static void sim_stats(struct sim_stats *s) {
  void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  int (*f)(struct sim_stats *) = h ? (int (*)(struct sim_stats *))dlsym(h, "tms_sim_stats") : NULL;
  if (!f || f(s) != 0) { fprintf(stderr, "tms_sim_stats unavailable\n"); exit(93); }
}

static void sim_faults(const char *spec) {
  void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  int (*f)(const char *) = h ? (int (*)(const char *))dlsym(h, "tms_sim_set_faults") : NULL;
  if (!f || f(spec) != 0) { fprintf(stderr, "tms_sim_set_faults(%s) failed\n", spec); exit(93); }
}

/* ---- one vendor-neutral device interface ---------------------------------------------------- */
static int use_acl;
static int OOM, ILLEGAL;

static void dev_init(const char *api) {
  use_acl = strcmp(api, "acl") == 0;
  /* TMS_TEST_DEVICE: the one device this process uses (default 0). */
  int device = getenv("TMS_TEST_DEVICE") ? atoi(getenv("TMS_TEST_DEVICE")) : 0;
  if (use_acl) {
    EXPECT(ACL(aclInit)(NULL), 0);
    EXPECT(ACL(aclrtSetDevice)(device), 0);
    OOM = 207001;
    ILLEGAL = 107000;
  } else {
    EXPECT(CUDART(cudaSetDevice)(device), 0);
    OOM = 2;
    ILLEGAL = 700;
  }
}

static void dev_thread_init(void) {
  if (use_acl) EXPECT(ACL(aclrtSetDevice)(0), 0);
}

/* ACL: huge pages only (policy 1), so an injected out-of-memory is not answered by the huge-first
 * fallback to normal pages (acl-policies tests the policies themselves). */
static int dev_malloc(void **p, size_t n) {
  return use_acl ? ACL(aclrtMallocAlign32)(p, n, 1) : CUDART(cudaMalloc)(p, n);
}
static int dev_free(void *p) { return use_acl ? ACL(aclrtFree)(p) : CUDART(cudaFree)(p); }
static int dev_write(void *dst, const void *src, size_t n) {
  return use_acl ? ACL(aclrtMemcpy)(dst, n, src, n, 1) : CUDART(cudaMemcpy)(dst, src, n, 1);
}
static int dev_read(void *dst, const void *src, size_t n) {
  return use_acl ? ACL(aclrtMemcpy)(dst, n, src, n, 2) : CUDART(cudaMemcpy)(dst, src, n, 2);
}
/* The device memory the hook's copy streams take, made with its first region allocation on a
 * device and kept: the simulator's figure for a process's first CUDA streams (tms-sim
 * STREAM_POOL_BYTES, measured on an H200); ACL streams take none there. On a real device the
 * figure is the driver's, within DRIVER_SLACK. */
static size_t hook_stream_bytes(void) { return on_simulator() && !use_acl ? 2 * MiB : 0; }

static size_t dev_free_mem(void) {
  size_t f = 0, t = 0;
  if (use_acl) ACL(aclrtGetMemInfo)(1, &f, &t); else CUDART(cudaMemGetInfo)(&f, &t);
  return f;
}

static void region(const char *tag, int backup) {
  TMS(tms_set_current_tag)(tag);
  TMS(tms_set_interesting_region)(true);
  TMS(tms_set_enable_cpu_backup)(backup != 0);
}
static void no_region(void) { TMS(tms_set_interesting_region)(false); }

static uint64_t checksum(const unsigned char *p, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}
/* Every byte depends on its whole offset (no period), so bytes restored to the wrong place, even
 * a whole piece or chunk off, change the checksum. */
static void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) {
    uint64_t x = ((uint64_t)i + 1) * 0x9E3779B97F4A7C15ULL;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ULL;
    p[i] = (unsigned char)(x >> 56) ^ (unsigned char)seed;
  }
}
static uint64_t dev_checksum(void *d, size_t n) {
  unsigned char *h = malloc(n);
  EXPECT(dev_read(h, d, n), 0);
  uint64_t c = checksum(h, n);
  free(h);
  return c;
}
static void dev_fill(void *d, size_t n, unsigned seed) {
  unsigned char *h = malloc(n);
  fill(h, n, seed);
  EXPECT(dev_write(d, h, n), 0);
  free(h);
}

static const size_t sizes[] = {8 * MiB, 3 * MiB + 5, 64 * 1024};
static const size_t rounded[] = {8 * MiB, 4 * MiB, 2 * MiB};
#define NALLOC 3

/* Region allocations pause (free memory rises by the rounded sizes), resume at the same
 * addresses, and hold the same bytes through `cycles` cycles with backup. */
static int cycle(long cycles) {
  void *p[NALLOC];
  uint64_t sum[NALLOC];
  size_t total = 0;
  size_t free0 = dev_free_mem();
  region("weights", 1);
  for (int i = 0; i < NALLOC; i++) {
    EXPECT(dev_malloc(&p[i], sizes[i]), 0);
    dev_fill(p[i], sizes[i], (unsigned)i + 1);
    sum[i] = dev_checksum(p[i], sizes[i]);
    total += rounded[i];
  }
  /* Outside the region: passthrough, never paused. */
  no_region();
  void *plain;
  EXPECT(dev_malloc(&plain, 1 * MiB), 0);
  dev_fill(plain, 1 * MiB, 99);
  uint64_t plain_sum = dev_checksum(plain, 1 * MiB);
  size_t free1 = dev_free_mem();
  EXPECT(free0 - free1 >= total, 1);
  for (long c = 0; c < cycles; c++) {
    tms_report r;
    memset(&r, 0xff, sizeof r);
    EXPECT(TMS(tms_pause_report)("weights", &r), 0);
    EXPECT(r.error, 0);
    EXPECT(r.allocations_done, NALLOC);
    EXPECT(r.bytes_done, total);
    EXPECT_FREE(r.device_free_after - r.device_free_before, total);
    EXPECT_FREE(dev_free_mem() - free1, total);
    if (c == 0) {
      /* Paused memory is not there. On CUDA touching it is a sticky fault that ends the context
       * (sim::a_device_fault_is_sticky); the Ascend runtime reports it per call. */
      if (use_acl) {
        unsigned char b;
        EXPECT(dev_read(&b, p[0], 1), ILLEGAL);
      }
      EXPECT(TMS(tms_pause_report)("weights", &r), 0); /* idempotent */
      EXPECT(r.allocations_done, 0);
      EXPECT(r.allocations_skipped, NALLOC);
      tms_tag_status st[4];
      size_t n = 0;
      EXPECT(TMS(tms_status)(st, 4, &n), 0);
      EXPECT(n, 1);
      EXPECT(strcmp(st[0].tag, "weights"), 0);
      EXPECT(st[0].allocations_paused, NALLOC);
      EXPECT(st[0].bytes_paused, total);
      uint8_t *bp = TMS(tms_get_cpu_backup_pointer)((const uint8_t *)p[0], 16);
      EXPECT(bp != NULL, 1);
      unsigned char expect[16];
      fill(expect, 16, 1);
      EXPECT(memcmp(bp, expect, 16), 0);
    }
    EXPECT(TMS(tms_resume_report)("weights", &r), 0);
    EXPECT(r.allocations_done, NALLOC);
    EXPECT_FREE(r.device_free_before - r.device_free_after, total);
    EXPECT_FREE(dev_free_mem(), free1);
    for (int i = 0; i < NALLOC; i++) EXPECT(dev_checksum(p[i], sizes[i]) == sum[i], 1);
  }
  tms_report r;
  EXPECT(TMS(tms_resume_report)(NULL, &r), 0); /* nothing paused: all skipped */
  EXPECT(r.allocations_skipped, NALLOC);
  EXPECT(dev_checksum(plain, 1 * MiB) == plain_sum, 1);
  for (int i = 0; i < NALLOC; i++) EXPECT(dev_free(p[i]), 0);
  EXPECT(dev_free(plain), 0);
  EXPECT_FREE(dev_free_mem(), free0 - hook_stream_bytes());
  if (on_simulator()) {
    struct sim_stats s;
    sim_stats(&s);
    EXPECT(s.live_handles + s.live_mappings + s.reservations + s.plain_allocations, 0);
  }
  printf("cycles=%ld bytes=%zu free0=%zu ok\n", cycles, total, free0);
  return 0;
}

/* OOM on resume returns the vendor's code and loses nothing; a retry completes. */
static int oom_resume(void) {
  size_t cap = dev_free_mem();
  region("kv", 1);
  void *a, *b;
  EXPECT(dev_malloc(&a, 16 * MiB), 0);
  EXPECT(dev_malloc(&b, 16 * MiB), 0);
  dev_fill(a, 16 * MiB, 5);
  dev_fill(b, 16 * MiB, 6);
  uint64_t sa = dev_checksum(a, 16 * MiB), sb = dev_checksum(b, 16 * MiB);
  EXPECT(TMS(tms_pause)("kv"), 0);
  /* Someone else takes almost everything. */
  no_region();
  void *hog;
  EXPECT(dev_malloc(&hog, cap - 8 * MiB), 0);
  tms_report r;
  EXPECT(TMS(tms_resume_report)("kv", &r), TMS_ERR_OUT_OF_MEMORY);
  EXPECT(r.driver_error, OOM);
  EXPECT(r.allocations_done, 0);
  tms_tag_status st;
  size_t n;
  EXPECT(TMS(tms_status)(&st, 1, &n), 0);
  EXPECT(st.allocations_paused, 2);
  EXPECT(dev_free(hog), 0);
  /* A create that fails half-way (the second of two) leaves one resumed, one paused. */
  sim_faults(use_acl ? "aclrtMallocPhysical:2" : "cuMemCreate:2");
  EXPECT(TMS(tms_resume_report)("kv", &r), TMS_ERR_OUT_OF_MEMORY);
  EXPECT(r.allocations_done, 1);
  EXPECT(r.allocations_failed, 1);
  sim_faults("");
  EXPECT(TMS(tms_resume_report)("kv", &r), 0);
  EXPECT(r.allocations_done, 1);
  EXPECT(r.allocations_skipped, 1);
  EXPECT(dev_checksum(a, 16 * MiB) == sa, 1);
  EXPECT(dev_checksum(b, 16 * MiB) == sb, 1);
  /* Margin: region malloc and resume keep `margin` bytes free. */
  TMS(set_memory_margin_bytes)(dev_free_mem());
  region("kv", 1);
  void *c;
  EXPECT(dev_malloc(&c, 2 * MiB), OOM);
  TMS(set_memory_margin_bytes)(0);
  /* A size that cannot be rounded to the granularity is out of memory, not a wrapped size. */
  EXPECT(dev_malloc(&c, SIZE_MAX), OOM);
  EXPECT(dev_malloc(&c, SIZE_MAX - 4096), OOM);
  EXPECT(TMS(tms_pause)("kv"), 0);
  TMS(set_memory_margin_bytes)(dev_free_mem() - 16 * MiB);
  if (getenv("TMS_RESUME_KEEPS_MARGIN")) {
    EXPECT(TMS(tms_resume_report)("kv", &r), TMS_ERR_OUT_OF_MEMORY); /* refused up front */
    EXPECT(r.allocations_done, 0);
    EXPECT(r.device_free_after, r.device_free_before);
    TMS(set_memory_margin_bytes)(0);
  }
  /* As torch_memory_saver: the margin guards allocation only, so a waking job gets its memory. */
  EXPECT(TMS(tms_resume)("kv"), 0);
  TMS(set_memory_margin_bytes)(0);
  EXPECT(dev_checksum(a, 16 * MiB) == sa, 1);
  EXPECT(dev_free(a), 0);
  EXPECT(dev_free(b), 0);
  printf("oom-resume ok\n");
  return 0;
}

static void assert_no_leak(const char *when) {
  if (!on_simulator()) return;
  struct sim_stats s;
  sim_stats(&s);
  if (s.live_handles || s.live_mappings || s.reservations || s.plain_allocations) {
    fprintf(stderr, "leak after %s: handles=%llu mappings=%llu reservations=%llu plain=%llu\n", when,
            (unsigned long long)s.live_handles, (unsigned long long)s.live_mappings,
            (unsigned long long)s.reservations, (unsigned long long)s.plain_allocations);
    exit(1);
  }
}

/* A backup copy fails after a piece was released, and so does bringing that piece back: the
 * allocation ends up paused with nothing lost, and resume restores every byte. */
static int rollback_fails(void) {
  /* The piece cannot be created again, or it is created but its contents cannot be copied back
   * (ACL: copies 1-4 are the backup of the four pieces, 5 the restore). */
  const char *cuda[] = {"cuStreamSynchronize:2,cuMemCreate:1", "cuStreamSynchronize:2,cuMemcpyHtoDAsync_v2:1", NULL};
  const char *acl[] = {"aclrtSynchronizeStream:2,aclrtMallocPhysical:1", "aclrtSynchronizeStream:2,aclrtMemcpyAsync:5",
                       NULL};
  const char **specs = use_acl ? acl : cuda;
  size_t size = 8 * MiB;
  region("f", 1);
  for (int k = 0; specs[k]; k++) {
    void *p;
    EXPECT(dev_malloc(&p, size), 0);
    dev_fill(p, size, 77 + (unsigned)k);
    uint64_t sum = dev_checksum(p, size);
    sim_faults(specs[k]);
    tms_report r;
    int code = TMS(tms_pause_report)("f", &r);
    sim_faults("");
    if (code == 0) { fprintf(stderr, "pause with %s reported success\n", specs[k]); return 1; }
    tms_tag_status st;
    size_t n;
    EXPECT(TMS(tms_status)(&st, 1, &n), 0);
    EXPECT(st.allocations_paused, 1);
    EXPECT(TMS(tms_resume)("f"), 0);
    EXPECT(dev_checksum(p, size) == sum, 1);
    EXPECT(TMS(tms_pause)("f"), 0);
    EXPECT(TMS(tms_resume)("f"), 0);
    EXPECT(dev_checksum(p, size) == sum, 1);
    EXPECT(dev_free(p), 0);
    TMS(tms_release_cpu_backups)(NULL);
    assert_no_leak(specs[k]);
  }
  printf("rollback-fails ok\n");
  return 0;
}

/* Calls made once per operation; every other call is made once per piece of an allocation. */
static int once_per_operation(const char *name) {
  const char *once[] = {"Reserve", "AddressFree", "ReleaseMemAddress", "CtxSynchronize", "SynchronizeDevice", "cuEvent",
                        "HostAlloc", "MallocHost", NULL};
  for (int i = 0; once[i]; i++)
    if (strstr(name, once[i])) return 1;
  return 0;
}

/* A fault in each driver call of malloc, free, pause and resume: an error comes back, state stays
 * consistent (contents intact once the fault is gone), nothing leaks. With `nth` > 1 and an
 * allocation of several pieces (TMS_PHYSICAL_CHUNK_MB), the fault hits a later piece, after
 * earlier ones were already released or created. */
static int faults(size_t size, int nth) {
  const char *malloc_calls_cuda[] = {"cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", NULL};
  const char *malloc_calls_acl[] = {"aclrtMallocPhysical", "aclrtReserveMemAddress", "aclrtMapMem", NULL};
  const char *pause_calls_cuda[] = {"cuEventCreate", "cuEventRecord", "cuEventSynchronize", "cuMemHostAlloc", "cuMemcpyDtoHAsync_v2", "cuStreamSynchronize", "cuMemUnmap", "cuMemRelease", NULL};
  const char *pause_calls_acl[] = {"aclrtSynchronizeDevice", "aclrtMallocHost", "aclrtMemcpyAsync", "aclrtSynchronizeStream", "aclrtUnmapMem", "aclrtFreePhysical", NULL};
  const char *resume_calls_cuda[] = {"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemcpyHtoDAsync_v2", "cuStreamSynchronize", NULL};
  const char *resume_calls_acl[] = {"aclrtMallocPhysical", "aclrtMapMem", "aclrtMemcpyAsync", "aclrtSynchronizeStream", NULL};
  const char *free_calls_cuda[] = {"cuCtxSynchronize", "cuMemUnmap", "cuMemRelease", "cuMemAddressFree", NULL};
  const char *free_calls_acl[] = {"aclrtSynchronizeDevice", "aclrtUnmapMem", "aclrtFreePhysical", "aclrtReleaseMemAddress", NULL};
  const char **mc = use_acl ? malloc_calls_acl : malloc_calls_cuda;
  const char **pc = use_acl ? pause_calls_acl : pause_calls_cuda;
  const char **rc = use_acl ? resume_calls_acl : resume_calls_cuda;
  const char **fc = use_acl ? free_calls_acl : free_calls_cuda;
  char spec[128];
  region("f", 1);
  for (int i = 0; mc[i]; i++) {
    void *p = NULL;
    snprintf(spec, sizeof spec, "%s:%d:%d", mc[i], once_per_operation(mc[i]) ? 1 : nth, OOM);
    sim_faults(spec);
    EXPECT(dev_malloc(&p, size), OOM);
    sim_faults("");
    assert_no_leak(mc[i]);
  }
  for (int i = 0; pc[i]; i++) {
    void *p;
    EXPECT(dev_malloc(&p, size), 0);
    dev_fill(p, size, (unsigned)i);
    uint64_t sum = dev_checksum(p, size);
    TMS(tms_release_cpu_backups)(NULL); /* so the pinned allocation runs again */
    snprintf(spec, sizeof spec, "%s:%d", pc[i], once_per_operation(pc[i]) ? 1 : nth);
    sim_faults(spec);
    tms_report r;
    int code = TMS(tms_pause_report)("f", &r);
    sim_faults("");
    if (code == 0) { fprintf(stderr, "pause with %s failing reported success\n", pc[i]); return 1; }
    EXPECT(TMS(tms_resume)("f"), 0); /* whatever state it was left in, resume completes it */
    EXPECT(dev_checksum(p, size) == sum, 1);
    EXPECT(TMS(tms_pause)("f"), 0);
    EXPECT(TMS(tms_resume)("f"), 0);
    EXPECT(dev_checksum(p, size) == sum, 1);
    EXPECT(dev_free(p), 0);
    assert_no_leak(pc[i]);
  }
  for (int i = 0; rc[i]; i++) {
    void *p;
    EXPECT(dev_malloc(&p, size), 0);
    dev_fill(p, size, (unsigned)i + 50);
    uint64_t sum = dev_checksum(p, size);
    EXPECT(TMS(tms_pause)("f"), 0);
    snprintf(spec, sizeof spec, "%s:%d", rc[i], once_per_operation(rc[i]) ? 1 : nth);
    sim_faults(spec);
    tms_report r;
    int code = TMS(tms_resume_report)("f", &r);
    sim_faults("");
    if (code == 0) { fprintf(stderr, "resume with %s failing reported success\n", rc[i]); return 1; }
    EXPECT(r.allocations_failed, 1);
    tms_tag_status st;
    size_t n;
    EXPECT(TMS(tms_status)(&st, 1, &n), 0);
    EXPECT(st.allocations_paused, 1);
    EXPECT(TMS(tms_resume)("f"), 0);
    EXPECT(dev_checksum(p, size) == sum, 1);
    EXPECT(dev_free(p), 0);
    assert_no_leak(rc[i]);
  }
  for (int i = 0; fc[i]; i++) {
    for (int paused = 0; paused < 2; paused++) {
      void *p;
      EXPECT(dev_malloc(&p, size), 0);
      if (paused) EXPECT(TMS(tms_pause)("f"), 0);
      snprintf(spec, sizeof spec, "%s:%d", fc[i], once_per_operation(fc[i]) ? 1 : nth);
      sim_faults(spec);
      int code = dev_free(p);
      sim_faults("");
      if (code != 0) EXPECT(dev_free(p), 0); /* a failed free can be retried */
      assert_no_leak(fc[i]);
    }
  }
  TMS(tms_release_cpu_backups)(NULL);
  printf("faults ok\n");
  return 0;
}

/* Synchronizes fail while a pause backs up three allocations of two pieces each (`spec`, e.g.
 * every stream synchronize from the second on, or one of them and the restore that would undo
 * it): the report agrees with itself (done + failed = 3, an error only next to failures, what
 * is paused at least what is done), and once the faults are gone the next resume brings every
 * paused allocation back at once, not failing on an error the pause left on a stream. */
static int sync_fault(const char *spec) {
  region("s", 1);
  void *p[3];
  uint64_t sum[3];
  for (int i = 0; i < 3; i++) {
    EXPECT(dev_malloc(&p[i], 4 * MiB), 0);
    dev_fill(p[i], 4 * MiB, 11u + (unsigned)i);
    sum[i] = dev_checksum(p[i], 4 * MiB);
  }
  sim_faults(spec);
  tms_report r;
  int code = TMS(tms_pause_report)("s", &r);
  sim_faults("");
  tms_tag_status st;
  size_t n;
  EXPECT(TMS(tms_status)(&st, 1, &n), 0);
  printf("pause rc=%d done=%llu failed=%llu driver=%d paused=%llu\n", code, (unsigned long long)r.allocations_done,
         (unsigned long long)r.allocations_failed, r.driver_error, (unsigned long long)st.allocations_paused);
  if (code == 0) { fprintf(stderr, "pause with %s reported success\n", spec); return 1; }
  EXPECT(r.allocations_done + r.allocations_failed, 3);
  EXPECT(r.allocations_failed > 0, 1);
  EXPECT(st.allocations_paused >= r.allocations_done, 1);
  code = TMS(tms_resume_report)("s", &r);
  printf("resume rc=%d done=%llu failed=%llu driver=%d\n", code, (unsigned long long)r.allocations_done,
         (unsigned long long)r.allocations_failed, r.driver_error);
  EXPECT(code, 0);
  EXPECT(r.allocations_done, st.allocations_paused);
  for (int i = 0; i < 3; i++) {
    EXPECT(dev_checksum(p[i], 4 * MiB) == sum[i], 1);
    EXPECT(dev_free(p[i]), 0);
  }
  TMS(tms_release_cpu_backups)(NULL);
  printf("sync-fault ok\n");
  return 0;
}

/* ---- concurrency ------------------------------------------------------------------------------ */
static volatile int stop;

/* Threads 1-4 write and verify their allocations under tag "churn", which is never paused
 * (writing to memory while it is being paused loses the write on any saver); threads 5-8 allocate
 * and free under tag "volatile", which the pauser pauses and resumes concurrently. */
static void *churn(void *arg) {
  unsigned seed = (unsigned)(size_t)arg;
  int touch = seed <= 4;
  dev_thread_init();
  region(touch ? "churn" : "volatile", 1);
  unsigned char *h = malloc(6 * MiB), *back = malloc(6 * MiB);
  long rounds = 0;
  while (!stop) {
    size_t n = (size_t)(1 + rand_r(&seed) % 4) * 256 * 1024 - (rand_r(&seed) % 4096);
    void *p;
    int rc = dev_malloc(&p, n);
    if (rc != 0) { fprintf(stderr, "churn malloc: %d\n", rc); exit(1); }
    if (touch) {
      fill(h, n, seed);
      EXPECT(dev_write(p, h, n), 0);
      EXPECT(dev_read(back, p, n), 0);
      if (memcmp(h, back, n) != 0) { fprintf(stderr, "corruption in churn\n"); exit(1); }
    }
    EXPECT(dev_free(p), 0);
    rounds++;
    usleep(200); /* leave the pauser CPU on small machines */
  }
  free(h);
  free(back);
  return (void *)rounds;
}

static int threads(long cycles) {
  region("stable", 1);
  void *s;
  EXPECT(dev_malloc(&s, 4 * MiB), 0);
  dev_fill(s, 4 * MiB, 77);
  uint64_t sum = dev_checksum(s, 4 * MiB);
  pthread_t th[8];
  for (long i = 0; i < 8; i++) pthread_create(&th[i], NULL, churn, (void *)(i + 1));
  for (long c = 0; c < cycles; c++) {
    const char *tag = (c % 2 == 0) ? "stable" : "volatile";
    int rc = TMS(tms_pause)(tag);
    if (rc) { fprintf(stderr, "pause %ld: %d\n", c, rc); return 1; }
    rc = TMS(tms_resume)(tag);
    if (rc) { fprintf(stderr, "resume %ld: %d\n", c, rc); return 1; }
    if (c % 2 == 0) EXPECT(dev_checksum(s, 4 * MiB) == sum, 1);
  }
  stop = 1;
  long total = 0;
  for (int i = 0; i < 8; i++) {
    void *r;
    pthread_join(th[i], &r);
    total += (long)r;
  }
  EXPECT(TMS(tms_resume)(NULL), 0);
  EXPECT(dev_checksum(s, 4 * MiB) == sum, 1);
  EXPECT(dev_free(s), 0);
  TMS(tms_release_cpu_backups)(NULL);
  assert_no_leak("threads");
  printf("threads ok cycles=%ld churn_rounds=%ld\n", cycles, total);
  return 0;
}

/* Churn threads run for `seconds` while something outside (tms-ctl) pauses and resumes tags
 * "volatile" and "stable"; the stable allocation must hold its bytes at the end. */
static int churn_for(long seconds) {
  region("stable", 1);
  void *s;
  EXPECT(dev_malloc(&s, 4 * MiB), 0);
  dev_fill(s, 4 * MiB, 77);
  uint64_t sum = dev_checksum(s, 4 * MiB);
  printf("ready\n");
  fflush(stdout);
  pthread_t th[8];
  for (long i = 0; i < 8; i++) pthread_create(&th[i], NULL, churn, (void *)(i + 1));
  sleep((unsigned)seconds);
  stop = 1;
  long total = 0;
  for (int i = 0; i < 8; i++) {
    void *r;
    pthread_join(th[i], &r);
    total += (long)r;
  }
  EXPECT(TMS(tms_resume)(NULL), 0);
  EXPECT(dev_checksum(s, 4 * MiB) == sum, 1);
  printf("churn ok rounds=%ld\n", total);
  return 0;
}

/* Driven over stdin by a test to make two processes take turns on one device:
 * commands alloc MiB | alloc-env MiB | dead MiB | fill | pause | resume | verify | free | info | quit; one reply
 * line each. */
static int serve(void) {
  char line[128];
  void *p = NULL;
  size_t n = 0;
  uint64_t sum = 0;
  setvbuf(stdout, NULL, _IOLBF, 0);
  while (fgets(line, sizeof line, stdin)) {
    long arg = 0;
    if (sscanf(line, "alloc %ld", &arg) == 1) {
      region("train", 1);
      n = (size_t)arg * MiB;
      printf("rc=%d\n", dev_malloc(&p, n));
    } else if (sscanf(line, "alloc-env %ld", &arg) == 1) {
      /* A region whose backup flag is the environment's default (TMS_INIT_ENABLE_CPU_BACKUP). */
      TMS(tms_set_current_tag)("train");
      TMS(tms_set_interesting_region)(true);
      n = (size_t)arg * MiB;
      printf("rc=%d\n", dev_malloc(&p, n));
    } else if (sscanf(line, "plain %ld", &arg) == 1) {
      no_region();
      void *q;
      printf("rc=%d\n", dev_malloc(&q, (size_t)arg * MiB));
    } else if (sscanf(line, "dead %ld", &arg) == 1) {
      /* `arg` MiB from 1 MiB into the allocation need not survive the next pause. */
      tms_range r = {(uint64_t)(uintptr_t)p + MiB, (uint64_t)arg * MiB};
      printf("rc=%d\n", TMS(tms_mark_dead)(&r, 1));
    } else if (!strncmp(line, "fill", 4)) {
      dev_fill(p, n, 42);
      sum = dev_checksum(p, n);
      printf("rc=0\n");
    } else if (!strncmp(line, "pause", 5)) {
      tms_report r;
      int rc = TMS(tms_pause_report)(NULL, &r);
      printf("rc=%d done=%llu freed=%llu\n", rc, (unsigned long long)r.bytes_done,
             (unsigned long long)(r.device_free_after - r.device_free_before));
    } else if (!strncmp(line, "resume", 6)) {
      tms_report r;
      int rc = TMS(tms_resume_report)(NULL, &r);
      printf("rc=%d done=%llu driver=%d\n", rc, (unsigned long long)r.bytes_done, r.driver_error);
    } else if (!strncmp(line, "verify", 6)) {
      printf("rc=%d\n", dev_checksum(p, n) == sum ? 0 : 1);
    } else if (!strncmp(line, "free", 4)) {
      printf("rc=%d\n", dev_free(p));
    } else if (sscanf(line, "ctx %ld", &arg) == 1) {
      /* Whether this process has a (primary) context on device `arg`, asked without making one. */
      void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
      int (*state)(int, unsigned *, int *) = h ? (int (*)(int, unsigned *, int *))dlsym(h, "cuDevicePrimaryCtxGetState") : NULL;
      unsigned flags = 0;
      int active = -1;
      int rc = state ? state((int)arg, &flags, &active) : -2;
      printf("rc=%d active=%d\n", rc, active);
    } else if (!strncmp(line, "info", 4)) {
      printf("rc=0 free=%zu\n", dev_free_mem());
    } else if (!strncmp(line, "quit", 4)) {
      return 0;
    } else {
      printf("rc=-1 unknown\n");
    }
  }
  return 0;
}

/* A forked child starts with no tracked allocations of its own and can pause/resume its own;
 * the parent's are untouched. */
static int fork_child(void) {
  region("parent", 1);
  void *p;
  EXPECT(dev_malloc(&p, 4 * MiB), 0);
  dev_fill(p, 4 * MiB, 9);
  uint64_t sum = dev_checksum(p, 4 * MiB);
  pid_t pid = fork();
  if (pid == 0) {
    size_t n = 99;
    EXPECT(TMS(tms_status)(NULL, 0, &n), 0);
    EXPECT(n, 0);
    region("child", 1);
    void *c;
    EXPECT(dev_malloc(&c, 2 * MiB), 0);
    tms_report r;
    EXPECT(TMS(tms_pause_report)(NULL, &r), 0);
    EXPECT(r.allocations_done, 1);
    EXPECT(TMS(tms_resume)(NULL), 0);
    EXPECT(dev_free(c), 0);
    _exit(0);
  }
  int status = -1;
  waitpid(pid, &status, 0);
  EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, 1);
  tms_report r;
  EXPECT(TMS(tms_pause_report)(NULL, &r), 0);
  EXPECT(r.allocations_done, 1);
  EXPECT(TMS(tms_resume)(NULL), 0);
  EXPECT(dev_checksum(p, 4 * MiB) == sum, 1);
  EXPECT(dev_free(p), 0);
  printf("fork ok\n");
  return 0;
}

/* Without a driver the hook passes everything through: allocations work, nothing is tracked. */
static int no_driver(void) {
  region("x", 1);
  void *p;
  EXPECT(dev_malloc(&p, 4 * MiB), 0);
  tms_report r;
  EXPECT(TMS(tms_pause_report)(NULL, &r), 0);
  EXPECT(r.allocations_done, 0);
  EXPECT(dev_free(p), 0);
  printf("passthrough ok\n");
  return 0;
}

/* Disk backup: a paused allocation's contents live in a file of the chosen folder (and nowhere
 * else), come back byte for byte, and the file goes at resume. A file that cannot be read fails
 * the resume with TMS_ERR_IO and leaves the allocation paused with it; once the file is back, the
 * resume completes. */
static int disk_backup(const char *dir) {
  TMS(tms_set_disk_backup_dir)(dir);
  region("disk", 0);
  TMS(tms_set_enable_disk_backup)(true);
  EXPECT(TMS(tms_get_enable_disk_backup)(), true);
  void *p;
  EXPECT(dev_malloc(&p, 6 * MiB + 123), 0);
  TMS(tms_set_enable_disk_backup)(false);
  no_region();
  dev_fill(p, 6 * MiB + 123, 9);
  uint64_t sum = dev_checksum(p, 6 * MiB + 123);
  size_t free0 = dev_free_mem();
  tms_report r;
  EXPECT(TMS(tms_pause_report)("disk", &r), 0);
  EXPECT(r.allocations_done, 1);
  EXPECT_FREE(dev_free_mem() - free0, 8 * MiB);
  EXPECT(TMS(tms_get_cpu_backup_pointer)((const uint8_t *)p, 16) == NULL, 1); /* not in host memory */
  char path[512], moved[600];
  snprintf(path, sizeof path, "%s/tms-backup-%d-%lx.bin", dir, (int)getpid(), (unsigned long)(uintptr_t)p);
  struct stat st;
  EXPECT(stat(path, &st), 0);
  EXPECT((size_t)st.st_size, 6 * MiB + 123);
  snprintf(moved, sizeof moved, "%s.away", path);
  EXPECT(rename(path, moved), 0);
  EXPECT(TMS(tms_resume_report)("disk", &r), 6); /* TMS_ERR_IO */
  EXPECT(r.allocations_failed, 1);
  EXPECT_FREE(dev_free_mem() - free0, 8 * MiB); /* still paused */
  EXPECT(rename(moved, path), 0);
  EXPECT(TMS(tms_resume_report)("disk", &r), 0);
  EXPECT(r.allocations_done, 1);
  EXPECT(dev_checksum(p, 6 * MiB + 123) == sum, 1);
  EXPECT(stat(path, &st), -1); /* the file is gone once resumed */
  EXPECT(dev_free(p), 0);
  printf("disk-backup ok\n");
  return 0;
}

/* Pause while a (simulated) kernel still runs on another stream and writes the allocation: the
 * pause must wait for it (a GPU faults work whose memory is unmapped under it), so the backup
 * holds the kernel's output and the stream ends without an error. */
static int kernel_then_pause(void) {
  region("train", 1);
  void *p;
  EXPECT(dev_malloc(&p, 8 * MiB), 0);
  no_region();
  dev_fill(p, 8 * MiB, 3);
  void *stream = NULL;
  EXPECT(CUDART(cudaStreamCreate)(&stream), 0);
  void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  int (*kernel)(void *, void *, size_t, int, unsigned) =
      h ? (int (*)(void *, void *, size_t, int, unsigned))dlsym(h, "tms_sim_launch_kernel") : NULL;
  EXPECT(kernel != NULL, 1);
  EXPECT(kernel(stream, p, 8 * MiB, 0xAB, 300000), 0); /* 0.3 s of work, then the write */
  tms_report r;
  EXPECT(TMS(tms_pause_report)("train", &r), 0);
  EXPECT(r.allocations_done, 1);
  /* While paused: the backup holds the kernel's output, and the kernel ended without a fault. */
  const unsigned char *bp = TMS(tms_get_cpu_backup_pointer)((const uint8_t *)p, 8 * MiB);
  EXPECT(bp != NULL, 1);
  size_t stale = 0;
  for (size_t i = 0; i < 8 * MiB; i++) stale += bp[i] != 0xAB;
  EXPECT(stale, 0);
  EXPECT(CUDART(cudaStreamSynchronize)(stream), 0);
  EXPECT(TMS(tms_resume_report)("train", &r), 0);
  unsigned char *back = malloc(8 * MiB);
  EXPECT(dev_read(back, p, 8 * MiB), 0);
  size_t wrong = 0;
  for (size_t i = 0; i < 8 * MiB; i++) wrong += back[i] != 0xAB;
  free(back);
  EXPECT(wrong, 0);
  EXPECT(CUDART(cudaStreamDestroy)(stream), 0);
  EXPECT(dev_free(p), 0);
  printf("kernel-pause ok\n");
  return 0;
}

/* A thread that never made a context current (a weight-loading worker, say) allocates in a
 * region while a margin is set: the margin check must not reach the driver without a context. */
static void *margin_alloc(void *arg) {
  (void)arg;
  region("loader", 0);
  void *p = NULL;
  long rc = dev_malloc(&p, 4 * MiB);
  if (rc == 0 && dev_free(p) != 0) rc = -1;
  return (void *)rc;
}

static int margin_thread(void) {
  TMS(set_memory_margin_bytes)(64 * MiB);
  pthread_t th;
  void *r;
  pthread_create(&th, NULL, margin_alloc, NULL);
  pthread_join(th, &r);
  EXPECT((long)r, 0);
  printf("margin-thread ok\n");
  return 0;
}

/* The "mmap" backend backs up to pageable memory (no pinned bytes) that resume gives back;
 * "pinned" buffers stay pooled for the next pause. The backend is a per-thread setting. */
static void *backend_of_new_thread(void *arg) {
  *(int *)arg = strcmp(TMS(tms_get_cpu_backup_backend)(), "mmap") == 0;
  return NULL;
}
static uint64_t backup_bytes_of(const char *tag) {
  tms_tag_status st[16];
  size_t n = 0;
  EXPECT(TMS(tms_status)(st, 16, &n), 0);
  for (size_t i = 0; i < n && i < 16; i++)
    if (!strcmp(st[i].tag, tag)) return st[i].backup_bytes;
  return 0;
}
static int backup_backends(void) {
  TMS(tms_set_cpu_backup_backend)("mmap");
  EXPECT(strcmp(TMS(tms_get_cpu_backup_backend)(), "mmap"), 0);
  int other = -1;
  pthread_t th;
  pthread_create(&th, NULL, backend_of_new_thread, &other);
  pthread_join(th, NULL);
  EXPECT(other, 0);
  region("pageable", 1);
  void *a, *b;
  EXPECT(dev_malloc(&a, 8 * MiB), 0);
  TMS(tms_set_cpu_backup_backend)("pinned");
  region("pinned", 1);
  EXPECT(dev_malloc(&b, 8 * MiB), 0);
  no_region();
  dev_fill(a, 8 * MiB, 3);
  dev_fill(b, 8 * MiB, 4);
  uint64_t sa = dev_checksum(a, 8 * MiB), sb = dev_checksum(b, 8 * MiB);
  struct sim_stats s0, s1, s2;
  sim_stats(&s0);
  EXPECT(TMS(tms_pause)("pageable"), 0);
  sim_stats(&s1);
  EXPECT(s1.pinned_host_bytes, s0.pinned_host_bytes);
  EXPECT(TMS(tms_get_cpu_backup_pointer)(a, 8 * MiB) != NULL, 1);
  EXPECT(backup_bytes_of("pageable") >= 8 * MiB, 1);
  EXPECT(TMS(tms_pause)("pinned"), 0);
  sim_stats(&s2);
  EXPECT(s2.pinned_host_bytes >= s1.pinned_host_bytes + 8 * MiB, 1);
  EXPECT(TMS(tms_resume)(NULL), 0);
  EXPECT(dev_checksum(a, 8 * MiB) == sa, 1);
  EXPECT(dev_checksum(b, 8 * MiB) == sb, 1);
  EXPECT(backup_bytes_of("pageable"), 0);
  EXPECT(backup_bytes_of("pinned") >= 8 * MiB, 1);
  EXPECT(dev_free(a), 0);
  EXPECT(dev_free(b), 0);
  printf("backup-backends ok\n");
  return 0;
}

/* Region memory is GPUDirect-RDMA capable where the device supports it, like cudaMalloc's, also
 * after a pause and resume (NCCL checks this attribute before registering a user buffer). */
static int rdma_capable(void *p) {
  void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  int (*attr)(void *, int, unsigned long long) =
      h ? (int (*)(void *, int, unsigned long long))dlsym(h, "cuPointerGetAttribute") : NULL;
  unsigned v = 99;
  if (!attr || attr(&v, 15 /* CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE */, (unsigned long long)(uintptr_t)p) != 0)
    return -1;
  return (int)v;
}
static int rdma(void) {
  no_region();
  void *plain, *a;
  EXPECT(dev_malloc(&plain, 2 * MiB), 0);
  EXPECT(rdma_capable(plain), 1);
  region("kv", 1);
  EXPECT(dev_malloc(&a, 6 * MiB), 0);
  EXPECT(rdma_capable(a), 1);
  EXPECT(rdma_capable((char *)a + 5 * MiB), 1);
  EXPECT(TMS(tms_pause)("kv"), 0);
  EXPECT(TMS(tms_resume)("kv"), 0);
  EXPECT(rdma_capable(a), 1);
  EXPECT(dev_free(a), 0);
  EXPECT(dev_free(plain), 0);
  printf("rdma ok\n");
  return 0;
}

/* Pause waits for what the application queued where a synchronous copy would (the default
 * stream and blocking streams), and not for non-blocking streams: a collective blocked on a peer
 * that itself waits for this process to pause must not hang the pause. */
static int collective_released, pause_rc = -1;
static void block_like_a_collective(void *arg) {
  (void)arg;
  while (!__atomic_load_n(&collective_released, __ATOMIC_ACQUIRE)) usleep(1000);
}
static int slow_kernel_started;
static void slow_kernel(void *arg) {
  (void)arg;
  __atomic_store_n(&slow_kernel_started, 1, __ATOMIC_RELEASE);
  usleep(200 * 1000);
}
static void *pause_in_thread(void *arg) {
  (void)arg;
  __atomic_store_n(&pause_rc, TMS(tms_pause)("kv"), __ATOMIC_RELEASE);
  return NULL;
}
static int pause_streams(void) {
  region("kv", 1);
  void *a;
  EXPECT(dev_malloc(&a, 4 * MiB), 0);
  no_region();
  unsigned char *host = malloc(4 * MiB);
  fill(host, 4 * MiB, 7);
  cudaStream_t comm, work;
  EXPECT(CUDART(cudaStreamCreateWithFlags)(&comm, 1 /* cudaStreamNonBlocking, as NCCL's */), 0);
  EXPECT(CUDART(cudaStreamCreateWithFlags)(&work, 0), 0);
  /* The driver runs host functions on one thread of its own, in no promised order across
   * streams (CUDA Runtime API, cudaLaunchHostFunc): the blocking stream's work is queued, and its
   * host function running, before the "collective" is queued, or the "collective" could hold that
   * thread and the copy behind slow_kernel would never run. */
  EXPECT(CUDART(cudaLaunchHostFunc)(work, slow_kernel, NULL), 0);
  EXPECT(CUDART(cudaMemcpyAsync)(a, host, 4 * MiB, 1, work), 0);
  for (int i = 0; i < 10000 && !__atomic_load_n(&slow_kernel_started, __ATOMIC_ACQUIRE); i++) usleep(1000);
  EXPECT(CUDART(cudaLaunchHostFunc)(comm, block_like_a_collective, NULL), 0);
  pthread_t th;
  pthread_create(&th, NULL, pause_in_thread, NULL);
  for (int i = 0; i < 10000 && __atomic_load_n(&pause_rc, __ATOMIC_ACQUIRE) == -1; i++) usleep(1000);
  if (__atomic_load_n(&pause_rc, __ATOMIC_ACQUIRE) == -1) {
    fprintf(stderr, "pause waited 10 s for a non-blocking stream\n");
    exit(1);
  }
  pthread_join(th, NULL);
  EXPECT(pause_rc, 0);
  __atomic_store_n(&collective_released, 1, __ATOMIC_RELEASE);
  EXPECT(CUDART(cudaStreamSynchronize)(comm), 0);
  EXPECT(TMS(tms_resume)("kv"), 0);
  /* The write queued on the blocking stream landed before the pause took the memory. */
  EXPECT(dev_checksum(a, 4 * MiB) == checksum(host, 4 * MiB), 1);
  EXPECT(CUDART(cudaStreamDestroy)(comm), 0);
  EXPECT(CUDART(cudaStreamDestroy)(work), 0);
  EXPECT(dev_free(a), 0);
  free(host);
  printf("pause-streams ok\n");
  return 0;
}

/* aclrtMalloc's policy decides the physical memory of region allocations, as the runtime's own
 * allocator would: huge or normal pages, P2P memory; huge-first falls back to normal pages when
 * huge ones run out; a policy that cannot be reproduced (read-only) passes through untracked. */
static int mem_attr_at(void *p) {
  void *h = dlopen("libascendcl.so", RTLD_LAZY | RTLD_NOLOAD);
  int (*f)(const void *) = h ? (int (*)(const void *))dlsym(h, "tms_sim_mem_attr") : NULL;
  return f ? f(p) : -2;
}
static int acl_policies(void) {
  struct { int policy; size_t size; int attr; } cases[] = {
      {0 /* HUGE_FIRST */, 4 * MiB, 4 /* HBM_MEM_HUGE */},
      {0, 512 * 1024, 5 /* HBM_MEM_NORMAL: 1 MiB or less */},
      {1 /* HUGE_ONLY */, 4 * MiB, 4},
      {2 /* NORMAL_ONLY */, 4 * MiB, 5},
      {3 /* HUGE_FIRST_P2P */, 4 * MiB, 8 /* HBM_MEM_P2P_HUGE */},
      {5 /* NORMAL_ONLY_P2P */, 4 * MiB, 9 /* HBM_MEM_P2P_NORMAL */},
      {0x1000 | 2 /* HIGH_BAND_WIDTH | NORMAL_ONLY */, 4 * MiB, 5},
  };
  region("kv", 1);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    void *p;
    EXPECT(ACL(aclrtMallocAlign32)(&p, cases[i].size, cases[i].policy), 0);
    EXPECT(mem_attr_at(p), cases[i].attr);
    dev_fill(p, cases[i].size, (unsigned)i);
    uint64_t sum = dev_checksum(p, cases[i].size);
    EXPECT(TMS(tms_pause)("kv"), 0);
    EXPECT(mem_attr_at(p), -1);
    EXPECT(TMS(tms_resume)("kv"), 0);
    EXPECT(mem_attr_at(p), cases[i].attr);
    EXPECT(dev_checksum(p, cases[i].size) == sum, 1);
    EXPECT(dev_free(p), 0);
  }
  /* Huge pages exhausted: huge-first takes normal ones; huge-only fails with the runtime's code. */
  void *p;
  sim_faults("aclrtMallocPhysical:1:207001");
  EXPECT(ACL(aclrtMallocAlign32)(&p, 4 * MiB, 0), 0);
  sim_faults("");
  EXPECT(mem_attr_at(p), 5);
  EXPECT(dev_free(p), 0);
  sim_faults("aclrtMallocPhysical:1:207001");
  EXPECT(ACL(aclrtMallocAlign32)(&p, 4 * MiB, 1), 207001);
  sim_faults("");
  /* Read-only memory cannot be rebuilt from physical memory: plain, untracked, still usable. */
  EXPECT(ACL(aclrtMalloc)(&p, 4 * MiB, 0x100000), 0);
  EXPECT(mem_attr_at(p), -1);
  size_t n = 99;
  EXPECT(TMS(tms_status)(NULL, 0, &n), 0);
  EXPECT(n, 0);
  EXPECT(dev_free(p), 0);
  printf("acl-policies ok\n");
  return 0;
}

/* The pinned buffers kept after resume for the next pause: `kept_mib` of the three 4 MiB
 * backups stay, as TMS_PINNED_POOL_MAX_MB and TMS_PINNED_POOL_HOST_RESERVE_PERCENT allow. */
static int pool_cap(long kept_mib) {
  region("pooled", 1);
  void *p[3];
  uint64_t sum[3];
  for (int i = 0; i < 3; i++) {
    EXPECT(dev_malloc(&p[i], 4 * MiB), 0);
    dev_fill(p[i], 4 * MiB, (unsigned)i + 3);
    sum[i] = dev_checksum(p[i], 4 * MiB);
  }
  for (int round = 0; round < 2; round++) {
    EXPECT(TMS(tms_pause)("pooled"), 0);
    EXPECT(backup_bytes_of("pooled"), 12 * MiB);
    EXPECT(TMS(tms_resume)("pooled"), 0);
    EXPECT(backup_bytes_of("pooled"), (uint64_t)kept_mib * MiB);
    for (int i = 0; i < 3; i++) EXPECT(dev_checksum(p[i], 4 * MiB) == sum[i], 1);
  }
  struct sim_stats s;
  sim_stats(&s);
  EXPECT(s.pinned_host_bytes <= (uint64_t)kept_mib * MiB + 64 * 1024, 1);
  for (int i = 0; i < 3; i++) EXPECT(dev_free(p[i]), 0);
  printf("pool-cap ok\n");
  return 0;
}

static long rss_kib(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kib = -1;
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, "VmRSS:", 6)) kib = atol(line + 6);
  if (f) fclose(f);
  return kib;
}

/* A program naming a new tag every step ("step0", "step1", ...) must not grow the process for
 * good: a tag goes with its last allocation. The current tag's pointer stays readable while the
 * thread keeps it, and tms_status's names until the next call. */
static int tag_churn(long steps) {
  long first = 0;
  char name[64];
  for (long i = 0; i < steps; i++) {
    snprintf(name, sizeof name, "step%ld", i);
    region(name, 1);
    const char *shown = TMS(tms_get_current_tag)();
    EXPECT(strcmp(shown, name), 0);
    void *p;
    EXPECT(dev_malloc(&p, 4096), 0);
    no_region();
    EXPECT(TMS(tms_pause)(name), 0);
    EXPECT(TMS(tms_resume)(name), 0);
    tms_tag_status st[4];
    size_t n = 0;
    EXPECT(TMS(tms_status)(st, 4, &n), 0);
    EXPECT(n, 1);
    EXPECT(strcmp(st[0].tag, name), 0);
    EXPECT(strcmp(shown, name), 0); /* still this thread's tag */
    EXPECT(dev_free(p), 0);
    EXPECT(TMS(tms_status)(NULL, 0, &n), 0);
    EXPECT(n, 0);
    if (i == steps / 10) first = rss_kib();
  }
  TMS(tms_set_current_tag)(NULL);
  long last = rss_kib();
  printf("tag-churn: VmRSS %ld KiB after %ld steps, %ld KiB at step %ld\n", last, steps, first, steps / 10);
  EXPECT(last - first < 256, 1); /* interned for good: +848 KiB over 18,000 tags */
  printf("tag-churn ok\n");
  return 0;
}

static int dev_count(void) {
  if (use_acl) {
    uint32_t n = 0;
    EXPECT(ACL(aclrtGetDeviceCount)(&n), 0);
    return (int)n;
  }
  int n = 0;
  EXPECT(CUDART(cudaGetDeviceCount)(&n), 0);
  return n;
}

static int dev_set(int d) { return use_acl ? ACL(aclrtSetDevice)(d) : CUDART(cudaSetDevice)(d); }

static int dev_current(void) {
  int d = -1;
  if (use_acl) {
    int32_t a = -1;
    ACL(aclrtGetDevice)(&a);
    d = a;
  } else {
    CUDART(cudaGetDevice)(&d);
  }
  return d;
}

/* Region memory on every device of the machine (two or more): one pause of the tag releases each
 * device's share (free memory rises on each device by exactly what it holds there), resume
 * restores every allocation on its own device at its address with its bytes, and the caller's
 * current device is what it was. `cycles` pause/resume rounds. */
static int multi_device(long cycles) {
  enum { PER_DEVICE = 2, MAXDEV = 16 };
  int n = dev_count();
  if (n < 2) {
    fprintf(stderr, "multi-device: %d device(s); this check needs two or more\n", n);
    return 1;
  }
  if (n > MAXDEV) n = MAXDEV;
  void *p[MAXDEV][PER_DEVICE];
  uint64_t sum[MAXDEV][PER_DEVICE];
  size_t held[MAXDEV], before[MAXDEV];
  const size_t size[PER_DEVICE] = {6 * MiB, 2 * MiB};
  for (int d = 0; d < n; d++) {
    EXPECT(dev_set(d), 0);
    before[d] = dev_free_mem();
    region("multi", 1);
    held[d] = 0;
    for (int i = 0; i < PER_DEVICE; i++) {
      EXPECT(dev_malloc(&p[d][i], size[i]), 0);
      dev_fill(p[d][i], size[i], (unsigned)(d * 31 + i + 7));
      sum[d][i] = dev_checksum(p[d][i], size[i]);
      held[d] += size[i];
    }
    no_region();
    EXPECT(before[d] - dev_free_mem() >= held[d], 1);
  }
  const int home = n - 1; /* the caller's device during pause and resume: not device 0 */
  EXPECT(dev_set(home), 0);
  for (long c = 0; c < cycles; c++) {
    size_t live[MAXDEV];
    for (int d = 0; d < n; d++) {
      EXPECT(dev_set(d), 0);
      live[d] = dev_free_mem();
    }
    EXPECT(dev_set(home), 0);
    tms_report r;
    EXPECT(TMS(tms_pause_report)("multi", &r), 0);
    EXPECT(r.allocations_done, (uint64_t)(n * PER_DEVICE));
    EXPECT(dev_current(), home);
    for (int d = 0; d < n; d++) {
      EXPECT(dev_set(d), 0);
      EXPECT_FREE(dev_free_mem() - live[d], held[d]);
    }
    EXPECT(dev_set(home), 0);
    EXPECT(TMS(tms_resume_report)("multi", &r), 0);
    EXPECT(r.allocations_done, (uint64_t)(n * PER_DEVICE));
    EXPECT(dev_current(), home);
    for (int d = 0; d < n; d++) {
      EXPECT(dev_set(d), 0);
      EXPECT_FREE(dev_free_mem(), live[d]);
      for (int i = 0; i < PER_DEVICE; i++) EXPECT(dev_checksum(p[d][i], size[i]), sum[d][i]);
    }
    EXPECT(dev_set(home), 0);
  }
  for (int d = 0; d < n; d++) {
    EXPECT(dev_set(d), 0);
    for (int i = 0; i < PER_DEVICE; i++) EXPECT(dev_free(p[d][i]), 0);
  }
  printf("multi-device ok: devices=%d cycles=%ld\n", n, cycles);
  return 0;
}

/* Restore verification (tms_set_verify_restore; TMS_VERIFY_RESTORE=1 is the same from the start):
 * a clean cycle checks out; a backup written while paused (through tms_get_cpu_backup_pointer)
 * fails the resume with TMS_ERR_CORRUPT, the memory mapped with the written byte; on the
 * simulator, a restore copy that flips a byte (a `corrupt` fault rule) is made again and the
 * contents come back, one that flips every time fails with TMS_ERR_CORRUPT, and with
 * verification off the same bad copy passes unnoticed (what the option is for). */
static int verify_restore(void) {
  const size_t n = 3 * MiB + 4096;
  void *p;
  tms_report r;
  TMS(tms_set_verify_restore)(true);
  EXPECT(TMS(tms_get_verify_restore)(), 1);
  region("verify", 1);
  EXPECT(dev_malloc(&p, n), 0);
  no_region();
  dev_fill(p, n, 7);
  uint64_t sum = dev_checksum(p, n);

  EXPECT(TMS(tms_pause_report)("verify", &r), 0);
  EXPECT(TMS(tms_resume_report)("verify", &r), 0);
  EXPECT(dev_checksum(p, n), sum);

  EXPECT(TMS(tms_pause_report)("verify", &r), 0);
  uint8_t *b = TMS(tms_get_cpu_backup_pointer)((const uint8_t *)p + 2 * MiB + 10, 1);
  EXPECT(b != NULL, 1);
  *b ^= 0xff;
  EXPECT(TMS(tms_resume_report)("verify", &r), 7); /* TMS_ERR_CORRUPT */
  EXPECT(r.allocations_done, 1);
  EXPECT(dev_checksum(p, n) != sum, 1);
  dev_fill(p, n, 7);

  if (on_simulator()) {
    const char *copy = use_acl ? "aclrtMemcpyAsync" : "cuMemcpyHtoDAsync_v2";
    char spec[96];
    EXPECT(TMS(tms_pause_report)("verify", &r), 0);
    snprintf(spec, sizeof spec, "%s:1:corrupt", copy);
    sim_faults(spec);
    EXPECT(TMS(tms_resume_report)("verify", &r), 0);
    sim_faults("");
    EXPECT(dev_checksum(p, n), sum);

    EXPECT(TMS(tms_pause_report)("verify", &r), 0);
    snprintf(spec, sizeof spec, "%s:1+:corrupt", copy);
    sim_faults(spec);
    EXPECT(TMS(tms_resume_report)("verify", &r), 7);
    sim_faults("");
    EXPECT(dev_checksum(p, n) != sum, 1);
    dev_fill(p, n, 7);

    TMS(tms_set_verify_restore)(false);
    EXPECT(TMS(tms_pause_report)("verify", &r), 0);
    snprintf(spec, sizeof spec, "%s:1:corrupt", copy);
    sim_faults(spec);
    EXPECT(TMS(tms_resume_report)("verify", &r), 0);
    sim_faults("");
    EXPECT(dev_checksum(p, n) != sum, 1);
  }
  EXPECT(dev_free(p), 0);
  printf("verify ok\n");
  return 0;
}

/* Only live bytes cross the bus: a range marked dead (tms_mark_dead) is not copied by the next
 * pause or restored by its resume, and the rest comes back byte for byte, checked with restore
 * verification on (it must not take the undefined dead bytes for corruption). Bad ranges return
 * TMS_ERR_INVALID and mark nothing; the pause consumes the marks; marks on a paused allocation
 * are ignored. */
static int live_only(void) {
  const size_t n = 8 * MiB + 4096, dead_at = 2 * MiB + 512, dead_len = 3 * MiB;
  void *p, *plain;
  tms_report r;
  unsigned char *want = malloc(n), *got = malloc(n);
  fill(want, n, 3);
  TMS(tms_set_verify_restore)(true);
  region("live", 1);
  EXPECT(dev_malloc(&p, n), 0);
  no_region();
  EXPECT(dev_malloc(&plain, MiB), 0);
  EXPECT(dev_write(p, want, n), 0);
  uint64_t base = (uint64_t)(uintptr_t)p;

  /* Past the requested size, outside any region allocation, no array: refused, nothing marked,
   * also for the good range given beside a bad one. */
  tms_range past_end[] = {{base + n - 100, 200}};
  tms_range outside[] = {{(uint64_t)(uintptr_t)plain, 16}};
  tms_range mixed[] = {{base + dead_at, dead_len}, {base + n, 1}};
  EXPECT(TMS(tms_mark_dead)(past_end, 1), TMS_ERR_INVALID);
  EXPECT(TMS(tms_mark_dead)(outside, 1), TMS_ERR_INVALID);
  EXPECT(TMS(tms_mark_dead)(NULL, 1), TMS_ERR_INVALID);
  EXPECT(TMS(tms_mark_dead)(mixed, 2), TMS_ERR_INVALID);
  EXPECT(TMS(tms_mark_dead)(NULL, 0), TMS_OK);
  EXPECT(TMS(tms_pause_report)("live", &r), 0);
  EXPECT(r.backup_bytes, n);
  EXPECT(r.backup_bytes_skipped, 0);
  EXPECT(TMS(tms_resume_report)("live", &r), 0);
  EXPECT(r.backup_bytes, n);

  /* The middle range, given as two overlapping marks. */
  tms_range middle[] = {{base + dead_at, MiB}, {base + dead_at + MiB / 2, dead_len - MiB / 2}};
  EXPECT(TMS(tms_mark_dead)(middle, 2), TMS_OK);
  EXPECT(TMS(tms_pause_report)("live", &r), 0);
  EXPECT(r.allocations_done, 1);
  EXPECT(r.backup_bytes, n - dead_len);
  EXPECT(r.backup_bytes_skipped, dead_len);
  /* Marks on a paused allocation are ignored: the next pause below copies everything. */
  EXPECT(TMS(tms_mark_dead)(middle, 2), TMS_OK);
  EXPECT(TMS(tms_resume_report)("live", &r), 0);
  EXPECT(r.backup_bytes, n - dead_len);
  EXPECT(r.backup_bytes_skipped, dead_len);
  EXPECT(dev_read(got, p, n), 0);
  EXPECT(memcmp(got, want, dead_at), 0);
  EXPECT(memcmp(got + dead_at + dead_len, want + dead_at + dead_len, n - dead_at - dead_len), 0);

  /* The pause consumed the marks: the next one copies the whole allocation again. */
  EXPECT(dev_write(p, want, n), 0);
  EXPECT(TMS(tms_pause_report)("live", &r), 0);
  EXPECT(r.backup_bytes, n);
  EXPECT(r.backup_bytes_skipped, 0);
  EXPECT(TMS(tms_resume_report)("live", &r), 0);
  EXPECT(dev_read(got, p, n), 0);
  EXPECT(memcmp(got, want, n), 0);

  /* Marks die with their allocation: once it is freed its ranges are in no region allocation. */
  EXPECT(TMS(tms_mark_dead)(middle, 2), TMS_OK);
  EXPECT(dev_free(p), 0);
  EXPECT(TMS(tms_mark_dead)(middle, 2), TMS_ERR_INVALID);
  EXPECT(dev_free(plain), 0);
  TMS(tms_set_verify_restore)(false);
  free(want);
  free(got);
  printf("live-only ok: copied=%llu skipped=%llu\n", (unsigned long long)(n - dead_len),
         (unsigned long long)dead_len);
  return 0;
}

int tms_test_main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s MODE cuda|acl [ARGS]\n", argv[0]);
    return 2;
  }
  dev_init(argv[2]);
  const char *m = argv[1];
  if (!strcmp(m, "multi-device") && argc == 4) return multi_device(atol(argv[3]));
  if (!strcmp(m, "device-count")) {
    printf("devices=%d\n", dev_count());
    return 0;
  }
  if (!strcmp(m, "cycle")) return cycle(argc > 3 ? atol(argv[3]) : 1);
  if (!strcmp(m, "oom-resume")) return oom_resume();
  if (!strcmp(m, "faults")) return faults((argc > 3 ? atol(argv[3]) : 4) * MiB, argc > 4 ? atoi(argv[4]) : 1);
  if (!strcmp(m, "rollback-fails")) return rollback_fails();
  if (!strcmp(m, "sync-fault")) return sync_fault(argc > 3 ? argv[3] : "");
  if (!strcmp(m, "threads")) return threads(argc > 3 ? atol(argv[3]) : 1000);
  if (!strcmp(m, "serve")) return serve();
  if (!strcmp(m, "fork")) return fork_child();
  if (!strcmp(m, "churn")) return churn_for(argc > 3 ? atol(argv[3]) : 3);
  if (!strcmp(m, "no-driver")) return no_driver();
  if (!strcmp(m, "margin-thread")) return margin_thread();
  if (!strcmp(m, "kernel-pause")) return kernel_then_pause();
  if (!strcmp(m, "backup-backends")) return backup_backends();
  if (!strcmp(m, "rdma")) return rdma();
  if (!strcmp(m, "pause-streams")) return pause_streams();
  if (!strcmp(m, "acl-policies")) return acl_policies();
  if (!strcmp(m, "pool-cap")) return pool_cap(argc > 3 ? atol(argv[3]) : 4);
  if (!strcmp(m, "tag-churn")) return tag_churn(argc > 3 ? atol(argv[3]) : 100000);
  if (!strcmp(m, "disk-backup")) return disk_backup(argc > 3 ? argv[3] : "/tmp");
  if (!strcmp(m, "verify")) return verify_restore();
  if (!strcmp(m, "live-only")) return live_only();
  fprintf(stderr, "unknown mode %s\n", m);
  return 2;
}
