//! The control protocol of `libtms_hook.so` (docs/protocol.md): types, a strict request parser,
//! socket discovery and a blocking client.
//!
//! Line-delimited JSON over a Unix socket, one request per connection:
//! `{"v":1,"op":"pause","tag":"kv_cache"}\n` → `{"v":1,"ok":true,"result":{...}}\n`.
//! This crate exports no C symbols, so tools can link it without interposing anything.

pub mod abi;
#[cfg(feature = "cli")]
pub mod manual;
pub mod size;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const PROTOCOL_VERSION: u64 = 1;
/// Longest request line accepted, newline included.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;
/// Longest reply a client reads.
pub const MAX_REPLY_BYTES: usize = 16 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Ping,
    Status,
    /// `tag` None: every tag. `force`: also in a process that declared a manager
    /// (`TMS_MANAGED_BY`), which refuses pauses and resumes from anyone else (`managed`).
    Pause {
        tag: Option<String>,
        force: bool,
    },
    Resume {
        tag: Option<String>,
        force: bool,
    },
    Set(Settings),
}

/// Process-wide settings a `set` request may change; absent fields stay as they are.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settings {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_backup: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub margin_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retain_backup: Option<bool>,
}

/// Stable error codes of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Not JSON, not an object, a field of the wrong type, an unknown field.
    BadRequest,
    UnknownOp,
    UnsupportedVersion,
    TooLarge,
    /// The request did not arrive in time (or had no newline).
    Timeout,
    /// The peer is neither the same user nor root.
    Forbidden,
    /// Too many connections at once.
    Busy,
    OutOfMemory,
    DriverError,
    NoDriver,
    Internal,
    /// A pause or resume named a tag that no allocation of the process carries.
    UnknownTag,
    /// A resume checked with TMS_VERIFY_RESTORE did not bring back the bytes the pause saved.
    Corrupt,
    /// The process has a manager (TMS_MANAGED_BY) and the request was not forced: a pause from
    /// outside would pull memory from under the manager's next step.
    Managed,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::UnknownOp => "unknown_op",
            ErrorCode::UnsupportedVersion => "unsupported_version",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::Timeout => "timeout",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::Busy => "busy",
            ErrorCode::OutOfMemory => "out_of_memory",
            ErrorCode::DriverError => "driver_error",
            ErrorCode::NoDriver => "no_driver",
            ErrorCode::Internal => "internal",
            ErrorCode::UnknownTag => "unknown_tag",
            ErrorCode::Corrupt => "corrupt",
            ErrorCode::Managed => "managed",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtoError {
    pub code: ErrorCode,
    pub message: String,
}

impl ProtoError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ProtoError {
        ProtoError { code, message: message.into() }
    }
}

impl std::fmt::Display for ProtoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl std::error::Error for ProtoError {}

fn bad(message: impl Into<String>) -> ProtoError {
    ProtoError::new(ErrorCode::BadRequest, message)
}

fn only_fields(obj: &Map<String, Value>, allowed: &[&str]) -> Result<(), ProtoError> {
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(bad(format!("unknown field {k:?} (allowed: {})", allowed.join(", ")))),
        None => Ok(()),
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ProtoError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(bad(format!("{key} must be true or false"))),
    }
}

/// A JSON object whose keys are all different. serde_json keeps the last of repeated keys
/// silently, so `{"op":"ping","op":"pause"}` would be read as a pause.
struct UniqueKeys(Map<String, Value>);

impl<'de> Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Keys;
        impl<'de> serde::de::Visitor<'de> for Keys {
            type Value = UniqueKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<UniqueKeys, A::Error> {
                let mut out = Map::new();
                while let Some((k, v)) = m.next_entry::<String, Value>()? {
                    if out.contains_key(&k) {
                        return Err(serde::de::Error::custom(format!("field {k:?} appears twice")));
                    }
                    out.insert(k, v);
                }
                Ok(UniqueKeys(out))
            }
        }
        d.deserialize_map(Keys)
    }
}

/// Parses one request line (without or with its newline). Strict: every field is checked, and
/// a field may appear once.
pub fn parse_request(line: &[u8]) -> Result<Request, ProtoError> {
    if line.len() > MAX_REQUEST_BYTES {
        return Err(ProtoError::new(ErrorCode::TooLarge, format!("request exceeds {MAX_REQUEST_BYTES} bytes")));
    }
    let value: Value = serde_json::from_slice(line).map_err(|e| bad(format!("not JSON: {e}")))?;
    if !value.is_object() {
        return Err(bad("a request is a JSON object"));
    }
    let UniqueKeys(obj) = serde_json::from_slice(line).map_err(|e| bad(format!("{e}")))?;
    match obj.get("v") {
        None => {}
        Some(Value::Number(n)) if n.as_u64() == Some(PROTOCOL_VERSION) => {}
        Some(Value::Number(n)) => {
            return Err(ProtoError::new(
                ErrorCode::UnsupportedVersion,
                format!("protocol version {n} is not supported (this hook speaks {PROTOCOL_VERSION})"),
            ));
        }
        Some(_) => return Err(bad("v must be a number")),
    }
    let op = match obj.get("op") {
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err(bad("op must be a string")),
        None => return Err(bad("missing op")),
    };
    match op {
        "ping" | "status" => {
            only_fields(&obj, &["v", "op"])?;
            Ok(if op == "ping" { Request::Ping } else { Request::Status })
        }
        "pause" | "resume" => {
            only_fields(&obj, &["v", "op", "tag", "force"])?;
            let force = opt_bool(&obj, "force")?.unwrap_or(false);
            let tag = match obj.get("tag") {
                None | Some(Value::Null) => None,
                // An empty tag once meant every tag: a blank variable in a script paused everything.
                Some(Value::String(s)) if s.trim().is_empty() => {
                    return Err(bad("the empty tag names no tag; leave tag out (or null) for every tag"));
                }
                Some(Value::String(s)) if s.len() <= 256 && !s.contains('\0') => Some(s.clone()),
                Some(Value::String(_)) => return Err(bad("tag must be at most 256 bytes without NUL")),
                Some(_) => return Err(bad("tag must be a string or null")),
            };
            Ok(if op == "pause" { Request::Pause { tag, force } } else { Request::Resume { tag, force } })
        }
        "set" => {
            only_fields(&obj, &["v", "op", "default_backup", "margin_bytes", "retain_backup"])?;
            let margin_bytes = match obj.get("margin_bytes") {
                None | Some(Value::Null) => None,
                Some(Value::Number(n)) => {
                    Some(n.as_u64().ok_or_else(|| bad("margin_bytes must be a whole number >= 0"))?)
                }
                Some(_) => return Err(bad("margin_bytes must be a number")),
            };
            Ok(Request::Set(Settings {
                default_backup: opt_bool(&obj, "default_backup")?,
                margin_bytes,
                retain_backup: opt_bool(&obj, "retain_backup")?,
            }))
        }
        other => Err(ProtoError::new(
            ErrorCode::UnknownOp,
            format!("unknown op {other:?} (ping, status, pause, resume, set)"),
        )),
    }
}

impl Request {
    pub fn to_line(&self) -> String {
        let mut obj = Map::new();
        obj.insert("v".into(), PROTOCOL_VERSION.into());
        let op = match self {
            Request::Ping => "ping",
            Request::Status => "status",
            Request::Pause { tag, force } | Request::Resume { tag, force } => {
                if let Some(t) = tag {
                    obj.insert("tag".into(), t.clone().into());
                }
                if *force {
                    obj.insert("force".into(), true.into());
                }
                if matches!(self, Request::Pause { .. }) { "pause" } else { "resume" }
            }
            Request::Set(s) => {
                if let Value::Object(m) = serde_json::to_value(s).expect("settings serialize") {
                    obj.extend(m);
                }
                "set"
            }
        };
        obj.insert("op".into(), op.into());
        let mut line = Value::Object(obj).to_string();
        line.push('\n');
        line
    }
}

/// What pause and resume report: the counters of `tms_report` (include/tms.h, `abi::Report`) as
/// fields of its own, the tag asked for, and the failure as the protocol's error.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpReport {
    pub tag: Option<String>,
    /// Its `error` and `driver_error` are 0: `error` below says the failure.
    #[serde(flatten)]
    pub counts: abi::Report,
    /// The first failure, if any; the operation still did what it could.
    pub error: Option<ProtoError>,
}

impl OpReport {
    /// The report of `c`'s counters; `c.error` and `c.driver_error` are the C API's codes, and
    /// `error` says the same in the protocol's terms.
    pub fn new(tag: Option<String>, c: &abi::Report, error: Option<ProtoError>) -> OpReport {
        OpReport { tag, counts: abi::Report { error: 0, driver_error: 0, ..*c }, error }
    }
}

// Readers of a report count with `report.bytes_done`, as with the C report.
impl std::ops::Deref for OpReport {
    type Target = abi::Report;
    fn deref(&self) -> &abi::Report {
        &self.counts
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TagInfo {
    pub tag: String,
    pub allocations_active: u64,
    pub allocations_paused: u64,
    pub bytes_active: u64,
    pub bytes_paused: u64,
    pub backup_bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub vendor: String,
    pub device: i32,
    pub free: u64,
    pub total: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub pid: u32,
    pub name: Option<String>,
    pub hook_version: String,
    pub protocol: u64,
    pub devices: Vec<DeviceInfo>,
    pub tags: Vec<TagInfo>,
    pub margin_bytes: u64,
    pub retain_backup: bool,
    pub default_backup: bool,
    /// Host bytes of pinned buffers kept for the next pause by active allocations (absent from
    /// hooks older than this field).
    #[serde(default)]
    pub pooled_backup_bytes: u64,
    /// The NCCL communicators the process created (tag `nccl`) and its HCCL ones; absent when it has none, and
    /// from hooks older than this field.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub communicators: Vec<CommInfo>,
    /// Who pauses and resumes this process (TMS_MANAGED_BY): others' requests need `force`.
    /// Absent when nobody does, and from hooks older than this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub managed_by: Option<String>,
    /// The report of the last pause that took any allocation, from inside the process or over
    /// the socket: its `backup_bytes` were copied to the host, its `backup_bytes_skipped` were
    /// marked dead and not copied. Absent before the first such pause, and from hooks older
    /// than this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_pause: Option<OpReport>,
}

/// One communicator: NCCL's as `ncclCommMemStats` describes its device memory; HCCL's with its
/// buffers (2 x HCCL_BUFFSIZE MB, or its config's size) as persistent bytes, since HCCL cannot
/// release them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommInfo {
    /// "nccl" or "hccl" (absent from hooks older than this field, which knew NCCL only).
    #[serde(default = "nccl")]
    pub library: String,
    /// The communicator's handle in the process, for telling them apart.
    pub handle: u64,
    /// Its CUDA device (absent while a non-blocking init is still running).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<i32>,
    /// Device bytes a suspend releases (ncclStatGpuMemSuspend).
    pub suspendable_bytes: u64,
    /// Device bytes that stay while suspended (ncclStatGpuMemPersist).
    pub persistent_bytes: u64,
    pub suspended: bool,
    /// Suspended by tms (pause of tag `nccl`), so resumed by it; one the application suspended
    /// itself is left to it.
    #[serde(default)]
    pub suspended_by_tms: bool,
}

fn nccl() -> String {
    "nccl".to_string()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    pub v: u64,
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ProtoError>,
}

impl Reply {
    pub fn ok(result: Value) -> Reply {
        Reply { v: PROTOCOL_VERSION, ok: true, result: Some(result), error: None }
    }

    pub fn err(e: ProtoError) -> Reply {
        Reply { v: PROTOCOL_VERSION, ok: false, result: None, error: Some(e) }
    }

    pub fn to_line(&self) -> String {
        let mut s = serde_json::to_string(self).expect("reply serializes");
        s.push('\n');
        s
    }
}

// ---- discovery --------------------------------------------------------------------------------

/// The control socket folder: `$TMS_CONTROL_DIR`, else `$XDG_RUNTIME_DIR/tms` when
/// `$XDG_RUNTIME_DIR` is a private folder of ours, else `/tmp/tms-$UID`.
pub fn socket_dir() -> PathBuf {
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    socket_dir_from(std::env::var_os("TMS_CONTROL_DIR"), std::env::var_os("XDG_RUNTIME_DIR"), uid)
}

/// `socket_dir` with its inputs given. An `XDG_RUNTIME_DIR` that is not ours or is open to
/// others (a stale value after `su`, a shared folder) is passed over: a socket put there could be
/// replaced or squatted by someone else.
pub fn socket_dir_from(control_dir: Option<std::ffi::OsString>, xdg: Option<std::ffi::OsString>, uid: u32) -> PathBuf {
    if let Some(d) = control_dir.filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = xdg.filter(|d| !d.is_empty()).map(PathBuf::from)
        && let Ok(md) = std::fs::metadata(&d)
        && md.is_dir()
        && md.uid() == uid
        && md.mode() & 0o077 == 0
    {
        return d.join("tms");
    }
    PathBuf::from(format!("/tmp/tms-{uid}"))
}

/// Whether `dir` is safe to hold control sockets: a real directory (not a symlink) owned by
/// this user that no group or other user can write to. Anything else may be another user's, who
/// could replace or squat our sockets; the error says what is wrong and how to fix it. Reading
/// the folder is harmless (a 0755 folder a user made for TMS_CONTROL_DIR is fine): the server
/// serves only its own user's peers.
pub fn check_socket_dir(dir: &Path) -> std::io::Result<()> {
    let md = std::fs::symlink_metadata(dir)?;
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let fix = "remove it (as its owner or root) or point TMS_CONTROL_DIR at a private folder";
    if !md.file_type().is_dir() {
        return Err(std::io::Error::other(format!("{} is not a real directory; {fix}", dir.display())));
    }
    if md.uid() != uid {
        return Err(std::io::Error::other(format!(
            "{} is owned by uid {}, not by this user (uid {uid}): another user created it; {fix}",
            dir.display(),
            md.uid()
        )));
    }
    if md.mode() & 0o022 != 0 {
        return Err(std::io::Error::other(format!(
            "{} has mode {:o}: group or others can write to it, so they could replace our sockets (chmod 700 {0})",
            dir.display(),
            md.mode() & 0o777
        )));
    }
    Ok(())
}

/// The socket file name of a process: pid and start time (pid reuse cannot alias it).
pub fn socket_name(pid: u32, start_time: u64) -> String {
    format!("tms-{pid}-{start_time}.sock")
}

/// (pid, start time) from a socket file name made by `socket_name`.
pub fn parse_socket_name(name: &str) -> Option<(u32, u64)> {
    let rest = name.strip_prefix("tms-")?.strip_suffix(".sock")?;
    let (pid, start) = rest.split_once('-')?;
    Some((pid.parse().ok()?, start.parse().ok()?))
}

/// The stat line of process `pid`, read from its main thread's `/proc/PID/task/PID/stat`: on
/// Linux its state and start time are the process's (proc(5)), and unlike `/proc/PID/stat` no
/// user-mode emulator rewrites it. qemu-user answers a process's reads of its own
/// `/proc/self/stat` and `/proc/PID/stat` with a made-up line (state `0`, a start time of its
/// own), so a hooked aarch64 process under qemu-aarch64 would name its socket with a start time
/// that every other process, reading the kernel's, takes for a dead one.
fn stat_line(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/stat"))
        .or_else(|_| std::fs::read_to_string(format!("/proc/{pid}/stat")))
        .ok()
}

/// Field 22 of the process's stat line: start time in clock ticks since boot.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = stat_line(pid)?;
    let after_comm = &stat[stat.rfind(')')? + 2..];
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

/// The state letter of the process's stat line (R, S, D, T stopped, t traced, Z zombie, ...).
pub fn process_state(pid: u32) -> Option<char> {
    let stat = stat_line(pid)?;
    stat.get(stat.rfind(')')? + 2..)?.chars().next()
}

/// The name file beside a socket: the process's `TMS_NAME` as it was when it opened the socket,
/// so that a client can pick processes by name without asking each one (a stopped process
/// would make it wait).
pub fn name_file(socket: &Path) -> PathBuf {
    socket.with_extension("name")
}

/// The name a process wrote beside its socket. None: unnamed, or a hook that writes no name
/// file (then only asking the process tells).
pub fn read_name(socket: &Path) -> Option<Option<String>> {
    let text = std::fs::read(name_file(socket)).ok()?;
    Some(Some(String::from_utf8_lossy(&text).into_owned()).filter(|n| !n.is_empty()))
}

/// Whether `pid` has exited but not been reaped yet (a zombie, state Z, or dying, X): it serves
/// nothing, and its socket is as stale as a dead process's.
pub fn process_exited(pid: u32) -> bool {
    let Some(stat) = stat_line(pid) else { return true };
    let state = stat.rfind(')').and_then(|i| stat.get(i + 2..i + 3));
    matches!(state, Some("Z" | "X" | "x"))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketEntry {
    pub path: PathBuf,
    pub pid: u32,
    pub start_time: u64,
    /// The process with that pid and start time still exists.
    pub alive: bool,
}

/// The control sockets in `dir`, newest pid last.
pub fn list_sockets(dir: &Path) -> Vec<SocketEntry> {
    let Ok(rd) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out: Vec<SocketEntry> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let (pid, start_time) = parse_socket_name(&name)?;
            let alive = process_start_time(pid) == Some(start_time) && !process_exited(pid);
            Some(SocketEntry { path: e.path(), pid, start_time, alive })
        })
        .collect();
    out.sort_by_key(|s| s.pid);
    out
}

// ---- client -----------------------------------------------------------------------------------

#[derive(Debug)]
pub enum ClientError {
    Io(std::io::Error),
    /// The reply was not a protocol reply.
    BadReply(String),
    /// The hook answered with an error.
    Remote(ProtoError),
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientError::Io(e) => write!(f, "{e}"),
            ClientError::BadReply(m) => write!(f, "unexpected reply: {m}"),
            ClientError::Remote(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ClientError {}

impl From<std::io::Error> for ClientError {
    fn from(e: std::io::Error) -> Self {
        ClientError::Io(e)
    }
}

/// The error of a request that got no answer in time: `TimedOut`, saying how long was waited.
pub fn timed_out(timeout: Duration) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, format!("not responding within {}", seconds(timeout)))
}

/// `2s`, `0.5s`: a duration as a user wrote it.
pub fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 { format!("{s:.0}s") } else { format!("{s}s") }
}

/// A Unix stream connected to `path`, the connect itself bounded: a process that is stopped
/// with a full backlog would make a plain blocking connect wait forever.
fn connect(path: &Path, wait: Duration, timeout: Duration) -> std::io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: an all-zero sockaddr_un is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "socket path too long for a Unix socket"));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: plain socket creation; the fd is owned by the stream below at once.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh socket fd that nothing else owns.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    // A Unix connect that waits for room in the backlog waits at most the send timeout.
    stream.set_write_timeout(Some(wait))?;
    let len = (std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1) as libc::socklen_t;
    loop {
        // SAFETY: addr is a valid sockaddr_un of length len.
        let rc = unsafe { libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len) };
        if rc == 0 {
            return Ok(stream);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => return Err(timed_out(timeout)),
            _ => return Err(e),
        }
    }
}

/// Writes all of `bytes` without SIGPIPE: a server that already closed (busy, forbidden) must
/// not kill a client that lets SIGPIPE end it (tms-ctl does, for `| head`).
fn send_all(stream: &UnixStream, mut bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    while !bytes.is_empty() {
        // SAFETY: sends from a live buffer on our own socket.
        let n = unsafe { libc::send(stream.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        bytes = &bytes[n as usize..];
    }
    Ok(())
}

/// Reads one reply line before `deadline`: a peer trickling bytes cannot stretch the wait.
fn read_reply(stream: &mut UnixStream, deadline: Instant, timeout: Duration) -> std::io::Result<Vec<u8>> {
    let mut line = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out(timeout));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf) {
            Ok(0) => return Ok(line),
            Ok(n) => {
                if let Some(end) = buf[..n].iter().position(|&b| b == b'\n') {
                    line.extend_from_slice(&buf[..=end]);
                    return Ok(line);
                }
                line.extend_from_slice(&buf[..n]);
                if line.len() > MAX_REPLY_BYTES {
                    return Err(std::io::Error::other(format!("reply exceeds {MAX_REPLY_BYTES} bytes")));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(timed_out(timeout));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Sends one request and returns the reply's result and error as they came: a failed pause or
/// resume carries both (the report of what was done, and the first failure).
///
/// `timeout` bounds the whole exchange, connect to last byte; a process that does not answer
/// in time gives an `Io` error of kind `TimedOut` ("not responding within 2s"). A `busy` reply
/// (the process serves too many connections) is retried until then: busy is answered before
/// the request is read, so nothing was done.
pub fn call_full(
    path: &Path,
    request: &Request,
    timeout: Duration,
) -> Result<(Option<Value>, Option<ProtoError>), ClientError> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(10);
    loop {
        let got = call_once(path, request, deadline, timeout)?;
        let busy = matches!(&got.1, Some(e) if e.code == ErrorCode::Busy) && got.0.is_none();
        let left = deadline.saturating_duration_since(Instant::now());
        if !busy || left <= pause {
            return Ok(got);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

fn call_once(
    path: &Path,
    request: &Request,
    deadline: Instant,
    timeout: Duration,
) -> Result<(Option<Value>, Option<ProtoError>), ClientError> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut stream = connect(path, left, timeout)?;
    // A server that refuses a peer (forbidden, busy) answers without reading and closes: the
    // write may then fail while the reply is already waiting to be read.
    let written = send_all(&stream, request.to_line().as_bytes());
    let line = read_reply(&mut stream, deadline, timeout);
    let line = match line {
        Ok(l) if !l.is_empty() => l,
        Ok(_) => {
            written?;
            return Err(ClientError::BadReply("connection closed without a reply".into()));
        }
        Err(e) => {
            written?;
            return Err(e.into());
        }
    };
    let reply: Reply = serde_json::from_slice(&line).map_err(|e| ClientError::BadReply(e.to_string()))?;
    if reply.ok != reply.error.is_none() || (reply.result.is_none() && reply.error.is_none()) {
        return Err(ClientError::BadReply("inconsistent ok/result/error".into()));
    }
    Ok((reply.result, reply.error))
}

/// Sends one request; its result, or the hook's error.
pub fn call(path: &Path, request: &Request, timeout: Duration) -> Result<Value, ClientError> {
    match call_full(path, request, timeout)? {
        (Some(r), None) => Ok(r),
        (_, Some(e)) => Err(ClientError::Remote(e)),
        (None, None) => Err(ClientError::BadReply("neither result nor error".into())),
    }
}

fn operation(path: &Path, request: &Request, timeout: Duration) -> Result<OpReport, ClientError> {
    match call_full(path, request, timeout)? {
        (Some(v), error) => {
            let mut report: OpReport = serde_json::from_value(v).map_err(|e| ClientError::BadReply(e.to_string()))?;
            if report.error.is_none() {
                report.error = error;
            }
            Ok(report)
        }
        (None, Some(e)) => Err(ClientError::Remote(e)),
        (None, None) => Err(ClientError::BadReply("neither result nor error".into())),
    }
}

pub fn status(path: &Path, timeout: Duration) -> Result<Status, ClientError> {
    let v = call(path, &Request::Status, timeout)?;
    serde_json::from_value(v).map_err(|e| ClientError::BadReply(e.to_string()))
}

/// Pauses `tag` (None: every tag). `Ok` carries the report even when the operation failed
/// (`report.error`); `Err` means no report came back.
pub fn pause(path: &Path, tag: Option<&str>, timeout: Duration) -> Result<OpReport, ClientError> {
    operation(path, &Request::Pause { tag: tag.map(String::from), force: false }, timeout)
}

/// `pause` or `resume` as the process's manager does it (`force`: a managed process obeys).
pub fn operate_forced(path: &Path, pause: bool, tag: Option<&str>, timeout: Duration) -> Result<OpReport, ClientError> {
    let tag = tag.map(String::from);
    let request = if pause { Request::Pause { tag, force: true } } else { Request::Resume { tag, force: true } };
    operation(path, &request, timeout)
}

/// Resumes `tag` (None: every tag); as `pause`.
pub fn resume(path: &Path, tag: Option<&str>, timeout: Duration) -> Result<OpReport, ClientError> {
    operation(path, &Request::Resume { tag: tag.map(String::from), force: false }, timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_field_is_refused() {
        let e = parse_request(br#"{"op":"ping","op":"pause"}"#).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest);
        assert!(e.message.contains("\"op\" appears twice"), "{}", e.message);
        assert!(parse_request(br#"{"op":"pause","tag":"kv"}"#).is_ok());
    }

    #[test]
    fn requests_round_trip() {
        for r in [
            Request::Ping,
            Request::Status,
            Request::Pause { tag: None, force: false },
            Request::Resume { tag: Some("kv_cache".into()), force: false },
            Request::Pause { tag: Some("weights".into()), force: true },
            Request::Set(Settings { default_backup: Some(true), margin_bytes: Some(1 << 30), retain_backup: None }),
        ] {
            assert_eq!(parse_request(r.to_line().as_bytes()).unwrap(), r);
        }
    }

    #[test]
    fn malformed_requests_get_specific_errors() {
        let code = |s: &str| parse_request(s.as_bytes()).unwrap_err().code;
        assert_eq!(code("not json"), ErrorCode::BadRequest);
        assert_eq!(code("[1,2]"), ErrorCode::BadRequest);
        assert_eq!(code(r#"{"v":1}"#), ErrorCode::BadRequest);
        assert_eq!(code(r#"{"op":7}"#), ErrorCode::BadRequest);
        assert_eq!(code(r#"{"op":"explode"}"#), ErrorCode::UnknownOp);
        assert_eq!(code(r#"{"v":2,"op":"ping"}"#), ErrorCode::UnsupportedVersion);
        assert_eq!(code(r#"{"op":"pause","tag":5}"#), ErrorCode::BadRequest);
        assert_eq!(code(r#"{"op":"pause","tga":"x"}"#), ErrorCode::BadRequest);
        assert_eq!(code(r#"{"op":"set","margin_bytes":-1}"#), ErrorCode::BadRequest);
        assert_eq!(code(r#"{"op":"set","retain_backup":"yes"}"#), ErrorCode::BadRequest);
        let huge = format!(r#"{{"op":"pause","tag":"{}"}}"#, "x".repeat(MAX_REQUEST_BYTES));
        assert_eq!(code(&huge), ErrorCode::TooLarge);
        assert_eq!(code(r#"{"op":"pause","tag":""}"#), ErrorCode::BadRequest);
        assert_eq!(parse_request(br#"{"op":"pause","tag":null}"#).unwrap(), Request::Pause { tag: None, force: false });
        assert_eq!(
            parse_request(br#"{"op":"resume","force":true}"#).unwrap(),
            Request::Resume { tag: None, force: true }
        );
        assert!(parse_request(br#"{"op":"pause","force":"yes"}"#).is_err());
    }

    #[test]
    fn xdg_runtime_dir_is_used_only_when_private_and_ours() {
        use std::os::unix::fs::PermissionsExt;
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        let base = std::env::temp_dir().join(format!("tms-proto-xdg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let xdg = Some(base.clone().into_os_string());
        let fallback = PathBuf::from(format!("/tmp/tms-{uid}"));
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(socket_dir_from(None, xdg.clone(), uid), base.join("tms"));
        assert_eq!(socket_dir_from(Some("/x".into()), xdg.clone(), uid), PathBuf::from("/x"));
        assert_eq!(
            socket_dir_from(None, xdg.clone(), uid + 1),
            fallback.clone().with_file_name(format!("tms-{}", uid + 1))
        );
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(socket_dir_from(None, xdg, uid), fallback);
        assert_eq!(socket_dir_from(None, Some("/nonexistent/run".into()), uid), fallback);
        assert_eq!(socket_dir_from(None, None, uid), fallback);
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// The JSON fields of `v`, in order.
    fn keys<T: Serialize>(v: &T) -> Vec<String> {
        match serde_json::to_value(v).unwrap() {
            Value::Object(m) => m.keys().cloned().collect(),
            other => panic!("not an object: {other}"),
        }
    }

    /// The C struct's field names, less `skip`, between `first` and `last`.
    fn c_fields(layout: abi::Layout, first: &str, skip: &[&str], last: &[&str]) -> Vec<String> {
        let middle = layout.fields.iter().map(|f| f.name).filter(|n| !skip.contains(n));
        std::iter::once(first).chain(middle).chain(last.iter().copied()).map(String::from).collect()
    }

    #[test]
    fn the_protocol_carries_the_fields_of_the_c_structs() {
        // serde_json's map keeps its keys sorted, so the orders are compared sorted; a field added
        // to one side only shows by name in the difference.
        let sorted = |mut v: Vec<String>| {
            v.sort();
            v
        };
        let report = OpReport { error: Some(ProtoError::new(ErrorCode::Internal, "x")), ..OpReport::default() };
        assert_eq!(
            sorted(keys(&report)),
            sorted(c_fields(abi::Report::LAYOUT, "tag", &["error", "driver_error"], &["error"]))
        );
        assert_eq!(sorted(keys(&TagInfo::default())), sorted(c_fields(abi::TagStatus::LAYOUT, "tag", &["tag"], &[])));
    }

    #[test]
    fn a_report_on_the_wire_is_flat_in_field_order_and_reads_back() {
        let c = abi::Report {
            error: abi::TMS_ERR_DRIVER,
            driver_error: 2,
            allocations_done: 1,
            bytes_done: 2,
            allocations_skipped: 3,
            bytes_skipped: 4,
            allocations_failed: 5,
            bytes_failed: 6,
            backup_bytes: 7,
            elapsed_ns: 8,
            device_free_before: 9,
            device_free_after: 10,
            device_total: 11,
            backup_ns: 12,
            backup_bytes_skipped: 13,
        };
        let report = OpReport::new(Some("kv".into()), &c, Some(ProtoError::new(ErrorCode::DriverError, "x")));
        let line = serde_json::to_string(&report).unwrap();
        assert_eq!(
            line,
            r#"{"tag":"kv","allocations_done":1,"bytes_done":2,"allocations_skipped":3,"bytes_skipped":4,"#.to_owned()
                + r#""allocations_failed":5,"bytes_failed":6,"backup_bytes":7,"elapsed_ns":8,"device_free_before":9,"#
                + r#""device_free_after":10,"device_total":11,"backup_ns":12,"backup_bytes_skipped":13,"error":{"code":"driver_error","message":"x"}}"#
        );
        assert_eq!(serde_json::from_str::<OpReport>(&line).unwrap(), report);
        // Hooks older than backup_ns or backup_bytes_skipped send none; every other counter is
        // required.
        let old = line.replace(r#","backup_ns":12"#, "").replace(r#","backup_bytes_skipped":13"#, "");
        let read = serde_json::from_str::<OpReport>(&old).unwrap();
        assert_eq!((read.backup_ns, read.backup_bytes_skipped), (0, 0));
        assert!(serde_json::from_str::<OpReport>(&line.replace(r#""bytes_done":2,"#, "")).is_err());
    }

    #[test]
    fn socket_names_carry_pid_and_start_time() {
        assert_eq!(parse_socket_name(&socket_name(42, 123456)), Some((42, 123456)));
        assert_eq!(parse_socket_name("tms-x-1.sock"), None);
        assert_eq!(parse_socket_name("other.sock"), None);
    }
}
