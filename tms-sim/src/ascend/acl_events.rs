//! ACL's events, stream queries and the runtime settings torch_npu makes at start-up
//! (acl/acl_rt.h of CANN's runtime). Events and streams are the core's, as for CUDA; settings that
//! change nothing on a device without kernels are checked and kept, so a program reads back what
//! it set.

use crate::ascend::acl::{INVALID_PARAM, RT_FEATURE_NOT_SUPPORT, RT_PARAM_INVALID, SUCCESS, call, put};
use crate::ascend::{ACL_DEVICE, stream_id};
use crate::core::sim::sim;
use libc::{c_char, c_float, c_void};
use std::sync::atomic::{AtomicI32, Ordering};

/// ACL_EVENT_SYNC, ACL_EVENT_CAPTURE_STREAM_PROGRESS, ACL_EVENT_TIME_LINE, ACL_EVENT_EXTERNAL.
const EVENT_FLAGS: u32 = 0x1 | 0x2 | 0x8 | 0x20;
/// ACL_EVENT_IPC: events shared between processes, which the simulator does not share.
const EVENT_IPC: u32 = 0x40;
/// ACL_STREAM_FAST_LAUNCH .. ACL_STREAM_DEVICE_USE_ONLY.
const STREAM_FLAGS: u32 = 0x3f;
/// ACL_ERROR_RT_EVENT_NOT_COMPLETE: a timing query on an event whose record has not run.
const RT_EVENT_NOT_COMPLETE: i32 = 507_006;

fn current() -> Result<usize, i32> {
    match ACL_DEVICE.with(|c| c.get()) {
        0 => Err(crate::ascend::acl::RT_CONTEXT_NULL),
        n => Ok(n - 1),
    }
}

fn create_event(name: &str, event: *mut *mut c_void, flag: u32) -> i32 {
    call(name, || {
        if event.is_null() || flag & !(EVENT_FLAGS | EVENT_IPC) != 0 {
            return INVALID_PARAM;
        }
        if flag & EVENT_IPC != 0 {
            return RT_FEATURE_NOT_SUPPORT;
        }
        put(event, sim().streams.event_create(flag) as *mut c_void)
    })
}

pub unsafe extern "C" fn aclrt_create_event(event: *mut *mut c_void) -> i32 {
    create_event("aclrtCreateEvent", event, 0x8)
}

pub unsafe extern "C" fn aclrt_create_event_with_flag(event: *mut *mut c_void, flag: u32) -> i32 {
    create_event("aclrtCreateEventWithFlag", event, flag)
}

pub unsafe extern "C" fn aclrt_create_event_ex_with_flag(event: *mut *mut c_void, flag: u32) -> i32 {
    create_event("aclrtCreateEventExWithFlag", event, flag)
}

pub unsafe extern "C" fn aclrt_destroy_event(event: *mut c_void) -> i32 {
    call("aclrtDestroyEvent", || if sim().streams.event_destroy(event as usize) { SUCCESS } else { INVALID_PARAM })
}

pub unsafe extern "C" fn aclrt_record_event(event: *mut c_void, stream: *mut c_void) -> i32 {
    call("aclrtRecordEvent", || {
        let Some(ev) = sim().streams.event(event as usize) else { return INVALID_PARAM };
        let dev = match current() {
            Ok(d) => d,
            Err(e) => return e,
        };
        sim().streams.event_record(&ev, stream_id(stream as usize), dev).map_or(RT_PARAM_INVALID, |()| SUCCESS)
    })
}

/// Resetting returns the event to "not recorded" once the stream's earlier work has run; the
/// simulator's records complete in stream order already, so a later wait on a reset event is
/// satisfied by the next record, as on the device.
pub unsafe extern "C" fn aclrt_reset_event(event: *mut c_void, stream: *mut c_void) -> i32 {
    call("aclrtResetEvent", || {
        if sim().streams.event(event as usize).is_none() {
            return INVALID_PARAM;
        }
        if sim().streams.exists(stream_id(stream as usize)) { SUCCESS } else { RT_PARAM_INVALID }
    })
}

pub unsafe extern "C" fn aclrt_synchronize_event(event: *mut c_void) -> i32 {
    call("aclrtSynchronizeEvent", || match sim().streams.event(event as usize) {
        Some(ev) => {
            ev.synchronize();
            SUCCESS
        }
        None => INVALID_PARAM,
    })
}

/// aclrtEventRecordedStatus: NOT_READY 0, COMPLETE 1.
pub unsafe extern "C" fn aclrt_query_event_status(event: *mut c_void, status: *mut i32) -> i32 {
    call("aclrtQueryEventStatus", || match sim().streams.event(event as usize) {
        Some(ev) => put(status, i32::from(ev.is_complete())),
        None => INVALID_PARAM,
    })
}

/// aclrtEventWaitStatus: COMPLETE 0, NOT_READY 1 (the reverse of the recorded status).
pub unsafe extern "C" fn aclrt_query_event_wait_status(event: *mut c_void, status: *mut i32) -> i32 {
    call("aclrtQueryEventWaitStatus", || match sim().streams.event(event as usize) {
        Some(ev) => put(status, i32::from(!ev.is_complete())),
        None => INVALID_PARAM,
    })
}

pub unsafe extern "C" fn aclrt_event_elapsed_time(ms: *mut c_float, start: *mut c_void, end: *mut c_void) -> i32 {
    call("aclrtEventElapsedTime", || {
        let (Some(a), Some(b)) = (sim().streams.event(start as usize), sim().streams.event(end as usize)) else {
            return INVALID_PARAM;
        };
        match (a.completed_at(), b.completed_at()) {
            (Some(t0), Some(t1)) => put(ms, (t1 as f64 - t0 as f64) as c_float / 1e6),
            _ => RT_EVENT_NOT_COMPLETE,
        }
    })
}

pub unsafe extern "C" fn aclrt_stream_wait_event(stream: *mut c_void, event: *mut c_void) -> i32 {
    call("aclrtStreamWaitEvent", || {
        let Some(ev) = sim().streams.event(event as usize) else { return INVALID_PARAM };
        let dev = match current() {
            Ok(d) => d,
            Err(e) => return e,
        };
        sim().streams.wait_event(stream_id(stream as usize), &ev, dev).map_or(RT_PARAM_INVALID, |()| SUCCESS)
    })
}

/// aclrtStreamStatus: COMPLETE 0, NOT_READY 1.
pub unsafe extern "C" fn aclrt_stream_query(stream: *mut c_void, status: *mut i32) -> i32 {
    call("aclrtStreamQuery", || match sim().streams.is_idle(stream_id(stream as usize)) {
        Ok(idle) => put(status, i32::from(!idle)),
        Err(_) => RT_PARAM_INVALID,
    })
}

pub unsafe extern "C" fn aclrt_create_stream_with_config(stream: *mut *mut c_void, _priority: u32, flag: u32) -> i32 {
    call("aclrtCreateStreamWithConfig", || {
        if stream.is_null() || flag & !STREAM_FLAGS != 0 {
            return INVALID_PARAM;
        }
        match current() {
            Ok(d) => match sim().streams.create(d) {
                Some(h) => put(stream, h as *mut c_void),
                None => crate::ascend::acl::RT_MEMORY_ALLOCATION,
            },
            Err(e) => e,
        }
    })
}

pub unsafe extern "C" fn aclrt_destroy_stream_force(stream: *mut c_void) -> i32 {
    call("aclrtDestroyStreamForce", || if sim().streams.destroy(stream as usize) { SUCCESS } else { RT_PARAM_INVALID })
}

/// The simulator's streams always finish their work, so waiting without a limit is the same
/// wait (-1: no limit; other negative values are refused).
pub unsafe extern "C" fn aclrt_synchronize_stream_with_timeout(stream: *mut c_void, timeout: i32) -> i32 {
    call("aclrtSynchronizeStreamWithTimeout", || {
        if timeout < -1 {
            return INVALID_PARAM;
        }
        sim().streams.synchronize(stream_id(stream as usize)).unwrap_or(RT_PARAM_INVALID)
    })
}

/// ACL_CONTINUE_ON_FAILURE (0) is how the simulator reports faults anyway (per call); a stream
/// asking to stop on failure (1) is accepted and behaves the same, since no task fails on its own.
pub unsafe extern "C" fn aclrt_set_stream_failure_mode(stream: *mut c_void, mode: u64) -> i32 {
    call("aclrtSetStreamFailureMode", || {
        if mode > 1 {
            return INVALID_PARAM;
        }
        if sim().streams.exists(stream_id(stream as usize)) { SUCCESS } else { RT_PARAM_INVALID }
    })
}

struct HostCall(usize, usize);
// SAFETY: the caller hands the function and its data to the runtime to call on another thread,
// which is what the runtime's contract allows.
unsafe impl Send for HostCall {}

pub unsafe extern "C" fn aclrt_launch_host_func(
    stream: *mut c_void,
    func: Option<unsafe extern "C" fn(*mut c_void)>,
    args: *mut c_void,
) -> i32 {
    call("aclrtLaunchHostFunc", || {
        let Some(f) = func else { return INVALID_PARAM };
        let dev = match current() {
            Ok(d) => d,
            Err(e) => return e,
        };
        let job = HostCall(f as usize, args as usize);
        let run = move || {
            let job = job;
            // SAFETY: the pointer was a valid `void (*)(void *)` when queued.
            let f: unsafe extern "C" fn(*mut c_void) = unsafe { std::mem::transmute(job.0) };
            // SAFETY: calling the user's host function with its own data, as the runtime does.
            unsafe { f(job.1 as *mut c_void) };
            0
        };
        sim().streams.submit_async(stream_id(stream as usize), dev, Box::new(run)).map_or(RT_PARAM_INVALID, |_| SUCCESS)
    })
}

// ---- settings ------------------------------------------------------------------------------

/// aclrtFloatOverflowMode of the process: SATURATION 0, INFNAN 1 (the A2 default).
static SAT_MODE: AtomicI32 = AtomicI32::new(1);

pub unsafe extern "C" fn aclrt_set_device_sat_mode(mode: i32) -> i32 {
    call("aclrtSetDeviceSatMode", || {
        if !(0..=1).contains(&mode) {
            return INVALID_PARAM;
        }
        SAT_MODE.store(mode, Ordering::Relaxed);
        SUCCESS
    })
}

pub unsafe extern "C" fn aclrt_get_device_sat_mode(mode: *mut i32) -> i32 {
    call("aclrtGetDeviceSatMode", || put(mode, SAT_MODE.load(Ordering::Relaxed)))
}

/// Overflow detection per stream: 0 off, 1 on; kept so that the getter reads it back.
fn overflow_switches() -> std::sync::MutexGuard<'static, std::collections::HashMap<usize, u32>> {
    static MAP: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<usize, u32>>> =
        std::sync::OnceLock::new();
    MAP.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

pub unsafe extern "C" fn aclrt_set_stream_overflow_switch(stream: *mut c_void, flag: u32) -> i32 {
    call("aclrtSetStreamOverflowSwitch", || {
        if flag > 1 {
            return INVALID_PARAM;
        }
        if !sim().streams.exists(stream_id(stream as usize)) {
            return RT_PARAM_INVALID;
        }
        overflow_switches().insert(stream as usize, flag);
        SUCCESS
    })
}

pub unsafe extern "C" fn aclrt_get_stream_overflow_switch(stream: *mut c_void, flag: *mut u32) -> i32 {
    call("aclrtGetStreamOverflowSwitch", || {
        if !sim().streams.exists(stream_id(stream as usize)) {
            return RT_PARAM_INVALID;
        }
        put(flag, overflow_switches().get(&(stream as usize)).copied().unwrap_or(0))
    })
}

/// Operator timeouts bound kernels, which the simulator does not run: accepted and reported back.
pub unsafe extern "C" fn aclrt_set_op_wait_timeout(_timeout: u32) -> i32 {
    call("aclrtSetOpWaitTimeout", || SUCCESS)
}

pub unsafe extern "C" fn aclrt_set_op_execute_timeout(_timeout: u32) -> i32 {
    call("aclrtSetOpExecuteTimeOut", || SUCCESS)
}

pub unsafe extern "C" fn aclrt_set_op_execute_timeout_v2(timeout: u64, actual: *mut u64) -> i32 {
    call("aclrtSetOpExecuteTimeOutV2", || put(actual, timeout))
}

/// The emulated device: an Atlas A2 training part (what `torch_npu` calls Ascend910B2).
pub unsafe extern "C" fn aclrt_get_soc_name() -> *const c_char {
    c"Ascend910B2".as_ptr()
}

pub unsafe extern "C" fn aclrt_device_can_access_peer(can: *mut i32, dev: i32, peer: i32) -> i32 {
    call("aclrtDeviceCanAccessPeer", || {
        match (sim().valid_device(dev as i64), sim().valid_device(peer as i64)) {
            // Devices of one simulated node share one host: every pair can reach each other.
            (Some(a), Some(b)) if a != b => put(can, 1),
            _ => INVALID_PARAM,
        }
    })
}

pub unsafe extern "C" fn aclrt_device_enable_peer_access(peer: i32, flags: u32) -> i32 {
    call("aclrtDeviceEnablePeerAccess", || {
        let dev = match current() {
            Ok(d) => d,
            Err(e) => return e,
        };
        match sim().valid_device(peer as i64) {
            Some(p) if p != dev && flags == 0 => SUCCESS,
            _ => INVALID_PARAM,
        }
    })
}

/// Faults are reported by the call that meets them (see acl.rs): nothing is left to collect.
pub unsafe extern "C" fn aclrt_get_last_error(_level: i32) -> i32 {
    SUCCESS
}

pub unsafe extern "C" fn aclrt_peek_at_last_error(_level: i32) -> i32 {
    SUCCESS
}

// ---- callbacks and their report threads ----------------------------------------------------

/// ACL_ERROR_RT_STREAM_SUBSCRIBE: the stream already has a report thread.
const RT_STREAM_SUBSCRIBE: i32 = 107_011;
/// ACL_ERROR_RT_STREAM_NO_CB_REG: a callback on a stream no thread subscribed to.
const RT_STREAM_NO_CB_REG: i32 = 107_015;
/// ACL_ERROR_RT_REPORT_TIMEOUT: no callback arrived within aclrtProcessReport's timeout.
const RT_REPORT_TIMEOUT: i32 = 507_012;

/// A callback that reached its place in its stream, waiting for its report thread to run it.
struct Pending {
    call: HostCall,
    done: Option<std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>>,
}

#[derive(Default)]
struct Reports {
    /// stream handle -> the thread id given to aclrtSubscribeReport
    subscribed: std::collections::HashMap<usize, u64>,
    /// thread id -> its callbacks due
    due: std::collections::HashMap<u64, std::collections::VecDeque<Pending>>,
}

fn reports() -> &'static (std::sync::Mutex<Reports>, std::sync::Condvar) {
    static R: std::sync::OnceLock<(std::sync::Mutex<Reports>, std::sync::Condvar)> = std::sync::OnceLock::new();
    R.get_or_init(Default::default)
}

fn lock_reports() -> std::sync::MutexGuard<'static, Reports> {
    reports().0.lock().unwrap_or_else(|e| e.into_inner())
}

pub unsafe extern "C" fn aclrt_subscribe_report(thread: u64, stream: *mut c_void) -> i32 {
    call("aclrtSubscribeReport", || {
        if !sim().streams.exists(stream_id(stream as usize)) {
            return RT_PARAM_INVALID;
        }
        let mut r = lock_reports();
        if r.subscribed.contains_key(&(stream as usize)) {
            return RT_STREAM_SUBSCRIBE;
        }
        r.subscribed.insert(stream as usize, thread);
        SUCCESS
    })
}

pub unsafe extern "C" fn aclrt_unsubscribe_report(thread: u64, stream: *mut c_void) -> i32 {
    call("aclrtUnSubscribeReport", || {
        let mut r = lock_reports();
        match r.subscribed.get(&(stream as usize)) {
            Some(&t) if t == thread => {
                r.subscribed.remove(&(stream as usize));
                SUCCESS
            }
            _ => RT_STREAM_NO_CB_REG,
        }
    })
}

/// Queues `fn(userData)` on the stream: when the stream reaches it, the subscribed report thread
/// runs it in its next aclrtProcessReport; ACL_CALLBACK_BLOCK (1) holds the stream until then.
pub unsafe extern "C" fn aclrt_launch_callback(
    func: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
    block: i32,
    stream: *mut c_void,
) -> i32 {
    call("aclrtLaunchCallback", || {
        let Some(f) = func else { return INVALID_PARAM };
        if !(0..=1).contains(&block) {
            return INVALID_PARAM;
        }
        let dev = match current() {
            Ok(d) => d,
            Err(e) => return e,
        };
        let Some(&thread) = lock_reports().subscribed.get(&(stream as usize)) else { return RT_STREAM_NO_CB_REG };
        let call = HostCall(f as usize, data as usize);
        let run = move || {
            let done =
                (block == 1).then(|| std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new())));
            lock_reports().due.entry(thread).or_default().push_back(Pending { call, done: done.clone() });
            reports().1.notify_all();
            if let Some(d) = done {
                let mut ran = d.0.lock().unwrap_or_else(|e| e.into_inner());
                while !*ran {
                    ran = d.1.wait(ran).unwrap_or_else(|e| e.into_inner());
                }
            }
            0
        };
        sim().streams.submit_async(stream_id(stream as usize), dev, Box::new(run)).map_or(RT_PARAM_INVALID, |_| SUCCESS)
    })
}

/// Runs one callback due to the calling thread, waiting up to `timeout` ms for one (-1: no limit).
pub unsafe extern "C" fn aclrt_process_report(timeout: i32) -> i32 {
    call("aclrtProcessReport", || {
        if timeout < -1 {
            return INVALID_PARAM;
        }
        // SAFETY: pthread_self has no preconditions.
        let me = unsafe { libc::pthread_self() } as u64;
        let deadline =
            (timeout >= 0).then(|| std::time::Instant::now() + std::time::Duration::from_millis(timeout as u64));
        let mut r = lock_reports();
        let pending = loop {
            if let Some(p) = r.due.get_mut(&me).and_then(|q| q.pop_front()) {
                break p;
            }
            r = match deadline {
                None => reports().1.wait(r).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return RT_REPORT_TIMEOUT;
                    }
                    reports().1.wait_timeout(r, left).unwrap_or_else(|e| e.into_inner()).0
                }
            };
        };
        drop(r);
        // SAFETY: the pointer was a valid `void (*)(void *)` when queued.
        let f: unsafe extern "C" fn(*mut c_void) = unsafe { std::mem::transmute(pending.call.0) };
        // SAFETY: the user's callback with its own data, on the thread that asked to run it.
        unsafe { f(pending.call.1 as *mut c_void) };
        if let Some(d) = pending.done {
            *d.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
            d.1.notify_all();
        }
        SUCCESS
    })
}

// ---- device figures ------------------------------------------------------------------------

/// What an Ascend910B2 reports for its cores and L2 (24 AI (cube) cores, 48 vector cores,
/// 192 MiB L2). Programs read them to size work; the simulator's own speed does not follow them.
const AI_CORES: i64 = 24;
const VECTOR_CORES: i64 = 48;
const L2_BYTES: i64 = 192 << 20;

/// `aclGetDeviceCapability(deviceId, aclDeviceInfo, int64_t *value)`: AI_CORE_NUM 0,
/// VECTOR_CORE_NUM 1, L2_SIZE 2.
pub unsafe extern "C" fn acl_get_device_capability(dev: u32, info: i32, value: *mut i64) -> i32 {
    call("aclGetDeviceCapability", || {
        if sim().valid_device(dev as i64).is_none() {
            return INVALID_PARAM;
        }
        match info {
            0 => put(value, AI_CORES),
            1 => put(value, VECTOR_CORES),
            2 => put(value, L2_BYTES),
            _ => INVALID_PARAM,
        }
    })
}

/// `aclrtGetDeviceInfo(deviceId, aclrtDevAttr, int64_t *value)`: the core counts, memory size and
/// L2 of the emulated part; attributes the simulator has no figure for are not supported.
pub unsafe extern "C" fn aclrt_get_device_info(dev: u32, attr: i32, value: *mut i64) -> i32 {
    call("aclrtGetDeviceInfo", || {
        let Some(d) = sim().valid_device(dev as i64) else { return INVALID_PARAM };
        match attr {
            101 | 102 => put(value, AI_CORES),
            201 => put(value, VECTOR_CORES),
            301 => put(value, sim().mem_info(d).1 as i64),
            302 => put(value, L2_BYTES),
            _ => RT_FEATURE_NOT_SUPPORT,
        }
    })
}

// ---- system parameters (aclSysParamOpt: DETERMINISTIC 0 .. ENABLE_KERNEL_EARLY_START 3) -----

/// The process's values (aclrtSetSysParamOpt) and the context's (aclrtCtxSetSysParamOpt): the
/// simulator computes nothing that they would change, so they are kept and read back.
static SYS_PARAMS: [std::sync::atomic::AtomicI64; 4] = [const { std::sync::atomic::AtomicI64::new(0) }; 4];
static CTX_PARAMS: [std::sync::atomic::AtomicI64; 4] = [const { std::sync::atomic::AtomicI64::new(0) }; 4];

fn set_param(table: &[std::sync::atomic::AtomicI64; 4], opt: i32, value: i64) -> i32 {
    match usize::try_from(opt).ok().and_then(|i| table.get(i)) {
        Some(slot) if value >= 0 => {
            slot.store(value, Ordering::Relaxed);
            SUCCESS
        }
        _ => INVALID_PARAM,
    }
}

fn get_param(table: &[std::sync::atomic::AtomicI64; 4], opt: i32, value: *mut i64) -> i32 {
    match usize::try_from(opt).ok().and_then(|i| table.get(i)) {
        Some(slot) => put(value, slot.load(Ordering::Relaxed)),
        None => INVALID_PARAM,
    }
}

pub unsafe extern "C" fn aclrt_set_sys_param_opt(opt: i32, value: i64) -> i32 {
    call("aclrtSetSysParamOpt", || set_param(&SYS_PARAMS, opt, value))
}

pub unsafe extern "C" fn aclrt_get_sys_param_opt(opt: i32, value: *mut i64) -> i32 {
    call("aclrtGetSysParamOpt", || get_param(&SYS_PARAMS, opt, value))
}

pub unsafe extern "C" fn aclrt_ctx_set_sys_param_opt(opt: i32, value: i64) -> i32 {
    call("aclrtCtxSetSysParamOpt", || match current() {
        Ok(_) => set_param(&CTX_PARAMS, opt, value),
        Err(e) => e,
    })
}

pub unsafe extern "C" fn aclrt_ctx_get_sys_param_opt(opt: i32, value: *mut i64) -> i32 {
    call("aclrtCtxGetSysParamOpt", || match current() {
        Ok(_) => get_param(&CTX_PARAMS, opt, value),
        Err(e) => e,
    })
}
