//! The vendor runtime as a hooked application sees it: `libcudart.so.12` is loaded, then every
//! function is resolved with `dlsym(RTLD_DEFAULT)`, so a preloaded libtms_hook.so wins exactly as
//! it does for PyTorch. The tms API is found the same way (present only when preloaded).

use libc::{c_char, c_int, c_void};
use std::ffi::CStr;

fn sym(name: &CStr) -> Result<usize, String> {
    // SAFETY: dlsym with a NUL-terminated name.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) } as usize;
    if p == 0 { Err(format!("{} not found", name.to_string_lossy())) } else { Ok(p) }
}

macro_rules! api {
    ($name:ident { $($field:ident : $sym:literal => fn($($arg:ty),*) -> $ret:ty;)* }) => {
        #[allow(clippy::type_complexity)]
        pub struct $name { $(pub $field: unsafe extern "C" fn($($arg),*) -> $ret,)* }
        impl $name {
            pub fn load() -> Result<$name, String> {
                // SAFETY: each symbol is resolved with its documented signature.
                unsafe { Ok($name { $($field: std::mem::transmute::<usize, unsafe extern "C" fn($($arg),*) -> $ret>(sym($sym)?),)* }) }
            }
        }
    };
}

api!(Runtime {
    malloc: c"cudaMalloc" => fn(*mut *mut c_void, usize) -> c_int;
    free: c"cudaFree" => fn(*mut c_void) -> c_int;
    memcpy: c"cudaMemcpy" => fn(*mut c_void, *const c_void, usize, c_int) -> c_int;
    memset: c"cudaMemset" => fn(*mut c_void, c_int, usize) -> c_int;
    malloc_host: c"cudaMallocHost" => fn(*mut *mut c_void, usize) -> c_int;
    free_host: c"cudaFreeHost" => fn(*mut c_void) -> c_int;
    set_device: c"cudaSetDevice" => fn(c_int) -> c_int;
    mem_get_info: c"cudaMemGetInfo" => fn(*mut usize, *mut usize) -> c_int;
    device_synchronize: c"cudaDeviceSynchronize" => fn() -> c_int;
});

pub use tms_vendor::cuda::IpcHandle as CudaIpcHandle;

// The IPC weight transport's calls (cuda_runtime_api.h), loaded only when it is used.
api!(CudaIpc {
    get_mem_handle: c"cudaIpcGetMemHandle" => fn(*mut CudaIpcHandle, *mut c_void) -> c_int;
    open_mem_handle: c"cudaIpcOpenMemHandle" => fn(*mut *mut c_void, CudaIpcHandle, u32) -> c_int;
    close_mem_handle: c"cudaIpcCloseMemHandle" => fn(*mut c_void) -> c_int;
});

// The same on Ascend (acl_rt.h, CANN "IPC memory sharing"): a 65-byte key, a pid whitelist.
api!(AclIpc {
    bare_tgid: c"aclrtDeviceGetBareTgid" => fn(*mut i32) -> c_int;
    export_key: c"aclrtIpcMemGetExportKey" => fn(*mut c_void, usize, *mut c_char, usize, u64) -> c_int;
    set_import_pid: c"aclrtIpcMemSetImportPid" => fn(*const c_char, *mut i32, usize) -> c_int;
    import_by_key: c"aclrtIpcMemImportByKey" => fn(*mut *mut c_void, *const c_char, u64) -> c_int;
    close: c"aclrtIpcMemClose" => fn(*const c_char) -> c_int;
});

// What a collective needs of the CUDA runtime beyond `Runtime`: streams (and the bench's device count).
api!(Streams {
    device_count: c"cudaGetDeviceCount" => fn(*mut c_int) -> c_int;
    create: c"cudaStreamCreate" => fn(*mut *mut c_void) -> c_int;
    synchronize: c"cudaStreamSynchronize" => fn(*mut c_void) -> c_int;
    destroy: c"cudaStreamDestroy" => fn(*mut c_void) -> c_int;
});

/// ncclUniqueId and HcclRootInfo, declared once for every part of tms (tms-vendor).
pub use tms_vendor::{hccl::RootInfo as HcclRootInfo, nccl::UniqueId as NcclUniqueId};

// NCCL's C ABI as nccl.h declares it (communicators are opaque pointers; ncclDataType_t and the
// results are ints).
api!(Nccl {
    get_unique_id: c"ncclGetUniqueId" => fn(*mut NcclUniqueId) -> c_int;
    comm_init_rank: c"ncclCommInitRank" => fn(*mut *mut c_void, c_int, NcclUniqueId, c_int) -> c_int;
    broadcast: c"ncclBroadcast" => fn(*const c_void, *mut c_void, usize, c_int, c_int, *mut c_void, *mut c_void) -> c_int;
    comm_destroy: c"ncclCommDestroy" => fn(*mut c_void) -> c_int;
    get_last_error: c"ncclGetLastError" => fn(*mut c_void) -> *const c_char;
});

// NCCL 2.29.7+'s communicator memory statistics (absent from older NCCL, so apart from `Nccl`).
api!(NcclMemStats {
    mem_stats: c"ncclCommMemStats" => fn(*mut c_void, c_int, *mut u64) -> c_int;
});

/// Loads NCCL into the global scope (after the CUDA runtime), as PyTorch and vLLM load it.
pub fn load_nccl() -> Result<(), String> {
    load_global(c"libnccl.so.2")
}

// HCCL's C ABI as hccl.h declares it (communicators are opaque pointers, HcclDataType and
// HcclResult are ints, counts are u64 and ranks u32), the calls vllm-ascend's communicator makes.
api!(Hccl {
    get_root_info: c"HcclGetRootInfo" => fn(*mut HcclRootInfo) -> c_int;
    comm_init_root_info: c"HcclCommInitRootInfo" => fn(u32, *const HcclRootInfo, u32, *mut *mut c_void) -> c_int;
    broadcast: c"HcclBroadcast" => fn(*mut c_void, u64, c_int, u32, *mut c_void, *mut c_void) -> c_int;
    comm_destroy: c"HcclCommDestroy" => fn(*mut c_void) -> c_int;
    get_error_string: c"HcclGetErrorString" => fn(c_int) -> *const c_char;
});

/// Loads HCCL into the global scope (after the ACL runtime), as vllm-ascend loads it.
pub fn load_hccl() -> Result<(), String> {
    load_global(c"libhccl.so")
}

// The ACL streams a collective runs on.
api!(AclStreams {
    create: c"aclrtCreateStream" => fn(*mut *mut c_void) -> c_int;
    synchronize: c"aclrtSynchronizeStream" => fn(*mut c_void) -> c_int;
    destroy: c"aclrtDestroyStream" => fn(*mut c_void) -> c_int;
});

fn load_global(lib: &CStr) -> Result<(), String> {
    // SAFETY: dlopen of a vendor library by soname.
    if unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null() {
        return Err(format!("{} cannot be loaded", lib.to_string_lossy()));
    }
    Ok(())
}

api!(Acl {
    init: c"aclInit" => fn(*const c_char) -> c_int;
    set_device: c"aclrtSetDevice" => fn(i32) -> c_int;
    malloc: c"aclrtMalloc" => fn(*mut *mut c_void, usize, c_int) -> c_int;
    free: c"aclrtFree" => fn(*mut c_void) -> c_int;
    memcpy: c"aclrtMemcpy" => fn(*mut c_void, usize, *const c_void, usize, c_int) -> c_int;
    get_mem_info: c"aclrtGetMemInfo" => fn(c_int, *mut usize, *mut usize) -> c_int;
});

// What the bench needs of ACL beyond `Acl`: pinned host memory, streams, memset and the
// virtual-memory calls a region allocation makes (signatures from acl_rt.h as restated in
// shared/reference/ascend.md; the hook does not export these, so they reach CANN directly).
api!(AclBench {
    malloc_host: c"aclrtMallocHost" => fn(*mut *mut c_void, usize) -> c_int;
    free_host: c"aclrtFreeHost" => fn(*mut c_void) -> c_int;
    memset: c"aclrtMemset" => fn(*mut c_void, usize, i32, usize) -> c_int;
    create_stream: c"aclrtCreateStream" => fn(*mut *mut c_void) -> c_int;
    synchronize_stream: c"aclrtSynchronizeStream" => fn(*mut c_void) -> c_int;
    destroy_stream: c"aclrtDestroyStream" => fn(*mut c_void) -> c_int;
    memcpy_async: c"aclrtMemcpyAsync" => fn(*mut c_void, usize, *const c_void, usize, c_int, *mut c_void) -> c_int;
    granularity: c"aclrtMemGetAllocationGranularity" => fn(*mut AclPhysicalMemProp, c_int, *mut usize) -> c_int;
    reserve: c"aclrtReserveMemAddress" => fn(*mut *mut c_void, usize, usize, *mut c_void, u64) -> c_int;
    release_address: c"aclrtReleaseMemAddress" => fn(*mut c_void) -> c_int;
    malloc_physical: c"aclrtMallocPhysical" => fn(*mut *mut c_void, usize, *const AclPhysicalMemProp, u64) -> c_int;
    free_physical: c"aclrtFreePhysical" => fn(*mut c_void) -> c_int;
    map: c"aclrtMapMem" => fn(*mut c_void, usize, usize, *mut c_void, u64) -> c_int;
    unmap: c"aclrtUnmapMem" => fn(*mut c_void) -> c_int;
});

pub use tms_vendor::acl::PhysicalMemProp as AclPhysicalMemProp;

/// Pinned HBM with 2 MiB pages on device 0 (ACL_HBM_MEM_HUGE): what the hook asks for when an
/// allocation over 1 MiB is made with torch_npu's ACL_MEM_MALLOC_HUGE_FIRST policy.
pub fn acl_huge_prop() -> AclPhysicalMemProp {
    AclPhysicalMemProp::pinned_on(0, 4) // ACL_HBM_MEM_HUGE
}

api!(Driver {
    init: c"cuInit" => fn(u32) -> c_int;
    reserve: c"cuMemAddressReserve" => fn(*mut u64, usize, usize, u64, u64) -> c_int;
    address_free: c"cuMemAddressFree" => fn(u64, usize) -> c_int;
    create: c"cuMemCreate" => fn(*mut u64, usize, *const AllocationProp, u64) -> c_int;
    release: c"cuMemRelease" => fn(u64) -> c_int;
    map: c"cuMemMap" => fn(u64, usize, usize, u64, u64) -> c_int;
    unmap: c"cuMemUnmap" => fn(u64, usize) -> c_int;
    set_access: c"cuMemSetAccess" => fn(u64, usize, *const AccessDesc, usize) -> c_int;
});

/// CUmemAllocationProp and CUmemAccessDesc, declared once for every part of tms (tms-vendor).
pub use tms_vendor::cuda::{AccessDesc, AllocationProp};

/// Pinned device memory on device 0.
pub fn device_prop() -> AllocationProp {
    AllocationProp::pinned_on(0)
}

/// Read/write access for device 0.
pub fn device_access() -> AccessDesc {
    AccessDesc {
        location: tms_vendor::cuda::MemLocation::device(0),
        flags: tms_vendor::cuda::ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// `tms_report`, which the hook fills.
pub use tms_proto::abi::Report;

api!(Tms {
    set_region: c"tms_set_interesting_region" => fn(bool) -> ();
    set_tag: c"tms_set_current_tag" => fn(*const c_char) -> ();
    set_backup: c"tms_set_enable_cpu_backup" => fn(bool) -> ();
    pause: c"tms_pause_report" => fn(*const c_char, *mut Report) -> c_int;
    resume: c"tms_resume_report" => fn(*const c_char, *mut Report) -> c_int;
});

// The part of the C ABI that torch_memory_saver's own library and libtms_hook.so share (the
// bench's side-by-side scenario calls only these, so both libraries run the same code).
api!(CommonTms {
    set_region: c"tms_set_interesting_region" => fn(bool) -> ();
    set_tag: c"tms_set_current_tag" => fn(*const c_char) -> ();
    set_backup: c"tms_set_enable_cpu_backup" => fn(bool) -> ();
    pause: c"tms_pause" => fn(*const c_char) -> c_int;
    resume: c"tms_resume" => fn(*const c_char) -> c_int;
});

/// Loads the CUDA runtime into the global scope (the driver comes with it on real systems and
/// on the simulator alike).
pub fn load_cuda() -> Result<(), String> {
    for name in [c"libcudart.so.12", c"libcudart.so.13", c"libcudart.so"] {
        // SAFETY: dlopen of a vendor library by soname.
        if !unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null() {
            for drv in [c"libcuda.so.1", c"libcuda.so"] {
                // SAFETY: as above.
                if !unsafe { libc::dlopen(drv.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null() {
                    return Ok(());
                }
            }
            return Err("libcuda.so.1 not found".into());
        }
    }
    Err("libcudart.so.12 not found: install the CUDA runtime or use --device sim".into())
}

/// Loads the Ascend runtime into the global scope.
pub fn load_acl() -> Result<(), String> {
    // SAFETY: dlopen of a vendor library by soname.
    if unsafe { libc::dlopen(c"libascendcl.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null() {
        return Err("libascendcl.so not found: source CANN's set_env.sh or use --device sim".into());
    }
    Ok(())
}

/// Whether a vendor library can be loaded here (an RTLD_LAZY probe, closed right away).
/// Whether `lib` loads here and exports `name`.
pub fn has_symbol(lib: &CStr, name: &CStr) -> bool {
    // SAFETY: dlopen/dlsym/dlclose of a library by soname.
    unsafe {
        let h = libc::dlopen(lib.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if h.is_null() {
            return false;
        }
        let found = !libc::dlsym(h, name.as_ptr()).is_null();
        libc::dlclose(h);
        found
    }
}

pub fn can_load(lib: &CStr) -> bool {
    // SAFETY: dlopen/dlclose of a library by soname.
    unsafe {
        let h = libc::dlopen(lib.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if h.is_null() {
            return false;
        }
        libc::dlclose(h);
        true
    }
}

pub fn check(what: &str, rc: c_int) -> Result<(), String> {
    if rc == 0 { Ok(()) } else { Err(format!("{what} returned {rc}{}", tms_vendor::explain(what, rc))) }
}
