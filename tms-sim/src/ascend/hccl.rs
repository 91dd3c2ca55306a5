//! The HCCL ABI (`libhccl.so`, CANN's hccl.h, hccl_comm.h and hccl_types.h) over the simulator's
//! collectives, on ACL streams.
//!
//! A communicator is made from the root info (`HcclGetRootInfo` on one rank, the 4108 bytes
//! passed to the others by the caller, as vllm-ascend's communicator does) or from a rank table
//! file (`HcclCommInitClusterInfo`). Its buffers take 2 x `HCCL_BUFFSIZE` MB of device memory
//! (default 200 MB; CANN: "each communicator occupies 2 x HCCL_BUFFSIZE", one buffer to send and
//! one to receive), or 2 x `HcclCommConfig.hcclBufferSize` when a config sets it. Init waits up to
//! `HCCL_CONNECT_TIMEOUT` seconds (CANN: 120 to 7200, default 120) for every rank;
//! `TMS_SIM_HCCL_CONNECT_TIMEOUT` (any number of seconds) takes precedence, for tests.

use crate::ascend::ACL_DEVICE;
use crate::core::collectives::{CollError, Comm, CommConfig, DType, Op, RedOp, UniqueId};
use crate::core::sim::{guard, sim};
use libc::{c_char, c_void};
use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

pub const SUCCESS: i32 = 0;
pub const E_PARA: i32 = 1;
pub const E_PTR: i32 = 2;
pub const E_MEMORY: i32 = 3;
pub const E_INTERNAL: i32 = 4;
pub const E_NOT_SUPPORT: i32 = 5;
pub const E_NOT_FOUND: i32 = 6;
pub const E_TIMEOUT: i32 = 9;
pub const E_OPEN_FILE_FAILURE: i32 = 10;
pub const E_TCP_CONNECT: i32 = 11;
pub const E_RUNTIME: i32 = 15;
pub const E_REMOTE: i32 = 21;

// Declared once for every part of tms (tms-vendor).
pub use tms_vendor::hccl::{
    BUFFSIZE_NOT_SET, CONFIG_MAGIC, CommConfigHead as HcclCommConfigHead, ROOT_INFO_BYTES, RootInfo as HcclRootInfo,
};
const DEFAULT_BUFFSIZE_MB: u64 = 200;
const CONNECT_TIMEOUT_RANGE_S: std::ops::RangeInclusive<u64> = 120..=7200;
const DEFAULT_CONNECT_TIMEOUT_S: u64 = 120;

pub fn code_of(e: &CollError) -> i32 {
    match e {
        CollError::InvalidArgument(_) | CollError::InvalidUsage(_) => E_PARA,
        CollError::Remote(_) => E_REMOTE,
        CollError::Timeout(_) => E_TIMEOUT,
        CollError::Aborted => E_INTERNAL,
        CollError::Device(_) => E_RUNTIME,
        CollError::OutOfMemory(_) => E_MEMORY,
        CollError::System(_) => E_TCP_CONNECT,
        CollError::Internal(_) => E_INTERNAL,
    }
}

/// `HcclSetConfig(HcclConfig, HcclConfigValue)`: HCCL_DETERMINISTIC (0) with 0 or 1. The simulator's
/// reductions are always computed in rank order, so both settings give the same (deterministic)
/// results.
pub unsafe extern "C" fn set_config(config: i32, value: i32) -> i32 {
    if config == 0 && (0..=1).contains(&value) { SUCCESS } else { E_PARA }
}

pub unsafe extern "C" fn get_error_string(code: i32) -> *const c_char {
    let text: &'static CStr = match code {
        SUCCESS => c"success",
        E_PARA => c"parameter error",
        E_PTR => c"empty pointer",
        E_MEMORY => c"memory error",
        E_INTERNAL => c"internal error",
        E_NOT_SUPPORT => c"not support feature",
        E_NOT_FOUND => c"not found specific resource",
        E_TIMEOUT => c"timeout",
        E_OPEN_FILE_FAILURE => c"open file fail",
        E_TCP_CONNECT => c"tcp connect fail",
        E_RUNTIME => c"call runtime api fail",
        E_REMOTE => c"error cqe",
        _ => c"unknown error",
    };
    text.as_ptr()
}

struct HcclComm {
    core: Arc<Comm>,
}

fn live() -> std::sync::MutexGuard<'static, HashMap<usize, Arc<HcclComm>>> {
    static LIVE: OnceLock<Mutex<HashMap<usize, Arc<HcclComm>>>> = OnceLock::new();
    LIVE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

fn lookup(comm: *mut c_void) -> Result<Arc<Comm>, i32> {
    if comm.is_null() {
        warn("a null communicator");
        return Err(E_PTR);
    }
    live().get(&(comm as usize)).map(|c| c.core.clone()).ok_or_else(|| {
        warn(&format!("{comm:p} is not a live communicator (destroyed, or not made by HcclCommInit*)"));
        E_PARA
    })
}

fn warn(msg: &str) {
    crate::core::config::warn(&format!("HCCL: {msg}"));
}

fn fail(e: CollError) -> i32 {
    warn(&e.to_string());
    code_of(&e)
}

fn call(body: impl FnOnce() -> i32) -> i32 {
    crate::core::context::note_per_call_faults();
    guard(E_INTERNAL, body)
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok().filter(|v| !v.trim().is_empty())?;
    match v.trim().parse() {
        Ok(n) => Some(n),
        Err(_) => {
            warn(&format!("{name}={v:?} is not a whole number; ignored"));
            None
        }
    }
}

fn connect_timeout() -> Duration {
    if let Some(s) = env_u64("TMS_SIM_HCCL_CONNECT_TIMEOUT") {
        return Duration::from_secs(s);
    }
    let s = match env_u64("HCCL_CONNECT_TIMEOUT") {
        Some(s) if CONNECT_TIMEOUT_RANGE_S.contains(&s) => s,
        Some(s) => {
            warn(&format!("HCCL_CONNECT_TIMEOUT={s} is outside 120..7200 s; using {DEFAULT_CONNECT_TIMEOUT_S}"));
            DEFAULT_CONNECT_TIMEOUT_S
        }
        None => DEFAULT_CONNECT_TIMEOUT_S,
    };
    Duration::from_secs(s)
}

fn comm_config(buffer_mb: Option<u64>) -> CommConfig {
    let mb = buffer_mb.or_else(|| env_u64("HCCL_BUFFSIZE").filter(|m| *m >= 1)).unwrap_or(DEFAULT_BUFFSIZE_MB);
    CommConfig { connect_timeout: connect_timeout(), buffer_bytes: 2 * mb * (1 << 20), persistent_bytes: 0 }
}

/// The calling thread's Ascend device (aclrtSetDevice's): HCCL needs one set first.
fn current_device() -> Result<usize, i32> {
    match ACL_DEVICE.with(|d| d.get()) {
        0 => {
            warn("no device is set on this thread (call aclrtSetDevice first)");
            Err(E_RUNTIME)
        }
        n => Ok(n - 1),
    }
}

fn dtype_of(code: i32) -> Result<DType, i32> {
    Ok(match code {
        0 => DType::I8,
        1 => DType::I16,
        2 => DType::I32,
        3 => DType::F16,
        4 => DType::F32,
        5 => DType::I64,
        6 => DType::U64,
        7 => DType::U8,
        8 => DType::U16,
        9 => DType::U32,
        10 => DType::F64,
        11 => DType::BF16,
        15 => DType::F8E4M3,
        16 => DType::F8E5M2,
        12 | 14 | 17 | 18 => {
            warn(&format!("data type {code} (INT128, HIF8, FP8E8M0, MXFP8) is not modelled by the simulator"));
            return Err(E_NOT_SUPPORT);
        }
        _ => {
            warn(&format!("{code} is not an HcclDataType"));
            return Err(E_PARA);
        }
    })
}

fn redop_of(code: i32) -> Result<RedOp, i32> {
    Ok(match code {
        0 => RedOp::Sum,
        1 => RedOp::Prod,
        2 => RedOp::Max,
        3 => RedOp::Min,
        _ => {
            warn(&format!("{code} is not an HcclReduceOp (SUM 0, PROD 1, MAX 2, MIN 3)"));
            return Err(E_PARA);
        }
    })
}

pub unsafe extern "C" fn get_root_info(out: *mut HcclRootInfo) -> i32 {
    call(|| {
        if out.is_null() {
            return E_PTR;
        }
        match crate::core::collectives::transport::create_root(connect_timeout()) {
            Ok(id) => {
                // SAFETY: checked non-null; the caller passes an HcclRootInfo.
                let info = unsafe { &mut *out };
                id.encode(&mut info.internal);
                SUCCESS
            }
            Err(e) => fail(e),
        }
    })
}

fn register(core: Arc<Comm>) -> *mut c_void {
    let comm = Arc::new(HcclComm { core });
    let ptr = Arc::as_ptr(&comm) as *mut c_void;
    live().insert(ptr as usize, comm);
    ptr
}

fn init(id: UniqueId, nranks: u32, rank: u32, buffer_mb: Option<u64>, out: *mut *mut c_void) -> i32 {
    if out.is_null() {
        return E_PTR;
    }
    if nranks == 0 || rank >= nranks {
        warn(&format!("rank {rank} of {nranks} ranks"));
        return E_PARA;
    }
    let device = match current_device() {
        Ok(d) => d,
        Err(code) => return code,
    };
    match Comm::init(id, nranks as usize, rank as usize, device, &comm_config(buffer_mb)) {
        Ok(core) => {
            // SAFETY: checked non-null.
            unsafe { out.write(register(core)) };
            SUCCESS
        }
        Err(e) => fail(e),
    }
}

fn root_id(info: *const HcclRootInfo) -> Result<UniqueId, i32> {
    if info.is_null() {
        return Err(E_PTR);
    }
    // SAFETY: checked non-null; the caller passes an HcclRootInfo.
    UniqueId::decode(unsafe { &(*info).internal }).ok_or_else(|| {
        warn("the root info was not made by HcclGetRootInfo");
        E_PARA
    })
}

pub unsafe extern "C" fn comm_init_root_info(
    nranks: u32,
    info: *const HcclRootInfo,
    rank: u32,
    out: *mut *mut c_void,
) -> i32 {
    call(|| match root_id(info) {
        Ok(id) => init(id, nranks, rank, None, out),
        Err(code) => code,
    })
}

pub unsafe extern "C" fn comm_init_root_info_config(
    nranks: u32,
    info: *const HcclRootInfo,
    rank: u32,
    config: *const HcclCommConfigHead,
    out: *mut *mut c_void,
) -> i32 {
    call(|| {
        let buffer_mb = match config_buffer_mb(config) {
            Ok(mb) => mb,
            Err(code) => return code,
        };
        match root_id(info) {
            Ok(id) => init(id, nranks, rank, buffer_mb, out),
            Err(code) => code,
        }
    })
}

/// The config's buffer size (MB) when set; a config not made by HcclCommConfigInit is refused.
fn config_buffer_mb(config: *const HcclCommConfigHead) -> Result<Option<u64>, i32> {
    if config.is_null() {
        return Err(E_PTR);
    }
    // SAFETY: checked non-null; every HcclCommConfig version starts with this head.
    let c = unsafe { &*config };
    if c.magic != CONFIG_MAGIC || c.size < std::mem::size_of::<HcclCommConfigHead>() {
        warn("the HcclCommConfig was not initialized by HcclCommConfigInit (magic word or size)");
        return Err(E_PARA);
    }
    Ok(match c.buffer_size_mb {
        BUFFSIZE_NOT_SET | 0 => None,
        mb => Some(mb as u64),
    })
}

/// A rank table (CANN's JSON, versions 1.0 and 1.2) names every rank and its device but no
/// bootstrap root: every rank derives the root's port and run number from the table's bytes,
/// and rank 0 starts the root there.
pub unsafe extern "C" fn comm_init_cluster_info(path: *const c_char, rank: u32, out: *mut *mut c_void) -> i32 {
    call(|| {
        if path.is_null() {
            return E_PTR;
        }
        // SAFETY: checked non-null; a NUL-terminated path.
        let path = unsafe { CStr::from_ptr(path) }.to_string_lossy().into_owned();
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) => {
                warn(&format!("cannot read the rank table {path}: {e}"));
                return E_OPEN_FILE_FAILURE;
            }
        };
        let (nranks, device) = match rank_table(&text, rank) {
            Ok(v) => v,
            Err(msg) => {
                warn(&format!("rank table {path}: {msg}"));
                return E_PARA;
            }
        };
        if current_device() != Ok(device) {
            warn(&format!("rank table {path}: rank {rank} is on device {device}; set it with aclrtSetDevice first"));
            return E_PARA;
        }
        let hash = fnv1a(&text);
        let at = std::net::SocketAddrV4::new(
            crate::core::collectives::transport::listen_ip(),
            20000 + (hash % 30000) as u16,
        );
        let id = if rank == 0 {
            match crate::core::collectives::transport::create_root_at(at, hash | 1, connect_timeout()) {
                Ok(id) => id,
                Err(e) => return fail(e),
            }
        } else {
            UniqueId { root: at, run: hash | 1 }
        };
        init(id, nranks as u32, rank, None, out)
    })
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100_0000_01b3))
}

/// (rank count, this rank's device id) from a rank table; every value is a string in CANN's
/// format, and a table whose status is not "completed" is not usable yet.
fn rank_table(text: &[u8], rank: u32) -> Result<(usize, usize), String> {
    let v: serde_json::Value = serde_json::from_slice(text).map_err(|e| format!("not JSON: {e}"))?;
    if v.get("status").and_then(|s| s.as_str()) != Some("completed") {
        return Err("status is not \"completed\"".into());
    }
    let servers = v.get("server_list").and_then(|s| s.as_array()).ok_or("no server_list")?;
    let mut ranks = Vec::new();
    for server in servers {
        for d in server.get("device").and_then(|d| d.as_array()).ok_or("a server without a device list")? {
            let field = |name: &str| -> Result<usize, String> {
                d.get(name)
                    .and_then(|x| x.as_str())
                    .and_then(|x| x.parse().ok())
                    .ok_or(format!("a device without a numeric \"{name}\" string"))
            };
            ranks.push((field("rank_id")?, field("device_id")?));
        }
    }
    ranks.sort_unstable();
    if ranks.iter().enumerate().any(|(i, (r, _))| *r != i) {
        return Err("rank_id values are not 0..n-1, each once".into());
    }
    let device = ranks.get(rank as usize).map(|(_, d)| *d).ok_or(format!("rank {rank} is not in the table"))?;
    Ok((ranks.len(), device))
}

/// One process, `ndev` devices (HcclCommInitAll): a root here and each rank's init in a thread of
/// its own, on its device.
pub unsafe extern "C" fn comm_init_all(ndev: u32, devices: *const i32, comms: *mut *mut c_void) -> i32 {
    call(|| {
        if devices.is_null() || comms.is_null() {
            return E_PTR;
        }
        if ndev == 0 {
            return E_PARA;
        }
        // SAFETY: the caller passes ndev device ids.
        let devs: Vec<i32> = (0..ndev as usize).map(|i| unsafe { *devices.add(i) }).collect();
        if let Some(bad) = devs.iter().find(|d| usize::try_from(**d).map_or(true, |d| d >= sim().devices())) {
            warn(&format!("HcclCommInitAll: device {bad} does not exist"));
            return E_PARA;
        }
        let cfg = comm_config(None);
        let id = match crate::core::collectives::transport::create_root(cfg.connect_timeout) {
            Ok(id) => id,
            Err(e) => return fail(e),
        };
        let threads: Vec<_> = devs
            .iter()
            .enumerate()
            .map(|(rank, &dev)| {
                let cfg = cfg.clone();
                std::thread::spawn(move || {
                    crate::ascend::open_acl_context(dev as usize);
                    Comm::init(id, ndev as usize, rank, dev as usize, &cfg)
                })
            })
            .collect();
        let results: Vec<Result<Arc<Comm>, CollError>> = threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|_| Err(CollError::Internal("an init thread panicked".into()))))
            .collect();
        if let Some(e) = results.iter().find_map(|r| r.as_ref().err()) {
            return fail(e.clone());
        }
        for (i, r) in results.into_iter().enumerate() {
            if let Ok(core) = r {
                // SAFETY: comms holds ndev entries.
                unsafe { comms.add(i).write(register(core)) };
            }
        }
        SUCCESS
    })
}

/// HcclSendRecvItem: {HcclSendRecvType sendRecvType (SEND 0, RECV 1); void *buf; uint64_t count;
/// HcclDataType dataType; uint32_t remoteRank}.
#[repr(C)]
pub struct HcclSendRecvItem {
    pub kind: i32,
    pub buf: *mut c_void,
    pub count: u64,
    pub dtype: i32,
    pub remote_rank: u32,
}

/// Sends and receives queued together: they run as one operation, sends first, so no order of
/// items can deadlock (HcclBatchSendRecv).
pub unsafe extern "C" fn batch_send_recv(
    items: *const HcclSendRecvItem,
    n: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    call(|| {
        if items.is_null() && n > 0 {
            return E_PTR;
        }
        let core = match lookup(comm) {
            Ok(c) => c,
            Err(code) => return code,
        };
        let mut ops = Vec::with_capacity(n as usize);
        for i in 0..n as usize {
            // SAFETY: the caller passes n items.
            let it = unsafe { &*items.add(i) };
            let (dtype, count) = match dtype_of(it.dtype).and_then(|d| Ok((d, count_of(it.count)?))) {
                Ok(v) => v,
                Err(code) => return code,
            };
            let (buf, peer) = (it.buf as usize, it.remote_rank as usize);
            ops.push(match it.kind {
                0 => Op::Send { buf, count, dtype, peer },
                1 => Op::Recv { buf, count, dtype, peer },
                k => {
                    warn(&format!("HcclBatchSendRecv: item {i} has type {k} (HCCL_SEND 0, HCCL_RECV 1)"));
                    return E_PARA;
                }
            });
        }
        if !sim().streams.exists(crate::ascend::stream_id(stream as usize)) {
            return E_PARA;
        }
        match core.submit(crate::ascend::stream_id(stream as usize), ops, crate::ascend::acl::code_of) {
            Ok(()) => SUCCESS,
            Err(e) => fail(e),
        }
    })
}

/// HcclAlltoAll with one count and type for every peer (what the core models); differing send
/// and receive counts or types are refused.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn all_to_all(
    send: *const c_void,
    send_count: u64,
    send_type: i32,
    recv: *const c_void,
    recv_count: u64,
    recv_type: i32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    call(|| {
        if send_count != recv_count || send_type != recv_type {
            warn("HcclAlltoAll: send and receive counts and types must match in the simulator");
            return E_PARA;
        }
        let o = dtype_of(send_type).and_then(|dtype| {
            Ok(Op::AllToAll { send: send as usize, recv: recv as usize, count: count_of(send_count)?, dtype })
        });
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn comm_destroy(comm: *mut c_void) -> i32 {
    call(|| {
        let Ok(core) = lookup(comm) else { return if comm.is_null() { E_PTR } else { E_PARA } };
        live().remove(&(comm as usize));
        core.destroy();
        SUCCESS
    })
}

pub unsafe extern "C" fn get_rank_size(comm: *mut c_void, out: *mut u32) -> i32 {
    call(|| match lookup(comm) {
        Ok(c) if !out.is_null() => {
            // SAFETY: checked non-null.
            unsafe { out.write(c.nranks as u32) };
            SUCCESS
        }
        Ok(_) => E_PTR,
        Err(code) => code,
    })
}

pub unsafe extern "C" fn get_rank_id(comm: *mut c_void, out: *mut u32) -> i32 {
    call(|| match lookup(comm) {
        Ok(c) if !out.is_null() => {
            // SAFETY: checked non-null.
            unsafe { out.write(c.rank as u32) };
            SUCCESS
        }
        Ok(_) => E_PTR,
        Err(code) => code,
    })
}

pub unsafe extern "C" fn get_comm_async_error(comm: *mut c_void, out: *mut i32) -> i32 {
    call(|| match lookup(comm) {
        Ok(c) if !out.is_null() => {
            // SAFETY: checked non-null.
            unsafe { out.write(c.async_error().map_or(SUCCESS, |e| code_of(&e))) };
            SUCCESS
        }
        Ok(_) => E_PTR,
        Err(code) => code,
    })
}

fn enqueue(comm: *mut c_void, stream: *mut c_void, op: Result<Op, i32>) -> i32 {
    let core = match lookup(comm) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let op = match op {
        Ok(op) => op,
        Err(code) => return code,
    };
    if !sim().streams.exists(crate::ascend::stream_id(stream as usize)) {
        warn(&format!("{stream:p} is not an ACL stream"));
        return E_PARA;
    }
    match core.submit(crate::ascend::stream_id(stream as usize), vec![op], crate::ascend::acl::code_of) {
        Ok(()) => SUCCESS,
        Err(e) => fail(e),
    }
}

fn count_of(count: u64) -> Result<usize, i32> {
    usize::try_from(count).map_err(|_| E_PARA)
}

pub unsafe extern "C" fn broadcast(
    buf: *mut c_void,
    count: u64,
    dtype: i32,
    root: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    call(|| {
        let op = dtype_of(dtype).and_then(|dtype| {
            Ok(Op::Broadcast {
                send: buf as usize,
                recv: buf as usize,
                count: count_of(count)?,
                dtype,
                root: root as usize,
            })
        });
        enqueue(comm, stream, op)
    })
}

#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn all_reduce(
    send: *mut c_void,
    recv: *mut c_void,
    count: u64,
    dtype: i32,
    op: i32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    call(|| {
        let o = dtype_of(dtype).and_then(|dtype| {
            Ok(Op::AllReduce {
                send: send as usize,
                recv: recv as usize,
                count: count_of(count)?,
                dtype,
                op: redop_of(op)?,
            })
        });
        enqueue(comm, stream, o)
    })
}

#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn reduce(
    send: *mut c_void,
    recv: *mut c_void,
    count: u64,
    dtype: i32,
    op: i32,
    root: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    call(|| {
        let o = dtype_of(dtype).and_then(|dtype| {
            Ok(Op::Reduce {
                send: send as usize,
                recv: recv as usize,
                count: count_of(count)?,
                dtype,
                op: redop_of(op)?,
                root: root as usize,
            })
        });
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn all_gather(
    send: *mut c_void,
    recv: *mut c_void,
    count: u64,
    dtype: i32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    call(|| {
        let o = dtype_of(dtype).and_then(|dtype| {
            Ok(Op::AllGather { send: send as usize, recv: recv as usize, count: count_of(count)?, dtype })
        });
        enqueue(comm, stream, o)
    })
}

#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn reduce_scatter(
    send: *mut c_void,
    recv: *mut c_void,
    count: u64,
    dtype: i32,
    op: i32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    call(|| {
        let o = dtype_of(dtype).and_then(|dtype| {
            Ok(Op::ReduceScatter {
                send: send as usize,
                recv: recv as usize,
                count: count_of(count)?,
                dtype,
                op: redop_of(op)?,
            })
        });
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn send(
    buf: *mut c_void,
    count: u64,
    dtype: i32,
    peer: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    call(|| {
        let o = dtype_of(dtype)
            .and_then(|dtype| Ok(Op::Send { buf: buf as usize, count: count_of(count)?, dtype, peer: peer as usize }));
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn recv(
    buf: *mut c_void,
    count: u64,
    dtype: i32,
    peer: u32,
    comm: *mut c_void,
    stream: *mut c_void,
) -> i32 {
    call(|| {
        let o = dtype_of(dtype)
            .and_then(|dtype| Ok(Op::Recv { buf: buf as usize, count: count_of(count)?, dtype, peer: peer as usize }));
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn barrier(comm: *mut c_void, stream: *mut c_void) -> i32 {
    call(|| enqueue(comm, stream, Ok(Op::Barrier)))
}
