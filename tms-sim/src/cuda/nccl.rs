//! The NCCL ABI (`libnccl.so.2`, nccl.h of NCCL 2.30.7) over the simulator's collectives.
//!
//! A communicator handle is a pointer this module made and still knows: a null, freed or foreign
//! pointer gets ncclInvalidArgument, never a crash. Operations are queued on the given CUDA
//! stream (`core::collectives`); between ncclGroupStart and ncclGroupEnd they are held and
//! queued together at the end, and communicator inits inside a group run side by side at its end
//! (how one process initializes several devices). Non-blocking communicators (config.blocking =
//! 0) return ncclInProgress from init, which then completes in the background; callers poll
//! ncclCommGetAsyncError, as NCCL documents.
//!
//! Settings: `NCCL_BUFFSIZE` (bytes per connection buffer, default 4 MiB, as NCCL),
//! `NCCL_COMM_BLOCKING`, `TMS_SIM_NCCL_CONNECT_TIMEOUT` (seconds init waits for every rank,
//! default 120), `TMS_SIM_NCCL_CHANNELS` (channels per peer the buffers are counted for,
//! default 2).

use crate::core::collectives::{CollError, Comm, CommConfig, DType, Op, RedOp, UniqueId};
use crate::core::sim::{guard, sim};
use crate::cuda::RT_DEVICE;
use libc::{c_char, c_int, c_void};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

pub const SUCCESS: c_int = 0;
pub const UNHANDLED_CUDA_ERROR: c_int = 1;
pub const SYSTEM_ERROR: c_int = 2;
pub const INTERNAL_ERROR: c_int = 3;
pub const INVALID_ARGUMENT: c_int = 4;
pub const INVALID_USAGE: c_int = 5;
pub const REMOTE_ERROR: c_int = 6;
pub const IN_PROGRESS: c_int = 7;
pub const TIMEOUT: c_int = 8;

/// NCCL_VERSION(2, 30, 7): the nvidia-nccl-cu13 wheel PyTorch's CUDA 13 build depends on.
pub const VERSION_CODE: c_int = 23007;
pub use tms_vendor::nccl::{CONFIG_MAGIC, SUSPEND_MEM, UNIQUE_ID_BYTES};
/// NCCL_CONFIG_UNDEF_INT.
const UNDEF_INT: c_int = c_int::MIN;
/// NCCL_SPLIT_NOCOLOR.
const SPLIT_NOCOLOR: c_int = -1;
const DEFAULT_BUFFSIZE: u64 = 4 << 20;
const DEFAULT_CHANNELS: u64 = 2;
const DEFAULT_CONNECT_TIMEOUT_S: u64 = 120;
/// What a communicator keeps while suspended (its device-side structures and work queue). NVIDIA
/// gives no figure; this is the simulator's assumption, reported by ncclCommMemStats as
/// ncclStatGpuMemPersist.
const DEFAULT_PERSISTENT_BYTES: u64 = 1 << 20;

// Declared once for every part of tms (tms-vendor).
pub use tms_vendor::nccl::{ConfigHead as NcclConfigHead, UniqueId as NcclUniqueId};

pub fn code_of(e: &CollError) -> c_int {
    match e {
        CollError::InvalidArgument(_) => INVALID_ARGUMENT,
        CollError::InvalidUsage(_) | CollError::Aborted => INVALID_USAGE,
        CollError::Remote(_) => REMOTE_ERROR,
        CollError::Timeout(_) => TIMEOUT,
        CollError::Device(_) | CollError::OutOfMemory(_) => UNHANDLED_CUDA_ERROR,
        CollError::System(_) => SYSTEM_ERROR,
        CollError::Internal(_) => INTERNAL_ERROR,
    }
}

fn name_of(code: c_int) -> &'static str {
    match code {
        SUCCESS => "no error",
        UNHANDLED_CUDA_ERROR => "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        SYSTEM_ERROR => "unhandled system error (run with NCCL_DEBUG=INFO for details)",
        INTERNAL_ERROR => "internal error - please report this issue to the NCCL developers",
        INVALID_ARGUMENT => "invalid argument (run with NCCL_DEBUG=WARN for details)",
        INVALID_USAGE => "invalid usage (run with NCCL_DEBUG=WARN for details)",
        REMOTE_ERROR => "remote process exited or there was a network error",
        IN_PROGRESS => "NCCL operation in progress",
        TIMEOUT => "NCCL operation timed out",
        _ => "unknown result code",
    }
}

/// A communicator as the caller holds it. `core` is None while a non-blocking init runs.
pub struct NcclComm {
    core: Mutex<Option<Arc<Comm>>>,
    /// The init's failure, or ncclInProgress while it runs.
    state: Mutex<c_int>,
    device: usize,
    rank: usize,
    nranks: usize,
    blocking: bool,
}

impl NcclComm {
    fn core(&self) -> Result<Arc<Comm>, c_int> {
        match *self.state.lock().unwrap_or_else(|e| e.into_inner()) {
            SUCCESS => {}
            code => return Err(code),
        }
        self.core.lock().unwrap_or_else(|e| e.into_inner()).clone().ok_or(INVALID_USAGE)
    }
}

fn live() -> std::sync::MutexGuard<'static, HashMap<usize, Arc<NcclComm>>> {
    static LIVE: OnceLock<Mutex<HashMap<usize, Arc<NcclComm>>>> = OnceLock::new();
    LIVE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

fn lookup(comm: *mut c_void) -> Result<Arc<NcclComm>, c_int> {
    live().get(&(comm as usize)).cloned().ok_or_else(|| {
        set_last_error(format!("{comm:p} is not a live communicator (null, destroyed or never made by ncclCommInit*)"));
        INVALID_ARGUMENT
    })
}

fn last_error() -> &'static Mutex<CString> {
    static LAST: OnceLock<Mutex<CString>> = OnceLock::new();
    LAST.get_or_init(|| Mutex::new(CString::default()))
}

fn set_last_error(msg: String) {
    crate::core::config::warn(&format!("NCCL: {msg}"));
    *last_error().lock().unwrap_or_else(|e| e.into_inner()) = CString::new(msg.replace('\0', " ")).unwrap_or_default();
}

fn fail(e: CollError) -> c_int {
    let code = code_of(&e);
    set_last_error(e.to_string());
    code
}

fn call(body: impl FnOnce() -> c_int) -> c_int {
    guard(INTERNAL_ERROR, body)
}

fn put<T>(out: *mut T, v: T) -> c_int {
    if out.is_null() {
        set_last_error("a null output pointer".into());
        return INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; the caller passes a writable location.
    unsafe { out.write(v) };
    SUCCESS
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().unwrap_or_else(|_| {
            crate::core::config::warn(&format!("{name}={v:?} is not a whole number; using {default}"));
            default
        }),
        _ => default,
    }
}

fn comm_config(nranks: usize) -> CommConfig {
    let buffsize = env_u64("NCCL_BUFFSIZE", DEFAULT_BUFFSIZE);
    let channels = env_u64("TMS_SIM_NCCL_CHANNELS", DEFAULT_CHANNELS);
    CommConfig {
        connect_timeout: Duration::from_secs(env_u64("TMS_SIM_NCCL_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT_S)),
        // A send and a receive buffer per channel per peer (NCCL_BUFFSIZE is per connection).
        buffer_bytes: (nranks as u64 - 1) * channels * 2 * buffsize,
        persistent_bytes: env_u64("TMS_SIM_NCCL_PERSISTENT_MEMORY", DEFAULT_PERSISTENT_BYTES),
    }
}

fn dtype_of(code: c_int) -> Option<DType> {
    Some(match code {
        0 => DType::I8,
        1 => DType::U8,
        2 => DType::I32,
        3 => DType::U32,
        4 => DType::I64,
        5 => DType::U64,
        6 => DType::F16,
        7 => DType::F32,
        8 => DType::F64,
        9 => DType::BF16,
        10 => DType::F8E4M3,
        11 => DType::F8E5M2,
        _ => return None,
    })
}

/// Reductions made by ncclRedOpCreatePreMulSum, by (communicator, op number).
fn premul_ops() -> std::sync::MutexGuard<'static, HashMap<(usize, c_int), f64>> {
    static OPS: OnceLock<Mutex<HashMap<(usize, c_int), f64>>> = OnceLock::new();
    OPS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

fn redop_of(code: c_int, comm: *mut c_void) -> Option<RedOp> {
    Some(match code {
        0 => RedOp::Sum,
        1 => RedOp::Prod,
        2 => RedOp::Max,
        3 => RedOp::Min,
        4 => RedOp::Avg,
        n => RedOp::PreMulSum(*premul_ops().get(&(comm as usize, n))?),
    })
}

/// The CUDA device of the calling thread (cudaSetDevice's), with its context opened.
fn current_device() -> Result<usize, c_int> {
    let dev = RT_DEVICE.with(|d| d.get());
    if dev >= sim().devices() || !crate::cuda::open_cuda_context(dev) {
        set_last_error(format!("cannot use CUDA device {dev} (missing, or no room for its context)"));
        return Err(UNHANDLED_CUDA_ERROR);
    }
    Ok(dev)
}

// ---- versions, errors, ids -------------------------------------------------------------------

pub unsafe extern "C" fn get_version(version: *mut c_int) -> c_int {
    call(|| put(version, VERSION_CODE))
}

pub unsafe extern "C" fn get_error_string(result: c_int) -> *const c_char {
    static NAMES: OnceLock<Vec<CString>> = OnceLock::new();
    let names = NAMES.get_or_init(|| (0..=9).map(|c| CString::new(name_of(c)).unwrap_or_default()).collect());
    names.get(result as usize).unwrap_or(&names[9]).as_ptr()
}

pub unsafe extern "C" fn get_last_error(_comm: *mut c_void) -> *const c_char {
    // The string lives until the next error replaces it, as NCCL's does.
    last_error().lock().unwrap_or_else(|e| e.into_inner()).as_ptr()
}

pub unsafe extern "C" fn get_unique_id(out: *mut NcclUniqueId) -> c_int {
    call(|| {
        if out.is_null() {
            set_last_error("ncclGetUniqueId: a null id pointer".into());
            return INVALID_ARGUMENT;
        }
        let timeout = comm_config(2).connect_timeout;
        match crate::core::collectives::transport::create_root(timeout) {
            Ok(id) => {
                let mut bytes = [0u8; UNIQUE_ID_BYTES];
                id.encode(&mut bytes);
                put(out, NcclUniqueId { internal: bytes })
            }
            Err(e) => fail(e),
        }
    })
}

// ---- communicators ---------------------------------------------------------------------------

/// Reads a config as NCCL does: the magic must be NCCL_CONFIG_INITIALIZER's; `blocking` is UNDEF,
/// 0 or 1 (NCCL_COMM_BLOCKING decides when UNDEF; blocking by default).
fn blocking_of(config: *const NcclConfigHead) -> Result<bool, c_int> {
    let env_default = || std::env::var("NCCL_COMM_BLOCKING").map_or(true, |v| v.trim() != "0");
    if config.is_null() {
        return Ok(env_default());
    }
    // SAFETY: a non-null config points at an ncclConfig_t, whose head every version shares.
    let head = unsafe { &*config };
    if head.magic != CONFIG_MAGIC {
        set_last_error("ncclConfig_t argument not initialized via NCCL_CONFIG_INITIALIZER (wrong magic)".into());
        return Err(INVALID_ARGUMENT);
    }
    // `blocking` exists from config version 2.14 (21400) on; older ones take the default.
    if head.version < 21400 || head.size < std::mem::size_of::<NcclConfigHead>() {
        return Ok(env_default());
    }
    match head.blocking {
        UNDEF_INT => Ok(env_default()),
        0 => Ok(false),
        1 => Ok(true),
        v => {
            set_last_error(format!("ncclConfig_t.blocking is {v}; it must be 0 or 1"));
            Err(INVALID_ARGUMENT)
        }
    }
}

thread_local! {
    static GROUP_DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static GROUP_OPS: RefCell<Vec<(Arc<NcclComm>, crate::core::streams::StreamId, Op)>> = const { RefCell::new(Vec::new()) };
    static GROUP_INITS: RefCell<Vec<(Arc<NcclComm>, UniqueId)>> = const { RefCell::new(Vec::new()) };
    static GROUP_ERROR: std::cell::Cell<c_int> = const { std::cell::Cell::new(SUCCESS) };
}

fn in_group() -> bool {
    GROUP_DEPTH.with(|d| d.get()) > 0
}

fn register(comm: NcclComm) -> (Arc<NcclComm>, *mut c_void) {
    let comm = Arc::new(comm);
    let ptr = Arc::as_ptr(&comm) as *mut c_void;
    live().insert(ptr as usize, comm.clone());
    (comm, ptr)
}

/// Runs the init of `comm` (on this thread) and records its outcome.
fn finish_init(comm: &NcclComm, id: UniqueId) -> c_int {
    let result = Comm::init(id, comm.nranks, comm.rank, comm.device, &comm_config(comm.nranks));
    let code = match result {
        Ok(core) => {
            *comm.core.lock().unwrap_or_else(|e| e.into_inner()) = Some(core);
            SUCCESS
        }
        Err(e) => fail(e),
    };
    *comm.state.lock().unwrap_or_else(|e| e.into_inner()) = code;
    code
}

fn init_rank(out: *mut *mut c_void, nranks: c_int, id: &NcclUniqueId, rank: c_int, blocking: bool) -> c_int {
    if out.is_null() {
        set_last_error("ncclCommInitRank: a null communicator pointer".into());
        return INVALID_ARGUMENT;
    }
    if nranks < 1 || rank < 0 || rank >= nranks {
        set_last_error(format!("ncclCommInitRank: rank {rank} of {nranks} ranks"));
        return INVALID_ARGUMENT;
    }
    let Some(uid) = UniqueId::decode(&id.internal) else {
        set_last_error("ncclCommInitRank: the unique id was not made by ncclGetUniqueId".into());
        return INVALID_ARGUMENT;
    };
    let device = match current_device() {
        Ok(d) => d,
        Err(code) => return code,
    };
    let (comm, ptr) = register(NcclComm {
        core: Mutex::new(None),
        state: Mutex::new(IN_PROGRESS),
        device,
        rank: rank as usize,
        nranks: nranks as usize,
        blocking,
    });
    // SAFETY: checked non-null.
    unsafe { out.write(ptr) };
    if in_group() {
        GROUP_INITS.with(|g| g.borrow_mut().push((comm, uid)));
        return SUCCESS;
    }
    if !blocking {
        let spawned = std::thread::Builder::new().name("tms-sim-nccl-init".into()).spawn(move || {
            RT_DEVICE.with(|d| d.set(comm.device));
            finish_init(&comm, uid);
        });
        return if spawned.is_ok() { IN_PROGRESS } else { SYSTEM_ERROR };
    }
    let code = finish_init(&comm, uid);
    if code != SUCCESS {
        live().remove(&(ptr as usize));
        // SAFETY: checked non-null; NCCL leaves no communicator behind a failed blocking init.
        unsafe { out.write(std::ptr::null_mut()) };
    }
    code
}

pub unsafe extern "C" fn comm_init_rank(out: *mut *mut c_void, nranks: c_int, id: NcclUniqueId, rank: c_int) -> c_int {
    call(|| match blocking_of(std::ptr::null()) {
        Ok(b) => init_rank(out, nranks, &id, rank, b),
        Err(code) => code,
    })
}

pub unsafe extern "C" fn comm_init_rank_config(
    out: *mut *mut c_void,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
    config: *const NcclConfigHead,
) -> c_int {
    call(|| match blocking_of(config) {
        Ok(b) => init_rank(out, nranks, &id, rank, b),
        Err(code) => code,
    })
}

/// Several ids spread the bootstrap load on large jobs; the simulator needs only the first.
pub unsafe extern "C" fn comm_init_rank_scalable(
    out: *mut *mut c_void,
    nranks: c_int,
    rank: c_int,
    n_ids: c_int,
    ids: *const NcclUniqueId,
    config: *const NcclConfigHead,
) -> c_int {
    call(|| {
        if ids.is_null() || n_ids < 1 {
            set_last_error("ncclCommInitRankScalable: no unique id".into());
            return INVALID_ARGUMENT;
        }
        // SAFETY: checked non-null; the caller passes n_ids >= 1 ids.
        let id = unsafe { *ids };
        match blocking_of(config) {
            Ok(b) => init_rank(out, nranks, &id, rank, b),
            Err(code) => code,
        }
    })
}

/// One process, `ndev` devices: a root here and every rank's init side by side.
pub unsafe extern "C" fn comm_init_all(comms: *mut *mut c_void, ndev: c_int, devlist: *const c_int) -> c_int {
    call(|| {
        if comms.is_null() || ndev < 1 {
            set_last_error(format!("ncclCommInitAll: {ndev} devices"));
            return INVALID_ARGUMENT;
        }
        let devices: Vec<usize> = (0..ndev as usize)
            // SAFETY: devlist, when given, holds ndev entries.
            .map(|i| if devlist.is_null() { i } else { (unsafe { *devlist.add(i) }) as usize })
            .collect();
        if let Some(bad) = devices.iter().find(|d| **d >= sim().devices()) {
            set_last_error(format!("ncclCommInitAll: device {bad} does not exist"));
            return INVALID_ARGUMENT;
        }
        let id = match crate::core::collectives::transport::create_root(comm_config(2).connect_timeout) {
            Ok(id) => id,
            Err(e) => return fail(e),
        };
        let made: Vec<(Arc<NcclComm>, *mut c_void)> = devices
            .iter()
            .enumerate()
            .map(|(rank, &device)| {
                crate::cuda::open_cuda_context(device);
                register(NcclComm {
                    core: Mutex::new(None),
                    state: Mutex::new(IN_PROGRESS),
                    device,
                    rank,
                    nranks: devices.len(),
                    blocking: true,
                })
            })
            .collect();
        let code = init_side_by_side(made.iter().map(|(c, _)| (c.clone(), id)).collect());
        for (i, (_, ptr)) in made.iter().enumerate() {
            // SAFETY: comms holds ndev entries.
            unsafe { comms.add(i).write(if code == SUCCESS { *ptr } else { std::ptr::null_mut() }) };
            if code != SUCCESS {
                live().remove(&(*ptr as usize));
            }
        }
        code
    })
}

/// Runs inits in threads of their own and returns the first failure.
fn init_side_by_side(inits: Vec<(Arc<NcclComm>, UniqueId)>) -> c_int {
    let handles: Vec<_> = inits
        .into_iter()
        .map(|(comm, id)| {
            std::thread::spawn(move || {
                RT_DEVICE.with(|d| d.set(comm.device));
                finish_init(&comm, id)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap_or(INTERNAL_ERROR)).find(|c| *c != SUCCESS).unwrap_or(SUCCESS)
}

/// Every rank of `comm` calls this; ranks with the same color form a communicator, ordered by
/// (key, parent rank). The parent's connections carry the colors and the new ids.
pub unsafe extern "C" fn comm_split(
    comm: *mut c_void,
    color: c_int,
    key: c_int,
    out: *mut *mut c_void,
    config: *const NcclConfigHead,
) -> c_int {
    call(|| {
        let parent = match lookup(comm).and_then(|c| c.core().map(|core| (c, core))) {
            Ok(p) => p,
            Err(code) => return code,
        };
        if out.is_null() || (color < 0 && color != SPLIT_NOCOLOR) {
            set_last_error(format!("ncclCommSplit: color {color} (must be >= 0 or NCCL_SPLIT_NOCOLOR)"));
            return INVALID_ARGUMENT;
        }
        let blocking = match blocking_of(config) {
            Ok(b) => b,
            Err(code) => return code,
        };
        let (parent, core) = parent;
        let plan = match core.split(color, key, comm_config(2).connect_timeout) {
            Ok(p) => p,
            Err(e) => return fail(e),
        };
        let Some((id, rank, nranks)) = plan else {
            // SAFETY: checked non-null.
            unsafe { out.write(std::ptr::null_mut()) };
            return SUCCESS;
        };
        let id_bytes = {
            let mut b = [0u8; UNIQUE_ID_BYTES];
            id.encode(&mut b);
            NcclUniqueId { internal: b }
        };
        RT_DEVICE.with(|d| d.set(parent.device));
        init_rank(out, nranks as c_int, &id_bytes, rank as c_int, blocking)
    })
}

pub unsafe extern "C" fn comm_finalize(comm: *mut c_void) -> c_int {
    call(|| match lookup(comm).and_then(|c| c.core()) {
        Ok(core) => {
            core.finalize();
            core.async_error().map_or(SUCCESS, fail)
        }
        Err(code) => code,
    })
}

pub unsafe extern "C" fn comm_destroy(comm: *mut c_void) -> c_int {
    call(|| {
        let Ok(c) = lookup(comm) else { return INVALID_ARGUMENT };
        live().remove(&(comm as usize));
        premul_ops().retain(|(owner, _), _| *owner != comm as usize);
        if let Some(core) = c.core.lock().unwrap_or_else(|e| e.into_inner()).take() {
            core.destroy();
        }
        SUCCESS
    })
}

pub unsafe extern "C" fn comm_abort(comm: *mut c_void) -> c_int {
    call(|| {
        let Ok(c) = lookup(comm) else { return INVALID_ARGUMENT };
        live().remove(&(comm as usize));
        premul_ops().retain(|(owner, _), _| *owner != comm as usize);
        if let Some(core) = c.core.lock().unwrap_or_else(|e| e.into_inner()).take() {
            core.abort();
        }
        SUCCESS
    })
}

pub unsafe extern "C" fn comm_get_async_error(comm: *mut c_void, out: *mut c_int) -> c_int {
    call(|| {
        let c = match lookup(comm) {
            Ok(c) => c,
            Err(code) => return code,
        };
        let state = *c.state.lock().unwrap_or_else(|e| e.into_inner());
        let code = match state {
            SUCCESS => {
                match c.core.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|core| core.async_error()) {
                    Some(e) => {
                        // The message is what ncclGetLastError gives next; pollers (PyTorch's
                        // watchdog) ask often, so it is not logged again here.
                        *last_error().lock().unwrap_or_else(|e| e.into_inner()) =
                            CString::new(e.to_string().replace('\0', " ")).unwrap_or_default();
                        code_of(&e)
                    }
                    None => SUCCESS,
                }
            }
            other => other,
        };
        put(out, code)
    })
}

pub unsafe extern "C" fn comm_count(comm: *mut c_void, out: *mut c_int) -> c_int {
    call(|| lookup(comm).map_or_else(|c| c, |c| put(out, c.nranks as c_int)))
}

pub unsafe extern "C" fn comm_cu_device(comm: *mut c_void, out: *mut c_int) -> c_int {
    call(|| lookup(comm).map_or_else(|c| c, |c| put(out, c.device as c_int)))
}

pub unsafe extern "C" fn comm_user_rank(comm: *mut c_void, out: *mut c_int) -> c_int {
    call(|| lookup(comm).map_or_else(|c| c, |c| put(out, c.rank as c_int)))
}

// ---- operations ------------------------------------------------------------------------------

/// Checks and queues one operation (or holds it for the group's end).
fn enqueue(comm: *mut c_void, stream: *mut c_void, op: Result<Op, String>) -> c_int {
    let c = match lookup(comm) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let op = match op {
        Ok(op) => op,
        Err(msg) => {
            set_last_error(msg);
            return INVALID_ARGUMENT;
        }
    };
    let handle = stream as usize;
    let stream = crate::cuda::stream_id(handle);
    if !sim().streams.exists(stream) {
        set_last_error(format!("{handle:#x} is not a CUDA stream"));
        return INVALID_ARGUMENT;
    }
    if in_group() {
        // Arguments are checked now (an error is the call's); the init may still be pending.
        if let Ok(core) = c.core()
            && let Err(e) = core.check(&op)
        {
            return fail(e);
        }
        GROUP_OPS.with(|g| g.borrow_mut().push((c, stream, op)));
        return SUCCESS;
    }
    let core = match c.core() {
        Ok(core) => core,
        Err(code) => return code,
    };
    match core.submit(stream, vec![op], crate::cuda::runtime::code_of) {
        Ok(()) => SUCCESS,
        Err(e) => fail(e),
    }
}

fn types(dtype: c_int) -> Result<DType, String> {
    dtype_of(dtype).ok_or_else(|| format!("{dtype} is not an ncclDataType_t"))
}

fn reduction(op: c_int, comm: *mut c_void) -> Result<RedOp, String> {
    redop_of(op, comm).ok_or_else(|| format!("{op} is not an ncclRedOp_t of this communicator"))
}

fn rank_arg(v: c_int, what: &str) -> Result<usize, String> {
    usize::try_from(v).map_err(|_| format!("{what} {v} is negative"))
}

pub unsafe extern "C" fn broadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        let op = types(dtype).and_then(|dtype| {
            Ok(Op::Broadcast { send: send as usize, recv: recv as usize, count, dtype, root: rank_arg(root, "root")? })
        });
        enqueue(comm, stream, op)
    })
}

pub unsafe extern "C" fn bcast(
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    // SAFETY: the same contract, in place.
    unsafe { broadcast(buf, buf, count, dtype, root, comm, stream) }
}

pub unsafe extern "C" fn all_reduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        let o = types(dtype).and_then(|dtype| {
            Ok(Op::AllReduce { send: send as usize, recv: recv as usize, count, dtype, op: reduction(op, comm)? })
        });
        enqueue(comm, stream, o)
    })
}

#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn reduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        let o = types(dtype).and_then(|dtype| {
            Ok(Op::Reduce {
                send: send as usize,
                recv: recv as usize,
                count,
                dtype,
                op: reduction(op, comm)?,
                root: rank_arg(root, "root")?,
            })
        });
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn all_gather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        let o = types(dtype).map(|dtype| Op::AllGather { send: send as usize, recv: recv as usize, count, dtype });
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn reduce_scatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        let o = types(dtype).and_then(|dtype| {
            Ok(Op::ReduceScatter { send: send as usize, recv: recv as usize, count, dtype, op: reduction(op, comm)? })
        });
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn all_to_all(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        let o = types(dtype).map(|dtype| Op::AllToAll { send: send as usize, recv: recv as usize, count, dtype });
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn gather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        let o = types(dtype).and_then(|dtype| {
            Ok(Op::Gather { send: send as usize, recv: recv as usize, count, dtype, root: rank_arg(root, "root")? })
        });
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn send(
    buf: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        let o = types(dtype)
            .and_then(|dtype| Ok(Op::Send { buf: buf as usize, count, dtype, peer: rank_arg(peer, "peer")? }));
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn recv(
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    call(|| {
        let o = types(dtype)
            .and_then(|dtype| Ok(Op::Recv { buf: buf as usize, count, dtype, peer: rank_arg(peer, "peer")? }));
        enqueue(comm, stream, o)
    })
}

pub unsafe extern "C" fn group_start() -> c_int {
    call(|| {
        GROUP_DEPTH.with(|d| d.set(d.get() + 1));
        SUCCESS
    })
}

/// The outermost end queues each communicator's held operations, per stream, in the order
/// they were issued, after running the inits held with them.
pub unsafe extern "C" fn group_end() -> c_int {
    call(|| {
        let depth = GROUP_DEPTH.with(|d| d.get());
        if depth == 0 {
            set_last_error("ncclGroupEnd without ncclGroupStart".into());
            return INVALID_USAGE;
        }
        GROUP_DEPTH.with(|d| d.set(depth - 1));
        if depth > 1 {
            return SUCCESS;
        }
        let inits = GROUP_INITS.with(|g| std::mem::take(&mut *g.borrow_mut()));
        let ops = GROUP_OPS.with(|g| std::mem::take(&mut *g.borrow_mut()));
        let mut code = GROUP_ERROR.with(|e| e.replace(SUCCESS));
        if !inits.is_empty() {
            let all_blocking = inits.iter().all(|(c, _)| c.blocking);
            if all_blocking {
                let c = init_side_by_side(inits);
                if code == SUCCESS {
                    code = c;
                }
            } else {
                std::thread::spawn(move || init_side_by_side(inits));
                return IN_PROGRESS;
            }
        }
        let mut batches: Vec<(Arc<NcclComm>, crate::core::streams::StreamId, Vec<Op>)> = Vec::new();
        for (comm, stream, op) in ops {
            match batches.iter_mut().find(|(c, s, _)| Arc::ptr_eq(c, &comm) && *s == stream) {
                Some(b) => b.2.push(op),
                None => batches.push((comm, stream, vec![op])),
            }
        }
        // Every batch is queued, on the default stream too (each device's legacy queue), so a
        // process driving several devices queues them one after another and none waits for a
        // rank not queued yet.
        let results: Vec<Result<(), c_int>> = batches
            .into_iter()
            .map(|(comm, stream, ops)| {
                comm.core().and_then(|core| core.submit(stream, ops, crate::cuda::runtime::code_of).map_err(fail))
            })
            .collect();
        if let Some(Err(c)) = results.into_iter().find(|r| r.is_err())
            && code == SUCCESS
        {
            code = c;
        }
        code
    })
}

pub unsafe extern "C" fn red_op_create_pre_mul_sum(
    out: *mut c_int,
    scalar: *const c_void,
    dtype: c_int,
    residence: c_int,
    comm: *mut c_void,
) -> c_int {
    call(|| {
        if let Err(code) = lookup(comm) {
            return code;
        }
        let Some(dt) = dtype_of(dtype).filter(|d| d.is_float() && d.reducible()) else {
            set_last_error(format!("ncclRedOpCreatePreMulSum: type {dtype} (a float type is needed)"));
            return INVALID_ARGUMENT;
        };
        if scalar.is_null() || !(0..=1).contains(&residence) {
            set_last_error("ncclRedOpCreatePreMulSum: a null scalar or an unknown residence".into());
            return INVALID_ARGUMENT;
        }
        let mut bytes = vec![0u8; dt.size()];
        if residence == 0 {
            // ncclScalarDevice: read from device memory (at creation here; NCCL reads it when the
            // collective runs, which differs only if the caller changes it in between).
            if let Err(e) = sim().kernel_read(scalar as usize, &mut bytes) {
                return fail(CollError::Device(e));
            }
        } else {
            // SAFETY: a host scalar of the type's size.
            unsafe { std::ptr::copy_nonoverlapping(scalar as *const u8, bytes.as_mut_ptr(), bytes.len()) };
        }
        let value = scalar_value(dt, &bytes);
        let mut ops = premul_ops();
        let next = (5..).find(|n| !ops.contains_key(&(comm as usize, *n))).unwrap_or(5);
        ops.insert((comm as usize, next), value);
        put(out, next)
    })
}

fn scalar_value(dt: DType, b: &[u8]) -> f64 {
    use crate::core::collectives::reduce::{bf16_to_f32, f16_to_f32};
    match dt {
        DType::F16 => f16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
        DType::BF16 => bf16_to_f32(u16::from_le_bytes([b[0], b[1]])) as f64,
        DType::F32 => f32::from_le_bytes(b[..4].try_into().unwrap_or_default()) as f64,
        _ => f64::from_le_bytes(b[..8].try_into().unwrap_or_default()),
    }
}

pub unsafe extern "C" fn red_op_destroy(op: c_int, comm: *mut c_void) -> c_int {
    call(|| {
        if let Err(code) = lookup(comm) {
            return code;
        }
        if premul_ops().remove(&(comm as usize, op)).is_some() {
            SUCCESS
        } else {
            set_last_error(format!(
                "ncclRedOpDestroy: {op} was not made by ncclRedOpCreatePreMulSum on this communicator"
            ));
            INVALID_ARGUMENT
        }
    })
}

/// Releases the communicator's suspendable device memory (its buffers), once its queued work has
/// run. Until ncclCommResume its operations get ncclInvalidUsage.
pub unsafe extern "C" fn comm_suspend(comm: *mut c_void, flags: c_int) -> c_int {
    call(|| {
        let core = match lookup(comm).and_then(|c| c.core()) {
            Ok(core) => core,
            Err(code) => return code,
        };
        if flags != SUSPEND_MEM {
            set_last_error(format!("ncclCommSuspend: flags {flags:#x} (NCCL_SUSPEND_MEM, 0x1, is the only one)"));
            return INVALID_ARGUMENT;
        }
        core.suspend();
        SUCCESS
    })
}

pub unsafe extern "C" fn comm_resume(comm: *mut c_void) -> c_int {
    call(|| match lookup(comm).and_then(|c| c.core()) {
        Ok(core) => core.resume().map_or_else(fail, |()| SUCCESS),
        Err(code) => code,
    })
}

/// ncclCommMemStats: ncclStatGpuMemSuspend (0) bytes a suspend releases, ncclStatGpuMemSuspended
/// (1) 0 or 1, ncclStatGpuMemPersist (2) bytes kept, ncclStatGpuMemTotal (3) both.
pub unsafe extern "C" fn comm_mem_stats(comm: *mut c_void, stat: c_int, out: *mut u64) -> c_int {
    call(|| {
        let core = match lookup(comm).and_then(|c| c.core()) {
            Ok(core) => core,
            Err(code) => return code,
        };
        let m = core.mem_stats();
        let value = match stat {
            0 => m.suspendable,
            1 => m.suspended as u64,
            2 => m.persistent,
            3 => m.suspendable + m.persistent,
            _ => {
                set_last_error(format!("ncclCommMemStats: {stat} is not an ncclCommMemStat_t"));
                return INVALID_ARGUMENT;
            }
        };
        put(out, value)
    })
}

/// Buffer registration moves the same bytes, but pins the physical memory mapped at the buffer
/// now, as NCCL does: an operation on the range after that memory was replaced fails
/// (core::collectives::comm, "Registration").
pub unsafe extern "C" fn comm_register(
    comm: *mut c_void,
    buf: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> c_int {
    call(|| {
        if handle.is_null() {
            return INVALID_ARGUMENT;
        }
        let core = match lookup(comm).and_then(|c| c.core()) {
            Ok(core) => core,
            Err(code) => return code,
        };
        put(handle, core.register(buf as usize, size) as *mut c_void)
    })
}

pub unsafe extern "C" fn comm_deregister(comm: *mut c_void, handle: *mut c_void) -> c_int {
    call(|| {
        let core = match lookup(comm).and_then(|c| c.core()) {
            Ok(core) => core,
            Err(code) => return code,
        };
        if core.deregister(handle as u64) {
            SUCCESS
        } else {
            set_last_error(format!("ncclCommDeregister: {handle:p} is not a registration of this communicator"));
            INVALID_ARGUMENT
        }
    })
}

/// ncclMemAlloc: device memory on the current device (plain memory: it can be shared by IPC).
pub unsafe extern "C" fn mem_alloc(out: *mut *mut c_void, size: usize) -> c_int {
    call(|| {
        if out.is_null() {
            return INVALID_ARGUMENT;
        }
        let dev = match current_device() {
            Ok(d) => d,
            Err(code) => return code,
        };
        match sim().plain_alloc(dev, size) {
            Ok(p) => put(out, p as *mut c_void),
            Err(e) => fail(CollError::Device(e)),
        }
    })
}

pub unsafe extern "C" fn mem_free(ptr: *mut c_void) -> c_int {
    call(|| {
        if ptr.is_null() {
            return SUCCESS;
        }
        match sim().plain_free(ptr as usize) {
            Ok(()) => SUCCESS,
            Err(_) => {
                set_last_error(format!("ncclMemFree: {ptr:p} was not allocated by ncclMemAlloc"));
                INVALID_ARGUMENT
            }
        }
    })
}

/// Entry points PyTorch's libraries import that the simulator does not implement:
/// ncclInvalidUsage, with the name in the last error and one warning each.
pub fn not_supported(name: &str) -> c_int {
    crate::core::config::warn_not_supported(name, "ncclInvalidUsage");
    *last_error().lock().unwrap_or_else(|e| e.into_inner()) =
        CString::new(format!("{name} is not supported by the simulator")).unwrap_or_default();
    INVALID_USAGE
}
