//! Disk backup: the contents of allocations made with disk backup go to a file per allocation
//! while they are paused, instead of staying in pinned host memory. The pause pipeline stages
//! them through a pinned buffer as for CPU backup; the file is written once the device memory is
//! released and read back into a staging buffer before resume restores it. A file that cannot be
//! written leaves the contents in host memory (nothing is lost); one that cannot be read leaves the
//! allocation paused with its file, for a later resume.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Mutex;

/// `tms_set_disk_backup_dir`, else `TMS_DISK_BACKUP_DIR`, else /tmp (as torch_memory_saver).
static DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Sets the folder (None: back to the default).
pub fn set_dir(dir: Option<PathBuf>) {
    *DIR.lock().unwrap_or_else(|e| e.into_inner()) = dir;
}

pub fn dir() -> PathBuf {
    if let Some(d) = DIR.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        return d;
    }
    std::env::var_os("TMS_DISK_BACKUP_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| "/tmp".into())
}

/// The file that holds a paused allocation's contents: one per process and address.
pub fn file_for(addr: u64) -> PathBuf {
    dir().join(format!("tms-backup-{}-{addr:x}.bin", std::process::id()))
}

/// Writes `len` bytes at `src` to `path` (created or truncated, private to the user).
pub fn write(path: &std::path::Path, src: usize, len: usize) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    // SAFETY: `src` is a pinned buffer of at least `len` bytes that nothing else writes meanwhile.
    let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
    f.write_all(bytes)?;
    Ok(())
}

/// Reads exactly `len` bytes of `path` into `dst`.
pub fn read(path: &std::path::Path, dst: usize, len: usize) -> std::io::Result<()> {
    let mut f = std::fs::File::open(path)?;
    let size = f.metadata()?.len();
    if size != len as u64 {
        return Err(std::io::Error::other(format!("{} holds {size} bytes, expected {len}", path.display())));
    }
    // SAFETY: `dst` is a pinned buffer of at least `len` bytes owned by the caller.
    let bytes = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
    f.read_exact(bytes)
}

pub fn remove(path: &std::path::Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!("tms: cannot remove disk backup {}: {e}", path.display());
    }
}
