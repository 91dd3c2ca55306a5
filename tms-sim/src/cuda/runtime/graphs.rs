//! CUDA graphs: stream capture, instantiation, launch and user objects (see `crate::core::graphs`).

use super::{INVALID_RESOURCE_HANDLE, INVALID_VALUE, SUCCESS, call, code_of, put};
use crate::core::graphs::{CaptureError, Exec, LaunchError, Node, Retained, UserObject};
use crate::core::sim::sim;
use libc::{c_int, c_uint, c_ulonglong, c_void};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

/// Live handles, so a stale or foreign handle is an error instead of a wild pointer.
struct Handles<T> {
    live: Mutex<BTreeMap<usize, Arc<T>>>,
}

impl<T> Handles<T> {
    const fn new() -> Self {
        Handles { live: Mutex::new(BTreeMap::new()) }
    }

    fn insert(&self, value: T) -> usize {
        let value = Arc::new(value);
        let handle = Arc::as_ptr(&value) as usize;
        self.live.lock().unwrap_or_else(|e| e.into_inner()).insert(handle, value);
        handle
    }

    fn get(&self, handle: usize) -> Option<Arc<T>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).get(&handle).cloned()
    }

    fn remove(&self, handle: usize) -> Option<Arc<T>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).remove(&handle)
    }
}

/// A graph handle. A capture's graph has one from its first `cudaStreamGetCaptureInfo` on (user
/// objects can be retained in it then, as PyTorch's NCCL process group does), and
/// `cudaStreamEndCapture` returns that same handle with the nodes filled in.
struct GraphSlot {
    nodes: OnceLock<Arc<Vec<Node>>>,
    retained: Arc<Retained>,
}

static GRAPHS: Handles<GraphSlot> = Handles::new();
/// Capture id -> the handle its graph already has.
static CAPTURING: Mutex<Option<HashMap<u64, usize>>> = Mutex::new(None);

/// The handle of capture `id`'s graph, made on first request; None once the capture has ended.
pub fn capture_graph(id: u64) -> Option<usize> {
    let retained = sim().graphs.retained_of(id)?;
    let mut capturing = CAPTURING.lock().unwrap_or_else(|e| e.into_inner());
    let map = capturing.get_or_insert_with(HashMap::new);
    Some(*map.entry(id).or_insert_with(|| GRAPHS.insert(GraphSlot { nodes: OnceLock::new(), retained })))
}
static EXECS: Handles<Exec> = Handles::new();
static USER_OBJECTS: Handles<Arc<UserObject>> = Handles::new();

/// cudaStreamCaptureModeGlobal, ThreadLocal, Relaxed.
const CAPTURE_MODES: c_int = 2;

pub unsafe extern "C" fn cuda_stream_begin_capture(stream: *mut c_void, mode: c_int) -> i32 {
    call("cudaStreamBeginCapture", || {
        enter!();
        if !(0..=CAPTURE_MODES).contains(&mode) {
            return INVALID_VALUE;
        }
        if !sim().streams.exists(crate::cuda::stream_id(stream as usize)) {
            return INVALID_RESOURCE_HANDLE;
        }
        sim().graphs.begin(crate::cuda::stream_id(stream as usize)).map_or_else(capture_code, |_| SUCCESS)
    })
}

pub unsafe extern "C" fn cuda_stream_end_capture(stream: *mut c_void, graph: *mut *mut c_void) -> i32 {
    call("cudaStreamEndCapture", || {
        enter!();
        if graph.is_null() {
            return INVALID_VALUE;
        }
        let stream = crate::cuda::stream_id(stream as usize);
        let id = sim().graphs.capture_of(stream);
        match sim().graphs.end(stream) {
            Ok(g) => {
                let early = id.and_then(|id| {
                    CAPTURING.lock().unwrap_or_else(|e| e.into_inner()).as_mut().and_then(|m| m.remove(&id))
                });
                let handle = match early.and_then(|h| GRAPHS.get(h).map(|slot| (h, slot))) {
                    Some((h, slot)) => {
                        let _ = slot.nodes.set(g.nodes);
                        h
                    }
                    None => GRAPHS.insert(GraphSlot { nodes: OnceLock::from(g.nodes), retained: g.retained }),
                };
                put(graph, handle as *mut c_void)
            }
            Err(e) => capture_code(e),
        }
    })
}

/// cudaErrorStreamCaptureUnsupported, cudaErrorStreamCaptureInvalidated (CUDA Runtime API).
pub const CAPTURE_UNSUPPORTED: i32 = 900;
const CAPTURE_INVALIDATED: i32 = 901;

fn capture_code(e: CaptureError) -> i32 {
    match e {
        CaptureError::DefaultStream => CAPTURE_UNSUPPORTED,
        CaptureError::AlreadyCapturing => CAPTURE_INVALIDATED,
        CaptureError::NotCapturing => INVALID_VALUE,
    }
}

fn instantiate(exec: *mut *mut c_void, graph: *mut c_void) -> i32 {
    let Some(g) = GRAPHS.get(graph as usize) else { return INVALID_RESOURCE_HANDLE };
    // A graph still being captured cannot be instantiated.
    let Some(nodes) = g.nodes.get() else { return INVALID_VALUE };
    put(exec, EXECS.insert(Exec::new(nodes.clone(), g.retained.clone())) as *mut c_void)
}

pub unsafe extern "C" fn cuda_graph_instantiate(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    _flags: c_ulonglong,
) -> i32 {
    call("cudaGraphInstantiate", || {
        enter!();
        instantiate(exec, graph)
    })
}

pub unsafe extern "C" fn cuda_graph_instantiate_with_flags(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    _flags: c_ulonglong,
) -> i32 {
    call("cudaGraphInstantiateWithFlags", || {
        enter!();
        instantiate(exec, graph)
    })
}

pub unsafe extern "C" fn cuda_graph_launch(exec: *mut c_void, stream: *mut c_void) -> i32 {
    call("cudaGraphLaunch", || {
        enter!();
        let Some(e) = EXECS.get(exec as usize) else { return INVALID_RESOURCE_HANDLE };
        if !sim().streams.exists(crate::cuda::stream_id(stream as usize)) {
            return INVALID_RESOURCE_HANDLE;
        }
        let stream = crate::cuda::stream_id(stream as usize);
        match crate::core::graphs::launch(&e, stream, crate::cuda::current_device(), code_of) {
            Ok(()) => SUCCESS,
            Err(LaunchError::Earlier(code)) => code,
            Err(LaunchError::Memory(m)) => code_of(m),
            Err(LaunchError::Node(code)) => code,
        }
    })
}

pub unsafe extern "C" fn cuda_graph_exec_destroy(exec: *mut c_void) -> i32 {
    call(
        "cudaGraphExecDestroy",
        || if EXECS.remove(exec as usize).is_some() { SUCCESS } else { INVALID_RESOURCE_HANDLE },
    )
}

pub unsafe extern "C" fn cuda_graph_destroy(graph: *mut c_void) -> i32 {
    call("cudaGraphDestroy", || if GRAPHS.remove(graph as usize).is_some() { SUCCESS } else { INVALID_RESOURCE_HANDLE })
}

/// Node handles are the addresses of the graph's nodes.
pub unsafe extern "C" fn cuda_graph_get_nodes(graph: *mut c_void, nodes: *mut *mut c_void, count: *mut usize) -> i32 {
    call("cudaGraphGetNodes", || {
        let Some(g) = GRAPHS.get(graph as usize) else { return INVALID_RESOURCE_HANDLE };
        if count.is_null() {
            return INVALID_VALUE;
        }
        let empty = Arc::new(Vec::new());
        let g = g.nodes.get().unwrap_or(&empty);
        if nodes.is_null() {
            return put(count, g.len());
        }
        // SAFETY: checked non-null; the caller passes room for *count handles.
        let room = unsafe { *count };
        for (i, node) in g.iter().take(room).enumerate() {
            // SAFETY: i < room.
            unsafe { *nodes.add(i) = node as *const _ as *mut c_void };
        }
        put(count, room.min(g.len()))
    })
}

pub unsafe extern "C" fn cuda_user_object_create(
    object: *mut *mut c_void,
    ptr: *mut c_void,
    destroy: Option<crate::core::graphs::HostFn>,
    initial_refcount: c_uint,
    _flags: c_uint,
) -> i32 {
    call("cudaUserObjectCreate", || {
        let Some(destroy) = destroy else { return INVALID_VALUE };
        if initial_refcount == 0 {
            return INVALID_VALUE;
        }
        let obj = UserObject::new(ptr as usize, destroy as usize, initial_refcount as usize);
        put(object, USER_OBJECTS.insert(obj) as *mut c_void)
    })
}

pub unsafe extern "C" fn cuda_user_object_release(object: *mut c_void, count: c_uint) -> i32 {
    call("cudaUserObjectRelease", || match USER_OBJECTS.get(object as usize) {
        Some(obj) => {
            obj.release(count as usize);
            SUCCESS
        }
        None => INVALID_RESOURCE_HANDLE,
    })
}

/// cudaGraphUserObjectMove: the caller's references move to the graph.
const USER_OBJECT_MOVE: c_uint = 1;

pub unsafe extern "C" fn cuda_graph_retain_user_object(
    graph: *mut c_void,
    object: *mut c_void,
    count: c_uint,
    flags: c_uint,
) -> i32 {
    call("cudaGraphRetainUserObject", || {
        let (Some(g), Some(obj)) = (GRAPHS.get(graph as usize), USER_OBJECTS.get(object as usize)) else {
            return INVALID_RESOURCE_HANDLE;
        };
        if flags & USER_OBJECT_MOVE == 0 {
            obj.retain(count as usize);
        }
        g.retained.retain((*obj).clone(), count as usize);
        SUCCESS
    })
}
