// The runtime's names must carry the `libcudart.so.12` and `libcudart.so.13` version nodes:
// binaries built against the real runtimes reference `cudaMalloc@libcudart.so.12` (or `.13`), and
// the loader refuses a library without the node. The names are bound to their nodes by `.symver`
// in assembly (cuda/exports.rs); cudart.map declares the nodes. The soname is
// `libcudart.so.13` so that a preloaded simulator satisfies PyTorch's `NEEDED libcudart.so.13`,
// which its RPATH would otherwise resolve to NVIDIA's own runtime.
//
// A CUDA 12 build of PyTorch needs `libcudart.so.12` by its RPATH in the same way, and one object
// has one soname. So a second, tiny object is built here: soname `libcudart.so.12`, the
// `libcudart.so.12` version node (the loader checks the object that satisfies the NEEDED entry
// defines it), no functions, and `NEEDED libcudart.so.13` (the simulator) found through
// `RUNPATH $ORIGIN/..`. References still bind to the simulator's versioned definitions, which
// come first in the global scope. `tms-sim lib-dir` writes it to `tms-sim-lib/cuda12/libtms_sim_cuda12.so`.
use std::path::Path;
use std::process::Command;

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rerun-if-changed=cudart.map");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/cudart.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcudart.so.13");
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    build_cuda12_name(Path::new(&out));
    build_nccl_name(Path::new(&out));
}

/// The C compiler for the target being built, found as the `cc` crate finds it (`CC_<target>`,
/// then `TARGET_CC` or `CC`): these objects are loaded into the target's processes, so a cross
/// build (aarch64 on an x86_64 machine) must not make them with the host's compiler.
/// cargo-zigbuild sets `CC_<target>` to its own; a plain cross `cargo build` falls back to
/// Debian's cross compiler name (`aarch64-linux-gnu-gcc`).
fn c_compiler() -> String {
    let target = std::env::var("TARGET").expect("cargo sets TARGET");
    let host = std::env::var("HOST").expect("cargo sets HOST");
    let cross = target != host;
    let general = if cross { "TARGET_CC" } else { "CC" };
    let keys = [format!("CC_{target}"), format!("CC_{}", target.replace('-', "_")), general.to_string()];
    for key in &keys {
        println!("cargo:rerun-if-env-changed={key}");
    }
    if let Some(cc) = keys.iter().find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty())) {
        return cc;
    }
    if cross {
        let arch = target.split('-').next().unwrap_or_default();
        format!("{arch}-linux-gnu-gcc")
    } else {
        "cc".into()
    }
}

/// The same for NCCL: PyTorch's libtorch_cuda.so has `NEEDED libnccl.so.2` behind an RPATH
/// that names the nvidia-nccl wheel. An object with that soname and no functions (NCCL's names
/// are unversioned, so its references bind to the simulator, first in the global scope),
/// loaded before torch, stands in. `tms-sim lib-dir` writes it to `tms-sim-lib/nccl/`.
fn build_nccl_name(out: &Path) {
    let cc = c_compiler();
    std::fs::write(out.join("nccl.c"), "const char tms_sim_nccl_name[] = \"libnccl.so.2: tms-sim's NCCL name\";\n")
        .unwrap_or_else(|e| panic!("write nccl.c in OUT_DIR: {e}"));
    let status = Command::new(&cc)
        .current_dir(out)
        .args([
            "-shared",
            "-fPIC",
            "-nostdlib",
            "-o",
            "libnccl.so.2",
            "nccl.c",
            "-Wl,-soname,libnccl.so.2",
            "-Wl,-rpath,$ORIGIN/..",
            "-Wl,--enable-new-dtags",
            "-Wl,--no-as-needed",
            "./libcudart.so.13",
        ])
        .status()
        .unwrap_or_else(|e| panic!("run {cc} (a C compiler is needed to build tms-sim): {e}"));
    assert!(status.success(), "{cc} failed to build the libnccl.so.2 name");
}

fn build_cuda12_name(out: &Path) {
    let cc = c_compiler();
    let write = |name: &str, text: &str| {
        std::fs::write(out.join(name), text).unwrap_or_else(|e| panic!("write {name} in OUT_DIR: {e}"));
    };
    write("empty.c", "");
    write("cuda12.c", "const char tms_sim_cuda12_name[] = \"libcudart.so.12: tms-sim's CUDA 12 name\";\n");
    write("cuda12.map", "libcudart.so.12 { global: tms_sim_cuda12_name; local: *; };\n");
    let run = |args: &[&str]| {
        let status = Command::new(&cc)
            .current_dir(out)
            .args(args)
            .status()
            .unwrap_or_else(|e| panic!("run {cc} (a C compiler is needed to build tms-sim): {e}"));
        assert!(status.success(), "{cc} {} failed", args.join(" "));
    };
    // What the CUDA 12 name links against: an empty object named like the simulator.
    run(&["-shared", "-nostdlib", "-o", "libcudart.so.13", "empty.c", "-Wl,-soname,libcudart.so.13"]);
    run(&[
        "-shared",
        "-fPIC",
        "-nostdlib",
        "-o",
        "libcudart.so.12",
        "cuda12.c",
        "-Wl,-soname,libcudart.so.12",
        "-Wl,--version-script=cuda12.map",
        "-Wl,-rpath,$ORIGIN/..",
        "-Wl,--enable-new-dtags",
        "-Wl,--no-as-needed",
        "./libcudart.so.13",
    ]);
}
