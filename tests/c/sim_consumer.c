/* A consumer of the vendor runtimes, used to prove tms-sim (and, preloaded, tms-hook) behave like
 * the real libraries. Built three ways by the tests: linked against the sonames, as a plugin that a
 * loader dlopens RTLD_LOCAL, and with every call reached through dlsym(handle, name).
 * Usage: consumer MODE [ARGS]; prints what it measured and exits 0 when every check held. */
#define _GNU_SOURCE
#include "vendor.h"
#include <dlfcn.h>
#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MiB (1024ULL * 1024ULL)
#define EXPECT(expr, want)                                                                      \
  do {                                                                                          \
    long long _r = (long long)(expr), _w = (long long)(want);                                   \
    if (_r != _w) {                                                                             \
      fprintf(stderr, "%s:%d: %s = %lld, want %lld\n", __FILE__, __LINE__, #expr, _r, _w);      \
      return 1;                                                                                 \
    }                                                                                           \
  } while (0)

struct tms_sim_stats {
  uint32_t device_count, pad;
  uint64_t capacity, device_used[16], process_used[16];
  uint64_t host_resident_bytes, live_handles, live_mappings, reservations, plain_allocations,
      pinned_host_bytes;
};

/* The simulator's introspection call, found in whichever loaded library provides the driver. */
static void *dlsym_default(const char *name) {
  void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  return h ? dlsym(h, name) : NULL;
}

static int sim_stats(struct tms_sim_stats *s) {
  int (*f)(struct tms_sim_stats *) =
      (int (*)(struct tms_sim_stats *))dlsym_default("tms_sim_stats");
  return f ? f(s) : -1;
}

static size_t cuda_free_now(void) {
  size_t f = 0, t = 0;
  CUDART(cudaMemGetInfo)(&f, &t);
  return f;
}

static void fill(unsigned char *h, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(i * 31u + seed);
}

static int check(const unsigned char *h, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++)
    if (h[i] != (unsigned char)(i * 31u + seed)) return 0;
  return 1;
}

static CUmemAllocationProp cuda_prop(int dev) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = 1;          /* PINNED */
  p.location.type = 1; /* DEVICE */
  p.location.id = dev;
  return p;
}

/* Reserve, create, map, access, write; unmap+release (pause); create+map at the same address and
 * restore (resume). Free memory must drop and rise by exactly the size. */
static int cuda_vmm(void) {
  EXPECT(CUDRV(cuInit)(0), 0);
  CUcontext ctx;
  EXPECT(CUDRV(cuDevicePrimaryCtxRetain)(&ctx, 0), 0);
  EXPECT(CUDRV(cuCtxSetCurrent)(ctx), 0);
  CUmemAllocationProp prop = cuda_prop(0);
  size_t g = 0;
  EXPECT(CUDRV(cuMemGetAllocationGranularity)(&g, &prop, 0), 0);
  EXPECT(g, 2 * MiB);
  size_t size = 8 * MiB;
  size_t free0 = cuda_free_now();
  CUdeviceptr va;
  EXPECT(CUDRV(cuMemAddressReserve)(&va, size, 0, 0, 0), 0);
  CUmemGenericAllocationHandle h;
  EXPECT(CUDRV(cuMemCreate)(&h, size, &prop, 0), 0);
  size_t free1 = cuda_free_now();
  EXPECT(free0 - free1, size);
  EXPECT(CUDRV(cuMemMap)(va, size, 0, h, 0), 0);
  CUmemAccessDesc acc = {{1, 0}, 3};
  EXPECT(CUDRV(cuMemSetAccess)(va, size, &acc, 1), 0);
  unsigned char *host = malloc(size), *back = malloc(size);
  fill(host, size, 7);
  EXPECT(CUDART(cudaMemcpy)((void *)va, host, size, 1), 0);
  /* pause: save, unmap, release */
  EXPECT(CUDART(cudaMemcpy)(back, (void *)va, size, 2), 0);
  EXPECT(CUDRV(cuMemUnmap)(va, size), 0);
  EXPECT(CUDRV(cuMemRelease)(h), 0);
  size_t free2 = cuda_free_now();
  EXPECT(free2 - free1, size);
  /* resume at the same address */
  EXPECT(CUDRV(cuMemCreate)(&h, size, &prop, 0), 0);
  EXPECT(CUDRV(cuMemMap)(va, size, 0, h, 0), 0);
  EXPECT(CUDRV(cuMemSetAccess)(va, size, &acc, 1), 0);
  EXPECT(cuda_free_now(), free1);
  EXPECT(CUDART(cudaMemcpy)((void *)va, back, size, 1), 0);
  memset(host, 0, size);
  EXPECT(CUDART(cudaMemcpy)(host, (void *)va, size, 2), 0);
  EXPECT(check(host, size, 7), 1);
  EXPECT(CUDRV(cuMemUnmap)(va, size), 0);
  EXPECT(CUDRV(cuMemRelease)(h), 0);
  EXPECT(CUDRV(cuMemAddressFree)(va, size), 0);
  EXPECT(cuda_free_now(), free0);
  printf("free0=%zu free_after_create=%zu free_after_release=%zu\n", free0, free1, free2);
  free(host);
  free(back);
  return 0;
}

static void *no_context_thread(void *out) {
  size_t f, t;
  *(int *)out = CUDRV(cuMemGetInfo_v2)(&f, &t);
  return NULL;
}

static int cuda_errors(void) {
  size_t f, t;
  EXPECT(CUDRV(cuMemGetInfo_v2)(&f, &t), 3); /* before cuInit */
  EXPECT(CUDRV(cuInit)(0), 0);
  pthread_t th;
  int code = -1;
  pthread_create(&th, NULL, no_context_thread, &code);
  pthread_join(th, NULL);
  EXPECT(code, 201); /* no current context on a fresh thread */
  void *p = NULL;
  EXPECT(CUDART(cudaMalloc)(&p, 1 * MiB), 0);
  EXPECT(CUDART(cudaFree)(p), 0);
  EXPECT(CUDART(cudaFree)(p), 1);                    /* double free */
  EXPECT(CUDART(cudaFree)((void *)0x1234), 1);       /* unknown pointer */
  EXPECT(CUDART(cudaGetLastError)(), 1);
  EXPECT(CUDART(cudaGetLastError)(), 0);
  EXPECT(CUDART(cudaFree)(NULL), 0);                 /* context initialization idiom */
  EXPECT(CUDART(cudaMemGetInfo)(&f, &t), 0);
  EXPECT(CUDART(cudaMalloc)(&p, t + 1), 2);          /* larger than the device */
  CUmemAllocationProp prop = cuda_prop(0);
  CUmemGenericAllocationHandle h;
  EXPECT(CUDRV(cuMemCreate)(&h, 3 * MiB, &prop, 0), 1);          /* not a granularity multiple */
  EXPECT(CUDRV(cuMemCreate)(&h, (t / (2 * MiB) + 1) * 2 * MiB, &prop, 0), 2);
  CUmemAllocationProp bad = cuda_prop(7);
  EXPECT(CUDRV(cuMemCreate)(&h, 2 * MiB, &bad, 0), 101);         /* no such device */
  EXPECT(CUDRV(cuMemCreate)(&h, 2 * MiB, &prop, 0), 0);
  CUdeviceptr va;
  EXPECT(CUDRV(cuMemAddressReserve)(&va, 4 * MiB, 0, 0, 0), 0);
  EXPECT(CUDRV(cuMemMap)(va + 64 * MiB, 2 * MiB, 0, h, 0), 1);   /* outside the reservation */
  EXPECT(CUDRV(cuMemMap)(va, 2 * MiB, 4096, h, 0), 1);           /* offset must be 0 */
  EXPECT(CUDRV(cuMemMap)(va, 4 * MiB, 0, h, 0), 1);              /* larger than the handle */
  EXPECT(CUDRV(cuMemMap)(va, 2 * MiB, 0, h, 0), 0);
  EXPECT(CUDRV(cuMemMap)(va, 2 * MiB, 0, h, 0), 1);              /* overlapping map */
  CUmemAccessDesc acc = {{1, 0}, 3};
  EXPECT(CUDRV(cuMemSetAccess)(va, 1 * MiB, &acc, 1), 1);        /* part of a granule */
  EXPECT(CUDRV(cuMemSetAccess)(va, 4 * MiB, &acc, 1), 1);        /* beyond the mapping */
  EXPECT(CUDRV(cuMemSetAccess)(va, 2 * MiB, &acc, 1), 0);
  EXPECT(CUDART(cudaMemcpy)(&t, (void *)(va + 8), SIZE_MAX - 4, 2), 1); /* length wraps */
  EXPECT(CUDART(cudaMemset)((void *)va, 0, SIZE_MAX), 1);
  EXPECT(CUDRV(cuMemAddressFree)(va, 4 * MiB), 1);               /* still mapped */
  EXPECT(CUDRV(cuMemUnmap)(va, 1 * MiB), 1);                     /* partial unmap */
  EXPECT(CUDRV(cuMemUnmap)(va, 2 * MiB), 0);
  EXPECT(CUDRV(cuMemUnmap)(va, 2 * MiB), 1);                     /* double unmap */
  EXPECT(CUDRV(cuMemRelease)(h), 0);
  EXPECT(CUDRV(cuMemRelease)(h), 1);                             /* double release */
  EXPECT(CUDRV(cuMemAddressFree)(va, 4 * MiB), 0);
  EXPECT(CUDRV(cuMemAddressFree)(va, 4 * MiB), 1);               /* double free of the range */
  EXPECT(CUDART(cudaMemcpy)(NULL, &f, 8, 1), 1);
  EXPECT(CUDART(cudaMemcpy)(&t, &f, 8, 9), 1);                   /* bad kind */
  EXPECT(CUDART(cudaMemcpy)(&t, &f, 8, 1), 1);                   /* host->host called H2D */
  EXPECT(CUDART(cudaSetDevice)(99), 101);
  const char *s = NULL;
  EXPECT(CUDRV(cuGetErrorString)(2, &s), 0);
  EXPECT(strcmp(s, "out of memory"), 0);
  EXPECT(CUDRV(cuGetErrorString)(123456, &s), 1);
  printf("cuda errors ok\n");
  return 0;
}

static size_t acl_free_now(void) {
  size_t f = 0, t = 0;
  ACL(aclrtGetMemInfo)(1, &f, &t);
  return f;
}

static aclrtPhysicalMemProp acl_prop(uint32_t dev) {
  aclrtPhysicalMemProp p;
  memset(&p, 0, sizeof p);
  p.handleType = 0;
  p.allocationType = 0; /* PINNED */
  p.memAttr = 4;        /* HBM_MEM_HUGE */
  p.location.id = dev;
  p.location.type = 1;  /* DEVICE */
  return p;
}

static int acl_vmm(void) {
  EXPECT(ACL(aclInit)(NULL), 0);
  EXPECT(ACL(aclrtSetDevice)(0), 0);
  aclrtPhysicalMemProp prop = acl_prop(0);
  size_t g = 0;
  EXPECT(ACL(aclrtMemGetAllocationGranularity)(&prop, 0, &g), 0);
  EXPECT(g, 2 * MiB);
  size_t size = 8 * MiB;
  size_t free0 = acl_free_now();
  void *va;
  EXPECT(ACL(aclrtReserveMemAddress)(&va, size, 0, NULL, 0), 0);
  aclrtDrvMemHandle h;
  EXPECT(ACL(aclrtMallocPhysical)(&h, size, &prop, 0), 0);
  EXPECT(free0 - acl_free_now(), size);
  EXPECT(ACL(aclrtMapMem)(va, size, 0, h, 0), 0);
  unsigned char *host = malloc(size), *back = malloc(size);
  fill(host, size, 3);
  EXPECT(ACL(aclrtMemcpy)(va, size, host, size, 1), 0);
  EXPECT(ACL(aclrtMemcpy)(back, size, va, size, 2), 0);
  EXPECT(ACL(aclrtFreePhysical)(h), 107000); /* still mapped: refused */
  EXPECT(ACL(aclrtUnmapMem)(va), 0);
  EXPECT(ACL(aclrtUnmapMem)(va), 107000);    /* double unmap */
  EXPECT(ACL(aclrtFreePhysical)(h), 0);
  EXPECT(acl_free_now(), free0);
  EXPECT(ACL(aclrtMallocPhysical)(&h, size, &prop, 0), 0);
  EXPECT(ACL(aclrtMapMem)(va, size, 0, h, 0), 0);
  EXPECT(ACL(aclrtMemcpy)(va, size, back, size, 1), 0);
  memset(host, 0, size);
  EXPECT(ACL(aclrtMemcpy)(host, size, va, size, 2), 0);
  EXPECT(check(host, size, 3), 1);
  EXPECT(ACL(aclrtUnmapMem)(va), 0);
  EXPECT(ACL(aclrtFreePhysical)(h), 0);
  EXPECT(ACL(aclrtReleaseMemAddress)(va), 0);
  EXPECT(acl_free_now(), free0);
  printf("acl vmm ok free0=%zu\n", free0);
  free(host);
  free(back);
  return 0;
}

static void *acl_no_device_thread(void *out) {
  size_t f, t;
  *(int *)out = ACL(aclrtGetMemInfo)(1, &f, &t);
  return NULL;
}

/* A copy from an unmapped range is a device fault, and it is sticky: the context is dead, every
 * later call that needs it fails with 700 and cudaGetLastError keeps returning it; queries that
 * need no context still answer. */
static int cuda_sticky_fault(void) {
  EXPECT(CUDART(cudaSetDevice)(0), 0);
  void *plain = NULL;
  EXPECT(CUDART(cudaMalloc)(&plain, 1 * MiB), 0);
  EXPECT(CUDRV(cuInit)(0), 0);
  size_t size = 2 * MiB;
  CUdeviceptr va = 0;
  EXPECT(CUDRV(cuMemAddressReserve)(&va, size, 0, 0, 0), 0);
  unsigned char host[16];
  EXPECT(CUDART(cudaMemcpy)(host, (void *)va, 16, 2), 700); /* reserved, never mapped */
  void *p = NULL;
  EXPECT(CUDART(cudaMalloc)(&p, 1 * MiB), 700);
  EXPECT(CUDART(cudaFree)(plain), 700);
  EXPECT(CUDART(cudaGetLastError)(), 700);
  EXPECT(CUDART(cudaGetLastError)(), 700); /* not cleared */
  size_t f = 0, t = 0;
  EXPECT(CUDRV(cuMemGetInfo_v2)(&f, &t), 700);
  int n = 0;
  EXPECT(CUDART(cudaGetDeviceCount)(&n), 0);
  printf("sticky ok\n");
  return 0;
}

static int acl_errors(void) {
  EXPECT(ACL(aclInit)(NULL), 0);
  void *p = NULL;
  EXPECT(ACL(aclrtMalloc)(&p, 1 * MiB, 0), 107002); /* no device set on this thread */
  EXPECT(ACL(aclrtSetDevice)(0), 0);
  pthread_t th;
  int code = -1;
  pthread_create(&th, NULL, acl_no_device_thread, &code);
  pthread_join(th, NULL);
  EXPECT(code, 107002);
  EXPECT(ACL(aclrtSetDevice)(42), 107001);
  EXPECT(ACL(aclrtMallocAlign32)(&p, 1 * MiB, 0), 0);
  EXPECT(ACL(aclrtFree)(p), 0);
  EXPECT(ACL(aclrtFree)(p), 107000);                 /* double free */
  size_t f, t;
  EXPECT(ACL(aclrtGetMemInfo)(0, &f, &t), 0); /* DDR: a 910B has none */
  EXPECT(f, 0);
  EXPECT(t, 0);
  EXPECT(ACL(aclrtGetMemInfo)(10, &f, &t), 100000);
  EXPECT(ACL(aclrtGetMemInfo)(1, &f, &t), 0);
  EXPECT(t > 0, 1);
  EXPECT(ACL(aclrtMalloc)(&p, t + 1, 0), 207001);    /* out of memory */
  aclrtPhysicalMemProp prop = acl_prop(0);
  aclrtDrvMemHandle h;
  EXPECT(ACL(aclrtMallocPhysical)(&h, 3 * MiB, &prop, 0), 107000);
  EXPECT(ACL(aclrtMallocPhysical)(&h, (t / (2 * MiB) + 1) * 2 * MiB, &prop, 0), 207001);
  EXPECT(ACL(aclrtMallocPhysical)(&h, 2 * MiB, &prop, 0), 0);
  void *va;
  EXPECT(ACL(aclrtReserveMemAddress)(&va, 4 * MiB, 4096, NULL, 0), 100000); /* alignment must be 0 */
  EXPECT(ACL(aclrtReserveMemAddress)(&va, 4 * MiB, 0, NULL, 0), 0);
  EXPECT(ACL(aclrtMapMem)((char *)va + 64 * MiB, 2 * MiB, 0, h, 0), 107000); /* outside */
  EXPECT(ACL(aclrtMapMem)(va, 4 * MiB, 0, h, 0), 107000);                   /* size != handle */
  EXPECT(ACL(aclrtMapMem)(va, 2 * MiB, 0, h, 0), 0);
  EXPECT(ACL(aclrtReleaseMemAddress)(va), 107000);                          /* still mapped */
  EXPECT(ACL(aclrtMemcpy)(&f, 4, va, 8, 2), 100000);                        /* count > destMax */
  EXPECT(ACL(aclrtMemset)(va, 2 * MiB, 0xab, 2 * MiB), 0);
  EXPECT(ACL(aclrtUnmapMem)(va), 0);
  EXPECT(ACL(aclrtMemcpy)(&f, 8, va, 8, 2), 107000); /* unmapped: this call fails... */
  EXPECT(ACL(aclrtMalloc)(&p, 1 * MiB, 0), 0);       /* ...and later ones do not (per task) */
  EXPECT(ACL(aclrtFree)(p), 0);
  EXPECT(ACL(aclrtFreePhysical)(h), 0);
  EXPECT(ACL(aclrtFreePhysical)(h), 107000);                                /* double free */
  EXPECT(ACL(aclrtReleaseMemAddress)(va), 0);
  printf("acl errors ok\n");
  return 0;
}

/* Allocates MiB on the device and holds it until stdin closes; prints free memory before/after. */
static int hold(const char *api, long mib) {
  void *p = NULL;
  size_t before, after;
  int rc;
  if (strcmp(api, "acl") == 0) {
    ACL(aclrtSetDevice)(0);
    before = acl_free_now();
    rc = ACL(aclrtMalloc)(&p, (size_t)mib * MiB, 0);
    after = acl_free_now();
  } else {
    before = cuda_free_now();
    rc = CUDART(cudaMalloc)(&p, (size_t)mib * MiB);
    after = cuda_free_now();
  }
  printf("HOLD rc=%d free_before=%zu free_after=%zu\n", rc, before, after);
  fflush(stdout);
  char buf[16];
  while (read(0, buf, sizeof buf) > 0) {
  }
  if (rc == 0) {
    if (strcmp(api, "acl") == 0) ACL(aclrtFree)(p); else CUDART(cudaFree)(p);
  }
  return 0;
}

/* Device memory as the hook makes it: reserve, create, map, grant read/write on device 0. */
static int map_new_memory(size_t size, CUdeviceptr *va, CUmemGenericAllocationHandle *h) {
  CUmemAllocationProp prop = cuda_prop(0);
  EXPECT(CUDRV(cuMemAddressReserve)(va, size, 0, 0, 0), 0);
  EXPECT(CUDRV(cuMemCreate)(h, size, &prop, 0), 0);
  EXPECT(CUDRV(cuMemMap)(*va, size, 0, *h, 0), 0);
  CUmemAccessDesc acc = {{1, 0}, 3};
  EXPECT(CUDRV(cuMemSetAccess)(*va, size, &acc, 1), 0);
  return 0;
}

/* The kB figure of the first line of `path` that `format` (e.g. "Shmem: %ld kB") reads, or -1. */
static long proc_kib(const char *path, const char *format) {
  FILE *f = fopen(path, "r");
  char line[256];
  long v = -1;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, format, &v) == 1) break;
  if (f) fclose(f);
  return v;
}

static long shmem_kib(void) { return proc_kib("/proc/meminfo", "Shmem: %ld kB"); }

/* Releasing physical memory must give host memory back: the simulator's resident bytes (memfd
 * blocks) and the kernel's Shmem both fall; RSS alone would prove nothing. */
static int release_returns_memory(void) {
  struct tms_sim_stats s0, s1, s2;
  EXPECT(CUDRV(cuInit)(0), 0);
  size_t size = 256 * MiB;
  /* Shmem is machine-wide: other processes' shared memory moves it too (tests run in parallel).
     The simulator's own count is checked exactly every time; Shmem must show most of the
     256 MiB coming and going in one of three tries. */
  for (int attempt = 0; attempt < 3; attempt++) {
    CUdeviceptr va;
    CUmemGenericAllocationHandle h;
    EXPECT(sim_stats(&s0), 0);
    long shmem0 = shmem_kib();
    EXPECT(map_new_memory(size, &va, &h), 0);
    EXPECT(CUDART(cudaMemset)((void *)va, 0x5a, size), 0); /* touch every page */
    EXPECT(sim_stats(&s1), 0);
    long shmem1 = shmem_kib();
    EXPECT(CUDRV(cuMemUnmap)(va, size), 0);
    EXPECT(CUDRV(cuMemRelease)(h), 0);
    EXPECT(CUDRV(cuMemAddressFree)(va, size), 0);
    EXPECT(sim_stats(&s2), 0);
    long shmem2 = shmem_kib();
    printf("resident: %llu -> %llu -> %llu; Shmem kB: %ld -> %ld -> %ld\n",
           (unsigned long long)s0.host_resident_bytes, (unsigned long long)s1.host_resident_bytes,
           (unsigned long long)s2.host_resident_bytes, shmem0, shmem1, shmem2);
    EXPECT(s1.host_resident_bytes - s0.host_resident_bytes >= size, 1);
    EXPECT(s2.host_resident_bytes, s0.host_resident_bytes);
    if (shmem1 - shmem0 > 200 * 1024 && shmem1 - shmem2 > 200 * 1024) return 0;
  }
  fprintf(stderr, "Shmem never showed the 256 MiB coming and going\n");
  return 1;
}

static int count_fds(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  while (d && (e = readdir(d))) n += e->d_name[0] != '.';
  if (d) closedir(d);
  return n;
}

/* 10,000 live physical handles, each mapped, must not cost a file descriptor each. */
static int many_handles(long n) {
  EXPECT(CUDRV(cuInit)(0), 0);
  CUmemAllocationProp prop = cuda_prop(0);
  int fds0 = count_fds();
  CUdeviceptr va;
  EXPECT(CUDRV(cuMemAddressReserve)(&va, (size_t)n * 2 * MiB, 0, 0, 0), 0);
  CUmemGenericAllocationHandle *hs = calloc((size_t)n, sizeof *hs);
  CUmemAccessDesc acc = {{1, 0}, 3};
  for (long i = 0; i < n; i++) {
    CUdeviceptr at = va + (CUdeviceptr)i * 2 * MiB;
    EXPECT(CUDRV(cuMemCreate)(&hs[i], 2 * MiB, &prop, 0), 0);
    EXPECT(CUDRV(cuMemMap)(at, 2 * MiB, 0, hs[i], 0), 0);
    EXPECT(CUDRV(cuMemSetAccess)(at, 2 * MiB, &acc, 1), 0);
    EXPECT(CUDART(cudaMemcpy)((void *)at, &i, sizeof i, 1), 0);
  }
  struct tms_sim_stats s;
  EXPECT(sim_stats(&s), 0);
  EXPECT(s.live_handles, n);
  int fds1 = count_fds();
  for (long i = 0; i < n; i++) {
    long got = -1;
    EXPECT(CUDART(cudaMemcpy)(&got, (void *)(va + (CUdeviceptr)i * 2 * MiB), sizeof got, 2), 0);
    EXPECT(got, i);
  }
  for (long i = 0; i < n; i++) {
    EXPECT(CUDRV(cuMemUnmap)(va + (CUdeviceptr)i * 2 * MiB, 2 * MiB), 0);
    EXPECT(CUDRV(cuMemRelease)(hs[i]), 0);
  }
  EXPECT(CUDRV(cuMemAddressFree)(va, (size_t)n * 2 * MiB), 0);
  printf("handles=%ld fds: %d -> %d\n", n, fds0, fds1);
  EXPECT(fds1 - fds0 <= 2, 1);
  free(hs);
  return 0;
}

/* Prints the result code of `n` cuMemCreate calls (fault injection is set by the environment). */
static int creates(long n) {
  EXPECT(CUDRV(cuInit)(0), 0);
  CUmemAllocationProp prop = cuda_prop(0);
  for (long i = 0; i < n; i++) {
    CUmemGenericAllocationHandle h;
    int rc = CUDRV(cuMemCreate)(&h, 2 * MiB, &prop, 0);
    printf("%d%s", rc, i + 1 < n ? " " : "\n");
    if (rc == 0) CUDRV(cuMemRelease)(h);
  }
  return 0;
}

/* Async copies on streams overlap and complete by synchronize; contents must round-trip. */
static int streams(void) {
  size_t size = 32 * MiB;
  void *dev, *pinned;
  EXPECT(CUDART(cudaMalloc)(&dev, size), 0);
  EXPECT(CUDART(cudaMallocHost)(&pinned, size), 0);
  fill(pinned, size, 11);
  cudaStream_t s[4];
  for (int i = 0; i < 4; i++) EXPECT(CUDART(cudaStreamCreate)(&s[i]), 0);
  size_t chunk = size / 4;
  for (int i = 0; i < 4; i++)
    EXPECT(CUDART(cudaMemcpyAsync)((char *)dev + i * chunk, (char *)pinned + i * chunk, chunk, 1, s[i]), 0);
  for (int i = 0; i < 4; i++) EXPECT(CUDART(cudaStreamSynchronize)(s[i]), 0);
  memset(pinned, 0, size);
  for (int i = 0; i < 4; i++)
    EXPECT(CUDART(cudaMemcpyAsync)((char *)pinned + i * chunk, (char *)dev + i * chunk, chunk, 2, s[i]), 0);
  EXPECT(CUDART(cudaDeviceSynchronize)(), 0);
  EXPECT(check(pinned, size, 11), 1);
  for (int i = 0; i < 4; i++) EXPECT(CUDART(cudaStreamDestroy)(s[i]), 0);
  EXPECT(CUDART(cudaStreamSynchronize)(s[0]), 400); /* destroyed */
  EXPECT(CUDART(cudaFreeHost)(pinned), 0);
  EXPECT(CUDART(cudaFree)(dev), 0);
  printf("streams ok\n");
  return 0;
}

/* Run with TMS_SIM_COPY_GBPS=1. An async copy's bytes land over its modelled time (64 MiB at
 * 1 GB/s: about 67 ms), not when the call returns: a reader that skips the synchronize sees the old
 * bytes, in both directions. */
static int copies_land_late(void) {
  size_t size = 64 * MiB;
  void *dev;
  unsigned char *pinned, *probe;
  EXPECT(CUDART(cudaMalloc)(&dev, size), 0);
  EXPECT(CUDART(cudaMallocHost)((void **)&pinned, size), 0);
  EXPECT(CUDART(cudaMallocHost)((void **)&probe, 4096), 0);
  memset(pinned, 0, size);
  EXPECT(CUDART(cudaMemcpy)(dev, pinned, size, 1), 0);
  cudaStream_t s;
  EXPECT(CUDART(cudaStreamCreateWithFlags)(&s, 1 /* non-blocking: stream 0 does not wait for it */), 0);
  fill(pinned, size, 5);
  EXPECT(CUDART(cudaMemcpyAsync)(dev, pinned, size, 1, s), 0);
  EXPECT(CUDART(cudaMemcpy)(probe, (char *)dev + size - 4096, 4096, 2), 0);
  int landed_early = 0;
  for (size_t i = 0; i < 4096; i++) landed_early |= probe[i];
  EXPECT(landed_early, 0);
  EXPECT(CUDART(cudaStreamSynchronize)(s), 0);
  EXPECT(CUDART(cudaMemcpy)(probe, (char *)dev + size - 4096, 4096, 2), 0);
  for (size_t i = 0; i < 4096; i++) EXPECT(probe[i], (unsigned char)((size - 4096 + i) * 31u + 5));

  memset(pinned, 0, size);
  EXPECT(CUDART(cudaMemcpyAsync)(pinned, dev, size, 2, s), 0);
  int tail_early = 0;
  for (size_t i = size - 4096; i < size; i++) tail_early |= pinned[i];
  EXPECT(tail_early, 0);
  EXPECT(CUDART(cudaStreamSynchronize)(s), 0);
  EXPECT(check(pinned, size, 5), 1);
  EXPECT(CUDART(cudaStreamDestroy)(s), 0);
  EXPECT(CUDART(cudaFreeHost)(probe), 0);
  EXPECT(CUDART(cudaFreeHost)(pinned), 0);
  EXPECT(CUDART(cudaFree)(dev), 0);
  printf("copies land late ok\n");
  return 0;
}

/* A gate on the legacy default stream: a host function that holds the stream until the test
 * opens it. It gives up after 10 s and says so: a call that waited for the stream instead of
 * returning (the gate opens only after it returns) shows as a timed-out gate, not as a hang. */
struct gate {
  int open, timed_out;
};

static void gate_wait(void *arg) {
  struct gate *g = arg;
  for (int i = 0; i < 10000 && !__atomic_load_n(&g->open, __ATOMIC_ACQUIRE); i++) usleep(1000);
  if (!__atomic_load_n(&g->open, __ATOMIC_ACQUIRE)) __atomic_store_n(&g->timed_out, 1, __ATOMIC_RELEASE);
}

static int gate_close(struct gate *g, cudaStream_t s) {
  g->open = g->timed_out = 0;
  EXPECT(CUDART(cudaLaunchHostFunc)(s, gate_wait, g), 0);
  return 0;
}

/* Opens the gate and waits for the stream; the calls made meanwhile must not have waited. */
static int gate_open(struct gate *g, cudaStream_t s) {
  EXPECT(CUDART(cudaStreamQuery)(s), 600); /* cudaErrorNotReady: the gate still holds it */
  __atomic_store_n(&g->open, 1, __ATOMIC_RELEASE);
  EXPECT(CUDART(cudaStreamSynchronize)(s), 0);
  EXPECT(__atomic_load_n(&g->timed_out, __ATOMIC_ACQUIRE), 0);
  return 0;
}

static int all_zero(const unsigned char *h, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (h[i]) return 0;
  return 1;
}

/* The legacy default stream is asynchronous, as on a GPU (CUDA Runtime API, "API synchronization
 * behavior"): copies between device and page-locked memory, device-to-device copies and memsets
 * queued on stream 0 (and CU_STREAM_LEGACY, cudaStreamPerThread) return before they run; pageable
 * copies return once the source may be reused (to the device) or the bytes landed (to the host).
 * Run with TMS_SIM_COPY_GBPS=1. */
static int default_stream_async(void) {
  size_t size = 64 * MiB;
  unsigned char *dev, *dev2, *pinned, *pageable, *registered;
  EXPECT(CUDART(cudaMalloc)((void **)&dev, size), 0);
  EXPECT(CUDART(cudaMalloc)((void **)&dev2, size), 0);
  EXPECT(CUDART(cudaMallocHost)((void **)&pinned, size), 0);
  pageable = malloc(size);
  registered = malloc(size);
  EXPECT(pageable != NULL && registered != NULL, 1);
  EXPECT(CUDART(cudaHostRegister)(registered, size, 0), 0);
  fill(pageable, size, 5);
  EXPECT(CUDART(cudaMemcpy)(dev, pageable, size, 1), 0);
  struct gate g;

  /* A pinned D2H copy with nothing before it: it returns while the copy engine runs (64 MiB at
     1 GB/s take about 67 ms), and the bytes are all there after the synchronize. */
  memset(pinned, 0, size);
  EXPECT(CUDART(cudaMemcpyAsync)(pinned, dev, size, 2, 0), 0);
  EXPECT(CUDART(cudaStreamQuery)(0), 600);
  EXPECT(pinned[size - 1], 0);
  EXPECT(CUDART(cudaStreamSynchronize)(0), 0);
  EXPECT(CUDART(cudaStreamQuery)(0), 0);
  EXPECT(check(pinned, size, 5), 1);

  /* Behind a closed gate, every non-pageable kind is queued and lands in stream order. */
  memset(pinned, 0, size);
  memset(registered, 0, size);
  EXPECT(gate_close(&g, 0), 0);
  EXPECT(CUDART(cudaMemcpyAsync)(dev2, dev, size, 3, 0), 0);               /* device to device */
  EXPECT(CUDART(cudaMemcpyAsync)(pinned, dev2, size, 2, (cudaStream_t)1), 0); /* legacy, by name */
  EXPECT(CUDRV(cuMemcpyDtoHAsync_v2)(registered, (CUdeviceptr)dev2, size, 0), 0); /* driver API */
  cudaEvent_t ev;
  EXPECT(CUDART(cudaEventCreate)(&ev), 0);
  EXPECT(CUDART(cudaEventRecord)(ev, 0), 0);
  EXPECT(CUDART(cudaEventQuery)(ev), 600);
  EXPECT(all_zero(pinned, size), 1);
  EXPECT(all_zero(registered, size), 1);
  EXPECT(gate_open(&g, 0), 0);
  EXPECT(CUDART(cudaEventQuery)(ev), 0);
  EXPECT(check(pinned, size, 5), 1);
  EXPECT(check(registered, size, 5), 1);

  /* A memset and a pinned H2D copy queue too; cudaDeviceSynchronize waits for them. */
  EXPECT(gate_close(&g, 0), 0);
  EXPECT(CUDART(cudaMemsetAsync)(dev2, 0xAB, size, 0), 0);
  fill(pinned, size, 7);
  EXPECT(CUDART(cudaMemcpyAsync)(dev, pinned, size / 2, 1, (cudaStream_t)2), 0); /* per-thread */
  EXPECT(CUDRV(cuMemcpyHtoDAsync_v2)((CUdeviceptr)dev + size / 2, pinned + size / 2, size / 2, 0), 0);
  EXPECT(CUDART(cudaStreamQuery)(0), 600);
  __atomic_store_n(&g.open, 1, __ATOMIC_RELEASE);
  EXPECT(CUDART(cudaDeviceSynchronize)(), 0);
  EXPECT(g.timed_out, 0);
  EXPECT(CUDART(cudaMemcpy)(pageable, dev2, size, 2), 0);
  for (size_t i = 0; i < size; i++) EXPECT(pageable[i], 0xAB);
  EXPECT(CUDART(cudaMemcpy)(pageable, dev, size, 2), 0);
  EXPECT(check(pageable, size, 7), 1);

  /* A blocking stream waits for the legacy stream's earlier work; a non-blocking one does not. */
  cudaStream_t blocking, non_blocking;
  EXPECT(CUDART(cudaStreamCreate)(&blocking), 0);
  EXPECT(CUDART(cudaStreamCreateWithFlags)(&non_blocking, 1), 0);
  memset(pinned, 0, size);
  EXPECT(gate_close(&g, 0), 0);
  EXPECT(CUDART(cudaMemsetAsync)(dev2, 0x5A, size, 0), 0);
  EXPECT(CUDART(cudaMemcpyAsync)(registered, dev2, 4096, 2, non_blocking), 0);
  EXPECT(CUDART(cudaStreamSynchronize)(non_blocking), 0); /* returns with the gate closed */
  EXPECT(registered[0], 0xAB);                               /* read before the queued memset */
  cudaStream_t drv;
  EXPECT(CUDRV(cuStreamCreate)(&drv, 2), 1); /* CU_STREAM_NON_BLOCKING is the only flag */
  EXPECT(CUDRV(cuStreamCreate)(&drv, 1), 0); /* as the hook makes its copy streams */
  EXPECT(CUDRV(cuMemcpyDtoHAsync_v2)(registered, (CUdeviceptr)dev2, 4096, drv), 0);
  EXPECT(CUDRV(cuStreamSynchronize)(drv), 0); /* the driver's flag holds too */
  EXPECT(CUDRV(cuStreamDestroy_v2)(drv), 0);
  EXPECT(CUDART(cudaMemcpyAsync)(pinned, dev2, size, 2, blocking), 0);
  EXPECT(CUDART(cudaStreamQuery)(blocking), 600);
  EXPECT(gate_open(&g, 0), 0);
  EXPECT(CUDART(cudaStreamSynchronize)(blocking), 0);
  for (size_t i = 0; i < size; i++) EXPECT(pinned[i], 0x5A);
  EXPECT(CUDART(cudaStreamDestroy)(blocking), 0);
  EXPECT(CUDART(cudaStreamDestroy)(non_blocking), 0);

  /* Pageable memory keeps CUDA's documented behaviour, in stream order: to the host the call
     returns once the bytes landed, from the host once the source may be reused. */
  fill(pinned, size, 9);
  EXPECT(CUDART(cudaMemcpyAsync)(dev, pinned, size, 1, 0), 0);   /* queued first */
  memset(pageable, 0, size);
  EXPECT(CUDART(cudaMemcpyAsync)(pageable, dev, size, 2, 0), 0); /* after it, landed on return */
  EXPECT(CUDART(cudaStreamQuery)(0), 0);
  EXPECT(check(pageable, size, 9), 1);
  fill(pageable, size, 13);
  EXPECT(CUDART(cudaMemcpyAsync)(dev2, pageable, size, 1, 0), 0);
  memset(pageable, 0, size); /* the source may be reused at once */
  EXPECT(CUDART(cudaMemcpy)(pageable, dev2, size, 2), 0);
  EXPECT(check(pageable, size, 13), 1);

  EXPECT(CUDART(cudaEventDestroy)(ev), 0);
  EXPECT(CUDART(cudaHostUnregister)(registered), 0);
  free(registered);
  free(pageable);
  EXPECT(CUDART(cudaFreeHost)(pinned), 0);
  EXPECT(CUDART(cudaFree)(dev2), 0);
  EXPECT(CUDART(cudaFree)(dev), 0);
  printf("default stream async ok\n");
  return 0;
}

/* Work queued on the legacy default stream meets memory unmapped after it was queued: the fault
 * comes when the stream runs it, reported by the next synchronize and sticky (700), as on any
 * other stream. `what`: "copy" or "memset". */
static int default_stream_fault(const char *what) {
  EXPECT(CUDRV(cuInit)(0), 0);
  CUcontext ctx;
  EXPECT(CUDRV(cuDevicePrimaryCtxRetain)(&ctx, 0), 0);
  EXPECT(CUDRV(cuCtxSetCurrent)(ctx), 0);
  size_t size = 2 * MiB;
  CUdeviceptr va;
  CUmemGenericAllocationHandle h;
  EXPECT(map_new_memory(size, &va, &h), 0);
  unsigned char *pinned;
  EXPECT(CUDART(cudaMallocHost)((void **)&pinned, size), 0);
  struct gate g;
  EXPECT(gate_close(&g, 0), 0);
  if (!strcmp(what, "copy"))
    EXPECT(CUDART(cudaMemcpyAsync)((void *)va, pinned, size, 1, 0), 0);
  else
    EXPECT(CUDART(cudaMemsetAsync)((void *)va, 1, size, 0), 0);
  EXPECT(CUDRV(cuMemUnmap)(va, size), 0); /* the memory saver's pause, without a synchronize */
  __atomic_store_n(&g.open, 1, __ATOMIC_RELEASE);
  EXPECT(CUDART(cudaStreamSynchronize)(0), 700);
  EXPECT(g.timed_out, 0);
  void *p = NULL;
  EXPECT(CUDART(cudaMalloc)(&p, 1 * MiB), 700); /* sticky: the context is dead */
  printf("default stream fault ok\n");
  return 0;
}

/* Run with TMS_SIM_COPY_GBPS=1. Unmapping memory that a queued copy is still writing is allowed,
 * and the copy faults: its stream reports 700 and the context is dead (sticky), as on a GPU. This
 * is why pause must synchronize before it unmaps. */
static int unmap_in_flight(void) {
  EXPECT(CUDRV(cuInit)(0), 0);
  CUcontext ctx;
  EXPECT(CUDRV(cuDevicePrimaryCtxRetain)(&ctx, 0), 0);
  EXPECT(CUDRV(cuCtxSetCurrent)(ctx), 0);
  /* 256 MiB at the test's 1 GB/s take about 270 ms: the unmap lands mid-copy even when a loaded
     machine oversleeps the 20 ms several times over. */
  size_t size = 256 * MiB;
  CUdeviceptr va;
  CUmemGenericAllocationHandle h;
  EXPECT(map_new_memory(size, &va, &h), 0);
  unsigned char *pinned;
  EXPECT(CUDART(cudaMallocHost)((void **)&pinned, size), 0);
  fill(pinned, size, 9);
  cudaStream_t s;
  EXPECT(CUDART(cudaStreamCreateWithFlags)(&s, 1), 0);
  EXPECT(CUDART(cudaMemcpyAsync)((void *)va, pinned, size, 1, s), 0);
  usleep(20000);
  EXPECT(CUDRV(cuMemUnmap)(va, size), 0);
  EXPECT(CUDART(cudaStreamSynchronize)(s), 700);
  void *p = NULL;
  EXPECT(CUDART(cudaMalloc)(&p, 1 * MiB), 700);
  printf("unmap in flight ok\n");
  return 0;
}

/* Device memory is not host memory: dereferencing a device address from the CPU faults (the
 * process dies with SIGSEGV) although the memory is allocated, mapped and accessible to copies. */
static int touch_device(const char *what) {
  void *p = NULL;
  if (!strcmp(what, "plain")) {
    EXPECT(CUDART(cudaMalloc)(&p, 2 * MiB), 0);
  } else if (!strcmp(what, "acl")) {
    EXPECT(ACL(aclInit)(NULL), 0);
    EXPECT(ACL(aclrtSetDevice)(0), 0);
    EXPECT(ACL(aclrtMalloc)(&p, 2 * MiB, 0), 0);
  } else {
    EXPECT(CUDRV(cuInit)(0), 0);
    CUcontext ctx;
    EXPECT(CUDRV(cuDevicePrimaryCtxRetain)(&ctx, 0), 0);
    EXPECT(CUDRV(cuCtxSetCurrent)(ctx), 0);
    CUmemAllocationProp prop = cuda_prop(0);
    CUdeviceptr va;
    CUmemGenericAllocationHandle h;
    EXPECT(CUDRV(cuMemAddressReserve)(&va, 2 * MiB, 0, 0, 0), 0);
    EXPECT(CUDRV(cuMemCreate)(&h, 2 * MiB, &prop, 0), 0);
    EXPECT(CUDRV(cuMemMap)(va, 2 * MiB, 0, h, 0), 0);
    CUmemAccessDesc acc = {{1, 0}, 3};
    EXPECT(CUDRV(cuMemSetAccess)(va, 2 * MiB, &acc, 1), 0);
    p = (void *)va;
  }
  unsigned char byte = 0x77;
  if (!strcmp(what, "acl"))
    EXPECT(ACL(aclrtMemcpy)(p, 1, &byte, 1, 1), 0);
  else
    EXPECT(CUDART(cudaMemcpy)(p, &byte, 1, 1), 0);
  printf("copies reach it\n");
  fflush(stdout);
  volatile unsigned char *stray = p;
  printf("the CPU read %d\n", *stray); /* must not be reached */
  return 0;
}

static uint64_t used_by_me(void) {
  struct tms_sim_stats s;
  if (sim_stats(&s)) return (uint64_t)-1;
  return s.process_used[0];
}

/* Device memory as a GPU's driver accounts it: the context takes memory when the first call that
 * needs it creates it (device queries create none); small cudaMalloc allocations share 2 MiB
 * granules (512-byte aligned), large ones take whole granules; aclrtMalloc adds CANN's padding. */
static int accounting(long context_mib) {
  int n = 0;
  EXPECT(CUDART(cudaGetDeviceCount)(&n), 0);
  EXPECT(used_by_me(), 0); /* no context yet */
  EXPECT(CUDART(cudaSetDevice)(0), 0);
  uint64_t ctx = (uint64_t)context_mib * MiB;
  EXPECT(used_by_me(), ctx);
  size_t f = 0, t = 0;
  EXPECT(CUDART(cudaMemGetInfo)(&f, &t), 0);
  EXPECT(t - f, ctx);

  enum { SMALL = 4096 };
  static void *p[SMALL + 1];
  EXPECT(CUDART(cudaMalloc)(&p[0], 4), 0);
  EXPECT(used_by_me() - ctx, 2 * MiB); /* a granule for the first small allocation */
  for (int i = 1; i < SMALL; i++) EXPECT(CUDART(cudaMalloc)(&p[i], 500), 0);
  EXPECT(used_by_me() - ctx, 2 * MiB); /* 4096 x 512 bytes fill it exactly */
  EXPECT(CUDART(cudaMalloc)(&p[SMALL], 1), 0);
  EXPECT(used_by_me() - ctx, 4 * MiB);
  void *big = NULL;
  EXPECT(CUDART(cudaMalloc)(&big, 3 * MiB), 0);
  EXPECT(used_by_me() - ctx, 8 * MiB); /* 3 MiB takes two whole granules */
  EXPECT(CUDART(cudaFree)(big), 0);
  for (int i = 0; i <= SMALL; i++) EXPECT(CUDART(cudaFree)(p[i]), 0);
  EXPECT(used_by_me(), ctx);

  EXPECT(ACL(aclInit)(NULL), 0);
  EXPECT(ACL(aclrtSetDevice)(0), 0);
  uint64_t both = used_by_me();
  EXPECT(both > ctx, 1); /* the Ascend context takes its own */
  void *a = NULL;
  EXPECT(ACL(aclrtMalloc)(&a, 2 * MiB - 32, 0), 0); /* + 32 bytes of padding: 2 MiB */
  EXPECT(used_by_me() - both, 2 * MiB);
  EXPECT(ACL(aclrtFree)(a), 0);
  EXPECT(ACL(aclrtMalloc)(&a, 2 * MiB - 31, 0), 0); /* 32-byte rounding, then padding: 2 MiB + 32 */
  EXPECT(used_by_me() - both, 4 * MiB);
  EXPECT(ACL(aclrtFree)(a), 0);
  EXPECT(ACL(aclrtMallocAlign32)(&a, 2 * MiB - 31, 0), 0); /* rounding only */
  EXPECT(used_by_me() - both, 2 * MiB);
  EXPECT(ACL(aclrtFree)(a), 0);
  printf("accounting ok\n");
  return 0;
}

/* Run with a context larger than the device: creating it fails as out of memory, on every path
 * that creates one, and nothing is charged. */
static int context_does_not_fit(void) {
  EXPECT(CUDART(cudaSetDevice)(0), 2);
  void *p = NULL;
  EXPECT(CUDART(cudaMalloc)(&p, 1 * MiB), 2);
  EXPECT(CUDRV(cuInit)(0), 0);
  CUcontext ctx;
  EXPECT(CUDRV(cuDevicePrimaryCtxRetain)(&ctx, 0), 2);
  EXPECT(ACL(aclInit)(NULL), 0);
  EXPECT(ACL(aclrtSetDevice)(0), 207001);
  EXPECT(used_by_me(), 0);
  printf("context does not fit ok\n");
  return 0;
}

static long vmrss_kib(void) { return proc_kib("/proc/self/status", "VmRSS: %ld kB"); }

/* Device memory is not in a process's resident set on a GPU; tools and tests (torch_memory_saver's
 * own) read VmRSS to see a CPU backup come and go. Plain and virtual-memory allocations, written
 * by memset and by copies, must leave VmRSS where it was (`in_rss` 0), while the host side of a
 * copy counts as it should; with TMS_SIM_DEVICE_IN_RSS=1 (`in_rss` 1) the device bytes do count.
 * Contents are checked after each round trip: dropping the pages must keep the bytes. */
static int device_rss(int in_rss) {
  const size_t size = 256 * MiB;
  const long size_kib = (long)(size / 1024), slack_kib = 32 * 1024;
  struct tms_sim_stats s0, s1;
  EXPECT(CUDRV(cuInit)(0), 0);
  void *plain = NULL;
  EXPECT(CUDART(cudaMalloc)(&plain, 4096), 0); /* the context and the runtime's first pages */
  EXPECT(sim_stats(&s0), 0);
  long rss0 = vmrss_kib();
  EXPECT(CUDART(cudaFree)(plain), 0);
  EXPECT(CUDART(cudaMalloc)(&plain, size), 0);
  EXPECT(CUDART(cudaMemset)(plain, 0x5a, size), 0);
  EXPECT(sim_stats(&s1), 0);
  long rss1 = vmrss_kib();
  unsigned char *host = malloc(size);
  if (!host) return 1;
  EXPECT(CUDART(cudaMemcpy)(host, plain, size, 2), 0);
  long rss2 = vmrss_kib();
  for (size_t i = 0; i < size; i += 4093) EXPECT(host[i], 0x5a);

  CUdeviceptr va;
  CUmemGenericAllocationHandle h;
  EXPECT(map_new_memory(size, &va, &h), 0);
  for (size_t i = 0; i < size; i++) host[i] = (unsigned char)(i * 7 + (i >> 20));
  EXPECT(CUDART(cudaMemcpy)((void *)va, host, size, 1), 0);
  EXPECT(CUDART(cudaMemcpy)(plain, (void *)va, size, 3), 0);
  long rss3 = vmrss_kib();
  memset(host, 0, size);
  EXPECT(CUDART(cudaMemcpy)(host, plain, size, 2), 0);
  for (size_t i = 0; i < size; i += 4093) EXPECT(host[i], (unsigned char)(i * 7 + (i >> 20)));
  printf("VmRSS kB: %ld -> %ld (256 MiB set on the device) -> %ld (copied to the host) -> %ld "
         "(256 MiB more through virtual memory); simulator resident: +%llu MiB\n",
         rss0, rss1, rss2, rss3, (unsigned long long)((s1.host_resident_bytes - s0.host_resident_bytes) / MiB));
  EXPECT(s1.host_resident_bytes - s0.host_resident_bytes >= size, 1); /* the bytes are there */
  EXPECT(rss2 - rss1 >= size_kib - slack_kib, 1);                      /* the host side counts */
  if (in_rss) {
    EXPECT(rss1 - rss0 >= size_kib - slack_kib, 1);
    EXPECT(rss3 - rss2 >= size_kib - slack_kib, 1);
  } else {
    EXPECT(rss1 - rss0 < slack_kib, 1);
    EXPECT(rss3 - rss2 < slack_kib, 1);
  }
  EXPECT(CUDRV(cuMemUnmap)(va, size), 0);
  EXPECT(CUDRV(cuMemRelease)(h), 0);
  EXPECT(CUDRV(cuMemAddressFree)(va, size), 0);
  EXPECT(CUDART(cudaFree)(plain), 0);
  free(host);
  printf("device rss ok\n");
  return 0;
}

/* Ascend IPC, the exporter: 4 MiB of aclrtMalloc memory holding pattern 7, exported with the pid
 * whitelist on (after the refusals CANN documents); then commands from stdin: "allow PID",
 * "check SEED" (the memory holds that pattern) and "close" (the key). */
static int acl_ipc_export(void) {
  void *p = NULL, *va = NULL;
  char key[65], small[16];
  int32_t nobody = 1;
  unsigned char *h = malloc(4 * MiB);
  EXPECT(ACL(aclrtSetDevice)(0), 0);
  EXPECT(ACL(aclrtMalloc)(&p, 4 * MiB, 0), 0);
  fill(h, 4 * MiB, 7);
  EXPECT(ACL(aclrtMemcpy)(p, 4 * MiB, h, 4 * MiB, 1), 0);
  EXPECT(ACL(aclrtIpcMemGetExportKey)(p, 4 * MiB, small, sizeof small, 0), 100000); /* key < 65 */
  EXPECT(ACL(aclrtIpcMemGetExportKey)(p, 4 * MiB, key, sizeof key, 2), 100000);     /* flag */
  EXPECT(ACL(aclrtReserveMemAddress)(&va, 2 * MiB, 0, NULL, 0), 0);
  EXPECT(ACL(aclrtIpcMemGetExportKey)(va, 2 * MiB, key, sizeof key, 0), 107000); /* not aclrtMalloc */
  EXPECT(ACL(aclrtReleaseMemAddress)(va), 0);
  EXPECT(ACL(aclrtIpcMemGetExportKey)(p, 64 * MiB, key, sizeof key, 0), 107000); /* past the end */
  EXPECT(ACL(aclrtIpcMemSetImportPid)("tmsaclnosuchkey", &nobody, 1), 107000);   /* not exported */
  EXPECT(ACL(aclrtIpcMemGetExportKey)(p, 4 * MiB, key, sizeof key, 0), 0);
  EXPECT(ACL(aclrtIpcMemSetImportPid)(key, NULL, 1), 100000);
  printf("KEY %s\n", key);
  fflush(stdout);
  char line[128];
  while (fgets(line, sizeof line, stdin)) {
    int32_t pid;
    unsigned seed;
    if (sscanf(line, "allow %d", &pid) == 1) {
      printf("ALLOWED rc=%d\n", ACL(aclrtIpcMemSetImportPid)(key, &pid, 1));
    } else if (sscanf(line, "check %u", &seed) == 1) {
      EXPECT(ACL(aclrtMemcpy)(h, 4 * MiB, p, 4 * MiB, 2), 0);
      printf("CHECKED ok=%d\n", check(h, 4 * MiB, seed));
    } else if (!strncmp(line, "close", 5)) {
      printf("CLOSED rc=%d\n", ACL(aclrtIpcMemClose)(key));
    }
    fflush(stdout);
  }
  EXPECT(ACL(aclrtFree)(p), 0);
  free(h);
  return 0;
}

/* Ascend IPC, an importer: prints the pid the exporter must allow, waits for a line, imports KEY;
 * on success checks the exporter's pattern 7, writes pattern 9 through the import and closes. */
static int acl_ipc_import(const char *key) {
  int32_t pid = 0;
  void *p = NULL;
  EXPECT(ACL(aclrtSetDevice)(0), 0);
  EXPECT(ACL(aclrtDeviceGetBareTgid)(&pid), 0);
  printf("PID %d\n", pid);
  fflush(stdout);
  char line[16];
  if (!fgets(line, sizeof line, stdin)) return 1;
  EXPECT(ACL(aclrtIpcMemImportByKey)(&p, key, 2), 100000);         /* flag */
  EXPECT(ACL(aclrtIpcMemImportByKey)(&p, "not a key", 0), 100000); /* malformed */
  int rc = ACL(aclrtIpcMemImportByKey)(&p, key, 0);
  if (rc != 0) {
    printf("IMPORT rc=%d\n", rc);
    return 0;
  }
  unsigned char *h = malloc(4 * MiB);
  EXPECT(ACL(aclrtMemcpy)(h, 4 * MiB, p, 4 * MiB, 2), 0);
  int ok = check(h, 4 * MiB, 7);
  fill(h, 4 * MiB, 9);
  EXPECT(ACL(aclrtMemcpy)(p, 4 * MiB, h, 4 * MiB, 1), 0);
  EXPECT(ACL(aclrtIpcMemClose)(key), 0);
  EXPECT(ACL(aclrtIpcMemClose)(key), 107000); /* closed already */
  printf("IMPORT rc=0 data_ok=%d\n", ok);
  free(h);
  return 0;
}

int tms_test_main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s MODE [ARGS]\n", argv[0]);
    return 2;
  }
  const char *m = argv[1];
  if (!strcmp(m, "cuda-vmm")) return cuda_vmm();
  if (!strcmp(m, "cuda-errors")) return cuda_errors();
  if (!strcmp(m, "cuda-sticky")) return cuda_sticky_fault();
  if (!strcmp(m, "acl-vmm")) return acl_vmm();
  if (!strcmp(m, "acl-errors")) return acl_errors();
  if (!strcmp(m, "acl-ipc-export")) return acl_ipc_export();
  if (!strcmp(m, "acl-ipc-import") && argc == 3) return acl_ipc_import(argv[2]);
  if (!strcmp(m, "hold") && argc == 4) return hold(argv[2], atol(argv[3]));
  if (!strcmp(m, "release")) return release_returns_memory();
  if (!strcmp(m, "handles") && argc == 3) return many_handles(atol(argv[2]));
  if (!strcmp(m, "creates") && argc == 3) return creates(atol(argv[2]));
  if (!strcmp(m, "streams")) return streams();
  if (!strcmp(m, "copies-land-late")) return copies_land_late();
  if (!strcmp(m, "default-stream-async")) return default_stream_async();
  if (!strcmp(m, "default-stream-fault") && argc == 3) return default_stream_fault(argv[2]);
  if (!strcmp(m, "accounting") && argc == 3) return accounting(atol(argv[2]));
  if (!strcmp(m, "context-does-not-fit")) return context_does_not_fit();
  if (!strcmp(m, "touch-device") && argc == 3) return touch_device(argv[2]);
  if (!strcmp(m, "unmap-in-flight")) return unmap_in_flight();
  if (!strcmp(m, "device-rss") && argc == 3) return device_rss(atoi(argv[2]));
  fprintf(stderr, "unknown mode %s\n", m);
  return 2;
}
