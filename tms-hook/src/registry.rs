//! What the hook tracks: address → allocation. Changed only by the saver.

use crate::device::{PhysHandle, Vendor};
use crate::region::TagId;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Physical memory mapped with access at the address.
    Active,
    /// Address reserved; physical memory released (or, after a failed release, still held in
    /// `handle` but unmapped). Contents live in `backup` when `backup_valid`.
    Paused,
    /// Being paused, resumed or freed by one thread; others wait for it to settle.
    Busy,
}

/// A pinned host buffer (the vendor's page-locked allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostBuf {
    pub ptr: usize,
    pub len: usize,
}

#[derive(Debug, Clone)]
pub struct Allocation {
    /// Bytes the application asked for.
    pub size: usize,
    /// Bytes reserved and mapped (size rounded to the driver's granularity).
    pub rounded: usize,
    pub device: i32,
    pub vendor: Vendor,
    pub tag: TagId,
    pub backup_enabled: bool,
    pub state: State,
    pub handle: Option<PhysHandle>,
    pub backup: Option<HostBuf>,
    /// The backup holds the allocation's contents (it was paused with backup).
    pub backup_valid: bool,
    /// The application freed it but a driver call failed half-way; freeing again finishes the job,
    /// and pause/resume leave it alone.
    pub doomed: bool,
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
        // Budget: 512 bytes per tracked allocation, B-tree overhead included (< 2x the entry).
        let entry = std::mem::size_of::<u64>() + std::mem::size_of::<Allocation>();
        assert!(entry * 2 <= 512, "entry is {entry} bytes");
    }
}
