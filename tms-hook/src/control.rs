//! The control socket: each hooked process that uses device memory serves `tms-proto` requests on
//! a Unix socket, so an operator or orchestrator can pause, resume and inspect it from outside.
//!
//! Started lazily on a background thread at the first region allocation (or at the first hooked
//! call with `TMS_CONTROL=1`; never with `TMS_CONTROL=0`). A forked child starts its own on first
//! use. The folder is created 0700 and refused unless it is a real directory owned by this user
//! with no group/other access; the socket is 0600; peers must be the same user or root.

use crate::saver::{Error, Report};
use crate::{region, saver};
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use tms_proto::{ErrorCode, MAX_REQUEST_BYTES, OpReport, ProtoError, Reply, Request, Status, TagInfo};

/// Pid of the process whose server is running (a forked child has another pid and starts anew).
static STARTED_FOR: AtomicU32 = AtomicU32::new(0);
static ACTIVE_CONNECTIONS: AtomicUsize = AtomicUsize::new(0);
const MAX_CONNECTIONS: usize = 32;
/// Socket and name file to remove at exit, with the pid that owns them (a forked child must not
/// remove them).
static SOCKET: Mutex<Option<(u32, CString, CString)>> = Mutex::new(None);
/// `TMS_NAME` as it was when the socket opened: the name file says the same, so picking
/// processes by name from their files and asking them agree.
static NAME: OnceLock<(u32, Option<String>)> = OnceLock::new();
static WARNED: AtomicBool = AtomicBool::new(false);

fn setting() -> Option<bool> {
    crate::config::config().control
}

/// Called at every hooked allocation: starts the server when `TMS_CONTROL=1`.
pub fn on_hooked_call() {
    if setting() == Some(true) {
        ensure_started();
    }
}

/// Starts the server for this process if it is not running yet.
pub fn ensure_started() {
    if setting() == Some(false) {
        return;
    }
    let pid = std::process::id();
    let previous = STARTED_FOR.load(Ordering::Acquire);
    if previous == pid || STARTED_FOR.compare_exchange(previous, pid, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return;
    }
    let spawned = std::thread::Builder::new().name("tms-control".into()).spawn(|| {
        if let Err(e) = serve()
            && !WARNED.swap(true, Ordering::Relaxed)
        {
            tracing::warn!("tms: control socket unavailable: {e}; tms-ctl cannot reach this process");
        }
    });
    if let Err(e) = spawned {
        tracing::warn!("tms: cannot start the control thread: {e}");
    }
}

fn timeout() -> Duration {
    let ms = std::env::var("TMS_CONTROL_TIMEOUT_MS").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(5000);
    Duration::from_millis(ms.clamp(10, 600_000))
}

/// Creates the folder 0700 if needed, then refuses it unless it is safe to put a socket in.
pub fn secure_dir(dir: &Path) -> std::io::Result<()> {
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    tms_proto::check_socket_dir(dir)
}

extern "C" fn remove_socket_at_exit() {
    // try_lock: a thread killed mid-update must not make exit hang.
    if let Ok(guard) = SOCKET.try_lock()
        && let Some((pid, path, name)) = guard.as_ref()
        && *pid == std::process::id()
    {
        // SAFETY: NUL-terminated paths.
        unsafe {
            libc::unlink(path.as_ptr());
            libc::unlink(name.as_ptr());
        }
    }
}

fn serve() -> std::io::Result<()> {
    let dir = tms_proto::socket_dir();
    secure_dir(&dir)?;
    let pid = std::process::id();
    let start = tms_proto::process_start_time(pid).unwrap_or(0);
    let path: PathBuf = dir.join(tms_proto::socket_name(pid, start));
    // The socket is bound under its `.binding` name first (below), three bytes longer.
    if path.with_extension("binding").as_os_str().len() >= 108 {
        return Err(std::io::Error::other(format!(
            "socket path {} is too long for a Unix socket; set TMS_CONTROL_DIR to a shorter folder",
            path.display()
        )));
    }
    let _ = std::fs::remove_file(&path);
    // Bound under a name clients do not look for, then renamed into place: binding creates the
    // file before the socket listens, and a client that found it in between (this process
    // stopped there, say) would be refused instead of told the process does not answer.
    let binding = path.with_extension("binding");
    let _ = std::fs::remove_file(&binding);
    let listener = UnixListener::bind(&binding)?;
    std::fs::set_permissions(&binding, std::fs::Permissions::from_mode(0o600))?;
    if let Err(e) = std::fs::rename(&binding, &path) {
        let _ = std::fs::remove_file(&binding);
        return Err(e);
    }
    let name_path = tms_proto::name_file(&path);
    let name = own_name();
    // Best effort: without the file, clients ask the process its name instead.
    if let Err(e) = write_name_file(&name_path, name.as_deref().unwrap_or("")) {
        tracing::debug!("tms: cannot write {}: {e}", name_path.display());
    }
    let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
    let c_name = CString::new(name_path.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
    *SOCKET.lock().unwrap_or_else(|e| e.into_inner()) = Some((pid, c_path, c_name));
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    AT_EXIT.call_once(|| {
        // SAFETY: registers a function that only unlinks a path.
        unsafe { libc::atexit(remove_socket_at_exit) };
    });
    tracing::info!("tms: control socket {}", path.display());
    let mut backoff = Duration::ZERO;
    for conn in listener.incoming() {
        if std::process::id() != pid {
            break; // forked child: this listener belongs to the parent
        }
        let stream = match conn {
            Ok(s) => {
                backoff = Duration::ZERO;
                s
            }
            Err(e) => {
                // Out of file descriptors (or kernel memory): the pending connection stays
                // queued and accept fails again at once, so retrying without a pause would spin
                // a core for as long as the shortage lasts.
                if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) {
                    if backoff.is_zero() {
                        tracing::warn!("tms: control socket cannot accept connections: {e}; retrying");
                    }
                    backoff = (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                    std::thread::sleep(backoff);
                }
                continue;
            }
        };
        if ACTIVE_CONNECTIONS.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            ACTIVE_CONNECTIONS.fetch_sub(1, Ordering::AcqRel);
            refuse_busy(&stream);
            continue;
        }
        let spawned = std::thread::Builder::new().name("tms-control-conn".into()).spawn(move || {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle(stream)));
            ACTIVE_CONNECTIONS.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            ACTIVE_CONNECTIONS.fetch_sub(1, Ordering::AcqRel);
        }
    }
    Ok(())
}

fn write_name_file(path: &Path, name: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(name.as_bytes())
}

/// The name this process goes by: `TMS_NAME` when the socket opened (later changes to the
/// variable are not seen, as they are not by the name file).
fn own_name() -> Option<String> {
    let pid = std::process::id();
    let read = || std::env::var("TMS_NAME").ok().filter(|n| !n.is_empty());
    match NAME.get() {
        Some((p, n)) if *p == pid => n.clone(),
        Some(_) => read(), // a forked child of a process that served
        None => NAME.get_or_init(|| (pid, read())).1.clone(),
    }
}

/// Answers `busy` to a connection over the limit, from the accepting thread, so without
/// waiting: what the client already sent is read and dropped first, because closing a Unix
/// socket with unread data resets the client's end and it would see ECONNRESET, not the reply.
fn refuse_busy(stream: &UnixStream) {
    let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
    let mut s = stream;
    let _ = s.write_all(Reply::err(ProtoError::new(ErrorCode::Busy, "too many connections")).to_line().as_bytes());
    let mut sink = [0u8; 4096];
    for _ in 0..(MAX_REQUEST_BYTES / sink.len() + 1) {
        // SAFETY: reads into a live buffer, never blocking.
        let n = unsafe { libc::recv(stream.as_raw_fd(), sink.as_mut_ptr().cast(), sink.len(), libc::MSG_DONTWAIT) };
        if n <= 0 {
            break;
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// Who may pause and resume this process without `force`: None, anyone of its user; Some(who),
/// only requests that say they come from its manager (TMS_MANAGED_BY, `tms_set_managed_by`).
static MANAGER: Mutex<Option<Option<String>>> = Mutex::new(None);

/// The process's manager, if it declared one.
pub fn manager() -> Option<String> {
    let mut m = MANAGER.lock().unwrap_or_else(|e| e.into_inner());
    m.get_or_insert_with(|| crate::config::config().managed_by.clone()).clone()
}

/// Declares (Some) or clears (None) the process's manager.
pub fn set_manager(who: Option<String>) {
    *MANAGER.lock().unwrap_or_else(|e| e.into_inner()) = Some(who.filter(|w| !w.trim().is_empty()));
}

/// What changes the process's memory or settings from outside is said where its own log is read,
/// at warn, with who asked: a run that later fails has the cause in its worker's log. Its
/// manager's own requests (forced, from the pid TMS_MANAGED_BY names) are routine: info.
fn log_request(req: &Request, peer: Option<u32>) {
    let forced = match req {
        Request::Pause { force, .. } | Request::Resume { force, .. } => *force,
        Request::Set(_) => false,
        Request::Ping | Request::Status => return,
    };
    let from = peer.map_or_else(|| "an unknown process".into(), describe_peer);
    let by_manager = forced && peer.zip(manager()).is_some_and(|(pid, m)| m.contains(&format!("pid {pid})")));
    let line = req.to_line();
    if by_manager {
        tracing::info!("tms: control request from {from}, the manager: {}", line.trim_end());
    } else {
        tracing::warn!("tms: control request from {from}: {}", line.trim_end());
    }
}

/// A process as a log line names it: `pid 123 (tms-ctl)`.
fn describe_peer(pid: u32) -> String {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    match comm.trim() {
        "" => format!("pid {pid}"),
        name => format!("pid {pid} ({name})"),
    }
}

/// The peer's uid (SO_PEERCRED).
fn peer_uid(stream: &UnixStream) -> Option<u32> {
    peer_cred(stream).map(|c| c.uid)
}

/// The peer's credentials (SO_PEERCRED): its uid, and the pid that connected.
fn peer_cred(stream: &UnixStream) -> Option<libc::ucred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt into a correctly sized ucred.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred)
}

/// Whether the peer has closed its end entirely (a half-close after the request still waits
/// for the reply and is not "gone").
fn peer_gone(stream: &UnixStream) -> bool {
    let mut fds = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: polls one live fd without waiting.
    let n = unsafe { libc::poll(&mut fds, 1, 0) };
    n == 1 && fds.revents & libc::POLLHUP != 0
}

/// Only the same user, or root, may drive a process's memory.
pub fn peer_allowed(peer_uid: u32, own_uid: u32) -> bool {
    peer_uid == own_uid || peer_uid == 0
}

fn handle(stream: UnixStream) {
    let t = timeout();
    let deadline = Instant::now() + t;
    let _ = stream.set_write_timeout(Some(t));
    // SAFETY: getuid cannot fail.
    let own = unsafe { libc::getuid() };
    let reply = match peer_uid(&stream) {
        Some(uid) if peer_allowed(uid, own) => match read_request(&stream, deadline) {
            Ok(line) => match tms_proto::parse_request(&line) {
                // A client that gave up (its timeout passed while this process was stopped or
                // busy) was told the process did not answer: doing the pause now, unseen, would
                // contradict that.
                Ok(req) if peer_gone(&stream) => {
                    tracing::info!("tms: control request {req:?} dropped: its client is gone");
                    return;
                }
                Ok(req) => {
                    log_request(&req, peer_cred(&stream).map(|c| c.pid as u32));
                    dispatch(req)
                }
                Err(e) => Reply::err(e),
            },
            Err(e) => Reply::err(e),
        },
        Some(uid) => Reply::err(ProtoError::new(
            ErrorCode::Forbidden,
            format!("uid {uid} may not control a process of uid {own} (same user or root only)"),
        )),
        None => Reply::err(ProtoError::new(ErrorCode::Forbidden, "cannot read peer credentials")),
    };
    let mut s = &stream;
    let _ = s.write_all(reply.to_line().as_bytes());
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// Reads the request line, all of it before `deadline`: a per-read timeout would let a client
/// that trickles a byte now and then hold its connection slot for ever.
fn read_request(stream: &UnixStream, deadline: Instant) -> Result<Vec<u8>, ProtoError> {
    let mut line = Vec::new();
    let mut buf = [0u8; 4096];
    let mut s = stream;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ProtoError::new(ErrorCode::Timeout, "no complete request line in time"));
        }
        let _ = stream.set_read_timeout(Some(left));
        // Never read past the limit (plus the newline that may end it).
        let room = (MAX_REQUEST_BYTES + 1 - line.len()).min(buf.len());
        match s.read(&mut buf[..room]) {
            Ok(0) => break,
            Ok(n) => {
                if let Some(end) = buf[..n].iter().position(|&b| b == b'\n') {
                    line.extend_from_slice(&buf[..=end]);
                    break;
                }
                line.extend_from_slice(&buf[..n]);
                if line.len() > MAX_REQUEST_BYTES {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(ProtoError::new(ErrorCode::Timeout, "no complete request line in time"));
            }
            Err(e) => return Err(ProtoError::new(ErrorCode::BadRequest, format!("read failed: {e}"))),
        }
    }
    if line.last() != Some(&b'\n') {
        return Err(if line.len() > MAX_REQUEST_BYTES {
            ProtoError::new(ErrorCode::TooLarge, format!("request exceeds {MAX_REQUEST_BYTES} bytes"))
        } else {
            ProtoError::new(ErrorCode::BadRequest, "truncated request: a request ends with a newline")
        });
    }
    line.pop();
    Ok(line)
}

pub fn proto_error(e: &Error) -> ProtoError {
    let code = match e {
        Error::OutOfMemory { .. } => ErrorCode::OutOfMemory,
        Error::Driver(_) => ErrorCode::DriverError,
        Error::NoDriver(_) => ErrorCode::NoDriver,
        Error::Invalid(_) => ErrorCode::BadRequest,
        Error::Disk(_) => ErrorCode::Internal,
        Error::Corrupt { .. } => ErrorCode::Corrupt,
        Error::Registration(_) => ErrorCode::DriverError,
    };
    ProtoError::new(code, e.to_string())
}

fn op_report(tag: Option<String>, r: &Report) -> OpReport {
    OpReport::new(tag, r, r.error.as_ref().map(proto_error))
}

pub fn status() -> Status {
    let s = saver();
    Status {
        pid: std::process::id(),
        name: own_name(),
        hook_version: env!("CARGO_PKG_VERSION").to_string(),
        protocol: tms_proto::PROTOCOL_VERSION,
        devices: s
            .devices()
            .into_iter()
            .map(|(vendor, device, free, total)| tms_proto::DeviceInfo {
                vendor: vendor.name().to_string(),
                device,
                free,
                total,
            })
            .collect(),
        tags: s
            .status()
            .into_iter()
            .map(|t| TagInfo {
                tag: region::tag_name(t.tag),
                allocations_active: t.allocations_active,
                allocations_paused: t.allocations_paused,
                bytes_active: t.bytes_active,
                bytes_paused: t.bytes_paused,
                backup_bytes: t.backup_bytes,
            })
            .collect(),
        margin_bytes: s.margin(),
        retain_backup: s.retain_backup(),
        default_backup: region::default_backup(),
        pooled_backup_bytes: s.pooled_bytes(),
        communicators: crate::comms::status()
            .into_iter()
            .map(|c| tms_proto::CommInfo {
                library: c.library.to_string(),
                handle: c.handle as u64,
                device: c.device,
                suspendable_bytes: c.suspendable_bytes,
                persistent_bytes: c.persistent_bytes,
                suspended: c.suspended,
                suspended_by_tms: c.suspended_by_tms,
            })
            .collect(),
        managed_by: manager(),
        last_pause: s.last_pause().map(|(tag, r)| op_report(tag, &r)),
    }
}

fn json<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

fn dispatch(req: Request) -> Reply {
    match req {
        Request::Pause { force: false, .. } | Request::Resume { force: false, .. } if manager().is_some() => {
            let who = manager().unwrap_or_default();
            let verb = if matches!(req, Request::Pause { .. }) { "pause" } else { "resume" };
            Reply::err(ProtoError::new(
                ErrorCode::Managed,
                format!(
                    "refused: this process is managed by {who}, which pauses and resumes it itself; a {verb} from \
                     outside pulls memory from under its next step (on a GPU the process then dies with 700). \
                     Use --force to do it anyway"
                ),
            ))
        }
        Request::Ping => Reply::ok(serde_json::json!({ "pong": true, "pid": std::process::id() })),
        Request::Status => Reply::ok(json(&status())),
        Request::Pause { tag, .. } | Request::Resume { tag, .. }
            if tag.as_deref().is_some_and(|t| t.trim().is_empty()) =>
        {
            Reply::err(ProtoError::new(
                ErrorCode::BadRequest,
                "the empty tag names no tag; leave the tag out to pause or resume every tag",
            ))
        }
        Request::Pause { tag, .. } | Request::Resume { tag, .. } if tag.as_deref().is_some_and(|t| !tag_carried(t)) => {
            let t = tag.unwrap_or_default();
            let mut known: Vec<String> = status().tags.into_iter().map(|s| s.tag).collect();
            known.sort();
            known.dedup();
            let here = if known.is_empty() { "none".to_string() } else { known.join(", ") };
            Reply::err(ProtoError::new(
                ErrorCode::UnknownTag,
                format!("no allocation carries tag {t:?} and none ever did here (tags here: {here})"),
            ))
        }
        Request::Pause { tag, .. } => operation_reply(tag.clone(), &saver().pause(tag.as_deref())),
        Request::Resume { tag, .. } => operation_reply(tag.clone(), &saver().resume(tag.as_deref())),
        Request::Set(settings) => {
            let s = saver();
            let largest = s.devices().into_iter().map(|(_, _, _, total)| total).max();
            if let (Some(m), Some(total)) = (settings.margin_bytes, largest)
                && m > total
            {
                use tms_proto::size::format_size;
                return Reply::err(ProtoError::new(
                    ErrorCode::BadRequest,
                    format!(
                        "a margin of {} is more than this process's largest device holds ({}): every region \
                         allocation would be refused; nothing was changed",
                        format_size(m),
                        format_size(total)
                    ),
                ));
            }
            if let Some(m) = settings.margin_bytes {
                s.set_margin(m);
            }
            if let Some(r) = settings.retain_backup {
                s.set_retain_backup(r);
            }
            if let Some(b) = settings.default_backup {
                region::set_default_backup(b);
            }
            Reply::ok(json(&status()))
        }
    }
}

/// Whether the process knows `tag`: something carries it now, or it was used before (a pause
/// between one allocation's free and the next one's is no error; a name never used here is).
fn tag_carried(tag: &str) -> bool {
    region::lookup(tag) != region::NO_SUCH_TAG || region::ever_used(tag) || crate::comms::is_known_tag(tag)
}

/// A failed operation's reply carries its report too: what was done, skipped and failed.
fn operation_reply(tag: Option<String>, report: &Report) -> Reply {
    let out = op_report(tag, report);
    match &out.error {
        Some(e) => {
            Reply { v: tms_proto::PROTOCOL_VERSION, ok: false, result: Some(json(&out)), error: Some(e.clone()) }
        }
        None => Reply::ok(json(&out)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn only_the_same_user_or_root_is_served() {
        assert!(peer_allowed(1000, 1000));
        assert!(peer_allowed(0, 1000));
        assert!(!peer_allowed(1001, 1000));
        assert!(!peer_allowed(1000, 0));
    }

    #[test]
    fn unsafe_socket_folders_are_refused() {
        let base = tempfile_dir();
        let dir = base.join("ok");
        secure_dir(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        secure_dir(&open).expect("a folder others can only read is safe");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o775)).unwrap();
        assert!(secure_dir(&open).unwrap_err().to_string().contains("chmod 700"));
        let link = base.join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(secure_dir(&link).unwrap_err().to_string().contains("not a real directory"));
        std::fs::remove_dir_all(&base).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("tms-control-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
