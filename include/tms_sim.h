/* tms_sim.h: introspection and control entry points of libtms_sim.so (the emulated CUDA + Ascend
 * runtime). The vendor APIs it emulates are declared by the vendors' own headers. */
#ifndef TMS_SIM_H
#define TMS_SIM_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

#define TMS_SIM_MAX_DEVICES 16 /* devices reported here; a node may have up to 64 */

struct tms_sim_stats {
  uint32_t device_count;
  uint32_t reserved;
  uint64_t capacity;                              /* bytes per device */
  uint64_t device_used[TMS_SIM_MAX_DEVICES];      /* by every process on the node */
  uint64_t process_used[TMS_SIM_MAX_DEVICES];     /* by this process */
  uint64_t host_resident_bytes;                   /* host memory really held by device memory */
  uint64_t live_handles;                          /* physical allocations (cuMemCreate/aclrtMallocPhysical) */
  uint64_t live_mappings;
  uint64_t reservations;
  uint64_t plain_allocations;                     /* cudaMalloc / cuMemAlloc / aclrtMalloc */
  uint64_t pinned_host_bytes;
};

/* Fills *out; returns 0, or 1 when out is NULL. */
int tms_sim_stats(struct tms_sim_stats *out);

/* Replaces the fault-injection rules (TMS_SIM_FAIL syntax: NAME:N[+][:CODE],...; "" or NULL
 * clears them) and restarts call counting. Returns 0, or 1 for a malformed spec. */
int tms_sim_set_faults(const char *spec);

/* Whether [ptr, ptr + len) is device memory mapped with read and write access: 1 yes, 0 no
 * (paused, freed or partly unmapped), -1 not device memory. A query, not an access: it never
 * faults. */
int tms_sim_range_accessible(const void *ptr, size_t len);

/* Device memory is not host memory: a device address cannot be dereferenced by the process (it
 * faults, as on a GPU). This returns where the bytes of device range [ptr, ptr + len) can be read
 * and written by the host, or NULL when the range is not device memory mapped with read and write
 * access (paused, freed, partly unmapped, or not device memory). For the simulator's own CPU
 * compute layer and for tests; contiguous device memory has a contiguous view. The view is valid
 * until the range is unmapped or freed; after that its address may hold another allocation's bytes,
 * so a stale view corrupts instead of faulting: ask again for every use. */
void *tms_sim_host_view(const void *ptr, size_t len);

/* Called by a host function (cudaLaunchHostFunc) while a stream runs it: the work it stands for
 * failed with `code` (e.g. 719, cudaErrorLaunchFailure, for a CPU-computed kernel that raised).
 * The stream's next synchronize returns it, as a failed kernel's error surfaces on a GPU; the
 * first error since the last synchronize wins. Returns 0, or 1 when the caller is not a host
 * function running on a stream (a graph replayed in the calling thread, any other thread). */
int tms_sim_host_func_error(int code);

/* The caller will queue host functions that run Python (tms_sim_torch's asynchronous kernels):
 * from now on, for the rest of the process, every simulator wait for queued work releases the
 * Python GIL while it blocks when the waiting thread holds it, so that a queued kernel can take it.
 * Without this call waits never touch the GIL. Returns 0. */
int tms_sim_python_on_streams(void);

/* The end of a use of tms_sim_host_view's bytes for device range [ptr, ptr + len): the pages leave
 * the process's resident set (VmRSS), as device memory is not in a process's RSS on a GPU; the
 * bytes are kept and the next view faults them back in. The simulator does the same after each of
 * its own copies and memsets. TMS_SIM_DEVICE_IN_RSS=1 turns both off (device bytes then stay
 * resident, and repeated access is faster). Returns 0, or 1 when the range is not device memory
 * mapped with access (nothing done). */
int tms_sim_host_view_end(const void *ptr, size_t len);

/* What the physical memory mapped at `ptr` was created with: the aclrtMemAttr of Ascend memory
 * (aclrtMallocPhysical), the gpuDirectRDMACapable flag of CUDA memory (cuMemCreate); -1 when
 * `ptr` is not in such memory (a plain aclrtMalloc or cudaMalloc, host memory). */
int tms_sim_mem_attr(const void *ptr);

/* A simulated kernel: queues on `stream` (a CUDA stream, or an ACL stream) work that runs for
 * `usec` microseconds and then writes `value` over [dst, dst + bytes) of device memory, as a
 * training step or a collective still running when someone pauses. The range is checked when the
 * work runs: memory unmapped meanwhile is an illegal address (700), reported by the stream's next
 * synchronize. On the default stream (NULL) too it is queued (on the legacy stream, after the
 * blocking streams' work). Returns 0, or 1 for an unknown stream or a bad range (not device
 * memory). */
int tms_sim_launch_kernel(void *stream, void *dst, size_t bytes, int value, unsigned usec);

#ifdef __cplusplus
}
#endif
#endif
