//! What pause, resume, malloc and free report to their callers.

use crate::device::{DeviceError, Vendor};
use crate::region::TagId;
use tms_proto::abi;

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
    /// A restore checked with `TMS_VERIFY_RESTORE` did not bring the paused bytes back: `what`
    /// went wrong, first at `offset` into the allocation at `addr` (mapped, with what it got).
    Corrupt { addr: u64, size: u64, tag: String, offset: u64, what: &'static str },
    /// An NCCL registration of the memory could not be taken down before a pause or made again
    /// after a resume (registrations.rs): what, and what it means.
    Registration(String),
}

impl Error {
    /// The C API's `TMS_ERR_*` code for this failure, and the vendor's code where there is one.
    pub fn codes(&self) -> (i32, i32) {
        match self {
            Error::OutOfMemory { code, .. } => (abi::TMS_ERR_OUT_OF_MEMORY, *code),
            Error::Driver(d) => (abi::TMS_ERR_DRIVER, d.code),
            Error::NoDriver(_) => (abi::TMS_ERR_NO_DRIVER, 0),
            Error::Invalid(_) => (abi::TMS_ERR_INVALID, 0),
            Error::Disk(_) => (abi::TMS_ERR_IO, 0),
            Error::Corrupt { .. } => (abi::TMS_ERR_CORRUPT, 0),
            Error::Registration(_) => (abi::TMS_ERR_DRIVER, 0),
        }
    }

    /// The code the vendor API would return for this failure.
    pub fn vendor_code(&self, invalid: i32) -> i32 {
        match self {
            Error::Driver(e) => e.code,
            Error::OutOfMemory { code, .. } => *code,
            Error::NoDriver(_)
            | Error::Invalid(_)
            | Error::Disk(_)
            | Error::Corrupt { .. }
            | Error::Registration(_) => invalid,
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
            Error::Registration(what) => write!(f, "{what}"),
            Error::Corrupt { addr, size, tag, offset, what } => write!(
                f,
                "restore verification failed for allocation {addr:#x} ({size} bytes, tag {tag}): {what} at offset \
                 {offset}; its contents are not what the pause saved"
            ),
        }
    }
}

/// What a pause or resume did: the C API's report (include/tms.h), whose counters the saver
/// fills, and the first failure as a typed error, which `to_c` and the control plane turn into
/// their own codes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Its `error` and `driver_error` stay 0 here: the typed `error` below is the one source.
    counts: abi::Report,
    /// The first failure, if any (the operation still did what it could).
    pub error: Option<Error>,
}

// The saver and the NCCL communicators count into the C report's own fields
// (`report.bytes_done += n`) rather than into a restatement of them.
impl std::ops::Deref for Report {
    type Target = abi::Report;
    fn deref(&self) -> &abi::Report {
        &self.counts
    }
}

impl std::ops::DerefMut for Report {
    fn deref_mut(&mut self) -> &mut abi::Report {
        &mut self.counts
    }
}

impl Report {
    /// The C API's report: the counters, and the first failure as a `TMS_ERR_*` code with the
    /// vendor's code.
    pub fn to_c(&self) -> abi::Report {
        let (error, driver_error) = self.error.as_ref().map_or((abi::TMS_OK, 0), Error::codes);
        abi::Report { error, driver_error, ..self.counts }
    }

    /// One line for people: what was done, skipped and failed, how long, and device free memory.
    pub fn summary(&self, verb: &str) -> String {
        use tms_proto::size::{format_change, format_size};
        let mut line = format!(
            "{verb} {} allocation(s), {} in {:.1} ms (skipped {}, failed {}); device free {}",
            self.allocations_done,
            format_size(self.bytes_done),
            self.elapsed_ns as f64 / 1e6,
            self.allocations_skipped,
            self.allocations_failed,
            format_change(self.device_free_before, self.device_free_after)
        );
        if self.backup_bytes_skipped > 0 {
            line += &format!(
                "; backup copied {}, skipped {} marked dead",
                format_size(self.backup_bytes),
                format_size(self.backup_bytes_skipped)
            );
        }
        line
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_c_report_carries_the_counters_and_the_failure_as_codes() {
        let counts = abi::Report { bytes_done: 4096, backup_ns: 7, ..abi::Report::default() };
        let mut r = Report { counts, error: None };
        assert_eq!(r.to_c(), abi::Report { bytes_done: 4096, backup_ns: 7, ..abi::Report::default() });
        r.error = Some(Error::OutOfMemory { code: 207001, needed: 1, free: 0 });
        let c = r.to_c();
        assert_eq!((c.error, c.driver_error, c.bytes_done), (abi::TMS_ERR_OUT_OF_MEMORY, 207001, 4096));
        r.error = Some(Error::Disk("gone".into()));
        assert_eq!((r.to_c().error, r.to_c().driver_error), (abi::TMS_ERR_IO, 0));
        // The saver's own copy keeps no codes: the typed error is their one source.
        assert_eq!(r.driver_error, 0);
    }
}
