/* A process with NCCL communicators on two devices (ncclCommInitAll) pauses and resumes the
 * reserved tag "nccl" under libtms_hook.so. Linked against libnccl.so.2 (calls through the PLT,
 * as libtorch_cuda.so makes them). Prints key=value lines; exits non-zero at the first failed
 * check, naming it.
 *
 *   nccl_consumer cycle        everything in-process (tms_pause_report / tms_resume_report)
 *   nccl_consumer wait         creates the communicators, prints "ready", then for each line of
 *                              stdin prints the free memory of both devices and the all-reduce's
 *                              result, until "quit" (driven by tms-ctl from the test) */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "vendor.h"
#include "tms.h"

typedef void *ncclComm_t;
typedef int ncclResult_t;
ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommSuspend(ncclComm_t comm, int flags);
ncclResult_t ncclCommResume(ncclComm_t comm);
ncclResult_t ncclCommMemStats(ncclComm_t comm, int stat, uint64_t *value);
ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, int dtype, int op, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
const char *ncclGetLastError(ncclComm_t comm);

#define N 4
#define NCCL_FLOAT 7
#define NCCL_SUM 0

#define CHECK(cond, ...)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "FAILED line %d: %s: ", __LINE__, #cond);                           \
      fprintf(stderr, __VA_ARGS__);                                                       \
      fprintf(stderr, "\n");                                                              \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

/* The hook's API, found where LD_PRELOAD put it. */
static void *tms(const char *name) {
  void *f = dlsym(RTLD_DEFAULT, name);
  CHECK(f != NULL, "%s not found: is libtms_hook.so preloaded?", name);
  return f;
}

static ncclComm_t comms[2];
static float *bufs[2];

static uint64_t free_on(int dev) {
  size_t f = 0, t = 0;
  CHECK(cudaSetDevice(dev) == 0, "cudaSetDevice(%d)", dev);
  CHECK(cudaMemGetInfo(&f, &t) == 0, "cudaMemGetInfo");
  return f;
}

static uint64_t stat_of(int d, int which) {
  uint64_t v = 0;
  CHECK(ncclCommMemStats(comms[d], which, &v) == 0, "ncclCommMemStats(%d, %d)", d, which);
  return v;
}

/* All-reduce of rank d's values d+1, 2(d+1), ...: every rank gets 3, 6, 9, 12. Returns the first
 * nonzero NCCL code (the collective's or the group end's), or 0 when the result is correct. */
static int all_reduce(void) {
  float host[N];
  for (int d = 0; d < 2; d++) {
    for (int i = 0; i < N; i++) host[i] = (float)((d + 1) * (i + 1));
    CHECK(cudaSetDevice(d) == 0, "set");
    CHECK(cudaMemcpy(bufs[d], host, sizeof host, 1) == 0, "copy in");
  }
  int rc = 0;
  ncclGroupStart();
  for (int d = 0; d < 2; d++) {
    int r = ncclAllReduce(bufs[d], bufs[d], N, NCCL_FLOAT, NCCL_SUM, comms[d], NULL);
    if (r && !rc) rc = r;
  }
  int g = ncclGroupEnd();
  if (rc) return rc;
  if (g) return g;
  for (int d = 0; d < 2; d++) {
    CHECK(cudaSetDevice(d) == 0, "set");
    CHECK(cudaDeviceSynchronize() == 0, "sync");
    CHECK(cudaMemcpy(host, bufs[d], sizeof host, 2) == 0, "copy out");
    for (int i = 0; i < N; i++) CHECK(host[i] == (float)(3 * (i + 1)), "rank %d element %d is %g", d, i, host[i]);
  }
  return 0;
}

static void setup(void) {
  int devs[2] = {0, 1};
  for (int d = 0; d < 2; d++) {
    CHECK(cudaSetDevice(d) == 0, "set");
    CHECK(cudaMalloc((void **)&bufs[d], N * sizeof(float)) == 0, "cudaMalloc");
  }
  CHECK(ncclCommInitAll(comms, 2, devs) == 0, "ncclCommInitAll: %s", ncclGetLastError(NULL));
  CHECK(all_reduce() == 0, "first all-reduce");
}

typedef int (*op_fn)(const char *, tms_report *);

static void cycle(void) {
  op_fn pause = (op_fn)tms("tms_pause_report"), resume = (op_fn)tms("tms_resume_report");
  uint64_t before[2], suspendable[2];
  for (int d = 0; d < 2; d++) {
    before[d] = free_on(d);
    suspendable[d] = stat_of(d, 0);
    CHECK(suspendable[d] > 0, "device %d: nothing to suspend", d);
    CHECK(stat_of(d, 1) == 0, "suspended before any pause");
  }
  printf("suspendable=%llu,%llu persistent=%llu\n", (unsigned long long)suspendable[0],
         (unsigned long long)suspendable[1], (unsigned long long)stat_of(0, 2));

  tms_report r;
  memset(&r, 0, sizeof r);
  CHECK(pause("nccl", &r) == 0, "pause nccl: error %d driver %d", r.error, r.driver_error);
  CHECK(r.allocations_done == 2, "pause done %llu", (unsigned long long)r.allocations_done);
  CHECK(r.bytes_done == suspendable[0] + suspendable[1], "pause bytes %llu", (unsigned long long)r.bytes_done);
  CHECK(r.device_free_after - r.device_free_before == suspendable[0], "report's device free: %llu -> %llu",
        (unsigned long long)r.device_free_before, (unsigned long long)r.device_free_after);
  for (int d = 0; d < 2; d++) {
    uint64_t f = free_on(d);
    CHECK(f - before[d] == suspendable[d], "device %d: free rose by %llu, suspendable %llu", d,
          (unsigned long long)(f - before[d]), (unsigned long long)suspendable[d]);
    CHECK(stat_of(d, 1) == 1, "device %d not suspended", d);
  }
  printf("paused done=%llu bytes=%llu\n", (unsigned long long)r.allocations_done, (unsigned long long)r.bytes_done);

  int rc = all_reduce();
  CHECK(rc == 5, "collective while suspended returned %d, not ncclInvalidUsage", rc);
  printf("while_paused=%d message=%s\n", rc, ncclGetLastError(comms[0]));

  /* A second pause changes nothing. */
  CHECK(pause("nccl", &r) == 0, "second pause");
  CHECK(r.allocations_done == 0 && r.allocations_skipped == 2, "second pause done %llu skipped %llu",
        (unsigned long long)r.allocations_done, (unsigned long long)r.allocations_skipped);
  for (int d = 0; d < 2; d++) CHECK(free_on(d) - before[d] == suspendable[d], "second pause moved memory");
  /* Pausing every tag leaves communicators to the tag that names them. */
  CHECK(resume(NULL, &r) == 0, "resume of every tag");
  CHECK(stat_of(0, 1) == 1, "resume of every tag resumed a communicator");

  CHECK(resume("nccl", &r) == 0, "resume nccl: error %d driver %d", r.error, r.driver_error);
  CHECK(r.allocations_done == 2 && r.bytes_done == suspendable[0] + suspendable[1], "resume done %llu bytes %llu",
        (unsigned long long)r.allocations_done, (unsigned long long)r.bytes_done);
  for (int d = 0; d < 2; d++) {
    CHECK(free_on(d) == before[d], "device %d: free %llu after resume, %llu before pause", d,
          (unsigned long long)free_on(d), (unsigned long long)before[d]);
    CHECK(stat_of(d, 1) == 0, "device %d still suspended", d);
  }
  CHECK(resume("nccl", &r) == 0 && r.allocations_done == 0 && r.allocations_skipped == 2, "second resume");
  for (int d = 0; d < 2; d++) CHECK(free_on(d) == before[d], "second resume moved memory");
  CHECK(all_reduce() == 0, "all-reduce after resume");
  printf("resumed ok\n");

  /* Destroyed while suspended: NCCL gives everything back and tms forgets them. */
  CHECK(pause("nccl", &r) == 0 && r.allocations_done == 2, "third pause");
  uint64_t total[2] = {stat_of(0, 3), stat_of(1, 3)};
  for (int d = 0; d < 2; d++) CHECK(ncclCommDestroy(comms[d]) == 0, "destroy %d", d);
  for (int d = 0; d < 2; d++)
    CHECK(free_on(d) == before[d] + total[d], "device %d: free %llu after destroy, expected %llu", d,
          (unsigned long long)free_on(d), (unsigned long long)(before[d] + total[d]));
  CHECK(resume("nccl", &r) == 0 && r.allocations_done + r.allocations_skipped + r.allocations_failed == 0,
        "resume after destroy touched %llu", (unsigned long long)(r.allocations_done + r.allocations_skipped));
  CHECK(pause("nccl", &r) == 0 && r.allocations_done + r.allocations_skipped + r.allocations_failed == 0,
        "pause after destroy");
  printf("nccl cycle ok\n");
}

static void wait_loop(void) {
  printf("ready\n");
  fflush(stdout);
  char line[256];
  while (fgets(line, sizeof line, stdin)) {
    if (strncmp(line, "quit", 4) == 0) break;
    if (strncmp(line, "destroy", 7) == 0) {
      int a = ncclCommDestroy(comms[0]), b = ncclCommDestroy(comms[1]);
      printf("destroyed=%d,%d free0=%llu free1=%llu\n", a, b, (unsigned long long)free_on(0),
             (unsigned long long)free_on(1));
      fflush(stdout);
      continue;
    }
    int rc = all_reduce();
    printf("free0=%llu free1=%llu suspendable0=%llu suspendable1=%llu all_reduce=%d\n",
           (unsigned long long)free_on(0), (unsigned long long)free_on(1), (unsigned long long)stat_of(0, 0),
           (unsigned long long)stat_of(1, 0), rc);
    fflush(stdout);
  }
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  CHECK(argc == 2, "usage: nccl_consumer cycle|wait");
  setup();
  if (strcmp(argv[1], "cycle") == 0) {
    cycle();
  } else {
    wait_loop();
  }
  return 0;
}
