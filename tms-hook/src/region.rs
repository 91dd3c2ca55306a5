//! Thread-local region, tag and backup flags. Const-initialized `Cell`s without destructors, so
//! they stay usable during thread teardown and `atexit`, when hooks still run.

use crate::config::config;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

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

/// What the calling thread's region allocations are made under, read once where the hook
/// intercepts the allocation and handed to the saver as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flags {
    pub tag: TagId,
    /// CPU backup on pause.
    pub backup: bool,
    /// Disk backup on pause.
    pub disk: bool,
    /// The "mmap" CPU backup backend (pageable host memory) rather than "pinned".
    pub pageable: bool,
}

/// The calling thread's flags when it is in a region; None: its allocations pass through.
pub fn flags() -> Option<Flags> {
    in_region().then(|| Flags {
        tag: current_tag(),
        backup: backup_enabled(),
        disk: disk_backup_enabled(),
        pageable: pageable_backup(),
    })
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

/// The tag table. A program that names a new tag every step (`f"step{n}"`) must not grow the
/// process for good, so a tag is counted: one reference per allocation carrying it and one per
/// thread whose current tag it is; at zero it goes. The default tag (`TMS_INIT_TAG`) stays.
/// A tag named by pause or resume (maybe from outside, over the control socket) is only looked
/// up, never added.
///
/// Ids are never reused, so an id held past its tag's end names nothing rather than another tag.
struct TagTable {
    by_id: BTreeMap<TagId, Tag>,
    by_name: BTreeMap<Vec<u8>, TagId>,
    next: TagId,
}

struct Tag {
    name: CString,
    /// `PINNED`: never released.
    refs: u32,
}

const PINNED: u32 = u32::MAX;

static TAGS: Mutex<TagTable> = Mutex::new(TagTable { by_id: BTreeMap::new(), by_name: BTreeMap::new(), next: 0 });

pub type TagId = u32;

/// A TagId no allocation carries: pause or resume of a tag nothing was allocated under.
pub const NO_SUCH_TAG: TagId = TagId::MAX;

fn tags() -> std::sync::MutexGuard<'static, TagTable> {
    TAGS.lock().unwrap_or_else(|e| e.into_inner())
}

fn clean(tag: &str) -> CString {
    CString::new(tag.replace('\0', "")).expect("NULs removed")
}

impl TagTable {
    /// Finds or adds `tag` and takes `refs` references on it.
    fn acquire(&mut self, tag: &str, refs: u32) -> TagId {
        let name = clean(tag);
        if let Some(&id) = self.by_name.get(name.as_bytes()) {
            let t = self.by_id.get_mut(&id).expect("both maps hold every tag");
            t.refs = if refs == PINNED || t.refs == PINNED { PINNED } else { t.refs.saturating_add(refs) };
            return id;
        }
        // 4 billion distinct tags would be needed to run out; then the last id is shared (its
        // name stays the first one's) rather than wrapping onto live ids.
        remember(name.as_bytes());
        let id = self.next;
        self.next = self.next.saturating_add(1).min(NO_SUCH_TAG - 1);
        self.by_name.insert(name.as_bytes().to_vec(), id);
        self.by_id.insert(id, Tag { name, refs });
        id
    }

    fn release(&mut self, id: TagId) {
        let Some(t) = self.by_id.get_mut(&id) else { return };
        if t.refs == PINNED {
            return;
        }
        t.refs = t.refs.saturating_sub(1);
        if t.refs == 0 {
            let gone = self.by_id.remove(&id).expect("just seen");
            self.by_name.remove(gone.name.as_bytes());
        }
    }
}

/// Hashes of every tag name the process has used, so that the control plane can tell a tag that
/// is momentarily carried by nothing (a pause between one allocation's free and the next) from a
/// name never used here (a typo). Capped, so a program naming a new tag every step stays flat:
/// past the cap every name counts as used, and no pause is refused for it.
static USED: Mutex<Option<std::collections::HashSet<u64>>> = Mutex::new(None);
const USED_CAP: usize = 4096;

fn name_hash(name: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    h.finish()
}

fn remember(name: &[u8]) {
    let mut used = USED.lock().unwrap_or_else(|e| e.into_inner());
    let set = used.get_or_insert_with(Default::default);
    if set.len() < USED_CAP {
        set.insert(name_hash(name));
    }
}

/// Whether the process has ever used `tag` (or has used too many names to tell).
pub fn ever_used(tag: &str) -> bool {
    let name = clean(tag);
    let used = USED.lock().unwrap_or_else(|e| e.into_inner());
    used.as_ref().is_some_and(|set| set.len() >= USED_CAP || set.contains(&name_hash(name.as_bytes())))
}

/// The id of `tag`, added for the life of the process (the default tag, fixed names).
pub fn intern(tag: &str) -> TagId {
    tags().acquire(tag, PINNED)
}

/// One more allocation carries `id` (the caller holds another reference meanwhile: its thread's).
pub fn retain(id: TagId) {
    if let Some(t) = tags().by_id.get_mut(&id)
        && t.refs != PINNED
    {
        t.refs = t.refs.saturating_add(1);
    }
}

/// An allocation carrying `id` is gone.
pub fn release(id: TagId) {
    tags().release(id);
}

/// How many tags the table holds (for tests and `status`).
pub fn tag_count() -> usize {
    tags().by_id.len()
}

/// The id of `tag` if something carries it, else `NO_SUCH_TAG`; never adds to the table.
pub fn lookup(tag: &str) -> TagId {
    let name = clean(tag);
    tags().by_name.get(name.as_bytes()).copied().unwrap_or(NO_SUCH_TAG)
}

pub fn tag_name(id: TagId) -> String {
    tags().by_id.get(&id).map(|t| t.name.to_string_lossy().into_owned()).unwrap_or_default()
}

/// The calling thread's tag as a C string. It stays valid while the thread keeps that tag (the
/// thread holds a reference), as torch_memory_saver's `c_str()` of its thread-local string does.
pub fn current_tag_ptr() -> *const libc::c_char {
    let id = current_tag();
    tags().by_id.get(&id).map_or(c"default".as_ptr(), |t| t.name.as_ptr())
}

fn default_tag() -> TagId {
    static DEFAULT: OnceLock<TagId> = OnceLock::new();
    *DEFAULT.get_or_init(|| intern(&config().init_tag))
}

pub fn current_tag() -> TagId {
    match TAG.with(Cell::get) {
        0 => default_tag(),
        n => n - 1,
    }
}

pub fn set_tag(tag: Option<&str>) {
    let id = match tag {
        None => 0,
        Some(t) => tags().acquire(t, 1) + 1,
    };
    let old = TAG.with(|c| c.replace(id));
    if old != 0 {
        release(old - 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_the_threads_own_and_only_inside_a_region() {
        // Run on a thread of its own: the flags are thread-local and other tests set theirs.
        std::thread::spawn(|| {
            set_region(false);
            assert_eq!(flags(), None);
            set_region(true);
            set_tag(Some("flags-test"));
            set_backup(true);
            set_disk_backup(false);
            set_pageable_backup(true);
            let f = flags().expect("in a region");
            assert_eq!((tag_name(f.tag).as_str(), f.backup, f.disk, f.pageable), ("flags-test", true, false, true));
            set_tag(None);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_tag_goes_when_nothing_carries_it() {
        // Other tests share the table, so this one only looks at its own names.
        let names: Vec<String> = (0..10_000).map(|i| format!("region-test-step{i}")).collect();
        for name in &names {
            set_tag(Some(name));
            let id = current_tag();
            assert_eq!(tag_name(id), *name);
            // SAFETY: the thread holds its current tag, so the pointer is live.
            let shown = unsafe { std::ffi::CStr::from_ptr(current_tag_ptr()) };
            assert_eq!(shown.to_str().unwrap(), name);
            retain(id); // an allocation made under it
            set_tag(None);
            assert_eq!(lookup(name), id, "an allocation still carries {name}");
            release(id); // the allocation freed
            assert_eq!(lookup(name), NO_SUCH_TAG, "{name} stayed after its last user went");
            assert_eq!(tag_name(id), "", "a gone id names nothing");
        }
    }

    #[test]
    fn ids_are_not_reused_and_the_default_tag_stays() {
        set_tag(Some("region-test-a"));
        let a = current_tag();
        set_tag(Some("region-test-b"));
        let b = current_tag();
        assert_ne!(a, b);
        assert_eq!(lookup("region-test-a"), NO_SUCH_TAG);
        set_tag(Some("region-test-a"));
        assert_ne!(current_tag(), a, "a released id came back for another tag");
        set_tag(None);
        let default = current_tag();
        release(default);
        release(default);
        assert_eq!(lookup(&config().init_tag), default);
    }
}
