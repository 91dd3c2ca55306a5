//! Moving contents between device memory and pinned host buffers at bus speed: large allocations
//! are split into chunks, and chunks of all allocations of one pause or resume are spread over
//! several streams, so copies overlap each other (and the driver's own latency) instead of
//! running one synchronous copy per allocation.

use crate::device::{DevResult, Device, Stream};

#[derive(Debug, Clone, Copy)]
pub struct CopyJob {
    pub device_addr: u64,
    pub host: *mut u8,
    pub len: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    ToHost,
    ToDevice,
}

/// Queues every chunk of `jobs` round-robin on `streams`, then waits for all of them. Returns the
/// first error; every stream is synchronized either way so no copy is left in flight.
pub fn transfer(
    device: &dyn Device,
    streams: &[Stream],
    jobs: &[CopyJob],
    dir: Direction,
    chunk: usize,
) -> DevResult<()> {
    assert!(!streams.is_empty());
    let chunk = chunk.max(1 << 20);
    let mut first_error = None;
    let mut next = 0usize;
    'outer: for job in jobs {
        let mut offset = 0usize;
        while offset < job.len {
            let len = chunk.min(job.len - offset);
            let stream = streams[next % streams.len()];
            next += 1;
            // SAFETY: `host` points to a buffer of at least `job.len` bytes.
            let host = unsafe { job.host.add(offset) };
            let dev = job.device_addr + offset as u64;
            let r = match dir {
                Direction::ToHost => device.copy_to_host_async(host, dev, len, stream),
                Direction::ToDevice => device.copy_to_device_async(dev, host, len, stream),
            };
            if let Err(e) = r {
                first_error = Some(e);
                break 'outer;
            }
            offset += len;
        }
    }
    for &s in streams {
        if let Err(e) = device.stream_synchronize(s) {
            first_error.get_or_insert(e);
        }
    }
    if first_error.is_some() {
        // A failed synchronize does not mean the copies stopped: drain the device before the
        // caller unmaps anything, so no copy still in flight lands on (or reads from) memory
        // that is gone, and no stale error is left for the next operation.
        let _ = device.synchronize();
        for &s in streams {
            let _ = device.stream_synchronize(s);
        }
    }
    first_error.map_or(Ok(()), Err)
}
