//! Control-protocol types and a blocking client for the control socket served by `libtms_hook.so`.
//!
//! Not implemented yet (issue 4): this crate is a placeholder so the workspace has its final shape.
