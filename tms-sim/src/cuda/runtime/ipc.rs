//! CUDA IPC between processes of one simulated node: memory handles for `cudaMalloc` memory (how
//! SGLang, slime and torch.multiprocessing hand tensors to another process) and event handles.
//!
//! A memory handle names the exporter's device pool (a memfd), the range and the exporter's pid
//! and start time; the opener maps that range through `/proc/PID/fd/N`, so both processes see the
//! same bytes, and the memory stays charged to the exporter. As on a GPU, memory made with the
//! virtual-memory calls (cuMemCreate: every region allocation of the hook) has no IPC handle, a
//! handle cannot be opened in the process that made it, and a handle of a process that exited is
//! refused. Opened events are host-side only: they read as complete. So an event's handle is
//! handed out once the event's latest record has completed: the importer's wait on it (how
//! torch.multiprocessing orders a consumer after the producer's queued kernels) then holds.

use super::{INVALID_RESOURCE_HANDLE, INVALID_VALUE, MEMORY_ALLOCATION, SUCCESS, call, code_of, put};
use crate::core::sim::{ImportFailure, import_exported, sim};
use libc::{c_uint, c_void};

// `cudaIpcMemHandle_t` and `cudaIpcEventHandle_t`, declared once for every part of tms (tms-vendor).
use tms_vendor::cuda::IPC_MEM_LAZY_ENABLE_PEER_ACCESS as LAZY_ENABLE_PEER_ACCESS;
pub use tms_vendor::cuda::IpcHandle;

const MEM_MAGIC: &[u8; 8] = b"tmsipcm1";
const EVENT_MAGIC: &[u8; 8] = b"tmsipce1";
/// `cudaEventInterprocess` and `cudaEventDisableTiming`: an event must have both to be shared.
const INTERPROCESS: u32 = 0x4;
const DISABLE_TIMING: u32 = 0x2;

struct MemHandle {
    pid: u32,
    start_time: u64,
    fd: i32,
    offset: u64,
    len: u64,
    device: u32,
}

impl MemHandle {
    fn encode(&self) -> IpcHandle {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(MEM_MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.device.to_le_bytes());
        b[16..24].copy_from_slice(&self.start_time.to_le_bytes());
        b[24..28].copy_from_slice(&self.fd.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        IpcHandle { reserved: b }
    }

    fn decode(h: &IpcHandle) -> Option<MemHandle> {
        let b = &h.reserved;
        if &b[..8] != MEM_MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Some(MemHandle {
            pid: u32_at(8),
            device: u32_at(12),
            start_time: u64_at(16),
            fd: u32_at(24) as i32,
            offset: u64_at(32),
            len: u64_at(40),
        })
    }
}

pub unsafe extern "C" fn cuda_ipc_get_mem_handle(handle: *mut IpcHandle, ptr: *mut c_void) -> i32 {
    call("cudaIpcGetMemHandle", || {
        enter!();
        let mut mem = sim().mem.write().unwrap_or_else(|e| e.into_inner());
        let (_, len, device, offset) = match mem.ipc_export(ptr as usize) {
            Ok(found) => found,
            Err(e) => return code_of(e),
        };
        mem.retain_for_importers(offset);
        let pid = std::process::id();
        let h = MemHandle {
            pid,
            start_time: crate::core::node::process_start_time(pid).unwrap_or(0),
            fd: mem.pool_fd_for_ipc(),
            offset,
            len: len as u64,
            device: device as u32,
        };
        put(handle, h.encode())
    })
}

/// The handle is passed by value (64 bytes, in memory on the stack under the C ABI).
pub unsafe extern "C" fn cuda_ipc_open_mem_handle(ptr: *mut *mut c_void, handle: IpcHandle, flags: c_uint) -> i32 {
    call("cudaIpcOpenMemHandle", || {
        enter!();
        if ptr.is_null() || flags & !LAZY_ENABLE_PEER_ACCESS != 0 {
            return INVALID_VALUE;
        }
        let Some(h) = MemHandle::decode(&handle) else { return INVALID_RESOURCE_HANDLE };
        if h.pid == std::process::id() {
            // A handle cannot be opened by the process that exported it.
            return INVALID_RESOURCE_HANDLE;
        }
        let alive =
            crate::core::node::process_start_time(h.pid).is_some_and(|t| h.start_time == 0 || t == h.start_time);
        if !alive || (h.device as usize) >= sim().devices() {
            return INVALID_RESOURCE_HANDLE;
        }
        match import_exported(h.pid, h.fd, h.offset, h.len as usize, h.device as usize) {
            Ok(addr) => put(ptr, addr as *mut c_void),
            Err(ImportFailure::Unreachable) => INVALID_RESOURCE_HANDLE,
            Err(ImportFailure::Map) => MEMORY_ALLOCATION,
        }
    })
}

pub unsafe extern "C" fn cuda_ipc_close_mem_handle(ptr: *mut c_void) -> i32 {
    call("cudaIpcCloseMemHandle", || {
        enter!();
        // Work queued on streams may still read the memory.
        sim().synchronize(None);
        match sim().ipc_close(ptr as usize) {
            Ok(()) => SUCCESS,
            Err(e) => code_of(e),
        }
    })
}

pub unsafe extern "C" fn cuda_ipc_get_event_handle(handle: *mut IpcHandle, event: *mut c_void) -> i32 {
    call("cudaIpcGetEventHandle", || {
        enter!();
        let Some(ev) = sim().streams.event(event as usize) else { return INVALID_RESOURCE_HANDLE };
        if ev.flags & (INTERPROCESS | DISABLE_TIMING) != INTERPROCESS | DISABLE_TIMING {
            return INVALID_RESOURCE_HANDLE;
        }
        ev.synchronize();
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(EVENT_MAGIC);
        b[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        b[16..24].copy_from_slice(&(event as u64).to_le_bytes());
        put(handle, IpcHandle { reserved: b })
    })
}

pub unsafe extern "C" fn cuda_ipc_open_event_handle(event: *mut *mut c_void, handle: IpcHandle) -> i32 {
    call("cudaIpcOpenEventHandle", || {
        enter!();
        if &handle.reserved[..8] != EVENT_MAGIC {
            return INVALID_RESOURCE_HANDLE;
        }
        if u32::from_le_bytes(handle.reserved[8..12].try_into().expect("4 bytes")) == std::process::id() {
            return INVALID_RESOURCE_HANDLE;
        }
        // Never recorded here, so it reads as complete: waits on it return at once.
        put(event, sim().streams.event_create(INTERPROCESS | DISABLE_TIMING) as *mut c_void)
    })
}
