//! The vendors' C structs that more than one part of tms passes across an FFI boundary, declared
//! once, each with the layout its header gives checked at compile time (size and field offsets on
//! every 64-bit Linux target: x86_64 and aarch64 alike). The hook passes them to the real
//! drivers, the simulator receives them from programs built against the real headers, and the
//! runner calls the collectives with them: a field that moved in one copy and not another would
//! corrupt memory silently, so there is one copy.
//!
//! Sources (shared/reference/cuda.md, ascend.md, collectives.md): NVIDIA's CUDA Driver API
//! reference ("Virtual Memory Management", the `CUmem*` types in cuda.h), the CUDA Runtime API's
//! `cudaIpcMemHandle_t` (driver_types.h), CANN's runtime API
//! reference (`aclrtPhysicalMemProp`, `aclrtMemLocation`, `aclrtMemAccessDesc` in
//! acl_rt.h), nccl.h (`ncclUniqueId`, `ncclConfig_t`) and hccl_types.h (`HcclRootInfo`,
//! `HcclCommConfig`).

pub mod acl;
pub mod cuda;
pub mod hccl;
pub mod nccl;

/// ` (NAME: meaning)` for `code` returned by the vendor function `function` (the table is chosen
/// by its name: `acl…`/`Hccl…` are Ascend's, the rest CUDA's), or "" for a code not in the
/// tables. For messages such as "cuMemMap returned 700 (CUDA_ERROR_ILLEGAL_ADDRESS: …)".
pub fn explain(function: &str, code: std::ffi::c_int) -> String {
    if function.starts_with("nccl") {
        return nccl_error(code).map_or_else(String::new, |(name, meaning)| format!(" ({name}: {meaning})"));
    }
    explain_code(function.starts_with("acl") || function.starts_with("Hccl"), code)
}

/// NCCL's `ncclResult_t` (nccl.h; NCCL's API documentation, "Types"): a code from an `nccl*`
/// function is NCCL's own, not CUDA's.
fn nccl_error(code: std::ffi::c_int) -> Option<(&'static str, &'static str)> {
    Some(match code {
        1 => ("ncclUnhandledCudaError", "a CUDA call NCCL made failed"),
        2 => ("ncclSystemError", "a system call failed"),
        3 => ("ncclInternalError", "an internal check failed"),
        4 => ("ncclInvalidArgument", "an argument is not valid"),
        5 => ("ncclInvalidUsage", "the call is not valid here, or this NCCL lacks it"),
        6 => ("ncclRemoteError", "a peer failed or went away"),
        7 => ("ncclInProgress", "a non-blocking operation has not finished"),
        _ => return None,
    })
}

/// As `explain`, for a code of Ascend's runtime (`ascend`) or CUDA's.
pub fn explain_code(ascend: bool, code: std::ffi::c_int) -> String {
    let found = if ascend { acl::error(code) } else { cuda::error(code) };
    found.map_or_else(String::new, |(name, meaning)| format!(" ({name}: {meaning})"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn codes_are_named_by_the_vendor_the_function_belongs_to() {
        assert!(super::explain("cuMemMap", 700).starts_with(" (CUDA_ERROR_ILLEGAL_ADDRESS: "));
        assert!(super::explain("cudaMemcpy", 700).contains("restart the process"));
        assert!(super::explain("aclrtMemcpy", 207_001).starts_with(" (ACL_ERROR_RT_MEMORY_ALLOCATION: "));
        assert_eq!(super::explain("aclrtMemcpy", 700), "");
        assert_eq!(super::explain("cuMemMap", 12345), "");
        assert!(super::explain("ncclCommMemStats", 5).starts_with(" (ncclInvalidUsage: "));
        assert!(!super::explain("ncclCommSuspend", 1).contains("CUDA_ERROR"));
    }
}
