//! Thread-local region, tag and backup flags. Const-initialized `Cell`s without destructors, so
//! they stay usable during thread teardown and `atexit`, when hooks still run.

use crate::config::config;
use std::cell::Cell;
use std::ffi::{CStr, CString};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

const UNSET: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

thread_local! {
    static REGION: Cell<u8> = const { Cell::new(UNSET) };
    static BACKUP: Cell<u8> = const { Cell::new(UNSET) };
    static DISK_BACKUP: Cell<u8> = const { Cell::new(UNSET) };
    /// ON: the "mmap" CPU backup backend (pageable host memory); OFF: "pinned".
    static PAGEABLE_BACKUP: Cell<u8> = const { Cell::new(UNSET) };
    /// Interned tag id + 1; 0 means the default tag.
    static TAG: Cell<u32> = const { Cell::new(0) };
}

fn flag(v: bool) -> u8 {
    if v { ON } else { OFF }
}

pub fn in_region() -> bool {
    match REGION.with(Cell::get) {
        UNSET => config().init_enable,
        v => v == ON,
    }
}

pub fn set_region(on: bool) {
    REGION.with(|c| c.set(flag(on)));
}

/// The backup flag of threads that never set one: `TMS_INIT_ENABLE_CPU_BACKUP`, unless changed
/// through the control socket (`set default_backup`).
static DEFAULT_BACKUP: AtomicU8 = AtomicU8::new(UNSET);

pub fn default_backup() -> bool {
    match DEFAULT_BACKUP.load(Ordering::Relaxed) {
        UNSET => config().init_backup,
        v => v == ON,
    }
}

pub fn set_default_backup(on: bool) {
    DEFAULT_BACKUP.store(flag(on), Ordering::Relaxed);
}

pub fn backup_enabled() -> bool {
    match BACKUP.with(Cell::get) {
        UNSET => default_backup(),
        v => v == ON,
    }
}

pub fn set_backup(on: bool) {
    BACKUP.with(|c| c.set(flag(on)));
}

/// Whether this thread's region allocations back up to disk (thread-local, as upstream's flag;
/// threads that never set it: `TMS_INIT_ENABLE_DISK_BACKUP`).
pub fn disk_backup_enabled() -> bool {
    match DISK_BACKUP.with(Cell::get) {
        UNSET => config().disk_backup,
        v => v == ON,
    }
}

pub fn set_disk_backup(on: bool) {
    DISK_BACKUP.with(|c| c.set(flag(on)));
}

/// Whether this thread's region allocations back up to pageable host memory (torch_memory_saver's
/// "mmap" backend, a per-thread setting there too; threads that never set it:
/// `TMS_INIT_CPU_BACKUP_BACKEND`).
pub fn pageable_backup() -> bool {
    match PAGEABLE_BACKUP.with(Cell::get) {
        UNSET => config().backup_backend == "mmap",
        v => v == ON,
    }
}

pub fn set_pageable_backup(on: bool) {
    PAGEABLE_BACKUP.with(|c| c.set(flag(on)));
}

/// Tags are interned for the life of the process, so `tms_get_current_tag` can hand out pointers
/// that stay valid. Only the program's own tags (regions, `tms_set_current_tag`) are interned, a
/// handful; a tag named by pause or resume is only looked up, so clients naming ever new tags
/// (from outside, over the control socket) cannot grow the table.
static TAGS: Mutex<Vec<CString>> = Mutex::new(Vec::new());

pub type TagId = u32;

/// A TagId no allocation carries: pause or resume of a tag nothing was allocated under.
pub const NO_SUCH_TAG: TagId = TagId::MAX;

pub fn intern(tag: &str) -> TagId {
    let mut tags = TAGS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(i) = tags.iter().position(|t| t.to_bytes() == tag.as_bytes()) {
        return i as TagId;
    }
    tags.push(CString::new(tag.replace('\0', "")).expect("NULs removed"));
    (tags.len() - 1) as TagId
}

/// The id of `tag` if the program ever used it, else `NO_SUCH_TAG`; never adds to the table.
pub fn lookup(tag: &str) -> TagId {
    let tags = TAGS.lock().unwrap_or_else(|e| e.into_inner());
    let tag = tag.replace('\0', "");
    tags.iter().position(|t| t.to_bytes() == tag.as_bytes()).map_or(NO_SUCH_TAG, |i| i as TagId)
}

pub fn tag_name(id: TagId) -> String {
    tag_ptr(id).map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()).unwrap_or_default()
}

/// A pointer to the interned tag's bytes, valid for the life of the process (the `CString`'s heap
/// buffer does not move when the vector grows).
pub fn tag_ptr(id: TagId) -> Option<*const libc::c_char> {
    TAGS.lock().unwrap_or_else(|e| e.into_inner()).get(id as usize).map(|t| t.as_ptr())
}

pub fn current_tag() -> TagId {
    match TAG.with(Cell::get) {
        0 => intern(&config().init_tag),
        n => n - 1,
    }
}

pub fn set_tag(tag: Option<&str>) {
    let id = match tag {
        None => 0,
        Some(t) => intern(t) + 1,
    };
    TAG.with(|c| c.set(id));
}
