/* Two HCCL ranks in one process (HcclCommInitAll over devices 0 and 1, as CANN's single-process
 * multi-device samples make them), linked against libhccl.so and libascendcl.so, run under
 * libtms_hook.so. Written from CANN's documented ABI (shared/reference/collectives.md): no CANN
 * header is needed.
 *
 *   hccl_consumer        each rank's float32 buffer is region memory (tag "weights", with CPU
 *                        backup); an all-reduce (sum) is checked, the tag is paused (device free
 *                        memory must rise by the buffers' size) and resumed, and the same
 *                        all-reduce on the restored buffers is checked again. Then it prints
 *                        "ready" and waits for one line on stdin (the test asks tms-ctl for the
 *                        communicators the hook recorded meanwhile), destroys both and prints
 *                        "hccl ok".
 * Exits non-zero at the first failed check, naming it. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include "vendor.h"
#include "tms.h"

typedef void *HcclComm;
typedef int HcclResult;
HcclResult HcclCommInitAll(uint32_t ndev, int32_t *devices, HcclComm *comms);
HcclResult HcclAllReduce(void *send, void *recv, uint64_t count, int dtype, int op, HcclComm comm, void *stream);
HcclResult HcclCommDestroy(HcclComm comm);
aclError aclrtCreateStream(void **stream);
aclError aclrtSynchronizeStream(void *stream);
aclError aclrtDestroyStream(void *stream);

#define RANKS 2
#define COUNT (256 * 1024) /* floats per rank: 1 MiB */
#define HCCL_DATA_TYPE_FP32 4
#define HCCL_REDUCE_SUM 0
#define ACL_HBM_MEM 1
#define ACL_MEMCPY_HOST_TO_DEVICE 1
#define ACL_MEMCPY_DEVICE_TO_HOST 2

#define CHECK(cond, ...)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "FAILED line %d: %s: ", __LINE__, #cond);                           \
      fprintf(stderr, __VA_ARGS__);                                                       \
      fprintf(stderr, "\n");                                                              \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

static void *tms(const char *name) {
  void *f = dlsym(RTLD_DEFAULT, name);
  CHECK(f != NULL, "%s not found: is libtms_hook.so preloaded?", name);
  return f;
}

static HcclComm comms[RANKS];
static void *streams[RANKS];
static float *send_buf[RANKS], *recv_buf[RANKS];
static float host[COUNT];

static size_t free_on(int dev) {
  size_t f = 0, t = 0;
  CHECK(aclrtSetDevice(dev) == 0, "aclrtSetDevice(%d)", dev);
  CHECK(aclrtGetMemInfo(ACL_HBM_MEM, &f, &t) == 0, "aclrtGetMemInfo");
  return f;
}

/* Rank r holds r + 1 + i/1024 at i: the sum over both ranks is 3 + 2 * (i/1024). */
static void all_reduce_and_check(const char *when) {
  for (int r = 0; r < RANKS; r++) {
    CHECK(aclrtSetDevice(r) == 0, "aclrtSetDevice(%d)", r);
    int rc = HcclAllReduce(send_buf[r], recv_buf[r], COUNT, HCCL_DATA_TYPE_FP32, HCCL_REDUCE_SUM, comms[r], streams[r]);
    CHECK(rc == 0, "HcclAllReduce on rank %d %s returned %d", r, when, rc);
  }
  for (int r = 0; r < RANKS; r++) {
    CHECK(aclrtSetDevice(r) == 0, "aclrtSetDevice(%d)", r);
    CHECK(aclrtSynchronizeStream(streams[r]) == 0, "aclrtSynchronizeStream on rank %d %s", r, when);
    CHECK(aclrtMemcpy(host, sizeof host, recv_buf[r], sizeof host, ACL_MEMCPY_DEVICE_TO_HOST) == 0, "read back");
    for (int i = 0; i < COUNT; i++) {
      float want = 3.0f + 2.0f * (float)(i / 1024);
      CHECK(host[i] == want, "rank %d %s: element %d is %f, want %f", r, when, i, host[i], want);
    }
  }
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  void (*set_tag)(const char *) = (void (*)(const char *))tms("tms_set_current_tag");
  void (*set_region)(bool) = (void (*)(bool))tms("tms_set_interesting_region");
  void (*set_backup)(bool) = (void (*)(bool))tms("tms_set_enable_cpu_backup");
  int (*pause)(const char *, tms_report *) = (int (*)(const char *, tms_report *))tms("tms_pause_report");
  int (*resume)(const char *, tms_report *) = (int (*)(const char *, tms_report *))tms("tms_resume_report");

  CHECK(aclInit(NULL) == 0, "aclInit");
  int32_t devices[RANKS] = {0, 1};
  int rc = HcclCommInitAll(RANKS, devices, comms);
  CHECK(rc == 0, "HcclCommInitAll returned %d", rc);
  for (int r = 0; r < RANKS; r++) {
    CHECK(aclrtSetDevice(r) == 0, "aclrtSetDevice(%d)", r);
    CHECK(aclrtCreateStream(&streams[r]) == 0, "aclrtCreateStream on %d", r);
    set_tag("weights");
    set_backup(true);
    set_region(true);
    CHECK(aclrtMalloc((void **)&send_buf[r], sizeof host, 0) == 0, "aclrtMalloc send on %d", r);
    CHECK(aclrtMalloc((void **)&recv_buf[r], sizeof host, 0) == 0, "aclrtMalloc recv on %d", r);
    set_region(false);
    for (int i = 0; i < COUNT; i++) host[i] = (float)(r + 1) + (float)(i / 1024);
    CHECK(aclrtMemcpy(send_buf[r], sizeof host, host, sizeof host, ACL_MEMCPY_HOST_TO_DEVICE) == 0, "fill");
  }
  all_reduce_and_check("before the pause");

  size_t before[RANKS];
  for (int r = 0; r < RANKS; r++) before[r] = free_on(r);
  tms_report report;
  CHECK(pause("weights", &report) == 0, "tms_pause_report(weights)");
  for (int r = 0; r < RANKS; r++) {
    size_t now = free_on(r);
    CHECK(now >= before[r] + 2 * sizeof host, "device %d free memory rose by %zd bytes on pause, want >= %zu", r,
          (ssize_t)(now - before[r]), 2 * sizeof host);
  }
  CHECK(resume("weights", &report) == 0, "tms_resume_report(weights)");
  all_reduce_and_check("after the resume");

  printf("ready\n");
  char line[64];
  if (!fgets(line, sizeof line, stdin)) line[0] = 0;
  for (int r = 0; r < RANKS; r++) {
    CHECK(aclrtSetDevice(r) == 0, "aclrtSetDevice(%d)", r);
    CHECK(HcclCommDestroy(comms[r]) == 0, "HcclCommDestroy on rank %d", r);
    CHECK(aclrtFree(send_buf[r]) == 0 && aclrtFree(recv_buf[r]) == 0, "aclrtFree on %d", r);
    CHECK(aclrtDestroyStream(streams[r]) == 0, "aclrtDestroyStream on %d", r);
  }
  printf("hccl ok ranks=%d bytes_per_rank=%zu\n", RANKS, 2 * sizeof host);
  return 0;
}
