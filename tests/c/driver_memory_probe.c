/* How a driver's free-memory figure (cuMemGetInfo) moves under each call the hook makes: the
 * virtual-memory sequence, streams, events, pinned host memory and a plain allocation. Run by the
 * hardware kit on every GPU it meets (its log is the record), and on the simulator, whose figures
 * the test suite compares with those an H200 gave (docs/hardware.md).
 * Output: one `step=NAME delta=BYTES` line per call sequence (free after minus free before).
 * Exit: 0, or 1 with the failing call named, or 2 when libcuda.so.1 cannot be loaded. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef struct { int type, id; } MemLocation;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long MemHandle;
/* CUmemAllocationProp and CUmemAccessDesc, as cuda.h lays them out. */
typedef struct {
  int type, requested_handle_types;
  MemLocation location;
  void *win32_metadata;
  unsigned char compression, gpu_direct_rdma;
  unsigned short usage;
  unsigned char reserved[4];
} AllocationProp;
typedef struct {
  MemLocation location;
  int flags;
} AccessDesc;

#define DRIVER(name, ...) static CUresult (*name)(__VA_ARGS__)
DRIVER(cuInit, unsigned);
DRIVER(cuDeviceGet, int *, int);
DRIVER(cuDevicePrimaryCtxRetain, void **, int);
DRIVER(cuCtxSetCurrent, void *);
DRIVER(cuMemGetInfo_v2, size_t *, size_t *);
DRIVER(cuMemAddressReserve, CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
DRIVER(cuMemCreate, MemHandle *, size_t, const AllocationProp *, unsigned long long);
DRIVER(cuMemMap, CUdeviceptr, size_t, size_t, MemHandle, unsigned long long);
DRIVER(cuMemSetAccess, CUdeviceptr, size_t, const AccessDesc *, size_t);
DRIVER(cuMemUnmap, CUdeviceptr, size_t);
DRIVER(cuMemRelease, MemHandle);
DRIVER(cuStreamCreate, void **, unsigned);
DRIVER(cuEventCreate, void **, unsigned);
DRIVER(cuMemHostAlloc, void **, size_t, unsigned);
DRIVER(cuMemAlloc_v2, CUdeviceptr *, size_t);
DRIVER(cuMemFree_v2, CUdeviceptr);

#define MiB (1ull << 20)
static long long last_free;

static long long free_now(void) {
  size_t f = 0, t = 0;
  cuMemGetInfo_v2(&f, &t);
  return (long long)f;
}
static void step(const char *name) {
  long long f = free_now();
  printf("step=%s delta=%lld\n", name, f - last_free);
  last_free = f;
}
#define CALL(x)                                                                                 \
  do {                                                                                          \
    CUresult rc_ = (x);                                                                         \
    if (rc_) {                                                                                  \
      printf("%s returned %d\n", #x, rc_);                                                      \
      return 1;                                                                                 \
    }                                                                                           \
  } while (0)
#define RESOLVE(lib, f)                                                                         \
  do {                                                                                          \
    *(void **)&f = dlsym(lib, #f);                                                              \
    if (!f) {                                                                                   \
      printf("libcuda.so.1 has no %s\n", #f);                                                   \
      return 1;                                                                                 \
    }                                                                                           \
  } while (0)

int main(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) {
    printf("libcuda.so.1 cannot be loaded: %s\n", dlerror());
    return 2;
  }
  RESOLVE(lib, cuInit); RESOLVE(lib, cuDeviceGet); RESOLVE(lib, cuDevicePrimaryCtxRetain);
  RESOLVE(lib, cuCtxSetCurrent); RESOLVE(lib, cuMemGetInfo_v2); RESOLVE(lib, cuMemAddressReserve);
  RESOLVE(lib, cuMemCreate); RESOLVE(lib, cuMemMap); RESOLVE(lib, cuMemSetAccess);
  RESOLVE(lib, cuMemUnmap); RESOLVE(lib, cuMemRelease); RESOLVE(lib, cuStreamCreate);
  RESOLVE(lib, cuEventCreate); RESOLVE(lib, cuMemHostAlloc); RESOLVE(lib, cuMemAlloc_v2);
  RESOLVE(lib, cuMemFree_v2);
  int dev;
  void *ctx;
  CALL(cuInit(0));
  CALL(cuDeviceGet(&dev, 0));
  CALL(cuDevicePrimaryCtxRetain(&ctx, dev));
  CALL(cuCtxSetCurrent(ctx));
  last_free = free_now();

  AllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = 1;          /* CU_MEM_ALLOCATION_TYPE_PINNED */
  prop.location.type = 1; /* CU_MEM_LOCATION_TYPE_DEVICE */
  prop.location.id = dev;
  AccessDesc access;
  memset(&access, 0, sizeof access);
  access.location = prop.location;
  access.flags = 3; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
  const size_t sizes[3] = {8 * MiB, 4 * MiB, 2 * MiB};
  CUdeviceptr va[3];
  MemHandle h[3];
  for (int i = 0; i < 3; i++) CALL(cuMemAddressReserve(&va[i], sizes[i], 2 * MiB, 0, 0));
  step("reserve");
  /* Twice: a second cycle shows whether anything of the first one stayed. */
  for (int cycle = 0; cycle < 2; cycle++) {
    for (int i = 0; i < 3; i++) CALL(cuMemCreate(&h[i], sizes[i], &prop, 0));
    step("create");
    for (int i = 0; i < 3; i++) CALL(cuMemMap(va[i], sizes[i], 0, h[i], 0));
    step("map");
    for (int i = 0; i < 3; i++) CALL(cuMemSetAccess(va[i], sizes[i], &access, 1));
    step("set_access");
    for (int i = 0; i < 3; i++) CALL(cuMemUnmap(va[i], sizes[i]));
    step("unmap");
    for (int i = 0; i < 3; i++) CALL(cuMemRelease(h[i]));
    step("release");
  }
  void *streams[4];
  for (int i = 0; i < 4; i++) CALL(cuStreamCreate(&streams[i], 1 /* non-blocking */));
  step("stream_create_x4");
  void *more[4];
  for (int i = 0; i < 4; i++) CALL(cuStreamCreate(&more[i], 1));
  step("stream_create_x4_more");
  void *event;
  CALL(cuEventCreate(&event, 2 /* disable timing */));
  step("event_create");
  void *pinned;
  CALL(cuMemHostAlloc(&pinned, 64 * MiB, 1 /* portable */));
  step("host_alloc_64MiB");
  CUdeviceptr plain;
  CALL(cuMemAlloc_v2(&plain, 1 * MiB));
  step("mem_alloc_1MiB");
  CALL(cuMemFree_v2(plain));
  step("mem_free_1MiB");
  return 0;
}
