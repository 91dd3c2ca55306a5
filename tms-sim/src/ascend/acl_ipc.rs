//! Ascend IPC memory sharing between processes of one simulated node (CANN's runtime API,
//! "IPC memory sharing": `aclrtIpcMemGetExportKey`, `aclrtIpcMemSetImportPid`,
//! `aclrtIpcMemImportByKey`, `aclrtIpcMemClose`, and `aclrtDeviceGetBareTgid` for the pid an
//! importer is allowed by).
//!
//! The exporter's memory is shared the way the CUDA side shares it (cuda/runtime/ipc.rs): the
//! importer maps the exporter's device pool through `/proc/PID/fd/N`, so both see the same bytes
//! and the memory stays charged to the exporter. What the key names lives in a small record file
//! beside the node's state file, since the whitelist set after the export must reach importers in
//! other processes. As CANN documents: only `aclrtMalloc` memory is exported (memory made with the
//! virtual-memory calls is shared through shareable handles instead), the key buffer holds 65
//! bytes, an export validates importers against its pid whitelist unless exported with
//! ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION, and a key the exporter closed (or whose
//! exporter exited) imports no more.

use crate::ascend::acl::{INVALID_PARAM, RT_MEMORY_ALLOCATION, RT_PARAM_INVALID, SUCCESS, call, put};
use crate::core::node::process_start_time;
use crate::core::sim::{ImportFailure, import_exported, sim};
use libc::{c_char, c_void};
use std::collections::HashMap;
use std::ffi::CStr;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The key's length CANN fixes: 64 characters and the NUL.
const KEY_LEN: usize = 65;
/// ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION (DEFAULT, 0, validates).
const EXPORT_NO_PID_VALIDATION: u64 = 0x1;
/// ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS (DEFAULT, 0, leaves peer access off).
const IMPORT_ENABLE_PEER_ACCESS: u64 = 0x1;

/// What a key names, as its record file holds it.
struct Record {
    pid: u32,
    start_time: u64,
    fd: i32,
    /// The whole allocation in the exporter's pool, and where the exported pointer is in it.
    offset: u64,
    len: u64,
    delta: u64,
    device: u32,
    validate: bool,
    allowed: Vec<i32>,
}

impl Record {
    fn write(&self, key: &str) -> std::io::Result<()> {
        let allowed: Vec<String> = self.allowed.iter().map(i32::to_string).collect();
        let text = format!(
            "{} {} {} {} {} {} {} {}\n{}\n",
            self.pid,
            self.start_time,
            self.fd,
            self.offset,
            self.len,
            self.delta,
            self.device,
            u8::from(self.validate),
            allowed.join(" ")
        );
        let path = record_path(key);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, text)?;
        std::fs::rename(tmp, path)
    }

    fn read(key: &str) -> Option<Record> {
        let text = std::fs::read_to_string(record_path(key)).ok()?;
        let mut lines = text.lines();
        let f: Vec<u64> = lines.next()?.split_whitespace().map(|w| w.parse().ok()).collect::<Option<_>>()?;
        let allowed = lines.next().unwrap_or("").split_whitespace().map(|w| w.parse().ok()).collect::<Option<_>>()?;
        let [pid, start_time, fd, offset, len, delta, device, validate] = f[..] else { return None };
        Some(Record {
            pid: pid as u32,
            start_time,
            fd: fd as i32,
            offset,
            len,
            delta,
            device: device as u32,
            validate: validate == 1,
            allowed,
        })
    }
}

/// Keys are made of letters and digits only, so a key is a safe file name.
fn record_path(key: &str) -> PathBuf {
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    crate::core::config::state_dir().join(format!("tms-sim-{uid}-aclipc-{key}"))
}

/// This process's exports (key: its record) and imports (key: the mapped bases, one per import).
struct Tables {
    exports: HashMap<String, Record>,
    imports: HashMap<String, Vec<usize>>,
}

static TABLES: Mutex<Option<Tables>> = Mutex::new(None);
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

fn tables<T>(f: impl FnOnce(&mut Tables) -> T) -> T {
    let mut t = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    f(t.get_or_insert_with(|| Tables { exports: HashMap::new(), imports: HashMap::new() }))
}

/// A key argument: NUL-terminated, at most 64 characters, letters and digits.
fn key_of(key: *const c_char) -> Option<String> {
    if key.is_null() {
        return None;
    }
    // SAFETY: the caller passes a NUL-terminated string (CANN's contract for a key).
    let s = unsafe { CStr::from_ptr(key) }.to_str().ok()?;
    (!s.is_empty() && s.len() < KEY_LEN && s.bytes().all(|b| b.is_ascii_alphanumeric())).then(|| s.to_string())
}

pub unsafe extern "C" fn aclrt_device_get_bare_tgid(pid: *mut i32) -> i32 {
    // No container here: the process id the device sees is the process's own.
    call("aclrtDeviceGetBareTgid", || put(pid, std::process::id() as i32))
}

pub unsafe extern "C" fn aclrt_ipc_mem_get_export_key(
    dev_ptr: *mut c_void,
    size: usize,
    key: *mut c_char,
    len: usize,
    flags: u64,
) -> i32 {
    call("aclrtIpcMemGetExportKey", || {
        if dev_ptr.is_null() || key.is_null() || size == 0 || len < KEY_LEN || flags & !EXPORT_NO_PID_VALIDATION != 0 {
            return INVALID_PARAM;
        }
        let mem = sim().mem.read().unwrap_or_else(|e| e.into_inner());
        // Only aclrtMalloc memory has a key; region memory (the virtual-memory calls) has none.
        let Ok((start, alloc_len, device, offset)) = mem.ipc_export(dev_ptr as usize) else { return RT_PARAM_INVALID };
        let delta = dev_ptr as usize - start;
        if size > alloc_len - delta {
            return RT_PARAM_INVALID;
        }
        let pid = std::process::id();
        let record = Record {
            pid,
            start_time: process_start_time(pid).unwrap_or(0),
            fd: mem.pool_fd_for_ipc(),
            offset,
            len: alloc_len as u64,
            delta: delta as u64,
            device: device as u32,
            validate: flags & EXPORT_NO_PID_VALIDATION == 0,
            allowed: Vec::new(),
        };
        drop(mem);
        let name = format!("tmsacl{pid:x}k{:x}", NEXT_KEY.fetch_add(1, Ordering::Relaxed));
        if record.write(&name).is_err() {
            return RT_MEMORY_ALLOCATION;
        }
        tables(|t| t.exports.insert(name.clone(), record));
        let mut bytes = [0u8; KEY_LEN];
        bytes[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: the caller's key buffer holds `len` >= KEY_LEN bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr().cast(), key, KEY_LEN) };
        SUCCESS
    })
}

pub unsafe extern "C" fn aclrt_ipc_mem_set_import_pid(key: *const c_char, pid: *mut i32, num: usize) -> i32 {
    call("aclrtIpcMemSetImportPid", || {
        let Some(key) = key_of(key) else { return INVALID_PARAM };
        if pid.is_null() || num == 0 {
            return INVALID_PARAM;
        }
        // SAFETY: the caller passes `num` pids.
        let pids = unsafe { std::slice::from_raw_parts(pid, num) }.to_vec();
        // Only the exporter sets a key's whitelist.
        tables(|t| match t.exports.get_mut(&key) {
            Some(r) => {
                r.allowed.extend(pids);
                if r.write(&key).is_ok() { SUCCESS } else { RT_MEMORY_ALLOCATION }
            }
            None => RT_PARAM_INVALID,
        })
    })
}

pub unsafe extern "C" fn aclrt_ipc_mem_import_by_key(dev_ptr: *mut *mut c_void, key: *const c_char, flags: u64) -> i32 {
    call("aclrtIpcMemImportByKey", || {
        let Some(key) = key_of(key) else { return INVALID_PARAM };
        if dev_ptr.is_null() || flags & !IMPORT_ENABLE_PEER_ACCESS != 0 {
            return INVALID_PARAM;
        }
        // A key never exported, or closed by its exporter.
        let Some(r) = Record::read(&key) else { return RT_PARAM_INVALID };
        let alive = process_start_time(r.pid).is_some_and(|t| r.start_time == 0 || t == r.start_time);
        if !alive {
            let _ = std::fs::remove_file(record_path(&key));
            return RT_PARAM_INVALID;
        }
        if r.validate && !r.allowed.contains(&(std::process::id() as i32)) {
            return RT_PARAM_INVALID;
        }
        if r.device as usize >= sim().devices() {
            return RT_PARAM_INVALID;
        }
        let base = match import_exported(r.pid, r.fd, r.offset, r.len as usize, r.device as usize) {
            Ok(base) => base,
            Err(ImportFailure::Unreachable) => return RT_PARAM_INVALID,
            Err(ImportFailure::Map) => return RT_MEMORY_ALLOCATION,
        };
        tables(|t| t.imports.entry(key).or_default().push(base));
        put(dev_ptr, (base + r.delta as usize) as *mut c_void)
    })
}

pub unsafe extern "C" fn aclrt_ipc_mem_close(key: *const c_char) -> i32 {
    call("aclrtIpcMemClose", || {
        let Some(key) = key_of(key) else { return INVALID_PARAM };
        // An importer closes its mapping; the exporter closes the key itself.
        let imported = tables(|t| {
            let bases = t.imports.get_mut(&key)?;
            let base = bases.pop();
            if bases.is_empty() {
                t.imports.remove(&key);
            }
            base
        });
        if let Some(base) = imported {
            // Work queued on streams may still read the memory.
            sim().synchronize(None);
            return if sim().ipc_close(base).is_ok() { SUCCESS } else { RT_PARAM_INVALID };
        }
        match tables(|t| t.exports.remove(&key)) {
            Some(_) => {
                let _ = std::fs::remove_file(record_path(&key));
                SUCCESS
            }
            None => RT_PARAM_INVALID,
        }
    })
}
