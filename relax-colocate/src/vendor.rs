//! A vendor's device opened for the built-in workers (`run`'s worker and the bench's scenarios):
//! the runtime loaded into the global scope, its calls resolved where a preloaded hook wins
//! (runtime.rs), the calling thread's device chosen. The vendors' error numbers relax-colocate
//! reads are here, once.

use crate::runtime::{Acl, Runtime, load_acl, load_cuda};

/// cudaErrorMemoryAllocation (driver_types.h).
pub const CUDA_ERROR_MEMORY_ALLOCATION: i32 = 2;
/// aclInit's ACL_ERROR_REPEAT_INITIALIZE (acl_base.h): harmless, another library of the process
/// initialized ACL first.
pub const ACL_ERROR_REPEAT_INITIALIZE: i32 = 100_002;
/// ACL_ERROR_RT_MEMORY_ALLOCATION (acl_base.h): out of device memory.
pub const ACL_ERROR_RT_MEMORY_ALLOCATION: i32 = 207_001;

/// The vendor API a worker calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ApiKind {
    /// cudaMalloc/cudaFree and the cuMem* virtual-memory calls.
    Cuda,
    /// aclrtMalloc/aclrtFree and the aclrt* virtual-memory calls (Ascend CANN).
    Acl,
}

impl ApiKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ApiKind::Cuda => "cuda",
            ApiKind::Acl => "acl",
        }
    }

    pub fn parse(s: &str) -> Option<ApiKind> {
        match s {
            "cuda" => Some(ApiKind::Cuda),
            "acl" => Some(ApiKind::Acl),
            _ => None,
        }
    }
}

/// An opened device's runtime.
pub enum Opened {
    Cuda(Runtime),
    Acl(Acl),
}

impl Opened {
    pub fn kind(&self) -> ApiKind {
        match self {
            Opened::Cuda(_) => ApiKind::Cuda,
            Opened::Acl(_) => ApiKind::Acl,
        }
    }
}

/// The CUDA runtime, loaded, with no device chosen yet (a caller that must first count the
/// devices chooses with `set_cuda_device`).
pub fn cuda_runtime() -> Result<Runtime, String> {
    load_cuda()?;
    Runtime::load()
}

pub fn set_cuda_device(rt: &Runtime, index: i32) -> Result<(), String> {
    // SAFETY: plain runtime call.
    let rc = unsafe { (rt.set_device)(index) };
    if rc != 0 { Err(format!("cudaSetDevice({index}) returned {rc}")) } else { Ok(()) }
}

/// Device `index` of the CUDA runtime, current on the calling thread.
pub fn open_cuda(index: i32) -> Result<Runtime, String> {
    let rt = cuda_runtime()?;
    set_cuda_device(&rt, index)?;
    Ok(rt)
}

/// Device `index` of ACL, current on the calling thread: CANN requires a device set on the
/// thread before any allocation.
pub fn open_acl(index: i32) -> Result<Acl, String> {
    load_acl()?;
    let acl = Acl::load()?;
    // SAFETY: aclInit accepts NULL (no config file); then a device for this thread.
    unsafe {
        let rc = (acl.init)(std::ptr::null());
        if rc != 0 && rc != ACL_ERROR_REPEAT_INITIALIZE {
            return Err(format!("aclInit returned {rc}"));
        }
        let rc = (acl.set_device)(index);
        if rc != 0 {
            return Err(format!("aclrtSetDevice({index}) returned {rc}"));
        }
    }
    Ok(acl)
}

pub fn open(api: ApiKind, index: i32) -> Result<Opened, String> {
    Ok(match api {
        ApiKind::Cuda => Opened::Cuda(open_cuda(index)?),
        ApiKind::Acl => Opened::Acl(open_acl(index)?),
    })
}

/// Whether `rc` is the API's out-of-memory error.
pub fn out_of_memory(api: ApiKind, rc: i32) -> bool {
    match api {
        ApiKind::Cuda => rc == CUDA_ERROR_MEMORY_ALLOCATION,
        ApiKind::Acl => rc == ACL_ERROR_RT_MEMORY_ALLOCATION,
    }
}
