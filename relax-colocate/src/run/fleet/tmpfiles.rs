//! Files a run keeps outside its run directory: the temp folder (worker sockets, the control
//! folder, the simulator's state) and the shared-memory file the weights cross in, which is host
//! RAM until removed.
//!
//! Their names carry the owner's pid and start time (`relax-<pid>-<start>-XXXXXX`,
//! `relax-bucket-<pid>-<start>-XXXXXX`): a run removes its own on every exit it gets to run code
//! on, and a runner killed with SIGKILL cannot, so each run first sweeps those whose owner is gone.
//! The start time tells a dead owner from a new process that got its pid; a live run's files are
//! never touched.

use std::path::{Path, PathBuf};

pub const DIR_PREFIX: &str = "relax-";
pub const BUCKET_PREFIX: &str = "relax-bucket-";

/// The run's files outside its run directory: the temp folder with the control folder (`ctl`) and
/// the worker sockets (`w`), and the shared-memory file one bucket of weights crosses in. The
/// folder goes when this is dropped, and the bucket file with it.
pub struct Scratch {
    pub tmp: tempfile::TempDir,
    pub ctl_dir: PathBuf,
    pub sock_dir: PathBuf,
    pub shm: PathBuf,
    pub shm_bytes: u64,
    /// What dead runs had left, removed first.
    pub swept: Vec<PathBuf>,
}

impl Scratch {
    /// Sweeps what dead runs left, then makes this run's folder and a bucket file of `shm_bytes`.
    /// The workers' control sockets go in `ctl_dir` when given (made if missing, refused if it is
    /// not safe to hold them), else in the run's folder.
    pub fn create(shm_bytes: u64, ctl_dir: Option<&Path>) -> Result<Scratch, String> {
        let shm_dir = Path::new("/dev/shm");
        let mut swept = sweep(&std::env::temp_dir(), DIR_PREFIX);
        swept.extend(sweep(shm_dir, BUCKET_PREFIX));
        let owner = owner_tag();
        let tmp =
            tempfile::Builder::new().prefix(&format!("{DIR_PREFIX}{owner}")).tempdir().map_err(|e| e.to_string())?;
        let own_ctl = ctl_dir.is_none();
        let ctl_dir = ctl_dir.map_or_else(|| tmp.path().join("ctl"), Path::to_path_buf);
        let sock_dir = tmp.path().join("w");
        for d in [&ctl_dir, &sock_dir] {
            let existed = d.exists();
            std::fs::create_dir_all(d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
            // A folder of the user's keeps its mode; ours are private.
            if !existed || (own_ctl || d != &ctl_dir) {
                use std::os::unix::fs::PermissionsExt;
                let _ = std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700));
            }
        }
        tms_proto::check_socket_dir(&ctl_dir).map_err(|e| {
            format!("the control folder {}: {e} (--ctl-dir or TMS_CONTROL_DIR names it)", ctl_dir.display())
        })?;
        let shm_dir = if shm_dir.is_dir() { shm_dir.to_path_buf() } else { tmp.path().to_path_buf() };
        let shm = tempfile::Builder::new()
            .prefix(&format!("{BUCKET_PREFIX}{owner}"))
            .tempfile_in(&shm_dir)
            .map_err(|e| format!("cannot create the update bucket file in {}: {e}", shm_dir.display()))?;
        shm.as_file().set_len(shm_bytes).map_err(|e| e.to_string())?;
        let (_, shm) = shm.keep().map_err(|e| e.to_string())?;
        Ok(Scratch { tmp, ctl_dir, sock_dir, shm, shm_bytes, swept })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.shm);
    }
}

/// This process's part of the names: `<pid>-<start time>-`.
pub fn owner_tag() -> String {
    let pid = std::process::id();
    let start = tms_proto::process_start_time(pid).unwrap_or(0);
    format!("{pid}-{start}-")
}

/// (pid, start time) of the run that made `name` with `prefix`; None for names of another shape
/// (another program's, or an older runner's, which carried no owner).
fn owner(name: &str, prefix: &str) -> Option<(u32, u64)> {
    let mut parts = name.strip_prefix(prefix)?.splitn(3, '-');
    let pid = parts.next()?.parse().ok()?;
    let start = parts.next()?.parse().ok()?;
    parts.next().filter(|rest| !rest.is_empty())?;
    Some((pid, start))
}

fn owner_alive(pid: u32, start: u64) -> bool {
    tms_proto::process_start_time(pid) == Some(start) && !tms_proto::process_exited(pid)
}

/// Removes the entries of `dir` named with `prefix` whose owner is dead and which belong to this
/// user; returns what it removed.
pub fn sweep(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    // Without /proc every owner would look dead, a live run's included.
    if tms_proto::process_start_time(std::process::id()).is_none() {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((pid, start)) = owner(&name, prefix) else { continue };
        if owner_alive(pid, start) {
            continue;
        }
        // Not following links: a link named like ours is not ours to follow.
        let Ok(meta) = std::fs::symlink_metadata(e.path()) else { continue };
        if meta.uid() != uid {
            continue;
        }
        let gone = if meta.is_dir() { std::fs::remove_dir_all(e.path()) } else { std::fs::remove_file(e.path()) };
        if gone.is_ok() {
            removed.push(e.path());
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_their_owner() {
        assert_eq!(owner("relax-12-345-abcDEF", DIR_PREFIX), Some((12, 345)));
        assert_eq!(owner("relax-bucket-12-345-abcDEF", BUCKET_PREFIX), Some((12, 345)));
        // The bucket in the same folder as the temp dirs is not mistaken for one, nor an old name.
        assert_eq!(owner("relax-bucket-12-345-abcDEF", DIR_PREFIX), None);
        assert_eq!(owner("relax-12-345-abc", BUCKET_PREFIX), None);
        assert_eq!(owner("relax-abcDEF", DIR_PREFIX), None);
        assert_eq!(owner("relax-12-345-", DIR_PREFIX), None);
        let tag = owner_tag();
        let (pid, start) = owner(&format!("relax-{tag}x"), DIR_PREFIX).unwrap();
        assert_eq!(pid, std::process::id());
        assert!(owner_alive(pid, start));
        assert!(!owner_alive(pid, start + 1));
    }

    #[test]
    fn sweep_removes_a_dead_owners_entries_only() {
        let dir = tempfile::tempdir().unwrap();
        let live = dir.path().join(format!("relax-{}live", owner_tag()));
        let dead = dir.path().join(format!("relax-{}-1-dead", std::process::id()));
        let other = dir.path().join("relax-olderformat");
        for d in [&live, &dead, &other] {
            std::fs::create_dir(d).unwrap();
            std::fs::write(d.join("f"), b"x").unwrap();
        }
        assert_eq!(sweep(dir.path(), DIR_PREFIX), vec![dead.clone()]);
        assert!(live.is_dir() && other.is_dir() && !dead.exists());
    }
}
