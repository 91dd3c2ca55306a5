//! Only live bytes cross the bus. PyTorch's caching allocator keeps freed blocks inside its
//! segments, and each segment is one region allocation: a whole-allocation backup copies those
//! dead blocks too. `tms_mark_dead` names ranges whose contents need not survive the next pause;
//! that pause copies the rest (`live_ranges`) and records it in the allocation, and the resume,
//! restore verification and a rolled-back pause copy or check exactly those ranges.
//!
//! Marks are for the next pause of their allocation only: after a resume the allocator may hand
//! the block out again, so the pause consumes them (and a free drops them with the entry).

use super::{Error, Job, Saver, lock};
use crate::registry::State;
use std::ops::Range;

/// Live ranges are rounded out to this. PyTorch's blocks are multiples of 512 bytes at 512-byte
/// offsets, so its dead blocks survive the rounding whole; Ascend's asynchronous copies want
/// 64-byte aligned addresses, and a backup buffer and an allocation are aligned further than
/// 512, so every copy of a live range starts aligned on both sides.
pub const ALIGN: usize = 512;

/// A dead gap shorter than this between two live ranges is copied anyway: a copy more costs a
/// driver call and a stream slot, more than a few dozen KiB of bus time.
pub const MIN_GAP: usize = 64 << 10;

/// Adds `r` to `list` (sorted, disjoint, not touching), merging what it overlaps or touches.
pub fn insert(list: &mut Vec<Range<usize>>, r: Range<usize>) {
    if r.is_empty() {
        return;
    }
    let first = list.partition_point(|x| x.end < r.start);
    let last = list.partition_point(|x| x.start <= r.end);
    if first == last {
        list.insert(first, r);
        return;
    }
    let merged = list[first].start.min(r.start)..list[last - 1].end.max(r.end);
    list.splice(first..last, std::iter::once(merged));
}

/// The ranges of `size` bytes a backup copies when `dead` (sorted, disjoint) need not survive:
/// dead ranges shrunk to `ALIGN` (the ends of the allocation need no rounding), live ones
/// merged across gaps shorter than `MIN_GAP`.
pub fn live_ranges(size: usize, dead: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut live: Vec<Range<usize>> = Vec::new();
    let mut push = |r: Range<usize>| match live.last_mut() {
        Some(last) if r.start - last.end < MIN_GAP => last.end = r.end,
        _ => live.push(r),
    };
    let mut at = 0;
    for d in dead {
        let start = if d.start == 0 { 0 } else { d.start.next_multiple_of(ALIGN) };
        let end = if d.end >= size { size } else { d.end / ALIGN * ALIGN };
        if end <= start {
            continue;
        }
        if start > at {
            push(at..start);
        }
        at = at.max(end);
    }
    if at < size {
        push(at..size);
    }
    live
}

/// The parts of `live` (or of `0..size` when None) inside `within`.
pub fn clip(live: Option<&[Range<usize>]>, size: usize, within: Range<usize>) -> Vec<Range<usize>> {
    let whole = 0..size;
    let live = live.unwrap_or(std::slice::from_ref(&whole));
    live.iter().map(|r| r.start.max(within.start)..r.end.min(within.end)).filter(|r| !r.is_empty()).collect()
}

pub fn bytes(ranges: &[Range<usize>]) -> usize {
    ranges.iter().map(|r| r.len()).sum()
}

impl Saver {
    /// A pause consumes the marks of every allocation it takes: with a backup, they decide what
    /// it copies; without one, there is nothing to copy.
    pub(super) fn consume_marks(j: &mut Job) {
        let dead = std::mem::take(&mut j.a.dead);
        j.a.live = (j.a.backup_enabled && !dead.is_empty()).then(|| live_ranges(j.a.size, &dead));
    }

    /// Marks `ranges` (address, length) dead for the next pause of the allocations they lie in.
    /// All or nothing: a range outside every region allocation, or running past the end of the
    /// one it starts in (its requested size), changes nothing and is `Error::Invalid`. Ranges in
    /// allocations already paused are ignored (their backup is made; marks kept for a later
    /// pause could outlive the blocks they named). Zero-length ranges are ignored.
    pub fn mark_dead(&self, ranges: &[(u64, u64)]) -> Result<(), Error> {
        let mut reg = lock(&self.registry);
        let found = loop {
            let mut found = Vec::with_capacity(ranges.len());
            let mut busy = false;
            for &(addr, len) in ranges.iter().filter(|r| r.1 > 0) {
                let inside = reg.containing(addr).filter(|(start, a)| {
                    !a.doomed && addr.checked_add(len).is_some_and(|end| end <= start + a.size as u64)
                });
                let Some((start, a)) = inside else {
                    tracing::warn!(
                        "tms: mark dead: [{addr:#x}, +{len}) is not inside one region allocation; nothing marked"
                    );
                    return Err(Error::Invalid("a range is not inside one region allocation"));
                };
                busy |= a.state == State::Busy;
                found.push((start, (addr - start) as usize, len as usize));
            }
            if !busy {
                break found;
            }
            // Being paused, resumed or freed: its entry is written back when that ends.
            reg = self.settled.wait(reg).unwrap_or_else(|e| e.into_inner());
        };
        for (start, offset, len) in found {
            let Some(a) = reg.map.get_mut(&start) else { continue };
            if a.state == State::Active {
                insert(&mut a.dead, offset..offset + len);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
// Lists of one dead range are what the tests mean, not a range meant as a list of numbers.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    const K: usize = 1 << 10;
    const M: usize = 1 << 20;

    #[test]
    fn marks_merge_when_they_overlap_or_touch_and_stay_sorted() {
        let mut l = Vec::new();
        insert(&mut l, 10..20);
        insert(&mut l, 40..50);
        insert(&mut l, 0..5);
        assert_eq!(l, vec![0..5, 10..20, 40..50]);
        insert(&mut l, 20..30);
        assert_eq!(l, vec![0..5, 10..30, 40..50]);
        insert(&mut l, 4..45);
        assert_eq!(l, vec![0..50]);
        insert(&mut l, 60..60);
        assert_eq!(l, vec![0..50]);
    }

    #[test]
    fn live_ranges_are_the_complement_aligned_and_merged_across_small_gaps() {
        assert_eq!(live_ranges(8 * M, &[]), vec![0..8 * M]);
        assert_eq!(live_ranges(8 * M, &[2 * M..6 * M]), vec![0..2 * M, 6 * M..8 * M]);
        // Dead at either end: nothing copied there, no rounding needed.
        assert_eq!(live_ranges(8 * M + 3, &[0..M, 7 * M..8 * M + 3]), vec![M..7 * M]);
        // An unaligned dead range shrinks inward, so the live ranges grow outward to ALIGN.
        assert_eq!(live_ranges(8 * M, &[M + 1..2 * M - 1]), vec![0..M + ALIGN, 2 * M - ALIGN..8 * M]);
        // A gap under MIN_GAP is copied; one of MIN_GAP is not.
        assert_eq!(live_ranges(8 * M, &[M..M + MIN_GAP - ALIGN]), vec![0..8 * M]);
        assert_eq!(live_ranges(8 * M, &[M..M + MIN_GAP]), vec![0..M, M + MIN_GAP..8 * M]);
        // Everything dead: nothing to copy.
        assert_eq!(live_ranges(8 * M, &[0..8 * M]), Vec::<Range<usize>>::new());
        // A dead range too small to hold an aligned block is no gap at all.
        assert_eq!(live_ranges(4 * K, &[100..600]), vec![0..4 * K]);
    }

    #[test]
    fn clip_keeps_the_live_parts_of_a_piece() {
        let live = [0..M, 3 * M..5 * M];
        assert_eq!(clip(Some(&live), 6 * M, 2 * M..4 * M), vec![3 * M..4 * M]);
        assert_eq!(clip(Some(&live), 6 * M, M..3 * M), Vec::<Range<usize>>::new());
        assert_eq!(clip(None, 5 * M, 4 * M..6 * M), vec![4 * M..5 * M]);
        assert_eq!(bytes(&live), 3 * M);
    }
}
