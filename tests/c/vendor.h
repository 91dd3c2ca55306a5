/* The subset of the CUDA runtime/driver and Ascend ACL APIs the test consumers use, declared from
 * the public API facts (shared/reference). Test programs include this instead of vendor headers,
 * so they build without CUDA or CANN. */
#ifndef TMS_TEST_VENDOR_H
#define TMS_TEST_VENDOR_H
#include <stddef.h>
#include <stdint.h>

typedef int cudaError_t;
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *cudaStream_t;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int type; int requestedHandleTypes; CUmemLocation location; void *win32HandleMetaData;
  struct { unsigned char compressionType; unsigned char gpuDirectRDMACapable; unsigned short usage;
           unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;

cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, int kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, cudaStream_t s);
cudaError_t cudaMemset(void *p, int v, size_t n);
cudaError_t cudaMemGetInfo(size_t *free, size_t *total);
cudaError_t cudaGetDevice(int *d);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);
typedef void (*cudaHostFn_t)(void *userData);
cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *userData);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s);
cudaError_t cudaHostRegister(void *p, size_t n, unsigned flags);
cudaError_t cudaHostUnregister(void *p);
typedef void *cudaEvent_t;
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);

CUresult cuInit(unsigned flags);
CUresult cuDeviceGet(CUdevice *d, int ordinal);
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d);
CUresult cuCtxGetCurrent(CUcontext *c);
CUresult cuCtxSetCurrent(CUcontext c);
CUresult cuCtxGetDevice(CUdevice *d);
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d);
CUresult cuGetErrorString(CUresult r, const char **s);
CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuStreamCreate(cudaStream_t *s, unsigned flags);
CUresult cuStreamSynchronize(cudaStream_t s);
CUresult cuStreamDestroy_v2(cudaStream_t s);
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, cudaStream_t s);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, cudaStream_t s);
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr p, size_t size);
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop, unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle h);
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr p, size_t size);
CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option);

typedef int aclError;
typedef void *aclrtDrvMemHandle;
typedef void *aclrtContext;
typedef struct { uint32_t id; int type; } aclrtMemLocation;
typedef struct { int handleType; int allocationType; int memAttr; aclrtMemLocation location; uint64_t reserve; } aclrtPhysicalMemProp;
typedef struct { int flags; aclrtMemLocation location; uint8_t rsv[12]; } aclrtMemAccessDesc;

aclError aclInit(const char *config);
aclError aclrtSetDevice(int32_t d);
aclError aclrtGetDevice(int32_t *d);
aclError aclrtGetDeviceCount(uint32_t *count);
aclError aclrtGetCurrentContext(aclrtContext *c);
aclError aclrtSetCurrentContext(aclrtContext c);
aclError aclrtMalloc(void **p, size_t n, int policy);
aclError aclrtMallocAlign32(void **p, size_t n, int policy);
aclError aclrtFree(void *p);
aclError aclrtMallocHost(void **p, size_t n);
aclError aclrtFreeHost(void *p);
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t n, int kind);
aclError aclrtMemset(void *p, size_t max, int32_t v, size_t n);
aclError aclrtGetMemInfo(int attr, size_t *free, size_t *total);
aclError aclrtSynchronizeDevice(void);
aclError aclrtReserveMemAddress(void **p, size_t size, size_t align, void *expect, uint64_t flags);
aclError aclrtReleaseMemAddress(void *p);
aclError aclrtMallocPhysical(aclrtDrvMemHandle *h, size_t size, const aclrtPhysicalMemProp *prop, uint64_t flags);
aclError aclrtFreePhysical(aclrtDrvMemHandle h);
aclError aclrtMapMem(void *p, size_t size, size_t offset, aclrtDrvMemHandle h, uint64_t flags);
aclError aclrtUnmapMem(void *p);
aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, int option, size_t *g);
aclError aclrtDeviceGetBareTgid(int32_t *pid);
aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len, uint64_t flags);
aclError aclrtIpcMemSetImportPid(const char *key, int32_t *pid, size_t num);
aclError aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flags);
aclError aclrtIpcMemClose(const char *key);

/* CALL(f): the function f, reached the way this build of the consumer is configured:
 *  - default: a direct call through the PLT (the program or plugin is linked against the soname);
 *  - TMS_TEST_DLSYM: dlopen(soname, RTLD_LAZY|RTLD_GLOBAL) + dlsym(handle, "f"), torch_npu's way. */
#ifdef TMS_TEST_DLSYM
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
static void *tms_test_sym(const char *lib, const char *name) {
  void *h = dlopen(lib, RTLD_LAZY | RTLD_GLOBAL);
  if (!h) { fprintf(stderr, "dlopen %s: %s\n", lib, dlerror()); exit(90); }
  void *f = dlsym(h, name);
  if (!f) { fprintf(stderr, "dlsym %s: %s\n", name, dlerror()); exit(91); }
  return f;
}
#define CALL_IN(lib, f) ((__typeof__(&f))tms_test_sym(lib, #f))
#else
#define CALL_IN(lib, f) f
#endif
/* The runtime the dlsym-style consumers load: libcudart.so.12 unless the build says otherwise
 * (scripts/gpu-check.sh passes the machine's, e.g. libcudart.so.13). */
#ifndef TMS_CUDART_SONAME
#define TMS_CUDART_SONAME "libcudart.so.12"
#endif
#define CUDART(f) CALL_IN(TMS_CUDART_SONAME, f)
#define CUDRV(f) CALL_IN("libcuda.so.1", f)
#define ACL(f) CALL_IN("libascendcl.so", f)
#endif
