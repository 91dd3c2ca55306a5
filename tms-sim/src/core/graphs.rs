//! CUDA graphs by stream capture: while a stream captures, the work submitted to it (copies,
//! memsets, host functions, event records) is recorded as nodes instead of run; a launch of the
//! instantiated graph runs the nodes in capture order. The simulator has no kernels: the CPU
//! compute layer records each op it would have computed as a host-function node, so replaying a
//! graph re-runs the captured computation on the memory the graph captured.
//!
//! A launch waits for the stream's earlier work and then runs the nodes synchronously in the
//! calling thread (host functions of the layer need the caller's interpreter). A stream that
//! waits on an event recorded during a capture joins that capture, as on a GPU.
//!
//! A collective issued on a capturing stream is recorded too (`Node::Collective`) and performed,
//! peers and all, at each launch: NCCL captures collectives since 2.9 and every rank replays
//! the same sequence (NCCL user guide, "CUDA Graphs").

use crate::core::memory::MemError;
use crate::core::sim::{CopyDirection, sim};
use crate::core::streams::Event;
use crate::core::streams::StreamId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// A host function pointer and its argument.
pub type HostFn = unsafe extern "C" fn(*mut libc::c_void);
/// A stream callback: (stream, status, user data).
pub type StreamCallback = unsafe extern "C" fn(*mut libc::c_void, libc::c_int, *mut libc::c_void);

#[derive(Clone)]
pub enum Node {
    Copy {
        dst: usize,
        src: usize,
        n: usize,
        kind: CopyDirection,
    },
    Memset {
        dst: usize,
        value: u8,
        n: usize,
    },
    Host {
        f: usize,
        data: usize,
    },
    Callback {
        f: usize,
        stream: usize,
        data: usize,
    },
    EventRecord {
        event: Arc<Event>,
    },
    /// A collective, performed with the peers at each launch; its code is the front end's (0:
    /// done).
    Collective(Arc<dyn Fn() -> i32 + Send + Sync>),
}

/// A user object (cudaUserObjectCreate): a destructor run when its last reference goes.
pub struct UserObject {
    refs: AtomicUsize,
    destroy: usize,
    ptr: usize,
}

impl UserObject {
    pub fn new(ptr: usize, destroy: usize, refs: usize) -> Arc<UserObject> {
        Arc::new(UserObject { refs: AtomicUsize::new(refs), destroy, ptr })
    }

    pub fn retain(&self, n: usize) {
        self.refs.fetch_add(n, Ordering::AcqRel);
    }

    pub fn release(&self, n: usize) {
        // One atomic step from the count seen to the count left, so that two releases racing to
        // zero (or one after it) cannot both see themselves as the last and destroy twice.
        let Ok(before) =
            self.refs.fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| (r > 0).then(|| r.saturating_sub(n)))
        else {
            return;
        };
        if before <= n && self.destroy != 0 {
            run_destructor(self.destroy, self.ptr);
        }
    }
}

/// Runs a user object's destructor on the one thread kept for them, never in the thread that
/// dropped the last reference: "destructor callbacks ... are executed by a shared internal
/// thread" (CUDA Runtime API, cudaUserObjectCreate). Callers rely on it: PyTorch's NCCL process
/// group releases a graph's user object while holding the lock its destructor takes.
fn run_destructor(destroy: usize, ptr: usize) {
    static STARTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*STARTED.get_or_init(start_destructor_thread) {
        // No thread could be started: late beats never.
        call_destructor(destroy, ptr);
        return;
    }
    DESTRUCTORS.0.lock().unwrap_or_else(|e| e.into_inner()).push_back((destroy, ptr));
    DESTRUCTORS.1.notify_one();
}

/// Destructors waiting for the thread, and its wake-up.
static DESTRUCTORS: (Mutex<std::collections::VecDeque<(usize, usize)>>, std::sync::Condvar) =
    (Mutex::new(std::collections::VecDeque::new()), std::sync::Condvar::new());

/// A destructor may unwind: PyTorch's takes the GIL, and CPython ends a thread that does so once
/// the interpreter is finalizing with `pthread_exit`, a forced unwind.
type Destructor = unsafe extern "C-unwind" fn(*mut libc::c_void);

fn call_destructor(destroy: usize, ptr: usize) {
    // SAFETY: the destructor the caller registered, with its pointer, called once.
    let f: Destructor = unsafe { std::mem::transmute(destroy) };
    unsafe { f(ptr as *mut libc::c_void) };
}

/// The destructors' thread is a plain pthread, not a `std::thread`: the forced unwind of a
/// destructor ended by `pthread_exit` (above) must end the thread, and `std::thread` would catch
/// it and abort the process ("FATAL: exception not rethrown") as a Python program exits.
fn start_destructor_thread() -> bool {
    extern "C-unwind" fn run(_: *mut libc::c_void) -> *mut libc::c_void {
        loop {
            // Nothing with a destructor is alive across the call, so an unwind through this frame
            // has nothing to clean up.
            let (destroy, ptr) = {
                let mut queue = DESTRUCTORS.0.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    match queue.pop_front() {
                        Some(job) => break job,
                        None => queue = DESTRUCTORS.1.wait(queue).unwrap_or_else(|e| e.into_inner()),
                    }
                }
            };
            call_destructor(destroy, ptr);
        }
    }
    type Start = extern "C" fn(*mut libc::c_void) -> *mut libc::c_void;
    // SAFETY: the same signature and calling convention; only the unwinding contract differs,
    // and glibc's thread start lets a forced unwind end the thread.
    let start: Start =
        unsafe { std::mem::transmute(run as extern "C-unwind" fn(*mut libc::c_void) -> *mut libc::c_void) };
    let mut thread: libc::pthread_t = 0;
    // SAFETY: a new detached thread running `run`, which takes no argument.
    unsafe {
        if libc::pthread_create(&mut thread, std::ptr::null(), start, std::ptr::null_mut()) != 0 {
            return false;
        }
        libc::pthread_setname_np(thread, c"tms-sim-userobj".as_ptr());
        libc::pthread_detach(thread);
    }
    true
}

/// References a graph holds on user objects, released when the graph and every executable made
/// from it are gone.
#[derive(Default)]
pub struct Retained(Mutex<Vec<(Arc<UserObject>, usize)>>);

impl Retained {
    pub fn retain(&self, obj: Arc<UserObject>, n: usize) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push((obj, n));
    }
}

impl Drop for Retained {
    fn drop(&mut self) {
        for (obj, n) in self.0.get_mut().unwrap_or_else(|e| e.into_inner()).drain(..) {
            obj.release(n);
        }
    }
}

/// A captured graph (what cudaStreamEndCapture returns) and an instantiated one share the nodes.
pub struct Graph {
    pub nodes: Arc<Vec<Node>>,
    pub retained: Arc<Retained>,
}

pub struct Exec {
    pub nodes: Arc<Vec<Node>>,
    _retained: Arc<Retained>,
}

impl Graph {
    pub fn instantiate(&self) -> Exec {
        Exec { nodes: self.nodes.clone(), _retained: self.retained.clone() }
    }

    pub fn retain(&self, obj: Arc<UserObject>, n: usize) {
        self.retained.retain(obj, n);
    }
}

impl Exec {
    pub fn new(nodes: Arc<Vec<Node>>, retained: Arc<Retained>) -> Exec {
        Exec { nodes, _retained: retained }
    }
}

#[derive(Default)]
pub struct Graphs {
    /// Captures in progress; lets every stream operation skip the lookup when there are none.
    active: AtomicUsize,
    next_id: AtomicU64,
    /// Capturing stream -> capture id.
    streams: Mutex<HashMap<StreamId, u64>>,
    /// Capture id -> nodes recorded so far.
    building: Mutex<HashMap<u64, Building>>,
}

/// A graph under capture: its nodes so far, and the user objects retained in it already (a
/// capture's graph has a handle before the capture ends: `cudaStreamGetCaptureInfo`).
#[derive(Default)]
struct Building {
    nodes: Vec<Node>,
    retained: Arc<Retained>,
}

/// Why a capture call was refused (the CUDA runtime answers 900 and 901, and 1 for `NotCapturing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureError {
    /// The default stream cannot capture.
    DefaultStream,
    /// The stream is capturing already.
    AlreadyCapturing,
    /// The stream is not capturing.
    NotCapturing,
}

/// Why a graph launch stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchError {
    /// Work queued on the stream before the launch failed with this (front-end) code.
    Earlier(i32),
    /// A node met bad memory.
    Memory(MemError),
    /// A collective node failed with this (front-end) code.
    Node(i32),
}

impl Graphs {
    fn streams(&self) -> MutexGuard<'_, HashMap<StreamId, u64>> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn building(&self) -> MutexGuard<'_, HashMap<u64, Building>> {
        self.building.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The capture `stream` records into, if any.
    pub fn capture_of(&self, stream: StreamId) -> Option<u64> {
        if self.active.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.streams().get(&stream).copied()
    }

    /// Starts capturing on `stream` (not the default stream, which cannot capture).
    pub fn begin(&self, stream: StreamId) -> Result<u64, CaptureError> {
        if stream.is_default() {
            return Err(CaptureError::DefaultStream);
        }
        let mut streams = self.streams();
        if streams.contains_key(&stream) {
            return Err(CaptureError::AlreadyCapturing);
        }
        let id = self.next_id.fetch_add(1, Ordering::AcqRel) + 1;
        streams.insert(stream, id);
        self.building().insert(id, Building::default());
        self.active.fetch_add(1, Ordering::AcqRel);
        Ok(id)
    }

    /// Makes `stream` record into capture `id` too (it waited on an event of that capture).
    pub fn join(&self, stream: StreamId, id: u64) {
        if !stream.is_default() && self.building().contains_key(&id) {
            self.streams().insert(stream, id);
        }
    }

    /// Records `node` if `stream` is capturing; false if it is not (run the work now).
    pub fn record(&self, stream: StreamId, node: impl FnOnce() -> Node) -> bool {
        let Some(id) = self.capture_of(stream) else { return false };
        match self.building().get_mut(&id) {
            Some(b) => {
                b.nodes.push(node());
                true
            }
            None => false,
        }
    }

    /// Where user objects retained in capture `id`'s graph are kept until its graph goes.
    pub fn retained_of(&self, id: u64) -> Option<Arc<Retained>> {
        self.building().get(&id).map(|b| b.retained.clone())
    }

    /// Ends the capture `stream` started; every stream that joined it stops capturing.
    pub fn end(&self, stream: StreamId) -> Result<Graph, CaptureError> {
        let mut streams = self.streams();
        let id = streams.get(&stream).copied().ok_or(CaptureError::NotCapturing)?;
        streams.retain(|_, c| *c != id);
        drop(streams);
        let b = self.building().remove(&id).unwrap_or_default();
        self.active.fetch_sub(1, Ordering::AcqRel);
        Ok(Graph { nodes: Arc::new(b.nodes), retained: b.retained })
    }
}

/// Launches an instantiated graph on `stream` (`device`: whose default stream it names when it
/// is the default stream). A graph with collectives is queued there and returns at once, as on a
/// GPU: a launch that waited for its collectives would deadlock one thread that launches every
/// rank's graph in turn (one process driving several devices, as nccl-tests' graph mode does).
/// Other graphs run in the calling thread after the stream's earlier work (the CPU layer's
/// host functions want the caller's interpreter); they stop at the first failure.
/// `fault_code` turns a queued graph's device fault into the stream's code.
pub fn launch(
    exec: &Exec,
    stream: StreamId,
    device: usize,
    fault_code: fn(MemError) -> i32,
) -> Result<(), LaunchError> {
    let s = sim();
    if exec.nodes.iter().any(|n| matches!(n, Node::Collective(_))) {
        if exec.nodes.iter().any(|n| matches!(n, Node::Host { .. } | Node::Callback { .. })) {
            // Host functions (the CPU layer's kernels among them) may run Python on the worker.
            crate::core::gil::python_runs_on_streams();
        }
        let nodes = exec.nodes.clone();
        let retained = exec._retained.clone();
        let job = Box::new(move || {
            let _alive = retained;
            match run_nodes(&nodes) {
                Ok(()) => 0,
                Err(LaunchError::Memory(m)) => fault_code(m),
                Err(LaunchError::Earlier(code) | LaunchError::Node(code)) => code,
            }
        });
        return s
            .streams
            .submit_async(stream, device, job)
            .map(|_| ())
            .map_err(|_| LaunchError::Memory(MemError::Invalid));
    }
    if let Ok(code) = s.streams.synchronize(stream)
        && code != 0
    {
        return Err(LaunchError::Earlier(code));
    }
    run_nodes(&exec.nodes)
}

fn run_nodes(nodes: &[Node]) -> Result<(), LaunchError> {
    let s = sim();
    for node in nodes.iter() {
        match node {
            Node::Copy { dst, src, n, kind } => s.copy_now(*dst, *src, *n, *kind).map_err(LaunchError::Memory)?,
            Node::Memset { dst, value, n } => s.memset(*dst, *value, *n).map_err(LaunchError::Memory)?,
            Node::Host { f, data } => {
                // SAFETY: a host function recorded during capture, with its own argument.
                let f: HostFn = unsafe { std::mem::transmute(*f) };
                unsafe { f(*data as *mut libc::c_void) };
            }
            Node::Callback { f, stream, data } => {
                // SAFETY: a stream callback recorded during capture.
                let f: StreamCallback = unsafe { std::mem::transmute(*f) };
                unsafe { f(*stream as *mut libc::c_void, 0, *data as *mut libc::c_void) };
            }
            Node::EventRecord { event } => event.complete_now(),
            Node::Collective(run) => match run() {
                0 => {}
                code => return Err(LaunchError::Node(code)),
            },
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    unsafe extern "C" fn count_destroy(counter: *mut libc::c_void) {
        // SAFETY: the tests pass a pointer to a live AtomicUsize.
        unsafe { &*(counter as *const AtomicUsize) }.fetch_add(1, Ordering::SeqCst);
    }

    /// cudaUserObjectRelease: the destructor runs once, when the last reference goes, however
    /// the releases race; releases past zero do nothing.
    #[test]
    fn a_user_object_is_destroyed_exactly_once_when_releases_race() {
        for _ in 0..200 {
            let destroyed = Box::leak(Box::new(AtomicUsize::new(0)));
            let obj = UserObject::new(destroyed as *const AtomicUsize as usize, count_destroy as *const () as usize, 4);
            let threads: Vec<_> = (0..4)
                .map(|_| {
                    let obj = Arc::clone(&obj);
                    std::thread::spawn(move || obj.release(1))
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            wait_for(|| destroyed.load(Ordering::SeqCst) >= 1);
            obj.release(1);
            // Destructors run in order on one thread: a second one would have run by the time
            // this marker's has.
            let marker = Box::leak(Box::new(AtomicUsize::new(0)));
            UserObject::new(marker as *const AtomicUsize as usize, count_destroy as *const () as usize, 1).release(1);
            wait_for(|| marker.load(Ordering::SeqCst) == 1);
            assert_eq!(destroyed.load(Ordering::SeqCst), 1, "a release after the last must not destroy again");
        }
    }

    fn wait_for(done: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "a destructor never ran");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    static HELD: Mutex<()> = Mutex::new(());

    unsafe extern "C" fn destroy_under_lock(counter: *mut libc::c_void) {
        let _held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the test passes a pointer to a live AtomicUsize.
        unsafe { &*(counter as *const AtomicUsize) }.fetch_add(1, Ordering::SeqCst);
    }

    /// CUDA runs destructors on an internal thread, so a caller may drop the last reference while
    /// holding a lock its destructor takes (PyTorch's NCCL process group does); run in the
    /// releasing thread, this test deadlocks.
    #[test]
    fn a_destructor_runs_outside_the_thread_that_releases_the_object() {
        let destroyed = Box::leak(Box::new(AtomicUsize::new(0)));
        let obj =
            UserObject::new(destroyed as *const AtomicUsize as usize, destroy_under_lock as *const () as usize, 1);
        {
            let _held = HELD.lock().unwrap();
            obj.release(1);
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert_eq!(destroyed.load(Ordering::SeqCst), 0, "the destructor ran while its lock was held");
        }
        wait_for(|| destroyed.load(Ordering::SeqCst) == 1);
    }
}
