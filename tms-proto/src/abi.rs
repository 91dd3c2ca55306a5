//! The structs and error codes of libtms_hook.so's C API (include/tms.h), declared once.
//!
//! They live here rather than in tms-hook because this crate exports no symbols: the hook fills
//! them, and a program that calls the hook through dlsym (relax-colocate's bench) reads them,
//! without linking the hook's `no_mangle` exports into itself. Each struct also describes its own
//! layout (`LAYOUT`), against which tests/tests/abi.rs checks include/tms.h and the ctypes mirror
//! of python/tms field by field.

use libc::c_char;
use serde::{Deserialize, Serialize};

/// A C scalar as include/tms.h and Python's ctypes spell it.
pub trait CType {
    const C: &'static str;
    const CTYPES: &'static str;
}

impl CType for i32 {
    const C: &'static str = "int32_t";
    const CTYPES: &'static str = "c_int32";
}

impl CType for u64 {
    const C: &'static str = "uint64_t";
    const CTYPES: &'static str = "c_uint64";
}

impl CType for *const c_char {
    const C: &'static str = "const char *";
    const CTYPES: &'static str = "c_char_p";
}

/// One field of a C struct.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    /// The type as the header writes it (`uint64_t`, `const char *`).
    pub c_type: &'static str,
    /// The ctypes type the Python mirror must use (`c_uint64`).
    pub ctypes: &'static str,
    pub offset: usize,
    pub size: usize,
}

/// A C struct: its name here and in the Python mirror (`Report`), as the header names it
/// (`tms_report`), its size and its fields in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub name: &'static str,
    pub c_name: &'static str,
    pub size: usize,
    pub fields: &'static [Field],
}

/// Declares a `#[repr(C)]` struct and its `LAYOUT` from one list of fields, so that the Rust
/// type and what the tests compare the header and Python with cannot drift apart.
macro_rules! c_struct {
    ($(#[$meta:meta])* pub struct $name:ident = $c_name:literal {
        $($(#[$fmeta:meta])* pub $field:ident: $ty:ty,)*
    }) => {
        $(#[$meta])*
        #[repr(C)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
        }

        impl $name {
            pub const LAYOUT: Layout = Layout {
                name: stringify!($name),
                c_name: $c_name,
                size: std::mem::size_of::<$name>(),
                fields: &[$(Field {
                    name: stringify!($field),
                    c_type: <$ty as CType>::C,
                    ctypes: <$ty as CType>::CTYPES,
                    offset: std::mem::offset_of!($name, $field),
                    size: std::mem::size_of::<$ty>(),
                },)*],
            };
        }
    };
}

c_struct! {
    /// `tms_report`: what a pause or resume did. Allocations already in the target state are
    /// skipped; those the operation could not complete failed and stay as they were.
    ///
    /// Its serde form is the counters alone: the protocol's `OpReport` carries them as its own
    /// fields and says the failure in its own terms.
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Report = "tms_report" {
        /// `TMS_OK` or the first `TMS_ERR_*` met.
        #[serde(skip)]
        pub error: i32,
        /// The vendor's code for that error.
        #[serde(skip)]
        pub driver_error: i32,
        pub allocations_done: u64,
        /// Rounded sizes: what the device gave or got back.
        pub bytes_done: u64,
        pub allocations_skipped: u64,
        pub bytes_skipped: u64,
        pub allocations_failed: u64,
        pub bytes_failed: u64,
        /// Bytes copied to (pause) or from (resume) host backups.
        pub backup_bytes: u64,
        pub elapsed_ns: u64,
        pub device_free_before: u64,
        pub device_free_after: u64,
        pub device_total: u64,
        /// Time of the backup/restore pipeline: the copies, with the releases (pause) or creates
        /// (resume) overlapped into them (part of `elapsed_ns`). Absent from the replies of
        /// hooks older than the field.
        #[serde(default)]
        pub backup_ns: u64,
        /// Bytes of backed-up allocations not copied to (pause) or from (resume) their backups
        /// because they were marked dead (`tms_mark_dead`); `backup_bytes` plus these is what a
        /// whole-allocation backup copies. Absent from the replies of hooks older than the
        /// field.
        #[serde(default)]
        pub backup_bytes_skipped: u64,
    }
}

c_struct! {
    /// `tms_tag_status`: one tag's allocations and backups.
    #[derive(Debug, Clone, Copy)]
    pub struct TagStatus = "tms_tag_status" {
        /// Owned by the hook: valid until the calling thread's next `tms_status`.
        pub tag: *const c_char,
        pub allocations_active: u64,
        pub allocations_paused: u64,
        pub bytes_active: u64,
        pub bytes_paused: u64,
        /// Pinned host memory held for this tag's backups.
        pub backup_bytes: u64,
    }
}

c_struct! {
    /// `tms_range`: bytes at a device address, as `tms_mark_dead` takes them.
    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    pub struct MemRange = "tms_range" {
        pub addr: u64,
        pub len: u64,
    }
}

/// The C structs, for the tests that hold the header and the Python mirror to them.
pub const LAYOUTS: [Layout; 3] = [Report::LAYOUT, TagStatus::LAYOUT, MemRange::LAYOUT];

/// Declares the `TMS_*` codes and `CODES`, their names and values, from one list.
macro_rules! codes {
    ($($(#[$meta:meta])* $name:ident = $value:literal,)*) => {
        $($(#[$meta])* pub const $name: i32 = $value;)*
        /// Every code with its name, as include/tms.h and python/tms define them.
        pub const CODES: &[(&str, i32)] = &[$((stringify!($name), $value),)*];
    };
}

codes! {
    TMS_OK = 0,
    /// Bad argument.
    TMS_ERR_INVALID = 1,
    /// Not enough device memory (any margin included); nothing lost.
    TMS_ERR_OUT_OF_MEMORY = 2,
    /// A driver call failed; the report's `driver_error` has its code.
    TMS_ERR_DRIVER = 3,
    /// No CUDA or Ascend driver could be loaded.
    TMS_ERR_NO_DRIVER = 4,
    /// A bug in tms, caught before it reached the caller.
    TMS_ERR_INTERNAL = 5,
    /// A disk backup file could not be read; the allocation stays paused with it.
    TMS_ERR_IO = 6,
    /// A resume checked with `TMS_VERIFY_RESTORE` did not bring back the bytes the pause saved;
    /// the memory is mapped with what it got.
    TMS_ERR_CORRUPT = 7,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_those_of_the_structs() {
        let r = Report::LAYOUT;
        assert_eq!((r.name, r.c_name, r.size, r.fields.len()), ("Report", "tms_report", 112, 15));
        assert_eq!(
            r.fields[1],
            Field { name: "driver_error", c_type: "int32_t", ctypes: "c_int32", offset: 4, size: 4 }
        );
        assert_eq!(r.fields[13].name, "backup_ns");
        assert_eq!(r.fields[13].offset, 96);
        // New fields go at the end: every older field keeps its offset.
        assert_eq!((r.fields[14].name, r.fields[14].offset), ("backup_bytes_skipped", 104));
        let m = MemRange::LAYOUT;
        assert_eq!((m.c_name, m.size, m.fields[1].offset), ("tms_range", 16, 8));
        let t = TagStatus::LAYOUT;
        assert_eq!((t.c_name, t.size), ("tms_tag_status", 48));
        assert_eq!((t.fields[0].c_type, t.fields[0].ctypes), ("const char *", "c_char_p"));
        assert_eq!(CODES.first(), Some(&("TMS_OK", TMS_OK)));
        assert_eq!(CODES.last(), Some(&("TMS_ERR_CORRUPT", 7)));
    }
}
