//! Waiting without the Python GIL. The CPU compute layer (tms_sim_torch) queues PyTorch kernels as
//! host functions that run Python on a stream's worker thread, so they need the GIL. A thread that
//! holds the GIL and blocks in a simulator wait (a synchronize from C++ code that did not release
//! it) would wait for a queue whose next job waits for that thread: a deadlock a GPU cannot have,
//! as its kernels need no GIL. So every wait for queued work lets go of the GIL while it blocks,
//! as a C extension does around blocking code (`Py_BEGIN_ALLOW_THREADS`, CPython C API,
//! "Releasing the GIL from extension code": `PyEval_SaveThread` releases the GIL the thread holds,
//! `PyEval_RestoreThread` takes it back; `PyGILState_Check` tells whether the thread holds it).
//!
//! Only a process whose streams run Python does this (`python_runs_on_streams`, which the layer
//! calls when it first queues kernels): elsewhere a caller that kept the GIL around a wait keeps
//! it, whatever its reasons, as on a GPU.
//!
//! Python is found at run time (`dlsym(RTLD_DEFAULT)`): nothing is linked, and a process without
//! Python, or whose interpreter is not initialised (`Py_IsInitialized`, false from the start of
//! finalization on), waits exactly as before.

use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

static PYTHON_ON_STREAMS: AtomicBool = AtomicBool::new(false);

/// From now on this process's streams may run Python (kernels the CPU layer queued): waits let
/// go of the GIL. For the rest of the process: work queued before a switch back still needs it.
pub fn python_runs_on_streams() {
    PYTHON_ON_STREAMS.store(true, Ordering::Relaxed);
}

struct Python {
    is_initialized: unsafe extern "C" fn() -> i32,
    gil_check: unsafe extern "C" fn() -> i32,
    save_thread: unsafe extern "C" fn() -> *mut c_void,
    restore_thread: unsafe extern "C" fn(*mut c_void),
}

fn python() -> Option<&'static Python> {
    static PY: OnceLock<Option<Python>> = OnceLock::new();
    PY.get_or_init(|| {
        let find = |name: &std::ffi::CStr| {
            // SAFETY: dlsym with a valid NUL-terminated name; RTLD_DEFAULT searches the loaded objects.
            let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
            (!p.is_null()).then_some(p)
        };
        let (a, b, c, d) = (
            find(c"Py_IsInitialized")?,
            find(c"PyGILState_Check")?,
            find(c"PyEval_SaveThread")?,
            find(c"PyEval_RestoreThread")?,
        );
        // SAFETY: the CPython C API's signatures of these four functions.
        unsafe {
            Some(Python {
                is_initialized: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> i32>(a),
                gil_check: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> i32>(b),
                save_thread: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> *mut c_void>(c),
                restore_thread: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_void)>(d),
            })
        }
    })
    .as_ref()
}

/// Runs `wait` (which must not touch Python) with the GIL released when the calling thread holds
/// it; takes it back afterwards. Callers hold no lock of their own across this call, so taking
/// the GIL back cannot wait on a thread that waits for them.
pub fn released<R>(wait: impl FnOnce() -> R) -> R {
    if !PYTHON_ON_STREAMS.load(Ordering::Relaxed) {
        return wait();
    }
    let saved = python().and_then(|py| {
        // SAFETY: both may be called from any thread at any time (CPython C API); SaveThread only
        // when this thread holds the GIL, as checked.
        unsafe { ((py.is_initialized)() != 0 && (py.gil_check)() == 1).then(|| (py, (py.save_thread)())) }
    });
    let r = wait();
    if let Some((py, state)) = saved {
        // SAFETY: the thread state SaveThread returned on this thread, restored once.
        unsafe { (py.restore_thread)(state) };
    }
    r
}
