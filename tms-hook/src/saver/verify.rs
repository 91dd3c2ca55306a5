//! Restores checked byte for byte (`TMS_VERIFY_RESTORE=1`, `tms_set_verify_restore`).
//!
//! A bad restore is otherwise silent: torch_memory_saver issue 71 (weights corrupted after
//! pause/resume with backup on H100, garbage output with HTTP 200 after a few cycles) and SGLang
//! issue 15246 could not tell a bad restore from a bad model. With verification on, a pause takes
//! a checksum of every backup it made, per `CHUNK` of the bytes it copied (ranges marked dead are
//! not copied and stay undefined, `live.rs`), once the copy is complete; the resume then
//! checks that the backup is still what the pause saved (host memory written meanwhile, a bad
//! disk file) and reads the device's bytes back after the copy, comparing each with the backup.
//! A copy that went wrong is made once more; what still differs is an error naming the
//! allocation, its tag and the first offset, and the memory stays mapped so the caller decides.
//! The cost is one more pass over the bytes on the host at pause and a device-to-host read of
//! every restored byte at resume: a debugging mode.

use super::{Error, Job, Report, Saver};
use crate::device::{Device, DeviceError, Stream};
use crate::registry::HostBuf;
use std::ops::Range;
use xxhash_rust::xxh3::xxh3_64;

/// Bytes per checksum (and per read-back copy): a backup that changed is located to this.
const CHUNK: usize = 1 << 20;

/// The checksums of the backup's `ranges`, one per `CHUNK` of each range in order: only the
/// bytes the pause copied (what it was told was dead is undefined after the resume).
pub(super) fn checksums(b: &HostBuf, ranges: &[Range<usize>]) -> Vec<u64> {
    chunks(b, ranges).map(|(_, c)| xxh3_64(c)).collect()
}

/// The backup's `ranges` in `CHUNK`s, each with its offset in the allocation.
fn chunks<'b>(b: &'b HostBuf, ranges: &'b [Range<usize>]) -> impl Iterator<Item = (usize, &'b [u8])> + 'b {
    let end = ranges.last().map_or(0, |r| r.end);
    let data = bytes(b, end);
    ranges.iter().flat_map(move |r| {
        let part = &data[r.start.min(data.len())..r.end.min(data.len())];
        part.chunks(CHUNK).enumerate().map(move |(i, c)| (r.start + i * CHUNK, c))
    })
}

fn bytes(b: &HostBuf, len: usize) -> &[u8] {
    // SAFETY: a backup buffer holds at least the allocation's `len` bytes while it is owned by
    // the allocation being worked on (Busy), which nothing else frees or writes through us.
    unsafe { std::slice::from_raw_parts(b.ptr as *const u8, len.min(b.len)) }
}

/// The offset of the first chunk of the backup whose checksum changed since the pause.
fn first_changed_chunk(b: &HostBuf, ranges: &[Range<usize>], sums: &[u64]) -> Option<usize> {
    chunks(b, ranges).zip(sums).find(|((_, c), s)| xxh3_64(c) != **s).map(|((offset, _), _)| offset)
}

impl Saver {
    /// Records the checksums of each backup the pause just completed (when verification is on).
    pub(super) fn take_checksums(&self, j: &mut Job) {
        j.a.backup_sums = match (self.verify_restore(), j.a.backup) {
            (true, Some(b)) => Some(checksums(&b, &j.a.backup_ranges())),
            _ => None,
        };
    }

    /// After the copies back: every resumed allocation that has checksums is checked against
    /// them and against its device bytes (see the module's summary). Groups are bound to their
    /// device as the resume bound them.
    pub(super) fn verify_restored(&self, jobs: &mut [Job], report: &mut Report) {
        for ((vendor, device), idx) in Self::groups(jobs) {
            let Some(dev) = self.loaded(vendor) else { continue };
            let checked: Vec<usize> =
                idx.into_iter().filter(|&i| jobs[i].ok && jobs[i].a.backup_sums.is_some()).collect();
            if checked.is_empty() {
                continue;
            }
            let previous = match dev.bind_thread(device) {
                Ok(p) => p,
                Err(e) => {
                    Self::note(report, Error::Driver(e));
                    continue;
                }
            };
            match self.streams_for(dev.as_ref(), device) {
                Ok(streams) => {
                    for i in checked {
                        if let Err(e) = verify_one(dev.as_ref(), streams[0], &mut jobs[i]) {
                            tracing::error!("tms: resume: {e}");
                            report.error.get_or_insert(e);
                        }
                    }
                }
                Err(e) => Self::note(report, e),
            }
            dev.restore_thread(previous);
        }
        for j in jobs.iter_mut() {
            j.a.backup_sums = None;
        }
    }
}

fn corrupt(j: &Job, offset: usize, what: &'static str) -> Error {
    Error::Corrupt {
        addr: j.addr,
        size: j.a.size as u64,
        tag: crate::region::tag_name(j.a.tag),
        offset: offset as u64,
        what,
    }
}

/// Checks one resumed allocation's live bytes; copies them from the backup once more where the
/// device's differ from an intact backup.
fn verify_one(dev: &dyn Device, stream: Stream, j: &mut Job) -> Result<(), Error> {
    let (Some(b), Some(sums)) = (j.a.backup, j.a.backup_sums.as_ref()) else { return Ok(()) };
    let ranges = j.a.backup_ranges();
    if let Some(offset) = first_changed_chunk(&b, &ranges, sums) {
        return Err(corrupt(
            j,
            offset,
            "the host backup changed while paused (restored as it now is), first changed 1 MiB chunk",
        ));
    }
    let Some(offset) = first_difference(dev, stream, j.addr, &b, &ranges).map_err(Error::Driver)? else {
        return Ok(());
    };
    tracing::warn!(
        "tms: resume: allocation {:#x} ({} bytes, tag {}) came back different from its backup at offset {offset}; \
         copying it again",
        j.addr,
        j.a.size,
        crate::region::tag_name(j.a.tag)
    );
    ranges
        .iter()
        // SAFETY: every range lies inside the backup's `size` bytes.
        .try_for_each(|r| {
            dev.copy_to_device_async(
                j.addr + r.start as u64,
                unsafe { (b.ptr as *const u8).add(r.start) },
                r.len(),
                stream,
            )
        })
        .and_then(|()| dev.stream_synchronize(stream))
        .map_err(Error::Driver)?;
    match first_difference(dev, stream, j.addr, &b, &ranges).map_err(Error::Driver)? {
        None => Ok(()),
        Some(offset) => {
            Err(corrupt(j, offset, "the device's bytes differ from the backup after two copies, first byte"))
        }
    }
}

/// Reads the allocation's `ranges` back and returns the offset of the first byte that differs
/// from the backup, if any.
fn first_difference(
    dev: &dyn Device,
    stream: Stream,
    addr: u64,
    b: &HostBuf,
    ranges: &[Range<usize>],
) -> Result<Option<usize>, DeviceError> {
    let scratch = dev.host_alloc(CHUNK)?;
    let mut found = Ok(None);
    for (offset, expected) in chunks(b, ranges) {
        let n = expected.len();
        if let Err(e) = dev
            .copy_to_host_async(scratch, addr + offset as u64, n, stream)
            .and_then(|()| dev.stream_synchronize(stream))
        {
            found = Err(e);
            break;
        }
        // SAFETY: the scratch buffer holds CHUNK >= n bytes, written by the copy above.
        let got = unsafe { std::slice::from_raw_parts(scratch as *const u8, n) };
        if let Some(k) = got.iter().zip(expected).position(|(x, y)| x != y) {
            found = Ok(Some(offset + k));
            break;
        }
    }
    dev.host_free(scratch);
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_byte_is_found_in_its_chunk_and_nowhere_else() {
        let mut data = vec![7u8; 3 * CHUNK + 100];
        let b = HostBuf { ptr: data.as_mut_ptr() as usize, len: data.len(), pageable: true };
        let whole = std::iter::once(0..data.len()).collect::<Vec<_>>();
        let sums = checksums(&b, &whole);
        assert_eq!(sums.len(), 4);
        assert_eq!(first_changed_chunk(&b, &whole, &sums), None);
        data[2 * CHUNK + 5] ^= 1;
        assert_eq!(first_changed_chunk(&b, &whole, &sums), Some(2 * CHUNK));
        data[2 * CHUNK + 5] ^= 1;
        data[3 * CHUNK + 99] = 0;
        assert_eq!(first_changed_chunk(&b, &whole, &sums), Some(3 * CHUNK));
    }

    #[test]
    fn only_the_live_ranges_are_checked() {
        // Bytes a pause was told were dead are not copied: they may change without it being
        // corruption, and a change in a live range is found at its own offset.
        let mut data = vec![7u8; 4 * CHUNK];
        let b = HostBuf { ptr: data.as_mut_ptr() as usize, len: data.len(), pageable: true };
        let live = [0..CHUNK / 2, 3 * CHUNK..3 * CHUNK + 100];
        let sums = checksums(&b, &live);
        assert_eq!(sums.len(), 2);
        data[CHUNK] ^= 1;
        data[4 * CHUNK - 1] ^= 1;
        assert_eq!(first_changed_chunk(&b, &live, &sums), None);
        data[3 * CHUNK + 99] ^= 1;
        assert_eq!(first_changed_chunk(&b, &live, &sums), Some(3 * CHUNK));
    }
}
