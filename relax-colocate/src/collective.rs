//! One communicator of the vendor's collective library, loaded at run time (no CUDA or CANN at
//! build time): NCCL on the CUDA API, HCCL on ACL. Rank 0 makes the id (the library's bootstrap
//! root lives in the process that makes it, so the id cannot come from anywhere else), every rank
//! joins with it, and broadcasts run on a stream of the communicator's own. Shared by the bench's
//! collective row and the runner's broadcast weight transport.
//!
//! The device must be set on the calling thread before anything here (cudaSetDevice,
//! aclrtSetDevice): both libraries bind a communicator to the thread's device.

use crate::runtime::{AclStreams, Hccl, HcclRootInfo, Nccl, NcclMemStats, NcclUniqueId, Streams, load_hccl, load_nccl};
use crate::vendor::ApiKind;
use libc::c_void;
use std::ffi::CStr;

/// ncclUint8 and HCCL_DATA_TYPE_UINT8: every count here is in bytes.
const NCCL_UINT8: i32 = 1;
const HCCL_UINT8: i32 = 7;
/// ncclTimeout and HCCL_E_TIMEOUT: a rank did not come within the connect timeout.
const NCCL_TIMEOUT: i32 = 8;
const HCCL_E_TIMEOUT: i32 = 9;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Library {
    Nccl,
    Hccl,
}

impl Library {
    /// The library of a device API: NCCL on CUDA, HCCL on Ascend's.
    pub fn of(api: ApiKind) -> Library {
        match api {
            ApiKind::Cuda => Library::Nccl,
            ApiKind::Acl => Library::Hccl,
        }
    }

    pub fn parse(name: &str) -> Option<Library> {
        match name {
            "nccl" => Some(Library::Nccl),
            "hccl" => Some(Library::Hccl),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Library::Nccl => "nccl",
            Library::Hccl => "hccl",
        }
    }

    /// What the library's id is called in its API.
    fn id_bytes(self) -> usize {
        match self {
            Library::Nccl => 128,
            Library::Hccl => 4108,
        }
    }
}

/// A failed call: what returned what, and whether it was a rank that never came (the caller
/// names that rank rather than the one that waited for it).
#[derive(Debug)]
pub struct CollError {
    pub timed_out: bool,
    pub message: String,
}

impl From<CollError> for String {
    fn from(e: CollError) -> String {
        e.message
    }
}

fn plain(message: String) -> CollError {
    CollError { timed_out: false, message }
}

enum Lib {
    Nccl(Nccl, Streams),
    Hccl(Hccl, AclStreams),
}

impl Lib {
    fn load(library: Library) -> Result<Lib, CollError> {
        let lib = match library {
            Library::Nccl => {
                load_nccl().map_err(plain)?;
                Lib::Nccl(Nccl::load().map_err(plain)?, Streams::load().map_err(plain)?)
            }
            Library::Hccl => {
                load_hccl().map_err(plain)?;
                Lib::Hccl(Hccl::load().map_err(plain)?, AclStreams::load().map_err(plain)?)
            }
        };
        Ok(lib)
    }

    /// `rc` of the library's `what` as a result, with the library's own words for it.
    fn check(&self, what: &str, rc: i32) -> Result<(), CollError> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: both return a NUL-terminated string owned by the library (or null).
        let why = unsafe {
            match self {
                Lib::Nccl(n, _) => (n.get_last_error)(std::ptr::null_mut()),
                Lib::Hccl(h, _) => (h.get_error_string)(rc),
            }
        };
        let why = if why.is_null() {
            String::new()
        } else {
            // SAFETY: checked non-null, NUL-terminated.
            unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned()
        };
        let timeout = match self {
            Lib::Nccl(..) => NCCL_TIMEOUT,
            Lib::Hccl(..) => HCCL_E_TIMEOUT,
        };
        Err(CollError { timed_out: rc == timeout, message: format!("{what} returned {rc}: {why}") })
    }

    /// A stream call's result (the runtime's error codes, not the library's).
    fn stream_check(&self, what: &str, rc: i32) -> Result<(), CollError> {
        if rc == 0 { Ok(()) } else { Err(plain(format!("{what} returned {rc}"))) }
    }
}

/// Makes the id the ranks join with. The library's bootstrap root starts in this process, which
/// must therefore be rank 0's and stay up until every rank has joined.
pub fn unique_id(library: Library) -> Result<Vec<u8>, CollError> {
    let lib = Lib::load(library)?;
    match &lib {
        Lib::Nccl(n, _) => {
            let mut id = NcclUniqueId { internal: [0; 128] };
            // SAFETY: writes one ncclUniqueId.
            lib.check("ncclGetUniqueId", unsafe { (n.get_unique_id)(&mut id) })?;
            Ok(id.internal.to_vec())
        }
        Lib::Hccl(h, _) => {
            let mut info = Box::new(HcclRootInfo { internal: [0; 4108] });
            // SAFETY: writes one HcclRootInfo.
            lib.check("HcclGetRootInfo", unsafe { (h.get_root_info)(&mut *info) })?;
            Ok(info.internal.to_vec())
        }
    }
}

/// A communicator this process is rank `rank` of, and its stream.
pub struct Group {
    lib: Lib,
    comm: *mut c_void,
    stream: *mut c_void,
    pub rank: usize,
}

impl Group {
    /// Joins the communicator of `id` as `rank` of `world`; returns once every rank has (or the
    /// library's connect timeout has passed).
    pub fn join(library: Library, id: &[u8], rank: usize, world: usize) -> Result<Group, CollError> {
        if id.len() != library.id_bytes() {
            return Err(plain(format!("the {} id has {} bytes, not {}", library.name(), id.len(), library.id_bytes())));
        }
        if rank >= world {
            return Err(plain(format!("rank {rank} is out of range for {world} ranks")));
        }
        let lib = Lib::load(library)?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: the stream calls write one handle.
        match &lib {
            Lib::Nccl(_, s) => lib.stream_check("cudaStreamCreate", unsafe { (s.create)(&mut stream) })?,
            Lib::Hccl(_, s) => lib.stream_check("aclrtCreateStream", unsafe { (s.create)(&mut stream) })?,
        }
        let mut comm = std::ptr::null_mut();
        let joined = match &lib {
            Lib::Nccl(n, _) => {
                let id = NcclUniqueId { internal: id.try_into().expect("length checked") };
                // SAFETY: a valid out pointer and an id from rank 0's ncclGetUniqueId.
                lib.check("ncclCommInitRank", unsafe { (n.comm_init_rank)(&mut comm, world as i32, id, rank as i32) })
            }
            Lib::Hccl(h, _) => {
                let info = Box::new(HcclRootInfo { internal: id.try_into().expect("length checked") });
                // SAFETY: a valid out pointer and root info from rank 0's HcclGetRootInfo.
                let rc = unsafe { (h.comm_init_root_info)(world as u32, &*info, rank as u32, &mut comm) };
                lib.check("HcclCommInitRootInfo", rc)
            }
        };
        let group = Group { lib, comm, stream, rank };
        // A failed join still destroys the stream (Drop).
        joined.map(|()| group)
    }

    /// Queues a broadcast of `bytes` at device address `buf` from rank `root` on the group's
    /// stream: the root's bytes land in every other rank's `buf`.
    pub fn broadcast(&self, buf: u64, bytes: usize, root: usize) -> Result<(), CollError> {
        let p = buf as *mut c_void;
        // SAFETY: `buf` is a device buffer of at least `bytes` on every rank (the caller's
        // promise); sending and receiving in place is how both libraries broadcast.
        match &self.lib {
            Lib::Nccl(n, _) => self.lib.check("ncclBroadcast", unsafe {
                (n.broadcast)(p, p, bytes, NCCL_UINT8, root as i32, self.comm, self.stream)
            }),
            Lib::Hccl(h, _) => self.lib.check("HcclBroadcast", unsafe {
                (h.broadcast)(p, bytes as u64, HCCL_UINT8, root as u32, self.comm, self.stream)
            }),
        }
    }

    /// `ncclCommMemStats(comm, stat)` (0: the bytes a suspend releases, 2: the bytes it keeps);
    /// None for HCCL, or an NCCL older than 2.29.7 that has no such call.
    pub fn nccl_mem_stat(&self, stat: i32) -> Option<u64> {
        let Lib::Nccl(..) = &self.lib else { return None };
        let f = NcclMemStats::load().ok()?;
        let mut out = 0u64;
        // SAFETY: this group's live communicator and a valid out pointer.
        let rc = unsafe { (f.mem_stats)(self.comm, stat, &mut out) };
        (rc == 0).then_some(out)
    }

    /// Waits for everything queued on the group's stream.
    pub fn synchronize(&self) -> Result<(), CollError> {
        // SAFETY: the stream made in join.
        match &self.lib {
            Lib::Nccl(_, s) => self.lib.stream_check("cudaStreamSynchronize", unsafe { (s.synchronize)(self.stream) }),
            Lib::Hccl(_, s) => self.lib.stream_check("aclrtSynchronizeStream", unsafe { (s.synchronize)(self.stream) }),
        }
    }

    /// Destroys the communicator and the stream, saying what failed.
    pub fn destroy(mut self) -> Result<(), CollError> {
        self.release()
    }

    fn release(&mut self) -> Result<(), CollError> {
        let (comm, stream) = (std::mem::take(&mut self.comm), std::mem::take(&mut self.stream));
        let mut result = Ok(());
        // SAFETY: the handles made in join, taken so that they are released once; nothing is
        // queued on them once the caller synchronized (a broadcast in flight is the caller's bug).
        unsafe {
            if !comm.is_null() {
                result = match &self.lib {
                    Lib::Nccl(n, _) => self.lib.check("ncclCommDestroy", (n.comm_destroy)(comm)),
                    Lib::Hccl(h, _) => self.lib.check("HcclCommDestroy", (h.comm_destroy)(comm)),
                };
            }
            if !stream.is_null() {
                let rc = match &self.lib {
                    Lib::Nccl(_, s) => (s.destroy)(stream),
                    Lib::Hccl(_, s) => (s.destroy)(stream),
                };
                result = result.and(self.lib.stream_check("destroying the stream", rc));
            }
        }
        result
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// Bytes as lowercase hex, how an id crosses the worker protocol.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn from_hex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err(format!("an id of {} hex digits (an odd number)", s.len()));
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.as_bytes()
        .chunks(2)
        .map(|pair| match (digit(pair[0]), digit(pair[1])) {
            (Some(hi), Some(lo)) => Ok(hi << 4 | lo),
            _ => Err(format!("{:?} is not hex", String::from_utf8_lossy(pair))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_cross_as_hex_and_back() {
        let id: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&id)).unwrap(), id);
        assert!(from_hex("abc").is_err());
        assert!(from_hex("zz").is_err());
        assert_eq!(Library::of(ApiKind::Acl), Library::Hccl);
        assert_eq!(Library::parse(Library::of(ApiKind::Cuda).name()), Some(Library::Nccl));
    }
}
