// The runtime symbols must carry the `libcudart.so.12` version node: binaries linked against the
// real runtime reference `cudaMalloc@libcudart.so.12`, and the loader refuses a library that does
// not define that node. rustc's own (anonymous) version script names every `no_mangle` export
// exactly, and an exact match there wins over ours, so the runtime entry points are defined as
// assembler aliases (see `cudart_export!`) that only our wildcard matches.
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rerun-if-changed=cudart.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/cudart.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libtms_sim.so");
}
