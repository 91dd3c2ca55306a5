//! Module registration and kernel launches. Every CUDA binary registers its fat binaries,
//! functions and variables when it is loaded (`import torch` makes about 43,000 such calls), so
//! registration is a no-op that costs nothing. The simulator has no device code to run: every
//! launch fails with cudaErrorNoKernelImageForDevice and sets the thread's last error, which is
//! what PyTorch checks after each launch, so a kernel that did not run raises instead of leaving
//! the output unwritten.

use super::{INVALID_DEVICE_FUNCTION, NO_KERNEL_IMAGE, SUCCESS, call, put, rt};
use libc::{c_char, c_int, c_uint, c_void};

/// `dim3`, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Dim3 {
    pub x: c_uint,
    pub y: c_uint,
    pub z: c_uint,
}

/// What `__cudaRegisterFatBinary` hands back: an opaque handle the binary passes to the other
/// registration calls. One static slot serves every binary, as nothing is ever looked up in it.
static FAT_BINARY_HANDLE: [usize; 1] = [0];

pub unsafe extern "C" fn register_fat_binary(_fat_cubin: *mut c_void) -> *mut *mut c_void {
    FAT_BINARY_HANDLE.as_ptr() as *mut *mut c_void
}

pub unsafe extern "C" fn register_fat_binary_end(_handle: *mut *mut c_void) {}

/// `char __cudaInitModule(void **fatCubinHandle)`: CUDA 12 binaries call it while registering
/// their modules; there is nothing to load on the simulator, so the module is ready (true).
pub unsafe extern "C" fn init_module(_handle: *mut *mut c_void) -> c_char {
    1
}

pub unsafe extern "C" fn unregister_fat_binary(_handle: *mut *mut c_void) {}

pub unsafe extern "C" fn register_function(
    _handle: *mut *mut c_void,
    _host_fun: *const c_char,
    _device_fun: *mut c_char,
    _device_name: *const c_char,
    _thread_limit: c_int,
    _tid: *mut c_void,
    _bid: *mut c_void,
    _block_dim: *mut c_void,
    _grid_dim: *mut c_void,
    _warp_size: *mut c_int,
) {
}

pub unsafe extern "C" fn register_var(
    _handle: *mut *mut c_void,
    _host_var: *mut c_char,
    _device_address: *mut c_char,
    _device_name: *const c_char,
    _ext: c_int,
    _size: usize,
    _constant: c_int,
    _global: c_int,
) {
}

/// `<<<grid, block, shared, stream>>>` pushes its configuration; the launch stub pops it.
/// Both succeed so that the launch itself reports the real answer.
pub unsafe extern "C" fn push_call_configuration(
    _grid: Dim3,
    _block: Dim3,
    _shared: usize,
    _stream: *mut c_void,
) -> c_uint {
    0
}

pub unsafe extern "C" fn pop_call_configuration(
    _grid: *mut c_void,
    _block: *mut c_void,
    _shared: *mut usize,
    _stream: *mut c_void,
) -> i32 {
    SUCCESS
}

/// A kernel handle for a registered host stub: the stub's own address (the launch that uses it
/// is refused anyway).
pub unsafe extern "C" fn get_kernel(kernel: *mut *const c_void, entry: *const c_void) -> i32 {
    if entry.is_null() {
        return rt(INVALID_DEVICE_FUNCTION);
    }
    rt(put(kernel, entry))
}

fn refuse_launch(name: &str) -> i32 {
    call(name, || {
        enter!();
        NO_KERNEL_IMAGE
    })
}

pub unsafe extern "C" fn cuda_launch_kernel(
    _func: *const c_void,
    _grid: Dim3,
    _block: Dim3,
    _args: *mut *mut c_void,
    _shared: usize,
    _stream: *mut c_void,
) -> i32 {
    refuse_launch("cudaLaunchKernel")
}

pub unsafe extern "C" fn cuda_launch_kernel_ex_c(
    _config: *const c_void,
    _func: *const c_void,
    _args: *mut *mut c_void,
) -> i32 {
    refuse_launch("cudaLaunchKernelExC")
}

pub unsafe extern "C" fn cuda_launch_cooperative_kernel(
    _func: *const c_void,
    _grid: Dim3,
    _block: Dim3,
    _args: *mut *mut c_void,
    _shared: usize,
    _stream: *mut c_void,
) -> i32 {
    refuse_launch("cudaLaunchCooperativeKernel")
}

/// `struct cudaFuncAttributes` is answered for a kernel the simulator knows nothing about: the
/// same "no kernel image" a launch gets.
pub unsafe extern "C" fn cuda_func_get_attributes(_attrs: *mut c_void, _func: *const c_void) -> i32 {
    refuse_launch("cudaFuncGetAttributes")
}

/// Setting an attribute (dynamic shared memory, carve-out) needs nothing to be stored.
pub unsafe extern "C" fn cuda_func_set_attribute(func: *const c_void, _attr: c_int, _value: c_int) -> i32 {
    if func.is_null() {
        return rt(INVALID_DEVICE_FUNCTION);
    }
    SUCCESS
}

pub unsafe extern "C" fn cuda_occupancy_max_active_blocks(
    blocks: *mut c_int,
    func: *const c_void,
    block_size: c_int,
    shared: usize,
) -> i32 {
    // SAFETY: same contract with default flags.
    unsafe { cuda_occupancy_max_active_blocks_with_flags(blocks, func, block_size, shared, 0) }
}

/// A plausible occupancy (threads per SM over block size, at most 32 blocks), so launch
/// heuristics that size grids from it get sane numbers before the launch itself is refused.
pub unsafe extern "C" fn cuda_occupancy_max_active_blocks_with_flags(
    blocks: *mut c_int,
    func: *const c_void,
    block_size: c_int,
    _shared: usize,
    _flags: c_uint,
) -> i32 {
    call("cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", || {
        if func.is_null() {
            return INVALID_DEVICE_FUNCTION;
        }
        if block_size <= 0 {
            return super::INVALID_VALUE;
        }
        put(blocks, (super::devices::MAX_THREADS_PER_SM / block_size).clamp(0, 32))
    })
}
