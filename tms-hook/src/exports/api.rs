//! The project's own C API: explicit error codes, reports and status (include/tms.h; the structs
//! and codes are tms_proto::abi's).

use super::{api, opt_str};
use crate::{region, saver};
use libc::c_char;
use tms_proto::abi::{
    MemRange, Report as CReport, TMS_ERR_CORRUPT, TMS_ERR_DRIVER, TMS_ERR_INTERNAL, TMS_ERR_INVALID, TMS_ERR_IO,
    TMS_ERR_NO_DRIVER, TMS_ERR_OUT_OF_MEMORY, TMS_OK, TagStatus as CTagStatus,
};

fn operation(tag: *const c_char, out: *mut CReport, pause: bool) -> i32 {
    // SAFETY: NULL or a NUL-terminated string (the exported contract).
    let tag = unsafe { opt_str(tag) };
    api(
        || {
            let s = saver();
            let report = if pause { s.pause(tag.as_deref()) } else { s.resume(tag.as_deref()) };
            let c = report.to_c();
            if !out.is_null() {
                // SAFETY: the caller passes a tms_report to fill.
                unsafe { out.write(c) };
            }
            c.error
        },
        TMS_ERR_INTERNAL,
    )
}

/// Pauses `tag` (NULL or "" = every tag) and fills `out` if non-NULL.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_pause_report(tag: *const c_char, out: *mut CReport) -> i32 {
    operation(tag, out, true)
}

/// Resumes `tag` (NULL or "" = every tag) and fills `out` if non-NULL.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_resume_report(tag: *const c_char, out: *mut CReport) -> i32 {
    operation(tag, out, false)
}

thread_local! {
    /// The names the calling thread's last `tms_status` pointed to. A tag can end (its last
    /// allocation freed) right after the call, so the caller gets copies, valid until its next
    /// call.
    static STATUS_NAMES: std::cell::RefCell<Vec<std::ffi::CString>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn keep_status_names(names: impl Iterator<Item = String>) -> Vec<*const c_char> {
    let names: Vec<std::ffi::CString> =
        names.map(|n| std::ffi::CString::new(n.replace('\0', "")).expect("NULs removed")).collect();
    STATUS_NAMES
        .try_with(|kept| {
            let mut kept = kept.borrow_mut();
            *kept = names;
            kept.iter().map(|n| n.as_ptr()).collect()
        })
        // The thread is being torn down: empty names rather than dangling ones.
        .unwrap_or_default()
}

/// Writes up to `capacity` per-tag entries to `out`; `*count` receives the number of tags. The
/// `tag` pointers stay valid until this thread's next `tms_status`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_status(out: *mut CTagStatus, capacity: usize, count: *mut usize) -> i32 {
    if count.is_null() || (out.is_null() && capacity > 0) {
        return TMS_ERR_INVALID;
    }
    api(
        || {
            let tags = crate::existing_saver().map(|s| s.status()).unwrap_or_default();
            let names = keep_status_names(tags.iter().take(capacity).map(|t| region::tag_name(t.tag)));
            for (i, t) in tags.iter().take(capacity).enumerate() {
                let c = CTagStatus {
                    tag: names.get(i).copied().unwrap_or(c"".as_ptr()),
                    allocations_active: t.allocations_active,
                    allocations_paused: t.allocations_paused,
                    bytes_active: t.bytes_active,
                    bytes_paused: t.bytes_paused,
                    backup_bytes: t.backup_bytes,
                };
                // SAFETY: `out` has room for `capacity` entries.
                unsafe { out.add(i).write(c) };
            }
            // SAFETY: checked non-null.
            unsafe { count.write(tags.len()) };
            TMS_OK
        },
        TMS_ERR_INTERNAL,
    )
}

/// Marks `count` ranges dead for the next pause of their allocations (include/tms.h). All or
/// nothing: TMS_ERR_INVALID, nothing marked, when one is not inside a region allocation.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_mark_dead(ranges: *const MemRange, count: usize) -> i32 {
    if count == 0 {
        return TMS_OK;
    }
    if ranges.is_null() {
        return TMS_ERR_INVALID;
    }
    // SAFETY: the caller passes `count` ranges at `ranges` (the exported contract).
    let ranges = unsafe { std::slice::from_raw_parts(ranges, count) };
    api(
        || {
            let pairs: Vec<(u64, u64)> = ranges.iter().map(|r| (r.addr, r.len)).collect();
            let Some(s) = crate::existing_saver() else {
                // No saver yet: no region allocation either, so any non-empty range is outside one.
                return if pairs.iter().all(|r| r.1 == 0) { TMS_OK } else { TMS_ERR_INVALID };
            };
            match s.mark_dead(&pairs) {
                Ok(()) => TMS_OK,
                Err(e) => e.codes().0,
            }
        },
        TMS_ERR_INTERNAL,
    )
}

/// Frees retained pinned backup buffers of active allocations; `*bytes_freed` if non-NULL.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_release_cpu_backups(bytes_freed: *mut u64) -> i32 {
    api(
        || {
            let n = crate::existing_saver().map_or(0, |s| s.release_backups());
            if !bytes_freed.is_null() {
                // SAFETY: checked non-null.
                unsafe { bytes_freed.write(n) };
            }
            TMS_OK
        },
        TMS_ERR_INTERNAL,
    )
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_get_memory_margin_bytes() -> u64 {
    api(|| saver().margin(), 0)
}

/// Pauses made while this is on take checksums; resumes check the restored bytes against them.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_set_verify_restore(on: bool) {
    api(|| saver().set_verify_restore(on), ())
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_get_verify_restore() -> bool {
    api(|| saver().verify_restore(), false)
}

/// Declares who pauses and resumes this process (a launcher, a scheduler): control-socket pause
/// and resume requests that are not forced (`tms-ctl` without `--force`) are then refused, naming
/// it. NULL or "" clears it. Default: TMS_MANAGED_BY.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn tms_set_managed_by(manager: *const c_char) {
    // SAFETY: NULL or a NUL-terminated string (the exported contract).
    let who = unsafe { opt_str(manager) };
    api(|| crate::control::set_manager(who), ())
}

/// A static description of a TMS_ERR_* code.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_strerror(code: i32) -> *const c_char {
    match code {
        TMS_OK => c"success",
        TMS_ERR_INVALID => c"invalid argument",
        TMS_ERR_OUT_OF_MEMORY => c"out of device memory (see the report's driver_error)",
        TMS_ERR_DRIVER => c"a driver call failed (see the report's driver_error)",
        TMS_ERR_NO_DRIVER => c"no CUDA or Ascend driver could be loaded",
        TMS_ERR_INTERNAL => c"internal error in tms (a bug: please report it)",
        TMS_ERR_IO => c"a disk backup file could not be read; the allocation stays paused with its file",
        TMS_ERR_CORRUPT => c"a resume did not bring back the bytes the pause saved (TMS_VERIFY_RESTORE; the log names the allocation, tag and offset)",
        _ => c"unknown tms error code",
    }
    .as_ptr()
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn tms_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
