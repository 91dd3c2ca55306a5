//! The CUDA front end: the runtime (`libcudart.so.12`, `libcudart.so.13`), the driver
//! (`libcuda.so.1`), NVML (`libnvidia-ml.so.1`) and NCCL (`libnccl.so.2`), each turning the
//! core's errors into its own codes.

pub mod exports;

pub mod driver;
pub mod nccl;
pub mod nvml;
pub mod runtime;
