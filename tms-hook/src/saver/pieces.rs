//! The physical pieces behind an allocation and the host buffers holding its contents.

use super::Job;
use crate::backup::CopyJob;
use crate::device::{Device, DeviceError};
use crate::registry::{Allocation, HostBuf, Piece};

/// Gives the allocation a host buffer of its backend big enough for its contents (kept from an
/// earlier pause when it is).
pub(super) fn ensure_backup_buffer(dev: &dyn Device, a: &mut Allocation) -> Result<(), DeviceError> {
    let pageable = a.pageable_backup;
    if a.backup.is_none_or(|b| b.len < a.size || b.pageable != pageable) {
        if let Some(old) = a.backup.take() {
            free_host_buf(dev, old);
        }
        let len = a.size.max(1);
        let ptr = if pageable {
            map_pageable(len).ok_or(DeviceError { op: "mmap", code: dev.oom_code() })?
        } else {
            dev.host_alloc(len)?
        };
        a.backup = Some(HostBuf { ptr: ptr as usize, len, pageable });
    }
    Ok(())
}

/// Anonymous pageable memory for the "mmap" backend: the kernel may reclaim or swap it, and
/// `munmap` returns it to the system at once.
pub(super) fn map_pageable(len: usize) -> Option<*mut u8> {
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p.cast())
}

pub(super) fn free_host_buf(dev: &dyn Device, b: HostBuf) {
    if b.pageable {
        // SAFETY: a mapping of exactly this length made by map_pageable and no longer used.
        unsafe { libc::munmap(b.ptr as *mut libc::c_void, b.len) };
    } else {
        dev.host_free(b.ptr as *mut u8);
    }
}

/// Bytes of physical memory a paused allocation needs to be resumed (pieces that kept their
/// memory need none).
pub(super) fn missing_bytes(a: &Allocation) -> usize {
    (0..a.pieces.len()).filter(|&p| a.pieces[p].handle.is_none()).map(|p| a.piece_range(p).1).sum()
}

/// The copies that save or restore the data of piece `p` of a job: its live ranges (all of its
/// data unless the pause was told of dead ones), none where it holds no live data.
pub(super) fn piece_copies(j: &Job, p: usize) -> Vec<CopyJob> {
    let Some(b) = j.a.backup else { return Vec::new() };
    j.a.piece_live(p)
        .into_iter()
        .map(|r| {
            // SAFETY: the backup holds `size` bytes and every live range ends at or before `size`.
            let host = unsafe { (b.ptr as *mut u8).add(r.start) };
            CopyJob { device_addr: j.addr + r.start as u64, host, len: r.len() }
        })
        .collect()
}

/// Maps piece `i` of `a` at its place, creating physical memory unless the piece kept its handle.
/// Returns whether memory was created. On failure the piece is left unmapped, and memory created
/// here is released again.
pub(super) fn map_piece(
    dev: &dyn Device,
    device: i32,
    addr: u64,
    a: &mut Allocation,
    i: usize,
) -> Result<bool, DeviceError> {
    if a.pieces[i].mapped {
        return Ok(false);
    }
    let (offset, len) = a.piece_range(i);
    let at = addr + offset as u64;
    let (handle, created) = match a.pieces[i].handle {
        Some(h) => (h, false),
        None => (dev.create(device, len, a.mem_kind)?, true),
    };
    let undo = |e: DeviceError| {
        if created {
            let _ = dev.release(handle);
        }
        e
    };
    dev.map(at, len, handle).map_err(undo)?;
    if let Err(e) = dev.set_access(device, at, len) {
        let _ = dev.unmap(at, len);
        return Err(undo(e));
    }
    a.pieces[i] = Piece { handle: Some(handle), mapped: true };
    Ok(created)
}

/// Unmaps piece `i` if it is mapped; its handle (and contents) stay.
pub(super) fn unmap_piece(dev: &dyn Device, addr: u64, a: &mut Allocation, i: usize) -> Result<(), DeviceError> {
    if a.pieces[i].mapped {
        let (offset, len) = a.piece_range(i);
        dev.unmap(addr + offset as u64, len)?;
        a.pieces[i].mapped = false;
    }
    Ok(())
}

/// Releases the memory of an unmapped piece, if it still holds some.
pub(super) fn release_piece(dev: &dyn Device, a: &mut Allocation, i: usize) -> Result<(), DeviceError> {
    if !a.pieces[i].mapped
        && let Some(h) = a.pieces[i].handle
    {
        dev.release(h)?;
        a.pieces[i].handle = None;
    }
    Ok(())
}
