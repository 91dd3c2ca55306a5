//! torch_memory_saver's C ABI, symbol for symbol (shared/reference/torch-memory-saver.md), so its
//! Python wrapper and the frameworks that call it work unchanged. Differences are improvements:
//! nothing here exits the process; pause/resume are idempotent and return error codes.

use super::{api, opt_str};
use crate::{region, saver};
use libc::c_char;

#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_set_interesting_region(is_interesting_region: bool) {
    api(|| region::set_region(is_interesting_region), ())
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_get_interesting_region() -> bool {
    api(region::in_region, false)
}

/// NULL or "" selects the default tag (`TMS_INIT_TAG`, else "default").
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_set_current_tag(tag: *const c_char) {
    // SAFETY: NULL or a NUL-terminated string.
    let tag = unsafe { opt_str(tag) };
    api(|| region::set_tag(tag.as_deref()), ())
}

/// The calling thread's tag; the pointer stays valid until the thread sets another tag.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_get_current_tag() -> *const c_char {
    api(region::current_tag_ptr, c"default".as_ptr())
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_get_enable_cpu_backup() -> bool {
    api(region::backup_enabled, false)
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_set_enable_cpu_backup(enable: bool) {
    api(|| region::set_backup(enable), ())
}

/// The calling thread's CPU backup backend: "pinned" (page-locked, bus-speed copies) or "mmap"
/// (pageable memory the kernel may reclaim or swap, returned at resume; CUDA only: Ascend's
/// asynchronous copies need page-locked memory, so "mmap" backs up to pinned memory there).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_get_cpu_backup_backend() -> *const c_char {
    let pageable = api(region::pageable_backup, false);
    if pageable { c"mmap".as_ptr() } else { c"pinned".as_ptr() }
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_set_cpu_backup_backend(backend: *const c_char) {
    // SAFETY: NULL or a NUL-terminated string.
    let backend = unsafe { opt_str(backend) };
    api(
        || match backend.as_deref() {
            Some("mmap") => region::set_pageable_backup(true),
            Some("pinned") | None => region::set_pageable_backup(false),
            Some(other) => {
                crate::log::init();
                tracing::warn!("tms: cpu backup backend {other:?} is not pinned or mmap; keeping the current one")
            }
        },
        (),
    )
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_get_enable_disk_backup() -> bool {
    api(region::disk_backup_enabled, false)
}

/// This thread's disk-backup flag: region allocations made while it is on keep their contents in
/// a file of the disk backup folder while paused (see disk.rs).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_set_enable_disk_backup(enable: bool) {
    api(|| region::set_disk_backup(enable), ())
}

/// The folder of disk backup files, for the whole process (default `TMS_DISK_BACKUP_DIR`, else
/// /tmp). NULL or "" restores the default.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_set_disk_backup_dir(dir: *const c_char) {
    // SAFETY: NULL or a NUL-terminated string.
    let dir = unsafe { opt_str(dir) };
    api(|| crate::disk::set_dir(dir.filter(|d| !d.is_empty()).map(Into::into)), ())
}

/// Free memory to keep when allocating in a region and when resuming (no `tms_` prefix, as in
/// torch_memory_saver).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn set_memory_margin_bytes(value: u64) {
    api(|| saver().set_margin(value), ())
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_set_retain_cpu_backup(retain: bool) {
    api(|| saver().set_retain_backup(retain), ())
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_get_retain_cpu_backup() -> bool {
    api(|| saver().retain_backup(), false)
}

/// Pauses `tag` (NULL or "" = every tag). Returns 0 or a TMS_ERR_* code; see tms_pause_report.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_pause(tag: *const c_char) -> i32 {
    // SAFETY: forwarded contract.
    unsafe { super::api::tms_pause_report(tag, std::ptr::null_mut()) }
}

/// Resumes `tag` (NULL or "" = every tag). Returns 0 or a TMS_ERR_* code; see tms_resume_report.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_resume(tag: *const c_char) -> i32 {
    // SAFETY: forwarded contract.
    unsafe { super::api::tms_resume_report(tag, std::ptr::null_mut()) }
}

/// The host buffer holding the backup of `[gpu_ptr, gpu_ptr+size)`, or NULL if that range has
/// none (not tracked, backup disabled, or never paused).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_get_cpu_backup_pointer(gpu_ptr: *const u8, size: u64) -> *mut u8 {
    api(
        || match crate::existing_saver().and_then(|s| s.backup_pointer(gpu_ptr as u64, size)) {
            Some(p) => p as *mut u8,
            None => std::ptr::null_mut(),
        },
        std::ptr::null_mut(),
    )
}
