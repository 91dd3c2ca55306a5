//! Stand-ins for the rest of CANN that torch_npu's libraries link against: the operator compiler
//! (`libacl_op_compiler.so`), the graph engine (`libge_runner.so`, `libgraph.so`,
//! `libfmk_parser.so`, `libascend_protobuf.so`), the data tunnel (`libacl_tdt_channel.so`), ATB
//! (`libatb.so`), the profiler's reporting calls and the bounds-checked C string functions of
//! CANN's `libc_sec`. `tms-sim env` puts each of those file names on the library path as a link to
//! the simulator, so a program loads without CANN.
//!
//! What the simulator cannot do (compile or run operators and graphs, move tensors through the
//! data tunnel) fails as CANN documents a failure: an ACL call returns
//! ACL_ERROR_RT_FEATURE_NOT_SUPPORT (207000), a constructor returns NULL, an enum query returns its
//! UNDEFINED value; each such call says once on stderr which function it was. The C++ graph-engine
//! and ATB entry points have no error channel a caller could check (constructors, methods
//! returning objects), so they stop the process with a message naming the function. Profiling
//! reports are accepted and dropped, as with no profiler attached.

use libc::{c_char, c_void};
use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

/// ACL_ERROR_RT_FEATURE_NOT_SUPPORT.
const NOT_SUPPORTED: i64 = 207_000;

fn say_once(name: &str, what: &str) {
    static SAID: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let mut said = SAID.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if said.insert(name.to_string()) {
        eprintln!("tms-sim: {name} is not simulated ({what})");
    }
}

fn refuse(name: &str, value: i64) -> i64 {
    say_once(name, &format!("returned {value}"));
    value
}

fn not_simulated(name: &str) -> ! {
    eprintln!(
        "tms-sim: {name} is not simulated: the simulator runs no graph engine or ATB operators \
         (run torch_npu in eager mode; see docs/simulator.md)"
    );
    std::process::abort()
}

/// C functions that fail with a documented value: `name => value;`.
macro_rules! refused {
    ($($name:ident => $value:expr;)*) => {
        mod refused_fns {
            #![allow(non_snake_case)]
            use super::*;
            $(pub unsafe extern "C" fn $name() -> i64 { refuse(stringify!($name), $value) })*
        }
        export! { $($name => refused_fns::$name;)* }
    };
}

/// C++ entry points with no error channel: they stop the process, naming themselves.
macro_rules! stops {
    ($($name:ident;)*) => {
        mod stopping_fns {
            #![allow(non_snake_case)]
            use super::*;
            $(pub unsafe extern "C" fn $name() -> i64 { not_simulated(stringify!($name)) })*
        }
        export! { $($name => stopping_fns::$name;)* }
    };
}

refused! {
    // libascendcl.so: operator descriptions (acl/acl_base.h). Constructors fail with NULL, enum
    // queries with ACL_DT_UNDEFINED / ACL_FORMAT_UNDEFINED (-1), counts with 0.
    aclCreateDataBuffer => 0;
    aclDestroyDataBuffer => NOT_SUPPORTED;
    aclCreateTensorDesc => 0;
    aclDestroyTensorDesc => NOT_SUPPORTED;
    aclGetTensorDescType => -1;
    aclGetTensorDescFormat => -1;
    aclGetTensorDescNumDims => 0;
    aclGetTensorDescDimV2 => NOT_SUPPORTED;
    aclSetTensorDescName => NOT_SUPPORTED;
    aclSetTensorFormat => NOT_SUPPORTED;
    aclSetTensorPlaceMent => NOT_SUPPORTED;
    aclSetTensorShape => NOT_SUPPORTED;
    aclmdlInitDump => NOT_SUPPORTED;
    aclmdlSetDump => NOT_SUPPORTED;
    aclmdlFinalizeDump => NOT_SUPPORTED;
    // libacl_op_compiler.so (acl/acl_op_compiler.h, acl/acl_op.h): single-operator compilation.
    aclopCompileAndExecute => NOT_SUPPORTED;
    aclopCompileAndExecuteV2 => NOT_SUPPORTED;
    aclopCreateAttr => 0;
    aclopDestroyAttr => NOT_SUPPORTED;
    aclopSetAttrBool => NOT_SUPPORTED;
    aclopSetAttrDataType => NOT_SUPPORTED;
    aclopSetAttrFloat => NOT_SUPPORTED;
    aclopSetAttrInt => NOT_SUPPORTED;
    aclopSetAttrListBool => NOT_SUPPORTED;
    aclopSetAttrListFloat => NOT_SUPPORTED;
    aclopSetAttrListInt => NOT_SUPPORTED;
    aclopSetAttrListListInt => NOT_SUPPORTED;
    aclopSetAttrString => NOT_SUPPORTED;
    aclopStartDumpArgs => NOT_SUPPORTED;
    aclopStopDumpArgs => NOT_SUPPORTED;
    // libacl_tdt_channel.so (acl/acl_tdt.h): the host-device data tunnel.
    acltdtCreateChannelWithCapacity => 0;
    acltdtDestroyChannel => NOT_SUPPORTED;
    acltdtCreateDataset => 0;
    acltdtDestroyDataset => NOT_SUPPORTED;
    acltdtGetDataItem => 0;
    acltdtGetDatasetSize => 0;
    acltdtGetDataAddrFromItem => 0;
    acltdtGetDataSizeFromItem => 0;
    acltdtGetDataTypeFromItem => -1;
    acltdtGetDimNumFromItem => 0;
    acltdtGetDimsFromItem => NOT_SUPPORTED;
    acltdtReceiveTensor => NOT_SUPPORTED;
    // Virtual-memory sharing by shareable handle (acl/acl_rt.h); the key-based IPC calls are
    // simulated (acl_ipc.rs).
    aclrtMemExportToShareableHandle => NOT_SUPPORTED;
    aclrtMemImportFromShareableHandle => NOT_SUPPORTED;
    aclrtMemSetPidToShareableHandle => NOT_SUPPORTED;
}

stops! {
    // The runtime's kernel registration and launch (runtime/rt.h): kernels are not run.
    rtDevBinaryRegister;
    rtFunctionRegister;
    rtKernelLaunch;
    // The graph engine (ge/ge_api.h, graph/*.h), for torchair's graph mode.
    _ZN2ge10GEFinalizeEv;
    _ZN2ge10TensorDesc11SetDataTypeENS_8DataTypeE;
    _ZN2ge10TensorDesc12SetPlacementENS_9PlacementE;
    _ZN2ge10TensorDesc14SetOriginShapeERKNS_5ShapeE;
    _ZN2ge10TensorDesc15SetOriginFormatENS_6FormatE;
    _ZN2ge10TensorDesc9SetFormatENS_6FormatE;
    _ZN2ge10TensorDescC1Ev;
    _ZN2ge12AscendStringC1EPKc;
    _ZN2ge12GEInitializeERKSt3mapINS_12AscendStringES1_St4lessIS1_ESaISt4pairIKS1_S1_EEE;
    _ZN2ge13GEGetErrorMsgEv;
    _ZN2ge13GetFormatNameENS_6FormatE;
    _ZN2ge15OperatorFactory14CreateOperatorEPKcS2_;
    _ZN2ge15OperatorFactory9IsExistOpEPKc;
    _ZN2ge17GEGetWarningMsgV2Ev;
    _ZN2ge5Graph28LoadFromSerializedModelArrayEPKvm;
    _ZN2ge5Graph8CopyFromERKS0_;
    _ZN2ge5GraphC1EPKc;
    _ZN2ge5ShapeC1ERKSt6vectorIlSaIlEE;
    _ZN2ge6Tensor11SetDataTypeERKNS_8DataTypeE;
    _ZN2ge6Tensor11SetShapeDimEml;
    _ZN2ge6Tensor12SetPlacementERKNS_9PlacementE;
    _ZN2ge6Tensor13SetTensorDescERKNS_10TensorDescE;
    _ZN2ge6Tensor14SetShapeDimNumEm;
    _ZN2ge6Tensor17SetOriginShapeDimEml;
    _ZN2ge6Tensor20SetOriginShapeDimNumEm;
    _ZN2ge6Tensor7GetDataEv;
    _ZN2ge6Tensor7SetDataEPhmRKSt8functionIFvS1_EE;
    _ZN2ge6Tensor9ResetDataEPhmRKSt8functionIFvS1_EE;
    _ZN2ge6Tensor9ResetDataEv;
    _ZN2ge6Tensor9SetFormatERKNS_6FormatE;
    _ZN2ge6TensorC1Ev;
    _ZN2ge7Session11RemoveGraphEj;
    _ZN2ge7Session12CompileGraphEj;
    _ZN2ge7Session23GetCompiledGraphSummaryEj;
    _ZN2ge7Session23RunGraphWithStreamAsyncEjPvRKSt6vectorINS_6TensorESaIS3_EERS5_;
    _ZN2ge7Session23SetGraphConstMemoryBaseEjPKvm;
    _ZN2ge7Session28UpdateGraphFeatureMemoryBaseEjPKvm;
    _ZN2ge7Session30SetGraphFixedFeatureMemoryBaseEjPKvm;
    _ZN2ge7Session39UpdateGraphRefreshableFeatureMemoryBaseEjPKvm;
    _ZN2ge7Session8AddGraphEjRKNS_5GraphERKSt3mapINS_12AscendStringES5_St4lessIS5_ESaISt4pairIKS5_S5_EEE;
    _ZN2ge7Session8RunGraphEjRKSt6vectorINS_6TensorESaIS2_EERS4_;
    _ZN2ge7SessionC1ERKSt3mapINS_12AscendStringES2_St4lessIS2_ESaISt4pairIKS2_S2_EEE;
    _ZN2ge7SessionD1Ev;
    _ZN2ge8Operator15UpdateInputDescEPKcRKNS_10TensorDescE;
    _ZNK2ge10TensorDesc11GetDataTypeEv;
    _ZNK2ge10TensorDesc12GetPlacementEv;
    _ZNK2ge10TensorDesc8GetShapeEv;
    _ZNK2ge10TensorDesc9GetFormatEv;
    _ZNK2ge12AscendString9GetStringEv;
    _ZNK2ge12AscendStringeqERKS0_;
    _ZNK2ge12AscendStringltERKS0_;
    _ZNK2ge20CompiledGraphSummary15GetOutputDtypesERSt6vectorINS_8DataTypeESaIS2_EE;
    _ZNK2ge20CompiledGraphSummary15GetOutputShapesERSt6vectorINS_5ShapeESaIS2_EE;
    _ZNK2ge20CompiledGraphSummary18GetConstMemorySizeERm;
    _ZNK2ge20CompiledGraphSummary20GetFeatureMemorySizeERm;
    _ZNK2ge20CompiledGraphSummary25GetFixedFeatureMemorySizeERm;
    _ZNK2ge20CompiledGraphSummary31GetFeatureMemoryBaseRefreshableERb;
    _ZNK2ge20CompiledGraphSummary8IsStaticEv;
    _ZNK2ge5GNode7GetTypeERNS_12AscendStringE;
    _ZNK2ge5Graph10SaveToFileEPKc;
    _ZNK2ge5Graph11GetAllNodesEv;
    _ZNK2ge5Shape7GetDimsEv;
    _ZNK2ge6Tensor11GetDataTypeEv;
    _ZNK2ge6Tensor11GetShapeDimEm;
    _ZNK2ge6Tensor12GetPlacementEv;
    _ZNK2ge6Tensor13GetTensorDescEv;
    _ZNK2ge6Tensor14GetShapeDimNumEv;
    _ZNK2ge6Tensor20GetOriginShapeDimNumEv;
    _ZNK2ge6Tensor7GetDataEv;
    _ZNK2ge6Tensor9GetFormatEv;
    _ZNK2ge7Session25RegisterExternalAllocatorEPKvSt10shared_ptrINS_9AllocatorEE;
    _ZNK2ge8Operator25GetAllIrAttrNamesAndTypesERSt3mapINS_12AscendStringES2_St4lessIS2_ESaISt4pairIKS2_S2_EEE;
    // ATB (atb/atb_infer.h), for torch_npu's ATB operator plugin.
    _ZN3atb13CreateContextEPPNS_7ContextE;
    _ZN3atb14DestroyContextEPNS_7ContextE;
    _ZN3atb15CreateOperationINS_5infer11LinearParamEEEiRKT_PPNS_9OperationE;
    _ZN3atb15CreateOperationINS_5infer12ElewiseParamEEEiRKT_PPNS_9OperationE;
    _ZN3atb15CreateOperationINS_5infer12RmsNormParamEEEiRKT_PPNS_9OperationE;
    _ZN3atb15CreateOperationINS_5infer14GroupTopkParamEEEiRKT_PPNS_9OperationE;
    _ZN3atb15CreateOperationINS_5infer18SelfAttentionParamEEEiRKT_PPNS_9OperationE;
    _ZN3atb15CreateOperationINS_5infer19PagedAttentionParamEEEiRKT_PPNS_9OperationE;
    _ZN3atb15CreateOperationINS_5infer20ReshapeAndCacheParamEEEiRKT_PPNS_9OperationE;
    _ZN3atb15CreateOperationINS_5infer9RopeParamEEEiRKT_PPNS_9OperationE;
    _ZN3atb16DestroyOperationEPNS_9OperationE;
    _ZN3atb5Utils13GetTensorSizeERKNS_6TensorE;
}

// ---- profiling reports (toolchain/prof_api.h): accepted, as with no profiler attached ---------

pub unsafe extern "C" fn msprof_report_api(_aging: u32, _api: *const c_void) -> i32 {
    0
}

pub unsafe extern "C" fn msprof_report_compact_info(_aging: u32, _data: *const c_void, _len: u32) -> i32 {
    0
}

pub unsafe extern "C" fn msprof_report_additional_info(_aging: u32, _data: *const c_void, _len: u32) -> i32 {
    0
}

pub unsafe extern "C" fn msprof_register_callback(_module: u32, _handle: *const c_void) -> i32 {
    0
}

/// The profiler's clock: nanoseconds of the monotonic clock.
pub unsafe extern "C" fn msprof_sys_cycle_time() -> u64 {
    crate::core::timing::now_ns()
}

/// A stable id for a string (FNV-1a), as the profiler hands out ids for names it will report.
pub unsafe extern "C" fn msprof_get_hash_id(info: *const c_char, len: usize) -> u64 {
    if info.is_null() {
        return 0;
    }
    // SAFETY: the caller passes `len` readable bytes.
    let bytes = unsafe { std::slice::from_raw_parts(info.cast::<u8>(), len) };
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// `void aclAppLog(aclLogLevel, const char *func, const char *file, uint32_t line, const char
/// *fmt, ...)`: the application's log goes to CANN's log daemon, which is not there.
pub unsafe extern "C" fn acl_app_log(_level: i32, _func: *const c_char, _file: *const c_char, _line: u32) {}

// ---- libc_sec (securec.h): the bounds-checked string functions CANN's libraries call ---------

const EOK: i32 = 0;
const EINVAL: i32 = 22;
const ERANGE: i32 = 34;
/// securec's "_AND_RESET" codes: the error, with the destination's first byte set to 0.
const EINVAL_AND_RESET: i32 = EINVAL | 128;
const ERANGE_AND_RESET: i32 = ERANGE | 128;
/// SECUREC_STRING_MAX_LEN.
const STRING_MAX: usize = 0x7fff_ffff;

pub unsafe extern "C" fn strcpy_s(dest: *mut c_char, dest_max: usize, src: *const c_char) -> i32 {
    if dest.is_null() {
        return EINVAL;
    }
    if dest_max == 0 || dest_max > STRING_MAX {
        return ERANGE;
    }
    if src.is_null() {
        // SAFETY: dest is non-null with room for at least one byte.
        unsafe { *dest = 0 };
        return EINVAL_AND_RESET;
    }
    // SAFETY: src is a NUL-terminated string; at most dest_max bytes are read.
    let len = unsafe { libc::strnlen(src, dest_max) };
    if len >= dest_max {
        // SAFETY: as above.
        unsafe { *dest = 0 };
        return ERANGE_AND_RESET;
    }
    // SAFETY: len + 1 <= dest_max bytes fit; callers do not pass overlapping buffers.
    unsafe { std::ptr::copy(src, dest, len + 1) };
    EOK
}

unsafe extern "C" {
    // `va_list` is a pointer at the ABI on x86-64 (array of one tag) and on aarch64 (a 32-byte
    // struct passed by reference), so it is handed on as one.
    fn vsnprintf(s: *mut c_char, n: usize, format: *const c_char, ap: *mut c_void) -> i32;
}

/// Writes at most `count` characters (and the NUL) into `dest`; -1 when that cut the text short
/// or the arguments are bad, as securec's vsnprintf_s does.
pub unsafe extern "C" fn vsnprintf_s(
    dest: *mut c_char,
    dest_max: usize,
    count: usize,
    format: *const c_char,
    ap: *mut c_void,
) -> i32 {
    if dest.is_null() || dest_max == 0 || dest_max > STRING_MAX {
        return -1;
    }
    if format.is_null() {
        // SAFETY: dest holds at least one byte.
        unsafe { *dest = 0 };
        return -1;
    }
    let room = count.min(dest_max - 1);
    // SAFETY: room + 1 <= dest_max bytes are writable; format and ap come from the caller.
    let n = unsafe { vsnprintf(dest, room + 1, format, ap) };
    if n < 0 {
        // SAFETY: as above.
        unsafe { *dest = 0 };
        return -1;
    }
    if n as usize > room { -1 } else { n }
}

// ---- compile options (acl/acl_op_compiler.h): kept per process and read back ---------------

fn compile_options() -> std::sync::MutexGuard<'static, std::collections::HashMap<i32, Vec<u8>>> {
    static OPTS: OnceLock<Mutex<std::collections::HashMap<i32, Vec<u8>>>> = OnceLock::new();
    OPTS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner())
}

/// aclCompileOpt runs from ACL_PRECISION_MODE (0) to ACL_OP_DEBUG_OPTION (in the 20s in recent
/// CANN); values beyond are refused as invalid.
const COMPILE_OPT_LAST: i32 = 31;

/// ACL_OP_JIT_COMPILE: CANN's default on a 910B is "disable" (binary operators), which torch_npu
/// reads at start-up; with it unset, torch_npu would take jit compilation and turn BatchNorm and
/// Conv2d weights into NPU-private formats in `Module.to("npu")`, an operator of its own.
const ACL_OP_JIT_COMPILE: i32 = 10;

/// An option's value: what the process set, else CANN's default on a 910B.
fn compile_option(opt: i32) -> Vec<u8> {
    match compile_options().get(&opt) {
        Some(v) => v.clone(),
        None if opt == ACL_OP_JIT_COMPILE => b"disable".to_vec(),
        None => Vec::new(),
    }
}

/// `aclSetCompileopt(aclCompileOpt opt, const char *value)`: torch_npu sets its operator
/// compiler's options at start-up; no operator is compiled here, so they are only kept.
pub unsafe extern "C" fn acl_set_compileopt(opt: i32, value: *const c_char) -> i32 {
    if !(0..=COMPILE_OPT_LAST).contains(&opt) || value.is_null() {
        return 100_000;
    }
    // SAFETY: a NUL-terminated string from the caller.
    let v = unsafe { std::ffi::CStr::from_ptr(value) }.to_bytes().to_vec();
    compile_options().insert(opt, v);
    0
}

/// `size_t aclGetCompileoptSize(aclCompileOpt opt)`: the room a value needs, its NUL included.
pub unsafe extern "C" fn acl_get_compileopt_size(opt: i32) -> usize {
    compile_option(opt).len() + 1
}

/// `aclGetCompileopt(aclCompileOpt opt, char *value, size_t length)`.
pub unsafe extern "C" fn acl_get_compileopt(opt: i32, value: *mut c_char, length: usize) -> i32 {
    if !(0..=COMPILE_OPT_LAST).contains(&opt) || value.is_null() {
        return 100_000;
    }
    let v = compile_option(opt);
    if v.len() + 1 > length {
        return 100_000;
    }
    // SAFETY: length >= v.len() + 1 bytes are writable.
    unsafe {
        std::ptr::copy_nonoverlapping(v.as_ptr().cast::<c_char>(), value, v.len());
        *value.add(v.len()) = 0;
    }
    0
}
