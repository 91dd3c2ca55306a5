//! Streams: each is a worker thread that runs queued work in order. Asynchronous copies really
//! overlap with the caller and with other streams, which is what the hook's backup pipeline is
//! measured on. Errors are sticky per stream and reported by the next synchronize.

use std::collections::HashMap;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex};

type Job = Box<dyn FnOnce() -> i32 + Send>;

struct Progress {
    submitted: u64,
    done: u64,
    /// First error code of a job since the last synchronize (0 if none).
    error: i32,
}

struct Stream {
    device: usize,
    tx: Mutex<Sender<Job>>,
    progress: Arc<(Mutex<Progress>, Condvar)>,
}

/// The stream handle names no live stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownStream;

#[derive(Default)]
pub struct Streams {
    live: Mutex<HashMap<usize, Arc<Stream>>>,
}

impl Streams {
    /// Creates a stream; returns its opaque handle (never 0, which is the default stream).
    pub fn create(&self, device: usize) -> Option<usize> {
        let (tx, rx) = channel::<Job>();
        let progress = Arc::new((Mutex::new(Progress { submitted: 0, done: 0, error: 0 }), Condvar::new()));
        let worker_progress = progress.clone();
        std::thread::Builder::new()
            .name("tms-sim-stream".into())
            .spawn(move || {
                for job in rx {
                    let code = job();
                    let (lock, cv) = &*worker_progress;
                    let mut p = lock.lock().unwrap_or_else(|e| e.into_inner());
                    p.done += 1;
                    if code != 0 && p.error == 0 {
                        p.error = code;
                    }
                    cv.notify_all();
                }
            })
            .ok()?;
        let stream = Arc::new(Stream { device, tx: Mutex::new(tx), progress });
        let handle = Arc::as_ptr(&stream) as usize;
        self.live.lock().unwrap_or_else(|e| e.into_inner()).insert(handle, stream);
        Some(handle)
    }

    pub fn exists(&self, handle: usize) -> bool {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&handle)
    }

    pub fn device_of(&self, handle: usize) -> Option<usize> {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).get(&handle).map(|s| s.device)
    }

    /// Queues `job` on `handle`, or runs it now on the default stream (0). Returns false for an
    /// unknown stream.
    pub fn submit(&self, handle: usize, job: Job) -> Result<i32, UnknownStream> {
        if handle == 0 {
            return Ok(job());
        }
        let stream = self.live.lock().unwrap_or_else(|e| e.into_inner()).get(&handle).cloned().ok_or(UnknownStream)?;
        stream.progress.0.lock().unwrap_or_else(|e| e.into_inner()).submitted += 1;
        let tx = stream.tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.send(job).map_err(|_| UnknownStream)?;
        Ok(0)
    }

    /// Waits for everything queued on `handle`; returns the first error of those jobs.
    pub fn synchronize(&self, handle: usize) -> Result<i32, UnknownStream> {
        if handle == 0 {
            return Ok(0);
        }
        let stream = self.live.lock().unwrap_or_else(|e| e.into_inner()).get(&handle).cloned().ok_or(UnknownStream)?;
        Ok(wait(&stream))
    }

    /// Waits for every stream (of `device`, or all when None).
    pub fn synchronize_all(&self, device: Option<usize>) -> i32 {
        let all: Vec<Arc<Stream>> = self.live.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        let mut first = 0;
        for s in all.iter().filter(|s| device.is_none_or(|d| d == s.device)) {
            let code = wait(s);
            if first == 0 {
                first = code;
            }
        }
        first
    }

    /// Destroys a stream after its queued work finishes (as the real APIs do).
    pub fn destroy(&self, handle: usize) -> bool {
        let stream = self.live.lock().unwrap_or_else(|e| e.into_inner()).remove(&handle);
        match stream {
            Some(s) => {
                wait(&s);
                true
            }
            None => false,
        }
    }
}

fn wait(stream: &Stream) -> i32 {
    let (lock, cv) = &*stream.progress;
    let mut p = lock.lock().unwrap_or_else(|e| e.into_inner());
    while p.done < p.submitted {
        p = cv.wait(p).unwrap_or_else(|e| e.into_inner());
    }
    std::mem::take(&mut p.error)
}
