//! `cargo +nightly fuzz run parse_request` (from tms-proto/): the request parser must never
//! panic, and whatever it accepts must survive a round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = tms_proto::parse_request(data) {
        let again = tms_proto::parse_request(req.to_line().trim_end().as_bytes()).expect("a parsed request re-parses");
        assert_eq!(req, again);
    }
});
