//! How the built-in worker answers a request, for its roles and the transports' worker halves
//! alike: the failure it reports (kind, message) and the typed answer of a method.

use super::device::DevError;
use super::protocol::{self, Method};
use serde_json::Value;

/// A failed request: its kind on the wire (`oom`, `bad_request`, `device`, ...) and message.
pub(super) type Failure = (String, String);

pub(super) fn dev_err(e: DevError) -> Failure {
    match e {
        DevError::OutOfMemory(m) => ("oom".into(), m),
        DevError::Other(m) => ("device".into(), m),
    }
}

pub(super) fn bad(msg: impl Into<String>) -> Failure {
    ("bad_request".into(), msg.into())
}

/// Reads a request's params as `M`'s.
pub(super) fn params<M: Method>(p: &Value) -> Result<M::Params, Failure> {
    protocol::decode(p.clone()).map_err(|e| bad(format!("{}: {e}", M::NAME)))
}

/// Answers a request with `M`'s params and reply types.
pub(super) fn answer<M: Method>(
    p: &Value,
    f: impl FnOnce(M::Params) -> Result<M::Reply, Failure>,
) -> Result<Value, Failure> {
    let reply = f(params::<M>(p)?)?;
    Ok(serde_json::to_value(reply).expect("replies serialize"))
}
