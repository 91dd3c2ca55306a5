//! Finding the real functions behind the ones we export.
//!
//! Order: `dlsym(RTLD_NEXT)` (the runtime is in the global scope), then the libraries loaded
//! under the vendor sonames with `RTLD_NOLOAD` (the runtime was loaded `RTLD_LOCAL`, as Python
//! does with extension modules), then whatever an interposed `dlsym(handle, name)` call revealed.
//! A failed lookup is never cached: the runtime may be loaded later.
//!
//! Every lookup here goes through the real `dlsym`, never through our own exported one.

use libc::{c_char, c_void};
use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// The real `dlsym`, resolved on first need. Read by the `dlsym` trampoline in exports/dlsym.rs.
pub static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" {
    fn dlvsym(handle: *mut c_void, symbol: *const c_char, version: *const c_char) -> *mut c_void;
}

/// Resolves the real `dlsym` by version (glibc 2.34 moved it into libc; older names remain).
pub fn real_dlsym_addr() -> usize {
    let cached = REAL_DLSYM.load(Ordering::Acquire);
    if cached != 0 {
        return cached;
    }
    const VERSIONS: &[&CStr] = &[c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17", c"GLIBC_2.0"];
    for v in VERSIONS {
        // SAFETY: dlvsym with static NUL-terminated strings.
        let p = unsafe { dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), v.as_ptr()) } as usize;
        if p != 0 {
            REAL_DLSYM.store(p, Ordering::Release);
            return p;
        }
    }
    0
}

/// The real `dlsym(handle, name)`. `handle` is only passed on to glibc, never dereferenced.
pub fn real_dlsym(handle: *mut c_void, name: &CStr) -> *mut c_void {
    let handle = handle as usize;
    let addr = real_dlsym_addr();
    if addr == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: `addr` is glibc's dlsym.
    unsafe {
        let f: DlsymFn = std::mem::transmute(addr);
        f(handle as *mut c_void, name.as_ptr())
    }
}

/// One forwarded function: its name, the sonames of the library that defines it, the cached
/// address, and our own export (never to be mistaken for the real one).
pub struct Target {
    pub name: &'static CStr,
    pub sonames: &'static [&'static CStr],
    cached: AtomicUsize,
}

pub const CUDART: &[&CStr] = &[c"libcudart.so.12", c"libcudart.so.13", c"libcudart.so", c"libcudart.so.11.0"];
pub const ASCENDCL: &[&CStr] = &[c"libascendcl.so"];

impl Target {
    pub const fn new(name: &'static CStr, sonames: &'static [&'static CStr]) -> Target {
        Target { name, sonames, cached: AtomicUsize::new(0) }
    }

    /// The real function's address, or None if no loaded library provides it yet.
    pub fn resolve(&self, own: usize) -> Option<usize> {
        let cached = self.cached.load(Ordering::Acquire);
        if cached != 0 {
            return Some(cached);
        }
        let found = self.lookup(own)?;
        self.cached.store(found, Ordering::Release);
        Some(found)
    }

    fn lookup(&self, own: usize) -> Option<usize> {
        let next = real_dlsym(libc::RTLD_NEXT, self.name) as usize;
        if next != 0 && next != own {
            return Some(next);
        }
        for soname in self.sonames {
            // SAFETY: RTLD_NOLOAD only returns a handle to an already loaded library.
            let h = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
            if h.is_null() {
                continue;
            }
            let p = real_dlsym(h, self.name) as usize;
            // SAFETY: drops the reference RTLD_NOLOAD took; the library stays loaded.
            unsafe { libc::dlclose(h) };
            if p != 0 && p != own {
                return Some(p);
            }
        }
        None
    }

    /// Records an address seen through an interposed `dlsym(handle, name)` (covers runtimes
    /// loaded under other names).
    pub fn offer(&self, addr: usize, own: usize) {
        if addr != 0 && addr != own {
            let _ = self.cached.compare_exchange(0, addr, Ordering::AcqRel, Ordering::Acquire);
        }
    }
}

pub static CUDA_MALLOC: Target = Target::new(c"cudaMalloc", CUDART);
pub static CUDA_FREE: Target = Target::new(c"cudaFree", CUDART);
pub static CUDA_GET_DEVICE: Target = Target::new(c"cudaGetDevice", CUDART);
pub static CUDA_HOST_GET_FLAGS: Target = Target::new(c"cudaHostGetFlags", CUDART);
pub static CUDA_GET_LAST_ERROR: Target = Target::new(c"cudaGetLastError", CUDART);
pub static ACL_MALLOC: Target = Target::new(c"aclrtMalloc", ASCENDCL);
pub static ACL_MALLOC_ALIGN32: Target = Target::new(c"aclrtMallocAlign32", ASCENDCL);
pub static ACL_FREE: Target = Target::new(c"aclrtFree", ASCENDCL);
