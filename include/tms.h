/* tms.h: the C ABI of libtms_hook.so.
 *
 * Load the library with LD_PRELOAD (preload mode: it intercepts cudaMalloc/cudaFree and
 * aclrtMalloc/aclrtMallocAlign32/aclrtFree, also when reached through dlsym(handle, name)), or
 * dlopen it and plug tms_torch_malloc/tms_torch_free into PyTorch's pluggable allocator (torch mode).
 *
 * Every function here is safe to call from any thread, never exits or aborts the process, and
 * never lets an error pass silently: pause/resume return a code and can fill a report.
 * A test (tests/tests/abi.rs) keeps this file and the library's exports identical, and its
 * structs and codes identical to tms-proto/src/abi.rs, where the library declares them.
 */
#ifndef TMS_H
#define TMS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Error codes of the tms_* API ------------------------------------------------------------ */
#define TMS_OK 0
#define TMS_ERR_INVALID 1        /* bad argument */
#define TMS_ERR_OUT_OF_MEMORY 2  /* not enough device memory (any margin included); nothing lost */
#define TMS_ERR_DRIVER 3         /* a driver call failed; report.driver_error has its code */
#define TMS_ERR_NO_DRIVER 4      /* no CUDA or Ascend driver could be loaded */
#define TMS_ERR_INTERNAL 5       /* a bug in tms, caught before it reached the caller */
#define TMS_ERR_IO 6             /* a disk backup file could not be read; it stays paused with it */
#define TMS_ERR_CORRUPT 7        /* TMS_VERIFY_RESTORE: a resume did not bring back the paused bytes */

/* What a pause or resume did. Allocations already in the target state are "skipped"; allocations
 * the operation could not complete are "failed" and stay as they were (a paused allocation keeps
 * its backup), so calling again later finishes the job. */
typedef struct tms_report {
  int32_t error;                /* TMS_OK or the first TMS_ERR_* met */
  int32_t driver_error;         /* the vendor's code for that error (e.g. 2 or 207001 for OOM) */
  uint64_t allocations_done;
  uint64_t bytes_done;          /* rounded sizes (what the device gave or got back) */
  uint64_t allocations_skipped;
  uint64_t bytes_skipped;
  uint64_t allocations_failed;
  uint64_t bytes_failed;
  uint64_t backup_bytes;        /* bytes copied to (pause) or from (resume) host backups */
  uint64_t elapsed_ns;
  uint64_t device_free_before;  /* device free memory before and after, as the driver reports */
  uint64_t device_free_after;
  uint64_t device_total;
  uint64_t backup_ns;           /* time of the backup/restore pipeline: copies, with the releases
                                   (pause) or creates (resume) overlapped into it (part of elapsed_ns) */
  uint64_t backup_bytes_skipped; /* bytes of backed-up allocations not copied because they were
                                    marked dead (tms_mark_dead); plus backup_bytes, what a
                                    whole-allocation backup copies */
} tms_report;

/* Bytes at a device address (tms_mark_dead). */
typedef struct tms_range {
  uint64_t addr;
  uint64_t len;
} tms_range;

typedef struct tms_tag_status {
  const char *tag;              /* valid until this thread's next tms_status */
  uint64_t allocations_active;
  uint64_t allocations_paused;
  uint64_t bytes_active;
  uint64_t bytes_paused;
  uint64_t backup_bytes;        /* pinned host memory held for this tag's backups */
} tms_tag_status;

/* ---- torch_memory_saver's ABI (same names and signatures) ------------------------------------ */

/* The calling thread's region flag: allocations made while it is set are tracked (default:
 * TMS_INIT_ENABLE). */
void tms_set_interesting_region(bool is_interesting_region);
bool tms_get_interesting_region(void);
/* The calling thread's tag; NULL or "" selects the default (TMS_INIT_TAG, else "default"). */
void tms_set_current_tag(const char *tag);
/* Valid until the calling thread sets another tag. */
const char *tms_get_current_tag(void);
/* Whether allocations made by this thread are copied to host memory on pause (default:
 * TMS_INIT_ENABLE_CPU_BACKUP). Without backup, contents are undefined after resume. */
bool tms_get_enable_cpu_backup(void);
void tms_set_enable_cpu_backup(bool enable);
/* This thread's CPU backup backend (default TMS_INIT_CPU_BACKUP_BACKEND): "pinned" (page-locked,
 * pooled for the next pause) or "mmap" (pageable memory, given back at resume; CUDA only, Ascend
 * backs up to page-locked memory either way). Allocations keep the backend they were made with. */
const char *tms_get_cpu_backup_backend(void);
void tms_set_cpu_backup_backend(const char *backend);
/* Whether region allocations made by this thread keep their contents in a file while paused
 * (default: TMS_INIT_ENABLE_DISK_BACKUP). One file per allocation, tms-backup-PID-ADDR.bin in the
 * disk backup folder, removed at resume or free. */
bool tms_get_enable_disk_backup(void);
void tms_set_enable_disk_backup(bool enable);
/* The disk backup folder for the whole process (default TMS_DISK_BACKUP_DIR, else /tmp; NULL or
 * "" restores it). Use a real disk: tmpfs would keep the contents in host memory. */
void tms_set_disk_backup_dir(const char *dir);
/* Free device memory to keep: region allocations fail with out-of-memory when free < size +
 * margin (TMS_MEMORY_MARGIN_BYTES). Resume checks it too only with TMS_RESUME_KEEPS_MARGIN=1
 * (torch_memory_saver checks it at allocation only). */
void set_memory_margin_bytes(uint64_t value);
/* Resumes made while this is on keep handing out the last pause's backup through
 * tms_get_cpu_backup_pointer until the next pause (default: false, as torch_memory_saver, which
 * also decides it at resume; TMS_RETAIN_CPU_BACKUP). After a resume without it the pointer is
 * NULL. Pinned buffers are pooled for the next pause either way (TMS_KEEP_PINNED_BUFFERS). */
void tms_set_retain_cpu_backup(bool retain);
bool tms_get_retain_cpu_backup(void);
/* Pause/resume every allocation of `tag` (NULL or "" = every tag). Idempotent per allocation.
 * Return TMS_OK or a TMS_ERR_* code. */
int tms_pause(const char *tag);
int tms_resume(const char *tag);
/* The host buffer holding the backup of [gpu_ptr, gpu_ptr + size), or NULL. */
uint8_t *tms_get_cpu_backup_pointer(const uint8_t *gpu_ptr, uint64_t size);

/* ---- torch mode (PyTorch CUDAPluggableAllocator / torch_npu NPUPluggableAllocator) ----------- */
void *tms_torch_malloc(ssize_t size, int device, void *stream);
void tms_torch_free(void *ptr, ssize_t size, int device, void *stream);

/* ---- The tms API ------------------------------------------------------------------------------ */

/* As tms_pause/tms_resume, and fill *out (may be NULL). */
int tms_pause_report(const char *tag, tms_report *out);
int tms_resume_report(const char *tag, tms_report *out);
/* Declares the contents of `count` ranges dead for the next pause of the region allocations they
 * lie in (e.g. blocks a caching allocator holds free): that pause's backup copies only the rest,
 * merged into few large copies, and after the resume the dead bytes are undefined (as after
 * freeing them) while the others are restored byte for byte. The pause consumes the marks (the
 * allocator may reuse a block after the resume); freeing the allocation drops them. Ranges in an
 * allocation already paused, and zero-length ones, are ignored. All or nothing: a range that is
 * not inside one region allocation (from an address in it to at most the end of its requested
 * size) returns TMS_ERR_INVALID and marks nothing; so does ranges == NULL with count > 0. */
int tms_mark_dead(const tms_range *ranges, size_t count);
/* Write up to `capacity` per-tag entries to out; *count receives the number of tags. */
int tms_status(tms_tag_status *out, size_t capacity, size_t *count);
/* Free retained backup buffers of active allocations; *bytes_freed may be NULL. */
int tms_release_cpu_backups(uint64_t *bytes_freed);
uint64_t tms_get_memory_margin_bytes(void);
/* Restore verification (default TMS_VERIFY_RESTORE, off): pauses made while it is on take a
 * checksum of every backup, and the next resume checks the backup and reads the restored bytes
 * back, copying once more where a copy went wrong; what still differs fails the resume with
 * TMS_ERR_CORRUPT (the memory stays mapped). Costs a host pass at pause and a device-to-host read
 * of every restored byte at resume. Writes into a paused allocation's backup (through
 * tms_get_cpu_backup_pointer) count as corruption. */
void tms_set_verify_restore(bool on);
bool tms_get_verify_restore(void);
/* Declares who pauses and resumes this process (a launcher, a scheduler; default TMS_MANAGED_BY):
 * pause and resume requests over the control socket that are not forced (tms-ctl without
 * --force) are then refused, naming it. NULL or "" clears it. */
void tms_set_managed_by(const char *manager);
/* Static text for a TMS_ERR_* code. */
const char *tms_strerror(int code);
const char *tms_version(void);

/* ---- Interposed vendor entry points (declared by the vendors' headers) ------------------------
 * cudaMalloc, cudaFree, aclrtMalloc, aclrtMallocAlign32, aclrtFree, and dlsym. */

#ifdef __cplusplus
}
#endif
#endif
