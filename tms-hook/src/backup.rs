//! Moving contents between device memory and pinned host buffers at bus speed while the saver
//! releases or creates physical memory on the calling thread.
//!
//! Work goes out in batches of about one chunk. Each stream carries at most one batch at a time,
//! so synchronizing a stream reports on exactly that batch: the saver retires the oldest batch
//! (releases its memory, or records its failure) while the other streams are still copying. No
//! events are needed, which keeps the driver surface the hook depends on small.

use crate::device::{DevResult, Device, DeviceError, Stream};
use std::collections::VecDeque;
use std::ops::Range;

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

/// A batch that left the window: the caller's unit indices it carried and how its copies ended.
pub type Finished = (Vec<usize>, DevResult<()>);

/// Splits `count` units into consecutive batches of at least `target` bytes (a unit larger than
/// that is a batch of its own), so that many small allocations share one synchronize.
pub fn batches(count: usize, target: usize, mut bytes_of: impl FnMut(usize) -> usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for u in 0..count {
        bytes += bytes_of(u);
        if bytes >= target {
            out.push(start..u + 1);
            start = u + 1;
            bytes = 0;
        }
    }
    if start < count {
        out.push(start..count);
    }
    out
}

pub struct Window<'a> {
    device: &'a dyn Device,
    streams: &'a [Stream],
    chunk: usize,
    /// Batches in flight, oldest first: (index into `streams`, units).
    in_flight: VecDeque<(usize, Vec<usize>)>,
    idle: Vec<usize>,
}

impl<'a> Window<'a> {
    pub fn new(device: &'a dyn Device, streams: &'a [Stream], chunk: usize) -> Window<'a> {
        assert!(!streams.is_empty());
        Window {
            device,
            streams,
            chunk: chunk.max(1 << 20),
            in_flight: VecDeque::new(),
            idle: (0..streams.len()).rev().collect(),
        }
    }

    /// Queues `copies` as one batch carrying `units`. When every stream is busy, the oldest batch
    /// is waited for first; each batch that leaves the window (that one, or this one if it cannot
    /// be queued completely) goes to `retire`.
    pub fn send(&mut self, units: Vec<usize>, copies: &[CopyJob], dir: Direction, mut retire: impl FnMut(Finished)) {
        if self.idle.is_empty()
            && let Some(done) = self.retire_oldest()
        {
            retire(done);
        }
        if let Err(done) = self.submit(units, copies, dir) {
            retire(done);
        }
    }

    /// Waits for every batch still in flight, oldest first, handing each to `retire`.
    pub fn drain(&mut self, mut retire: impl FnMut(Finished)) {
        while let Some(done) = self.retire_oldest() {
            retire(done);
        }
    }

    fn submit(&mut self, units: Vec<usize>, copies: &[CopyJob], dir: Direction) -> Result<(), Finished> {
        let slot = match self.idle.pop() {
            Some(s) => s,
            None => {
                let e = DeviceError { op: "tms: copy window full", code: self.device.invalid_code() };
                return Err((units, Err(e)));
            }
        };
        let stream = self.streams[slot];
        for job in copies {
            let mut offset = 0usize;
            while offset < job.len {
                let len = self.chunk.min(job.len - offset);
                // SAFETY: `host` points to a buffer of at least `job.len` bytes.
                let host = unsafe { job.host.add(offset) };
                let dev = job.device_addr + offset as u64;
                let queued = match dir {
                    Direction::ToHost => self.device.copy_to_host_async(host, dev, len, stream),
                    Direction::ToDevice => self.device.copy_to_device_async(dev, host, len, stream),
                };
                if let Err(e) = queued {
                    self.drain_after_error(stream);
                    self.idle.push(slot);
                    return Err((units, Err(e)));
                }
                offset += len;
            }
        }
        self.in_flight.push_back((slot, units));
        Ok(())
    }

    /// Waits for the oldest batch in flight and hands it back.
    fn retire_oldest(&mut self) -> Option<Finished> {
        let (slot, units) = self.in_flight.pop_front()?;
        let stream = self.streams[slot];
        let result = self.device.stream_synchronize(stream);
        if result.is_err() {
            self.drain_after_error(stream);
        }
        self.idle.push(slot);
        Some((units, result))
    }

    fn drain_after_error(&self, stream: Stream) {
        drain_after_error(self.device, stream);
    }
}

/// A failed synchronize does not mean the copies stopped: drain the device before the caller
/// unmaps anything, so that no copy still in flight lands on (or reads from) memory that is gone,
/// and no stale error is left on the stream for the next operation that uses it.
pub fn drain_after_error(device: &dyn Device, stream: Stream) {
    let _ = device.synchronize();
    let _ = device.stream_synchronize(stream);
}

impl Drop for Window<'_> {
    /// Nothing may stay in flight once the saver lets go of the memory it copies.
    fn drop(&mut self) {
        while self.retire_oldest().is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::batches;

    #[test]
    fn batches_group_small_units_and_isolate_large_ones() {
        let sizes = [2, 2, 2, 2, 10, 1, 1];
        let got = batches(sizes.len(), 4, |u| sizes[u]);
        assert_eq!(got, vec![0..2, 2..4, 4..5, 5..7]);
        assert!(batches(0, 4, |_| 1).is_empty());
    }
}
