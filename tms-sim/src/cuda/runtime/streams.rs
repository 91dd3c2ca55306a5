//! Streams, events, host callbacks and stream-capture queries. Work submitted to a capturing
//! stream is recorded into its graph (crate::core::graphs) instead of run.

use super::graphs::CAPTURE_UNSUPPORTED;
use super::{INVALID_RESOURCE_HANDLE, INVALID_VALUE, NOT_READY, SUCCESS, call, put};
use crate::core::graphs::Node;
use crate::core::sim::sim;
use crate::core::streams::StreamId;
use libc::{c_float, c_int, c_uint, c_ulonglong, c_void};

/// cudaStreamNonBlocking and the default.
const STREAM_FLAGS: c_uint = tms_vendor::cuda::STREAM_NON_BLOCKING;
/// The priority range an H100 reports: 0 (least) to -5 (greatest).
pub const LEAST_PRIORITY: c_int = 0;
pub const GREATEST_PRIORITY: c_int = -5;

fn create(stream: *mut *mut c_void, flags: c_uint, priority: c_int) -> i32 {
    if stream.is_null() || flags & !STREAM_FLAGS != 0 {
        return INVALID_VALUE;
    }
    let dev = enter!();
    // Out-of-range priorities are clamped, as the runtime documents.
    let priority = priority.clamp(GREATEST_PRIORITY, LEAST_PRIORITY);
    if !crate::cuda::charge_stream_pool(dev) {
        return super::MEMORY_ALLOCATION;
    }
    match sim().streams.create_with(dev, crate::cuda::stream_kind(flags), priority) {
        Some(h) => put(stream, h as *mut c_void),
        None => super::MEMORY_ALLOCATION,
    }
}

pub unsafe extern "C" fn cuda_stream_create(stream: *mut *mut c_void) -> i32 {
    call("cudaStreamCreate", || create(stream, 0, 0))
}

pub unsafe extern "C" fn cuda_stream_create_with_flags(stream: *mut *mut c_void, flags: c_uint) -> i32 {
    call("cudaStreamCreateWithFlags", || create(stream, flags, 0))
}

pub unsafe extern "C" fn cuda_stream_create_with_priority(
    stream: *mut *mut c_void,
    flags: c_uint,
    priority: c_int,
) -> i32 {
    call("cudaStreamCreateWithPriority", || create(stream, flags, priority))
}

fn properties(stream: *mut c_void) -> Result<(u32, i32), i32> {
    match crate::cuda::stream_id(stream as usize) {
        StreamId::Default(_) => Ok((tms_vendor::cuda::STREAM_DEFAULT, 0)),
        StreamId::Created(s) => sim()
            .streams
            .properties(s)
            .map(|(kind, priority)| (crate::cuda::stream_flags(kind), priority))
            .map_err(|_| INVALID_RESOURCE_HANDLE),
    }
}

pub unsafe extern "C" fn cuda_stream_get_priority(stream: *mut c_void, priority: *mut c_int) -> i32 {
    call("cudaStreamGetPriority", || {
        enter!();
        properties(stream).map_or_else(|e| e, |(_, p)| put(priority, p))
    })
}

pub unsafe extern "C" fn cuda_stream_get_flags(stream: *mut c_void, flags: *mut c_uint) -> i32 {
    call("cudaStreamGetFlags", || {
        enter!();
        properties(stream).map_or_else(|e| e, |(f, _)| put(flags, f))
    })
}

pub unsafe extern "C" fn cuda_stream_synchronize(stream: *mut c_void) -> i32 {
    call("cudaStreamSynchronize", || {
        enter!();
        if sim().graphs.capture_of(crate::cuda::stream_id(stream as usize)).is_some() {
            return CAPTURE_UNSUPPORTED;
        }
        sim().streams.synchronize(crate::cuda::stream_id(stream as usize)).unwrap_or(INVALID_RESOURCE_HANDLE)
    })
}

pub unsafe extern "C" fn cuda_stream_query(stream: *mut c_void) -> i32 {
    call("cudaStreamQuery", || {
        enter!();
        if sim().graphs.capture_of(crate::cuda::stream_id(stream as usize)).is_some() {
            return CAPTURE_UNSUPPORTED;
        }
        match sim().streams.is_idle(crate::cuda::stream_id(stream as usize)) {
            Ok(true) => SUCCESS,
            Ok(false) => NOT_READY,
            Err(_) => INVALID_RESOURCE_HANDLE,
        }
    })
}

pub unsafe extern "C" fn cuda_stream_destroy(stream: *mut c_void) -> i32 {
    call("cudaStreamDestroy", || {
        enter!();
        if sim().streams.destroy(stream as usize) { SUCCESS } else { INVALID_RESOURCE_HANDLE }
    })
}

pub unsafe extern "C" fn cuda_stream_wait_event(stream: *mut c_void, event: *mut c_void, _flags: c_uint) -> i32 {
    call("cudaStreamWaitEvent", || {
        enter!();
        let Some(ev) = sim().streams.event(event as usize) else { return INVALID_RESOURCE_HANDLE };
        // Waiting on an event recorded during a capture joins that capture.
        if ev.capture() != 0 {
            sim().graphs.join(crate::cuda::stream_id(stream as usize), ev.capture());
            return SUCCESS;
        }
        // On the default stream too the wait is queued (core::streams::Streams::legacy): the
        // host goes on, and the stream's next work waits.
        sim()
            .streams
            .wait_event(crate::cuda::stream_id(stream as usize), &ev, crate::cuda::current_device())
            .map_or(INVALID_RESOURCE_HANDLE, |()| SUCCESS)
    })
}

/// A host function pointer and its argument, carried to a stream's worker thread.
struct HostCall(usize, usize);
// SAFETY: the caller hands the function and its data to the runtime to call on another thread,
// which is what the runtime's contract allows.
unsafe impl Send for HostCall {}

pub unsafe extern "C" fn cuda_launch_host_func(
    stream: *mut c_void,
    func: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) -> i32 {
    call("cudaLaunchHostFunc", || {
        enter!();
        let Some(f) = func else { return INVALID_VALUE };
        if sim()
            .graphs
            .record(crate::cuda::stream_id(stream as usize), || Node::Host { f: f as usize, data: data as usize })
        {
            return SUCCESS;
        }
        let job = HostCall(f as usize, data as usize);
        let run = move || {
            let job = job;
            // SAFETY: the pointer was a valid `void (*)(void *)` when queued.
            let f: unsafe extern "C" fn(*mut c_void) = unsafe { std::mem::transmute(job.0) };
            // SAFETY: calling the user's host function with its own data, as the runtime does.
            unsafe { f(job.1 as *mut c_void) };
            0
        };
        // On the default stream too it is queued: the host goes on, as on a GPU.
        sim()
            .streams
            .submit_async(crate::cuda::stream_id(stream as usize), crate::cuda::current_device(), Box::new(run))
            .map_or(INVALID_RESOURCE_HANDLE, |_| SUCCESS)
    })
}

type StreamCallback = unsafe extern "C" fn(*mut c_void, c_int, *mut c_void);

pub unsafe extern "C" fn cuda_stream_add_callback(
    stream: *mut c_void,
    callback: Option<StreamCallback>,
    data: *mut c_void,
    flags: c_uint,
) -> i32 {
    call("cudaStreamAddCallback", || {
        enter!();
        let Some(cb) = callback else { return INVALID_VALUE };
        if flags != 0 {
            return INVALID_VALUE;
        }
        let handle = stream as usize;
        let id = crate::cuda::stream_id(handle);
        if sim().graphs.record(id, || Node::Callback { f: cb as usize, stream: handle, data: data as usize }) {
            return SUCCESS;
        }
        let job = HostCall(cb as usize, data as usize);
        let run = move || {
            let job = job;
            // SAFETY: the pointer was a valid stream callback when queued.
            let f: StreamCallback = unsafe { std::mem::transmute(job.0) };
            // SAFETY: the runtime calls back with the stream, its status and the user's data.
            unsafe { f(handle as *mut c_void, SUCCESS, job.1 as *mut c_void) };
            0
        };
        sim()
            .streams
            .submit_async(id, crate::cuda::current_device(), Box::new(run))
            .map_or(INVALID_RESOURCE_HANDLE, |_| SUCCESS)
    })
}

pub unsafe extern "C" fn cuda_stream_is_capturing(stream: *mut c_void, status: *mut c_int) -> i32 {
    call("cudaStreamIsCapturing", || {
        // Like most runtime calls it makes the device's primary context current (torch calls it
        // right before cudaMalloc, from any thread, including autograd's workers).
        enter!();
        if !sim().streams.exists(crate::cuda::stream_id(stream as usize)) {
            return INVALID_RESOURCE_HANDLE;
        }
        // cudaStreamCaptureStatusActive (1) or None (0)
        put(status, c_int::from(sim().graphs.capture_of(crate::cuda::stream_id(stream as usize)).is_some()))
    })
}

/// CUDA 13's seven-argument form: status, id, graph, dependencies, edge data, count.
pub unsafe extern "C" fn cuda_stream_get_capture_info(
    stream: *mut c_void,
    status: *mut c_int,
    id: *mut c_ulonglong,
    graph: *mut *mut c_void,
    deps: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
) -> i32 {
    call("cudaStreamGetCaptureInfo", || {
        enter!();
        if !sim().streams.exists(crate::cuda::stream_id(stream as usize)) {
            return INVALID_RESOURCE_HANDLE;
        }
        let Some(capture) = sim().graphs.capture_of(crate::cuda::stream_id(stream as usize)) else {
            // The optional outputs are left alone when the stream is not capturing, as documented.
            return put(status, 0);
        };
        let code = put(status, 1);
        if !id.is_null() {
            put(id, capture);
        }
        // No dependency nodes are exposed.
        if !graph.is_null() {
            put(graph, super::graphs::capture_graph(capture).unwrap_or(0) as *mut c_void);
        }
        if !deps.is_null() {
            put(deps, std::ptr::null());
        }
        if !edges.is_null() {
            put(edges, std::ptr::null());
        }
        if !count.is_null() {
            put(count, 0);
        }
        code
    })
}

/// CUDA 12's `cudaStreamGetCaptureInfo_v2` (what its headers compile `cudaStreamGetCaptureInfo`
/// to): the CUDA 13 form without `edgeData_out`, so `numDependencies_out` is the sixth argument.
pub unsafe extern "C" fn cuda_stream_get_capture_info_v2(
    stream: *mut c_void,
    status: *mut c_int,
    id: *mut c_ulonglong,
    graph: *mut *mut c_void,
    deps: *mut *const c_void,
    count: *mut usize,
) -> i32 {
    // SAFETY: forwarding the caller's pointers; a null edge output is never written.
    unsafe { cuda_stream_get_capture_info(stream, status, id, graph, deps, std::ptr::null_mut(), count) }
}

/// The CUDA 11 form libcudart.so.12 keeps under the plain name: `(stream, status, id)`. Reading
/// more arguments than that would write through whatever the caller left in those registers.
pub unsafe extern "C" fn cuda_stream_get_capture_info_legacy(
    stream: *mut c_void,
    status: *mut c_int,
    id: *mut c_ulonglong,
) -> i32 {
    let none = std::ptr::null_mut();
    // SAFETY: forwarding the caller's pointers; null outputs are never written.
    unsafe { cuda_stream_get_capture_info(stream, status, id, none, none.cast(), none.cast(), none.cast()) }
}

pub unsafe extern "C" fn cuda_thread_exchange_stream_capture_mode(mode: *mut c_int) -> i32 {
    thread_local! {
        static MODE: std::cell::Cell<c_int> = const { std::cell::Cell::new(0) };
    }
    call("cudaThreadExchangeStreamCaptureMode", || {
        if mode.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: checked non-null; the caller passes the mode to install and gets the old one.
        unsafe { *mode = MODE.with(|m| m.replace(*mode)) };
        SUCCESS
    })
}

/// cudaEventDefault, BlockingSync, DisableTiming, Interprocess.
const EVENT_FLAGS: c_uint = 0x1 | 0x2 | 0x4;

pub unsafe extern "C" fn cuda_event_create_with_flags(event: *mut *mut c_void, flags: c_uint) -> i32 {
    call("cudaEventCreateWithFlags", || {
        if event.is_null() || flags & !EVENT_FLAGS != 0 {
            return INVALID_VALUE;
        }
        enter!();
        put(event, sim().streams.event_create(flags) as *mut c_void)
    })
}

pub unsafe extern "C" fn cuda_event_create(event: *mut *mut c_void) -> i32 {
    // SAFETY: same contract with default flags.
    unsafe { cuda_event_create_with_flags(event, 0) }
}

pub unsafe extern "C" fn cuda_event_record(event: *mut c_void, stream: *mut c_void) -> i32 {
    call("cudaEventRecord", || {
        enter!();
        let Some(ev) = sim().streams.event(event as usize) else { return INVALID_RESOURCE_HANDLE };
        if let Some(capture) = sim().graphs.capture_of(crate::cuda::stream_id(stream as usize)) {
            ev.set_capture(capture);
            sim().graphs.record(crate::cuda::stream_id(stream as usize), || Node::EventRecord { event: ev.clone() });
            return SUCCESS;
        }
        ev.set_capture(0);
        sim()
            .streams
            .event_record(&ev, crate::cuda::stream_id(stream as usize), crate::cuda::current_device())
            .map_or(INVALID_RESOURCE_HANDLE, |()| SUCCESS)
    })
}

pub unsafe extern "C" fn cuda_event_record_with_flags(event: *mut c_void, stream: *mut c_void, _flags: c_uint) -> i32 {
    // SAFETY: same contract; the only flag (external) changes nothing without graphs.
    unsafe { cuda_event_record(event, stream) }
}

pub unsafe extern "C" fn cuda_event_query(event: *mut c_void) -> i32 {
    call("cudaEventQuery", || match sim().streams.event(event as usize) {
        Some(ev) if ev.is_complete() => SUCCESS,
        Some(_) => NOT_READY,
        None => INVALID_RESOURCE_HANDLE,
    })
}

pub unsafe extern "C" fn cuda_event_synchronize(event: *mut c_void) -> i32 {
    call("cudaEventSynchronize", || match sim().streams.event(event as usize) {
        Some(ev) => {
            ev.synchronize();
            SUCCESS
        }
        None => INVALID_RESOURCE_HANDLE,
    })
}

pub unsafe extern "C" fn cuda_event_elapsed_time(ms: *mut c_float, start: *mut c_void, end: *mut c_void) -> i32 {
    call("cudaEventElapsedTime", || {
        let (Some(a), Some(b)) = (sim().streams.event(start as usize), sim().streams.event(end as usize)) else {
            return INVALID_RESOURCE_HANDLE;
        };
        // cudaEventDisableTiming on either event: cudaErrorInvalidResourceHandle.
        if (a.flags | b.flags) & 0x2 != 0 {
            return INVALID_RESOURCE_HANDLE;
        }
        match (a.completed_at(), b.completed_at()) {
            (Some(t0), Some(t1)) => put(ms, (t1 as f64 - t0 as f64) as c_float / 1e6),
            _ => NOT_READY,
        }
    })
}

pub unsafe extern "C" fn cuda_event_destroy(event: *mut c_void) -> i32 {
    call("cudaEventDestroy", || {
        if sim().streams.event_destroy(event as usize) { SUCCESS } else { INVALID_RESOURCE_HANDLE }
    })
}
