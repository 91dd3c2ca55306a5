// The runtime's names must carry the `libcudart.so.12` and `libcudart.so.13` version nodes:
// binaries built against the real runtimes reference `cudaMalloc@libcudart.so.12` (or `.13`), and
// the loader refuses a library without the node. The names are bound to their nodes by `.symver`
// in assembly (cuda_runtime/surface.rs); cudart.map declares the nodes. The soname is
// `libcudart.so.13` so that a preloaded simulator satisfies PyTorch's `NEEDED libcudart.so.13`,
// which its RPATH would otherwise resolve to NVIDIA's own runtime.
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rerun-if-changed=cudart.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/cudart.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcudart.so.13");
}
