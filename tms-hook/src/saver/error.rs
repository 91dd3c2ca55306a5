//! What pause, resume, malloc and free report to their callers.

use crate::device::{DeviceError, Vendor};
use crate::region::TagId;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A driver call failed; carries the vendor's code.
    Driver(DeviceError),
    /// Not enough free device memory (the vendor's out-of-memory code, what was needed, what was
    /// free at the time).
    OutOfMemory { code: i32, needed: u64, free: u64 },
    /// No driver of that vendor could be loaded.
    NoDriver(Vendor),
    /// Bad argument from the caller.
    Invalid(&'static str),
    /// A disk backup file could not be read (the allocation stays paused with its file).
    Disk(String),
}

impl Error {
    /// The code the vendor API would return for this failure.
    pub fn vendor_code(&self, invalid: i32) -> i32 {
        match self {
            Error::Driver(e) => e.code,
            Error::OutOfMemory { code, .. } => *code,
            Error::NoDriver(_) | Error::Invalid(_) | Error::Disk(_) => invalid,
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Driver(e) => write!(f, "driver call failed: {e}"),
            Error::OutOfMemory { needed, free, .. } => {
                write!(f, "out of device memory: {needed} bytes needed (any margin included), {free} free")
            }
            Error::NoDriver(v) => write!(f, "no {} driver could be loaded", v.name()),
            Error::Invalid(what) => write!(f, "invalid argument: {what}"),
            Error::Disk(what) => write!(f, "disk backup unreadable: {what}"),
        }
    }
}

/// What a pause or resume did; mirrors `tms_report` in include/tms.h.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    pub allocations_done: u64,
    pub bytes_done: u64,
    pub allocations_skipped: u64,
    pub bytes_skipped: u64,
    pub allocations_failed: u64,
    pub bytes_failed: u64,
    /// Bytes copied to or from host backups.
    pub backup_bytes: u64,
    pub elapsed_ns: u64,
    pub device_free_before: u64,
    pub device_free_after: u64,
    pub device_total: u64,
    /// Time of the backup/restore pipeline: the copies, with the releases (pause) or creates
    /// (resume) overlapped into them (included in `elapsed_ns`).
    pub backup_ns: u64,
    /// The first failure, if any (the operation still did what it could).
    pub error: Option<Error>,
}

impl Report {
    /// One line for people: what was done, skipped and failed, how long, and device free memory.
    pub fn summary(&self, verb: &str) -> String {
        use tms_proto::size::format_size;
        format!(
            "{verb} {} allocation(s), {} in {:.1} ms (skipped {}, failed {}); device free {} -> {}",
            self.allocations_done,
            format_size(self.bytes_done),
            self.elapsed_ns as f64 / 1e6,
            self.allocations_skipped,
            self.allocations_failed,
            format_size(self.device_free_before),
            format_size(self.device_free_after)
        )
    }
}

/// How a log line names the tag an operation was asked for.
pub fn tag_label(tag: Option<&str>) -> String {
    match tag {
        Some(t) => format!("tag {t:?}"),
        None => "every tag".to_string(),
    }
}

/// Per-tag view for `tms_status` and the control plane.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TagStatus {
    pub tag: TagId,
    pub allocations_active: u64,
    pub allocations_paused: u64,
    pub bytes_active: u64,
    pub bytes_paused: u64,
    pub backup_bytes: u64,
}
