//! `tms-ctl`: the control-plane CLI. Not implemented yet (issue 4).

fn main() -> std::process::ExitCode {
    eprintln!("tms-ctl: the control plane is not implemented yet (see issue 4)");
    std::process::ExitCode::from(1)
}
