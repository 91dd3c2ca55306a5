//! What the hook tracks: address → allocation. Changed only by the saver.

use crate::device::{PhysHandle, Vendor};
use crate::region::TagId;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Physical memory mapped with access at the address.
    Active,
    /// Address reserved; no piece mapped. A piece's physical memory is released, or, after a
    /// failed release (or a pause that had to stop half-way), still held and unmapped, with its
    /// contents in it. Contents of released pieces live in `backup` when `backup_valid`.
    Paused,
    /// Being paused, resumed or freed by one thread; others wait for it to settle.
    Busy,
}

/// A host buffer holding a backup: the vendor's page-locked allocation, or anonymous pageable
/// memory (`mmap`) for the "mmap" backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostBuf {
    pub ptr: usize,
    pub len: usize,
    pub pageable: bool,
}

/// One physical handle behind part of an allocation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Piece {
    /// None once released.
    pub handle: Option<PhysHandle>,
    pub mapped: bool,
}

#[derive(Debug, Clone)]
pub struct Allocation {
    /// Bytes the application asked for.
    pub size: usize,
    /// Bytes reserved and mapped (size rounded to the driver's granularity).
    pub rounded: usize,
    /// Bytes behind each physical handle (the last piece may be shorter). Large allocations are
    /// backed by several handles so that pause and resume can release or create one piece while
    /// another one's contents are on the bus.
    pub piece_len: usize,
    pub device: i32,
    pub vendor: Vendor,
    /// The physical memory kind its pieces are created with (again at every resume).
    pub mem_kind: crate::device::MemKind,
    pub tag: TagId,
    pub backup_enabled: bool,
    /// Backs up to pageable memory (the "mmap" backend), freed at resume instead of pooled.
    pub pageable_backup: bool,
    pub state: State,
    /// Active: every piece mapped; Paused: none mapped.
    pub pieces: Vec<Piece>,
    pub backup: Option<HostBuf>,
    /// The backup holds the contents of every piece whose memory was released (it was paused
    /// with backup).
    pub backup_valid: bool,
    /// Checksums of the backup, taken by a pause made with verification on
    /// (`TMS_VERIFY_RESTORE`) and checked by the next resume.
    pub backup_sums: Option<Vec<u64>>,
    /// Resumed while retention was on: the backup (the last pause's snapshot) is still handed
    /// out (`tms_get_cpu_backup_pointer`) until the next pause, as torch_memory_saver decides at
    /// resume time.
    pub backup_retained: bool,
    /// Made with disk backup: while paused, the contents live in `disk_file`, not in `backup`.
    pub disk: bool,
    pub disk_file: Option<std::path::PathBuf>,
    /// The application freed it but a driver call failed half-way; freeing again finishes the job,
    /// and pause/resume leave it alone.
    pub doomed: bool,
    /// Offsets the application marked dead for the next pause (`tms_mark_dead`): sorted,
    /// disjoint. That pause consumes them.
    pub dead: Vec<std::ops::Range<usize>>,
    /// What the backup holds: the ranges the last pause with backup copied (None: all of
    /// `size`). Everything else is undefined after the resume.
    pub live: Option<Vec<std::ops::Range<usize>>>,
}

impl Allocation {
    /// Offset and length of piece `i` in the reserved range.
    pub fn piece_range(&self, i: usize) -> (usize, usize) {
        let offset = i * self.piece_len;
        (offset, self.piece_len.min(self.rounded - offset))
    }

    /// Bytes of piece `i` that hold the application's data (nothing past `size` is copied).
    pub fn piece_data_len(&self, i: usize) -> usize {
        let (offset, len) = self.piece_range(i);
        self.size.saturating_sub(offset).min(len)
    }

    /// The ranges of piece `i` that its backup holds.
    pub fn piece_live(&self, i: usize) -> Vec<std::ops::Range<usize>> {
        let (offset, len) = self.piece_range(i);
        crate::saver::live::clip(self.live.as_deref(), self.size, offset..offset + len)
    }

    /// The ranges the backup holds, in order.
    pub fn backup_ranges(&self) -> Vec<std::ops::Range<usize>> {
        crate::saver::live::clip(self.live.as_deref(), self.size, 0..self.size)
    }

    pub fn all_mapped(&self) -> bool {
        self.pieces.iter().all(|p| p.mapped)
    }
}

#[derive(Debug, Default)]
pub struct Registry {
    pub map: BTreeMap<u64, Allocation>,
}

impl Registry {
    /// The allocation whose range contains `addr`.
    pub fn containing(&self, addr: u64) -> Option<(u64, &Allocation)> {
        let (&start, a) = self.map.range(..=addr).next_back()?;
        (addr < start + a.rounded as u64).then_some((start, a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_record_stays_small() {
        // Budget: 512 bytes per tracked allocation, B-tree overhead included (< 2x the entry),
        // plus the heap block of a one-piece list (allocator header included).
        let entry = std::mem::size_of::<u64>() + std::mem::size_of::<Allocation>();
        let one_piece = (std::mem::size_of::<Piece>() + 16).next_multiple_of(16);
        assert!(entry * 2 + one_piece <= 512, "entry is {entry} bytes, a piece {one_piece}");
    }

    #[test]
    fn pieces_cover_the_range_and_data_stops_at_size() {
        let a = Allocation {
            size: 5 << 20,
            rounded: 6 << 20,
            piece_len: 4 << 20,
            device: 0,
            vendor: Vendor::Cuda,
            mem_kind: 0,
            tag: 0,
            backup_enabled: true,
            pageable_backup: false,
            state: State::Active,
            pieces: vec![Piece::default(); 2],
            backup: None,
            backup_valid: false,
            backup_retained: false,
            backup_sums: None,
            disk: false,
            disk_file: None,
            doomed: false,
            dead: Vec::new(),
            live: None,
        };
        assert_eq!(a.piece_range(0), (0, 4 << 20));
        assert_eq!(a.piece_range(1), (4 << 20, 2 << 20));
        assert_eq!(a.piece_data_len(0), 4 << 20);
        assert_eq!(a.piece_data_len(1), 1 << 20);
    }
}
