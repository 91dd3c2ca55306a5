//! Every name the Ascend front end exports, declared once: ACL's (`libascendcl.so`) and HCCL's
//! (`libhccl.so`). cudart.map gives them the simulator's own version node, to which the
//! unversioned references of programs linked against the real libraries bind.

use super::{acl, acl_ipc, hccl};

export! {
    // ACL (libascendcl.so)
    aclInit => acl::acl_init;
    aclFinalize => acl::acl_finalize;
    aclGetRecentErrMsg => acl::acl_get_recent_err_msg;
    aclrtSetDevice => acl::aclrt_set_device;
    aclrtGetDevice => acl::aclrt_get_device;
    aclrtResetDevice => acl::aclrt_reset_device;
    aclrtGetDeviceCount => acl::aclrt_get_device_count;
    aclrtCreateContext => acl::aclrt_create_context;
    aclrtDestroyContext => acl::aclrt_destroy_context;
    aclrtGetCurrentContext => acl::aclrt_get_current_context;
    aclrtSetCurrentContext => acl::aclrt_set_current_context;
    aclrtSynchronizeDevice => acl::aclrt_synchronize_device;
    aclrtSynchronizeDeviceWithTimeout => acl::aclrt_synchronize_device_with_timeout;
    aclrtCreateStream => acl::aclrt_create_stream;
    aclrtSynchronizeStream => acl::aclrt_synchronize_stream;
    aclrtDestroyStream => acl::aclrt_destroy_stream;
    aclrtMalloc => acl::aclrt_malloc;
    aclrtMallocAlign32 => acl::aclrt_malloc_align32;
    aclrtFree => acl::aclrt_free;
    aclrtMallocHost => acl::aclrt_malloc_host;
    aclrtFreeHost => acl::aclrt_free_host;
    aclrtMemcpy => acl::aclrt_memcpy;
    aclrtMemcpyAsync => acl::aclrt_memcpy_async;
    aclrtMemset => acl::aclrt_memset;
    aclrtGetMemInfo => acl::aclrt_get_mem_info;
    aclrtMemGetAllocationGranularity => acl::aclrt_mem_get_allocation_granularity;
    aclrtReserveMemAddress => acl::aclrt_reserve_mem_address;
    aclrtReleaseMemAddress => acl::aclrt_release_mem_address;
    aclrtMallocPhysical => acl::aclrt_malloc_physical;
    aclrtFreePhysical => acl::aclrt_free_physical;
    aclrtMapMem => acl::aclrt_map_mem;
    aclrtUnmapMem => acl::aclrt_unmap_mem;
    aclrtMemSetAccess => acl::aclrt_mem_set_access;
    aclrtDeviceGetBareTgid => acl_ipc::aclrt_device_get_bare_tgid;
    aclrtIpcMemGetExportKey => acl_ipc::aclrt_ipc_mem_get_export_key;
    aclrtIpcMemSetImportPid => acl_ipc::aclrt_ipc_mem_set_import_pid;
    aclrtIpcMemImportByKey => acl_ipc::aclrt_ipc_mem_import_by_key;
    aclrtIpcMemClose => acl_ipc::aclrt_ipc_mem_close;    // HCCL (libhccl.so)
    HcclGetErrorString => hccl::get_error_string;
    HcclGetRootInfo => hccl::get_root_info;
    HcclCommInitRootInfo => hccl::comm_init_root_info;
    HcclCommInitRootInfoConfig => hccl::comm_init_root_info_config;
    HcclCommInitClusterInfo => hccl::comm_init_cluster_info;
    HcclCommInitAll => hccl::comm_init_all;
    HcclBatchSendRecv => hccl::batch_send_recv;
    HcclAlltoAll => hccl::all_to_all;
    HcclCommDestroy => hccl::comm_destroy;
    HcclGetRankSize => hccl::get_rank_size;
    HcclGetRankId => hccl::get_rank_id;
    HcclGetCommAsyncError => hccl::get_comm_async_error;
    HcclBroadcast => hccl::broadcast;
    HcclAllReduce => hccl::all_reduce;
    HcclReduce => hccl::reduce;
    HcclAllGather => hccl::all_gather;
    HcclReduceScatter => hccl::reduce_scatter;
    HcclSend => hccl::send;
    HcclRecv => hccl::recv;
    HcclBarrier => hccl::barrier;
}
