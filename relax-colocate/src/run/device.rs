//! Device memory as a worker sees it: the vendor runtime's malloc/free/memcpy, resolved through
//! `dlsym(RTLD_DEFAULT)` so the preloaded hook intercepts the allocations, and the tms region API
//! for tagging them.

use crate::runtime::{AclIpc, CudaIpc, CudaIpcHandle, Tms};
use crate::vendor::{self, ApiKind, Opened};
use std::ffi::CString;
use tms_vendor::cuda::IPC_MEM_LAZY_ENABLE_PEER_ACCESS;

const ACL_HBM_MEM: i32 = 1;

#[derive(Debug)]
pub enum DevError {
    OutOfMemory(String),
    Other(String),
}

impl std::fmt::Display for DevError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DevError::OutOfMemory(m) | DevError::Other(m) => f.write_str(m),
        }
    }
}

pub struct Device {
    api: Opened,
    tms: Tms,
}

impl Device {
    /// `api`: "cuda" or "acl".
    pub fn open(api: &str, index: i32) -> Result<Device, String> {
        let kind = ApiKind::parse(api).ok_or_else(|| format!("unknown device API {api:?} (cuda or acl)"))?;
        let api = vendor::open(kind, index)?;
        let tms = Tms::load().map_err(|_| {
            "the tms API is missing: run this worker with LD_PRELOAD=libtms_hook.so (relax-colocate run does)"
                .to_string()
        })?;
        Ok(Device { api, tms })
    }

    /// "cuda" or "acl", as `open` took it.
    pub fn api_name(&self) -> &'static str {
        self.api.kind().as_str()
    }

    fn fail(&self, what: &str, rc: i32) -> DevError {
        let oom = vendor::out_of_memory(self.api.kind(), rc);
        let msg = format!("{what} returned {rc}{}", tms_vendor::explain_code(matches!(self.api, Opened::Acl(_)), rc));
        if oom { DevError::OutOfMemory(format!("out of device memory: {msg}")) } else { DevError::Other(msg) }
    }

    /// Allocates inside a tms region with `tag`; `tag` None allocates outside any region.
    pub fn malloc(&self, bytes: u64, tag: Option<&str>, backup: bool) -> Result<u64, DevError> {
        let tag_c = CString::new(tag.unwrap_or("default")).expect("tags have no NUL");
        // SAFETY: tms region calls with valid arguments; they only set this thread's state.
        unsafe {
            (self.tms.set_tag)(tag_c.as_ptr());
            (self.tms.set_backup)(backup);
            (self.tms.set_region)(tag.is_some());
        }
        let mut p = std::ptr::null_mut();
        // SAFETY: the allocation functions write one pointer.
        let rc = unsafe {
            match &self.api {
                Opened::Cuda(rt) => (rt.malloc)(&mut p, bytes as usize),
                Opened::Acl(acl) => (acl.malloc)(&mut p, bytes as usize, 0),
            }
        };
        // SAFETY: as above.
        unsafe { (self.tms.set_region)(false) };
        if rc != 0 {
            let api = if matches!(self.api, Opened::Cuda(_)) { "cudaMalloc" } else { "aclrtMalloc" };
            // The size and tag in the message: the runner reads them back to draw the request.
            let mut request =
                crate::run::summary::FailedRequest { bytes, device_used: None, tag: tag.map(String::from) };
            let e = self.fail(&request.call(api), rc);
            return Err(match (e, self.mem_info()) {
                (DevError::OutOfMemory(m), Ok((free, total))) => {
                    request.device_used = Some(total.saturating_sub(free));
                    DevError::OutOfMemory(format!("{m}; {}", request.used_note(total)))
                }
                (e, _) => e,
            });
        }
        Ok(p as u64)
    }

    pub fn free(&self, ptr: u64) -> Result<(), DevError> {
        // SAFETY: a pointer this device returned.
        let rc = unsafe {
            match &self.api {
                Opened::Cuda(rt) => (rt.free)(ptr as *mut _),
                Opened::Acl(acl) => (acl.free)(ptr as *mut _),
            }
        };
        if rc != 0 { Err(self.fail("free", rc)) } else { Ok(()) }
    }

    /// kind: 1 host→device, 2 device→host, 3 device→device (the same numbers in both APIs).
    fn copy_raw(&self, dst: u64, src: u64, n: usize, kind: i32) -> Result<(), DevError> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the caller passes ranges that are valid for `n` bytes on the named sides.
        let rc = unsafe {
            match &self.api {
                Opened::Cuda(rt) => (rt.memcpy)(dst as *mut _, src as *const _, n, kind),
                Opened::Acl(acl) => (acl.memcpy)(dst as *mut _, n, src as *const _, n, kind),
            }
        };
        let what = if matches!(self.api, Opened::Cuda(_)) { "cudaMemcpy" } else { "aclrtMemcpy" };
        if rc != 0 { Err(self.fail(what, rc)) } else { Ok(()) }
    }

    pub fn write(&self, dst: u64, src: &[u8]) -> Result<(), DevError> {
        self.copy_raw(dst, src.as_ptr() as u64, src.len(), 1)
    }

    pub fn read(&self, dst: &mut [u8], src: u64) -> Result<(), DevError> {
        self.copy_raw(dst.as_mut_ptr() as u64, src, dst.len(), 2)
    }

    /// Device to device, complete when it returns. CUDA's cudaMemcpy does not wait for a
    /// device-to-device copy (CUDA Runtime API, "API synchronization behavior"); within one
    /// process stream order covers that, but a buffer another process writes next (IPC) or a
    /// reply that says the weights are in must not run ahead of the copy. aclrtMemcpy is
    /// synchronous.
    pub fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), DevError> {
        self.copy_raw(dst, src, n, 3)?;
        if let Opened::Cuda(rt) = &self.api {
            // SAFETY: no arguments.
            let rc = unsafe { (rt.device_synchronize)() };
            if rc != 0 {
                return Err(self.fail("cudaDeviceSynchronize", rc));
            }
        }
        Ok(())
    }

    /// (free, total) bytes of this device.
    pub fn mem_info(&self) -> Result<(u64, u64), DevError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two out-parameters.
        let rc = unsafe {
            match &self.api {
                Opened::Cuda(rt) => (rt.mem_get_info)(&mut free, &mut total),
                Opened::Acl(acl) => (acl.get_mem_info)(ACL_HBM_MEM, &mut free, &mut total),
            }
        };
        if rc != 0 { Err(self.fail("mem_get_info", rc)) } else { Ok((free as u64, total as u64)) }
    }

    pub fn write_f32(&self, dst: u64, v: &[f32]) -> Result<(), DevError> {
        // SAFETY: f32 has no padding; the byte view covers exactly the slice.
        self.write(dst, unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) })
    }

    pub fn read_f32(&self, dst: &mut [f32], src: u64) -> Result<(), DevError> {
        let n = std::mem::size_of_val(dst);
        // SAFETY: as above; every bit pattern is a valid f32.
        self.read(unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), n) }, src)
    }
}

/// CANN's key buffer: 64 characters and the NUL.
const ACL_IPC_KEY_LEN: usize = 65;

/// Device memory shared with another process of the node: the IPC weight transport. The
/// exporter's buffer must be plain memory (cudaMalloc / aclrtMalloc outside every region): the
/// vendors export no virtual-memory (region) allocation this way.
impl Device {
    fn ipc_symbols<T>(load: fn() -> Result<T, String>) -> Result<T, DevError> {
        load().map_err(|e| DevError::Other(format!("the runtime has no IPC entry point: {e}")))
    }

    /// The id the driver knows this process by, which an Ascend exporter must allow
    /// (aclrtDeviceGetBareTgid: in a container, the host's pid); CUDA has no whitelist.
    pub fn ipc_pid(&self) -> Result<i32, DevError> {
        match self.api {
            Opened::Cuda(_) => Ok(std::process::id() as i32),
            Opened::Acl(_) => {
                let ipc = Self::ipc_symbols(AclIpc::load)?;
                let mut pid = 0;
                // SAFETY: one out-parameter.
                let rc = unsafe { (ipc.bare_tgid)(&mut pid) };
                if rc != 0 { Err(self.fail("aclrtDeviceGetBareTgid", rc)) } else { Ok(pid) }
            }
        }
    }

    /// Exports `bytes` at `ptr` to the processes `importers` (ACL's whitelist); the handle's bytes.
    pub fn ipc_export(&self, ptr: u64, bytes: u64, importers: &[i32]) -> Result<Vec<u8>, DevError> {
        match self.api {
            Opened::Cuda(_) => {
                let ipc = Self::ipc_symbols(CudaIpc::load)?;
                let mut h = CudaIpcHandle { reserved: [0; tms_vendor::cuda::IPC_HANDLE_SIZE] };
                // SAFETY: a 64-byte out-parameter and a device pointer of ours.
                let rc = unsafe { (ipc.get_mem_handle)(&mut h, ptr as *mut _) };
                if rc != 0 { Err(self.fail("cudaIpcGetMemHandle", rc)) } else { Ok(h.reserved.to_vec()) }
            }
            Opened::Acl(_) => {
                let ipc = Self::ipc_symbols(AclIpc::load)?;
                let mut key = [0u8; ACL_IPC_KEY_LEN];
                // SAFETY: the key buffer is the documented 65 bytes; flag 0 turns the whitelist on.
                let rc =
                    unsafe { (ipc.export_key)(ptr as *mut _, bytes as usize, key.as_mut_ptr().cast(), key.len(), 0) };
                if rc != 0 {
                    return Err(self.fail("aclrtIpcMemGetExportKey", rc));
                }
                let mut pids = importers.to_vec();
                // SAFETY: a NUL-terminated key and `pids.len()` pids.
                let rc = unsafe { (ipc.set_import_pid)(key.as_ptr().cast(), pids.as_mut_ptr(), pids.len()) };
                if rc != 0 {
                    // SAFETY: the key just made.
                    unsafe { (ipc.close)(key.as_ptr().cast()) };
                    return Err(self.fail("aclrtIpcMemSetImportPid", rc));
                }
                Ok(key.iter().take_while(|b| **b != 0).copied().collect())
            }
        }
    }

    fn acl_key(handle: &[u8]) -> Result<CString, DevError> {
        CString::new(handle).map_err(|_| DevError::Other("an IPC key has a NUL byte".into()))
    }

    /// Opens another process's export: the pointer to its first byte.
    pub fn ipc_open(&self, handle: &[u8]) -> Result<u64, DevError> {
        let mut p = std::ptr::null_mut();
        let rc = match self.api {
            Opened::Cuda(_) => {
                let ipc = Self::ipc_symbols(CudaIpc::load)?;
                let bytes: [u8; 64] = handle
                    .try_into()
                    .map_err(|_| DevError::Other(format!("a CUDA IPC handle has 64 bytes, not {}", handle.len())))?;
                // SAFETY: one out-parameter, the handle by value.
                unsafe {
                    (ipc.open_mem_handle)(&mut p, CudaIpcHandle { reserved: bytes }, IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                }
            }
            Opened::Acl(_) => {
                let ipc = Self::ipc_symbols(AclIpc::load)?;
                let key = Self::acl_key(handle)?;
                // SAFETY: one out-parameter and a NUL-terminated key.
                unsafe { (ipc.import_by_key)(&mut p, key.as_ptr(), 0) }
            }
        };
        if rc != 0 { Err(self.fail("IPC open", rc)) } else { Ok(p as u64) }
    }

    /// Closes what `ipc_open` opened.
    pub fn ipc_close(&self, ptr: u64, handle: &[u8]) -> Result<(), DevError> {
        let rc = match self.api {
            // SAFETY: a pointer ipc_open returned.
            Opened::Cuda(_) => unsafe { (Self::ipc_symbols(CudaIpc::load)?.close_mem_handle)(ptr as *mut _) },
            // SAFETY: a NUL-terminated key.
            Opened::Acl(_) => unsafe { (Self::ipc_symbols(AclIpc::load)?.close)(Self::acl_key(handle)?.as_ptr()) },
        };
        if rc != 0 { Err(self.fail("IPC close", rc)) } else { Ok(()) }
    }

    /// Ends an export once every importer closed it (CANN asks the exporter to close its key
    /// last; a CUDA handle needs no close). The memory is the caller's to free.
    pub fn ipc_end_export(&self, handle: &[u8]) -> Result<(), DevError> {
        match self.api {
            Opened::Cuda(_) => Ok(()),
            Opened::Acl(_) => {
                // SAFETY: a NUL-terminated key.
                let rc = unsafe { (Self::ipc_symbols(AclIpc::load)?.close)(Self::acl_key(handle)?.as_ptr()) };
                if rc != 0 { Err(self.fail("aclrtIpcMemClose", rc)) } else { Ok(()) }
            }
        }
    }
}

/// A 64-bit content hash over bytes, four independent lanes so it runs near memory speed.
#[derive(Debug, Clone)]
pub struct Hasher {
    lanes: [u64; 4],
    len: u64,
}

impl Default for Hasher {
    fn default() -> Self {
        Hasher {
            lanes: [0x243F_6A88_85A3_08D3, 0x1319_8A2E_0370_7344, 0xA409_3822_299F_31D0, 0x082E_FA98_EC4E_6C89],
            len: 0,
        }
    }
}

impl Hasher {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;

    pub fn update(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(32);
        for c in &mut chunks {
            for (i, lane) in self.lanes.iter_mut().enumerate() {
                let w = u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
                *lane = (*lane ^ w).wrapping_mul(Self::K).rotate_left(29);
            }
        }
        for (i, b) in chunks.remainder().iter().enumerate() {
            self.lanes[i % 4] = (self.lanes[i % 4] ^ *b as u64).wrapping_mul(Self::K);
        }
        self.len += bytes.len() as u64;
    }

    pub fn hex(&self) -> String {
        let mut h = self.len.wrapping_mul(Self::K);
        for l in self.lanes {
            h = (h ^ l).wrapping_mul(Self::K).rotate_left(31);
        }
        format!("{h:016x}")
    }
}
