//! `relax-colocate`: the colocate runner. Not implemented yet (issue 5).

fn main() -> std::process::ExitCode {
    eprintln!("relax-colocate: the colocate runner is not implemented yet (see issue 5)");
    std::process::ExitCode::from(1)
}
