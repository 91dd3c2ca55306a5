//! Streams and events. A stream is a worker thread that runs queued work in order, started on
//! its first job (PyTorch creates 128 streams per device at start-up and uses few). Asynchronous
//! copies really overlap with the caller and with other streams, which is what the hook's backup
//! pipeline is measured on. Errors are sticky per stream and reported by the next synchronize.
//! An event completes when the work queued before its record has run.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

pub type Job = Box<dyn FnOnce() -> i32 + Send>;

/// The two default streams a program can name. Their queued work runs on one queue per device
/// (see `Streams::legacy`); they differ in whom they synchronize with: the legacy stream with the
/// device's blocking streams, the per-thread stream with nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DefaultStream {
    Legacy,
    PerThread,
}

/// A stream as the core knows it. Each front end translates its API's stream handles (and the
/// values it reserves for default streams) into this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamId {
    Default(DefaultStream),
    /// A stream made by `Streams::create_with`, by the handle it returned.
    Created(usize),
}

impl StreamId {
    pub const LEGACY: StreamId = StreamId::Default(DefaultStream::Legacy);

    pub fn is_default(self) -> bool {
        matches!(self, StreamId::Default(_))
    }
}

/// Whether a created stream synchronizes with the legacy default stream (CUDA Driver API,
/// "Stream synchronization behavior").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    Blocking,
    NonBlocking,
}

struct Progress {
    submitted: u64,
    done: u64,
    /// First error code of a job since the last synchronize (0 if none).
    error: i32,
}

struct Stream {
    device: usize,
    priority: i32,
    kind: StreamKind,
    /// Started on the first job.
    tx: Mutex<Option<Sender<Job>>>,
    progress: Arc<(Mutex<Progress>, Condvar)>,
}

/// The stream handle names no live stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownStream;

#[derive(Default)]
struct EventState {
    /// Records made so far; 0: never recorded.
    recorded: u64,
    /// The latest record that has completed.
    completed: u64,
    /// When the latest completed record completed (ns, monotonic).
    at_ns: u64,
}

pub struct Event {
    pub flags: u32,
    state: Mutex<EventState>,
    cv: Condvar,
    capture: std::sync::atomic::AtomicU64,
}

impl Event {
    fn lock(&self) -> MutexGuard<'_, EventState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn complete(&self, generation: u64) {
        let mut st = self.lock();
        if generation > st.completed {
            st.completed = generation;
            st.at_ns = crate::core::timing::now_ns();
        }
        self.cv.notify_all();
    }

    /// A record made and completed at once (a graph's event node at replay).
    pub fn complete_now(&self) {
        let generation = {
            let mut st = self.lock();
            st.recorded += 1;
            st.recorded
        };
        self.complete(generation);
    }

    /// The capture the latest record was made in (0: none), so a stream that waits on it joins.
    pub fn capture(&self) -> u64 {
        self.capture.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn set_capture(&self, id: u64) {
        self.capture.store(id, std::sync::atomic::Ordering::Release);
    }

    /// Whether the latest record (if any) has completed.
    pub fn is_complete(&self) -> bool {
        let st = self.lock();
        st.completed >= st.recorded
    }

    /// Waits until record `generation` has completed.
    fn wait_for(&self, generation: u64) {
        block_until(&self.state, &self.cv, |st| st.completed >= generation);
    }

    /// Waits for the latest record.
    pub fn synchronize(&self) {
        let target = self.lock().recorded;
        self.wait_for(target);
    }

    /// Completion time of the latest record, if it was recorded and has completed.
    pub fn completed_at(&self) -> Option<u64> {
        let st = self.lock();
        (st.recorded > 0 && st.completed >= st.recorded).then_some(st.at_ns)
    }
}

#[derive(Default)]
pub struct Streams {
    live: Mutex<HashMap<usize, Arc<Stream>>>,
    events: Mutex<HashMap<usize, Arc<Event>>>,
    /// The default stream's queue per device, for the work that does not block the host on a
    /// GPU: collectives, event records and waits, host functions, copies that involve no
    /// pageable host memory, memsets (`submit_async`). What still runs in the caller (pageable
    /// copies, the synchronous APIs, the CPU layer's kernels) runs after this queue has drained,
    /// so the stream's order holds. PyTorch depends on the host going on: it issues synchronous
    /// collectives on its current stream, then records an event and polls it, and a collective
    /// that ran on the host would hang it whenever a peer is lost.
    legacy: Mutex<HashMap<usize, Arc<Stream>>>,
}

impl Streams {
    fn live(&self) -> MutexGuard<'_, HashMap<usize, Arc<Stream>>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self, handle: usize) -> Result<Arc<Stream>, UnknownStream> {
        self.live().get(&handle).cloned().ok_or(UnknownStream)
    }

    /// The created stream `id` names; None for a default stream.
    fn created(&self, id: StreamId) -> Option<Result<Arc<Stream>, UnknownStream>> {
        match id {
            StreamId::Default(_) => None,
            StreamId::Created(handle) => Some(self.get(handle)),
        }
    }

    /// Creates a stream; returns its opaque handle (never one of the default stream's names).
    pub fn create(&self, device: usize) -> Option<usize> {
        self.create_with(device, StreamKind::Blocking, 0)
    }

    pub fn create_with(&self, device: usize, kind: StreamKind, priority: i32) -> Option<usize> {
        let progress = Arc::new((Mutex::new(Progress { submitted: 0, done: 0, error: 0 }), Condvar::new()));
        let stream = Arc::new(Stream { device, priority, kind, tx: Mutex::new(None), progress });
        let handle = Arc::as_ptr(&stream) as usize;
        self.live().insert(handle, stream);
        Some(handle)
    }

    pub fn exists(&self, id: StreamId) -> bool {
        match id {
            StreamId::Default(_) => true,
            StreamId::Created(handle) => self.live().contains_key(&handle),
        }
    }

    pub fn device_of(&self, id: StreamId) -> Option<usize> {
        let StreamId::Created(handle) = id else { return None };
        self.live().get(&handle).map(|s| s.device)
    }

    /// (kind, priority) of a created stream.
    pub fn properties(&self, handle: usize) -> Result<(StreamKind, i32), UnknownStream> {
        let s = self.get(handle)?;
        Ok((s.kind, s.priority))
    }

    /// Queues `job` on `handle`, or runs it now on the default stream. Returns the job's code
    /// when it ran now, else 0.
    pub fn submit(&self, id: StreamId, job: Job) -> Result<i32, UnknownStream> {
        let Some(stream) = self.created(id) else {
            self.settle_for(id);
            return Ok(job());
        };
        let stream = stream?;
        let job = self.after_legacy(&stream, job);
        enqueue(&stream, job)
    }

    /// The other half of the legacy stream's rule: work on a blocking stream waits for what was
    /// queued on its device's legacy stream before it (CUDA Driver API, "Stream synchronization
    /// behavior"). Only work queued earlier is waited for, on both sides, so the two waits never
    /// form a cycle.
    fn after_legacy(&self, stream: &Stream, job: Job) -> Job {
        if stream.kind == StreamKind::NonBlocking {
            return job;
        }
        let Some(legacy) = self.legacy.lock().unwrap_or_else(|e| e.into_inner()).get(&stream.device).cloned() else {
            return job;
        };
        let target = {
            let p = legacy.progress.0.lock().unwrap_or_else(|e| e.into_inner());
            if p.done >= p.submitted {
                return job;
            }
            p.submitted
        };
        Box::new(move || {
            wait_until(&legacy, target);
            job()
        })
    }

    /// Before work of the default stream runs in the caller (a synchronous copy or memset, a
    /// pageable copy): what the stream follows has run, the blocking streams' queued work and the
    /// default stream's own queue. Their errors stay for their own synchronize.
    pub fn settle_for(&self, id: StreamId) {
        self.legacy_barrier(id);
        self.settle_default();
    }

    /// An action on the legacy default stream first waits for all work queued on the blocking
    /// streams of the device whose context is current on the calling thread (`context::current`);
    /// non-blocking streams (NCCL's, PyTorch's side streams, the hook's copy streams) are not
    /// waited for, as CUDA documents.
    fn legacy_barrier(&self, id: StreamId) {
        if id != StreamId::Default(DefaultStream::Legacy) {
            return;
        }
        let Some(device) = crate::core::context::current() else { return };
        let blocking: Vec<Arc<Stream>> =
            self.live().values().filter(|s| s.device == device && s.kind == StreamKind::Blocking).cloned().collect();
        for s in blocking {
            wait(&s);
        }
    }

    /// The default stream's queue of `device` (each device has its own legacy stream).
    fn legacy_queue(&self, device: usize) -> Arc<Stream> {
        let mut legacy = self.legacy.lock().unwrap_or_else(|e| e.into_inner());
        legacy
            .entry(device)
            .or_insert_with(|| {
                let progress = Arc::new((Mutex::new(Progress { submitted: 0, done: 0, error: 0 }), Condvar::new()));
                Arc::new(Stream { device, priority: 0, kind: StreamKind::Blocking, tx: Mutex::new(None), progress })
            })
            .clone()
    }

    fn legacy_queues(&self) -> Vec<Arc<Stream>> {
        self.legacy.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }

    /// Waits for the default stream's queued work on every device, leaving its errors for the
    /// next synchronize: what runs on the default stream at once (copies, memsets, the CPU
    /// layer's kernels) comes after what was queued there before.
    pub fn settle_default(&self) {
        for s in self.legacy_queues() {
            settle(&s, None);
        }
    }

    /// Waits for the default stream's queued work on every device; returns the first error.
    fn drain_legacy(&self) -> i32 {
        let mut first = 0;
        for s in self.legacy_queues() {
            let code = wait(&s);
            if first == 0 {
                first = code;
            }
        }
        first
    }

    /// Queues `job` without blocking the host, on the default stream too (see `legacy`): there,
    /// on `device`'s queue (the caller's API says which device the thread works on).
    pub fn submit_async(&self, id: StreamId, device: usize, job: Job) -> Result<i32, UnknownStream> {
        if !id.is_default() {
            return self.submit(id, job);
        }
        // The legacy stream's rule holds for queued work too: it starts after the work already
        // queued on the blocking streams of the caller's device (what legacy_barrier waits for).
        let before: Vec<(Arc<Stream>, u64)> = match crate::core::context::current() {
            Some(current) if id == StreamId::Default(DefaultStream::Legacy) => self
                .live()
                .values()
                .filter(|s| s.device == current && s.kind == StreamKind::Blocking)
                .map(|s| (s.clone(), s.progress.0.lock().unwrap_or_else(|e| e.into_inner()).submitted))
                .collect(),
            _ => Vec::new(),
        };
        let job: Job = if before.is_empty() {
            job
        } else {
            Box::new(move || {
                for (stream, target) in &before {
                    wait_until(stream, *target);
                }
                job()
            })
        };
        enqueue(&self.legacy_queue(device), job)
    }

    /// Waits for everything queued on `handle`; returns the first error of those jobs.
    pub fn synchronize(&self, id: StreamId) -> Result<i32, UnknownStream> {
        match self.created(id) {
            None => Ok(self.drain_legacy()),
            Some(stream) => Ok(wait(&*stream?)),
        }
    }

    /// Whether everything queued on `handle` has run.
    pub fn is_idle(&self, id: StreamId) -> Result<bool, UnknownStream> {
        let Some(s) = self.created(id) else {
            return Ok(self.legacy_queues().iter().all(|s| {
                let p = s.progress.0.lock().unwrap_or_else(|e| e.into_inner());
                p.done >= p.submitted
            }));
        };
        let s = s?;
        let p = s.progress.0.lock().unwrap_or_else(|e| e.into_inner());
        Ok(p.done >= p.submitted)
    }

    /// Waits for every stream (of `device`, or all when None).
    pub fn synchronize_all(&self, device: Option<usize>) -> i32 {
        let mut first = self.drain_legacy();
        let all: Vec<Arc<Stream>> = self.live().values().cloned().collect();
        for s in all.iter().filter(|s| device.is_none_or(|d| d == s.device)) {
            let code = wait(s);
            if first == 0 {
                first = code;
            }
        }
        first
    }

    /// Waits for every stream's queued work without taking the errors it left: the stream's
    /// own next synchronize still reports them.
    pub fn drain_all(&self) {
        let mut all: Vec<Arc<Stream>> = self.live().values().cloned().collect();
        all.extend(self.legacy_queues());
        for s in &all {
            settle(s, None);
        }
    }

    /// Destroys a stream after its queued work finishes (as the real APIs do).
    pub fn destroy(&self, handle: usize) -> bool {
        let stream = self.live().remove(&handle);
        match stream {
            Some(s) => {
                wait(&s);
                true
            }
            None => false,
        }
    }

    fn events(&self) -> MutexGuard<'_, HashMap<usize, Arc<Event>>> {
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn event_create(&self, flags: u32) -> usize {
        let event = Arc::new(Event {
            flags,
            state: Mutex::new(EventState::default()),
            cv: Condvar::new(),
            capture: std::sync::atomic::AtomicU64::new(0),
        });
        let handle = Arc::as_ptr(&event) as usize;
        self.events().insert(handle, event);
        handle
    }

    pub fn event(&self, handle: usize) -> Option<Arc<Event>> {
        self.events().get(&handle).cloned()
    }

    pub fn event_destroy(&self, handle: usize) -> bool {
        self.events().remove(&handle).is_some()
    }

    /// Records `event` on `stream`: it completes once the work queued there before now has run.
    /// `device`: whose default stream `stream` names when it is the default stream.
    pub fn event_record(&self, event: &Arc<Event>, stream: StreamId, device: usize) -> Result<(), UnknownStream> {
        let generation = {
            let mut st = event.lock();
            st.recorded += 1;
            st.recorded
        };
        let target = event.clone();
        self.submit_async(
            stream,
            device,
            Box::new(move || {
                target.complete(generation);
                0
            }),
        )
        .map(|_| ())
        .inspect_err(|_| {
            // Not queued: nothing will complete this record.
            event.complete(generation);
        })
    }

    /// Makes `stream` wait for the event's latest record (a no-op if it was never recorded);
    /// `device` as for `event_record`.
    pub fn wait_event(&self, stream: StreamId, event: &Arc<Event>, device: usize) -> Result<(), UnknownStream> {
        let generation = event.lock().recorded;
        if event.lock().completed >= generation {
            return if self.exists(stream) { Ok(()) } else { Err(UnknownStream) };
        }
        let target = event.clone();
        self.submit_async(
            stream,
            device,
            Box::new(move || {
                target.wait_for(generation);
                0
            }),
        )
        .map(|_| ())
    }
}

fn enqueue(stream: &Stream, job: Job) -> Result<i32, UnknownStream> {
    stream.progress.0.lock().unwrap_or_else(|e| e.into_inner()).submitted += 1;
    let mut tx = stream.tx.lock().unwrap_or_else(|e| e.into_inner());
    if tx.is_none() {
        *tx = Some(start_worker(stream.progress.clone()).ok_or(UnknownStream)?);
    }
    let sent = tx.as_ref().map(|t| t.send(job));
    match sent {
        Some(Ok(())) => Ok(0),
        _ => {
            stream.progress.0.lock().unwrap_or_else(|e| e.into_inner()).submitted -= 1;
            Err(UnknownStream)
        }
    }
}

thread_local! {
    /// Whether this thread is a stream's worker (its jobs must not wait for queues: they are one).
    static ON_WORKER: Cell<bool> = const { Cell::new(false) };
    /// The error a host function reported for the job it runs in (`fail_current_job`).
    static JOB_ERROR: Cell<i32> = const { Cell::new(0) };
    /// Whether the running job holds host views (`VIEWS`) until it ends.
    static JOB_VIEWS: Cell<bool> = const { Cell::new(false) };
}

/// Host views of device memory held by queued work: the CPU layer's kernels run on a stream's
/// worker and compute on `tms_sim_host_view`s without any lock of the simulator, so whatever takes
/// memory away (unmap, free, revoking access) first waits for the jobs that hold views, and jobs
/// take no new ones meanwhile. On a GPU a kernel still running on a range being unmapped faults;
/// here it completes first (a kernel that starts after the unmap gets no view: 700 on its stream),
/// where the process would otherwise fault on the view's bytes. Copies have their own lock.
pub static VIEWS: ViewGate = ViewGate { state: Mutex::new(GateState { readers: 0, closing: 0 }), cv: Condvar::new() };

pub struct ViewGate {
    state: Mutex<GateState>,
    cv: Condvar,
}

struct GateState {
    /// Jobs holding views.
    readers: usize,
    /// Threads taking memory away.
    closing: usize,
}

/// Memory may be taken away while this lives (`ViewGate::close`).
pub struct Closed(&'static ViewGate);

impl Drop for Closed {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.closing -= 1;
        self.0.cv.notify_all();
    }
}

impl ViewGate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A job on a stream's worker takes a host view: it holds the gate until it ends (a job that
    /// already holds it takes more views at once, so two takers cannot wait for each other).
    pub fn enter(&'static self) {
        if !on_worker() || JOB_VIEWS.with(|v| v.get()) {
            return;
        }
        let mut st = self.lock();
        while st.closing > 0 {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.readers += 1;
        JOB_VIEWS.with(|v| v.set(true));
    }

    fn leave_job(&self) {
        if JOB_VIEWS.with(|v| v.replace(false)) {
            let mut st = self.lock();
            st.readers -= 1;
            self.cv.notify_all();
        }
    }

    /// Waits until no job holds a view (letting go of the GIL, which those jobs need); none
    /// takes one until the result is dropped.
    pub fn close(&'static self) -> Closed {
        self.lock().closing += 1;
        block_until(&self.state, &self.cv, |st| st.readers == 0);
        Closed(self)
    }
}

/// Whether the calling thread runs a stream's queued work.
pub fn on_worker() -> bool {
    ON_WORKER.with(|w| w.get())
}

/// A host function running on a stream's worker reports that the work it stands for failed with
/// `code`: the stream's next synchronize returns it (the first error since the last one wins), as
/// a failed kernel's error is reported on a GPU. False when the caller is not a stream's worker.
pub fn fail_current_job(code: i32) -> bool {
    if !on_worker() || code == 0 {
        return false;
    }
    JOB_ERROR.with(|e| {
        if e.get() == 0 {
            e.set(code);
        }
    });
    true
}

fn start_worker(progress: Arc<(Mutex<Progress>, Condvar)>) -> Option<Sender<Job>> {
    let (tx, rx) = channel::<Job>();
    std::thread::Builder::new()
        .name("tms-sim-stream".into())
        .spawn(move || {
            ON_WORKER.with(|w| w.set(true));
            for job in rx {
                let code = job();
                VIEWS.leave_job();
                let code = if code != 0 { code } else { JOB_ERROR.with(|e| e.take()) };
                JOB_ERROR.with(|e| e.set(0));
                let (lock, cv) = &*progress;
                let mut p = lock.lock().unwrap_or_else(|e| e.into_inner());
                p.done += 1;
                if code != 0 && p.error == 0 {
                    p.error = code;
                }
                cv.notify_all();
            }
        })
        .ok()?;
    Some(tx)
}

/// Waits until `stream` has run its first `target` jobs (None: all it has been given), leaving
/// their errors to its own synchronize. A wait that blocks lets go of the Python GIL (see `gil`).
fn settle(stream: &Stream, target: Option<u64>) {
    let (lock, cv) = &*stream.progress;
    block_until(lock, cv, |p| p.done >= target.unwrap_or(p.submitted));
}

/// Blocks until `ready` holds for the state `lock` guards, woken by `cv`. Every wait of the
/// simulator for queued work goes through here: one that has to block lets go of the Python GIL
/// (see `gil`), one that does not touches nothing.
fn block_until<T>(lock: &Mutex<T>, cv: &Condvar, ready: impl Fn(&T) -> bool) {
    if ready(&lock.lock().unwrap_or_else(|e| e.into_inner())) {
        return;
    }
    crate::core::gil::released(|| {
        let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
        while !ready(&st) {
            st = cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    });
}

/// Waits until `stream` has run its first `target` jobs, leaving their errors to its own
/// synchronize.
fn wait_until(stream: &Stream, target: u64) {
    settle(stream, Some(target));
}

fn wait(stream: &Stream) -> i32 {
    settle(stream, None);
    std::mem::take(&mut stream.progress.0.lock().unwrap_or_else(|e| e.into_inner()).error)
}
